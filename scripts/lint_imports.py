"""Check the import layers (``lint-imports``, contracts in pyproject.toml) on this source tree.

    python scripts/lint_imports.py [lint-imports options, e.g. --contract layers --verbose]

import-linter finds a package's modules by walking its folder, and ``tpuserve`` is no one folder:
every top-level folder installs as its subpackage (setup.py's ``package_dir``: ``attention/`` is
``tpuserve.attention``), joined at import time by the editable install's import hook, which a walk
of ``tpuserve/`` cannot see (bare ``lint-imports`` finds ``tpuserve.cli`` and nothing else). So
this lays the package out as it installs, as symlinks in a temporary folder (``tpuserve/`` holding
the files of ``tpuserve/`` and one link per subpackage folder, from setup.py's ``SUBPACKAGES``),
and runs ``lint-imports`` there on the repository's pyproject.toml: lint-imports puts its working
directory first on sys.path, so run in the repository it would find the bare ``tpuserve/`` again.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def subpackages() -> tuple[str, ...]:
    """setup.py's ``SUBPACKAGES``, read without running setup.py."""
    for node in ast.parse((REPO / "setup.py").read_text()).body:
        names = [getattr(t, "id", None) for t in node.targets] if isinstance(node, ast.Assign) else []
        if "SUBPACKAGES" in names:
            return tuple(ast.literal_eval(node.value))
    raise SystemExit("scripts/lint_imports.py: setup.py has no SUBPACKAGES tuple to read the folders from")


def link_tree(root: Path) -> None:
    """``root/tpuserve`` laid out as the installed package, out of symlinks into the repository."""
    package = root / "tpuserve"
    package.mkdir()
    for entry in (REPO / "tpuserve").iterdir():
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    for name in subpackages():
        (package / name).symlink_to(REPO / name, target_is_directory=True)


def main(argv: list[str]) -> int:
    exe = shutil.which("lint-imports")
    if exe is None:
        raise SystemExit("scripts/lint_imports.py: lint-imports is not installed (pip install import-linter)")
    with tempfile.TemporaryDirectory(prefix="tpuserve-imports-") as tmp:
        link_tree(Path(tmp))
        # --no-cache: a cache of a temporary tree would never be read again.
        return subprocess.run([exe, "--no-cache", *argv, str(REPO / "pyproject.toml")], cwd=tmp).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
