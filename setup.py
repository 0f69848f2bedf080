"""Package discovery for the one import name ``tpuserve`` (metadata lives in pyproject.toml).

The repository keeps one top-level folder per concern (attention/, kv_cache/, server/, ...), but they
install as ``tpuserve.attention``, ``tpuserve.kv_cache``, ... so a user's own ``server.py`` cannot
shadow ours and site-packages gains a single top-level name. Subpackages are found by walking the
folders, never listed by hand.
"""

from setuptools import find_packages, setup

SUBPACKAGES = ("attention", "kv_cache", "moe", "quant", "server", "spec_decode", "tpu_platform")

packages = ["tpuserve"] + [f"tpuserve.{p}" for p in find_packages(include=[f"{s}*" for s in SUBPACKAGES])]
package_dir = {"tpuserve": "tpuserve", **{f"tpuserve.{s}": s for s in SUBPACKAGES}}

# Read from the installed package: the calibration text of quantized loading (tpu_platform/models/calibrate.py) and
# the built-in page's static files (server/ui/).
package_data = {"tpuserve.quant": ["data/*.txt"], "tpuserve.server.ui": ["*.html", "*.js", "*.css"]}
setup(packages=packages, package_dir=package_dir, package_data=package_data)
