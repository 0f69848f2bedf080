#!/usr/bin/env bash
# Make sure Debian's headless Chromium and its WebDriver are installed (the browser test of the
# built-in page, tests/server/test_ui_browser.py). Installs `chromium` and `chromium-driver` with
# apt-get when either is missing: as root, or through sudo when it needs no password. Prints the two
# paths (browser, driver) on stdout; progress goes to stderr. Exits non-zero when they cannot be had.
set -euo pipefail
browser="${CHROMIUM:-/usr/bin/chromium}"
driver="${CHROMEDRIVER:-/usr/bin/chromedriver}"
if [ ! -x "$browser" ] || [ ! -x "$driver" ]; then
  if [ "$(id -u)" -eq 0 ]; then
    as_root=()
  elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    as_root=(sudo -n)
  else
    echo "[tpuserve] chromium is missing and neither root nor password-less sudo is available" >&2
    exit 1
  fi
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "[tpuserve] chromium is missing and there is no apt-get to install it" >&2
    exit 1
  fi
  echo "[tpuserve] installing chromium and chromium-driver with apt-get (first run only)" >&2
  export DEBIAN_FRONTEND=noninteractive
  # A fresh container may have no package lists yet; an install that fails on stale lists is retried
  # once after an update.
  "${as_root[@]}" apt-get install -y -qq --no-install-recommends chromium chromium-driver >&2 \
    || { "${as_root[@]}" apt-get update -qq >&2 \
      && "${as_root[@]}" apt-get install -y -qq --no-install-recommends chromium chromium-driver >&2; }
fi
"$browser" --version >&2
echo "$browser"
echo "$driver"
