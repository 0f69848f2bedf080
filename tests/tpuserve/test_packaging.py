"""The built wheel installs one import name, ``tpuserve``, with every folder as its subpackage."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FOLDERS = ("tpuserve", "attention", "kv_cache", "moe", "quant", "server", "spec_decode", "tpu_platform")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    src = tmp_path_factory.mktemp("src")
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for folder in FOLDERS:
        shutil.copytree(REPO / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path_factory.mktemp("wheel")
    # No build isolation: the venv's setuptools builds it offline (CI needs no extra download).
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(out),
            str(src),
        ],
        check=True,
        timeout=300,
    )
    (path,) = out.glob("tpuserve-*.whl")
    return zipfile.ZipFile(path)


def _dist_file(whl: zipfile.ZipFile, name: str) -> str:
    (member,) = [n for n in whl.namelist() if n.endswith(f".dist-info/{name}")]
    return whl.read(member).decode()


def test_top_level_is_only_tpuserve(wheel):
    assert _dist_file(wheel, "top_level.txt").split() == ["tpuserve"]
    roots = {n.split("/")[0] for n in wheel.namelist() if not n.split("/")[0].endswith(".dist-info")}
    assert roots == {"tpuserve"}


def test_every_folder_is_a_subpackage(wheel):
    names = set(wheel.namelist())
    for folder in FOLDERS[1:]:
        assert f"tpuserve/{folder}/__init__.py" in names, folder
    # Nested packages are discovered too, not only the ones someone remembered to list.
    for pkg in Path(REPO / "tpu_platform").rglob("__init__.py"):
        rel = pkg.relative_to(REPO).as_posix()
        assert f"tpuserve/{rel}" in names, rel


def test_entry_points_name_the_namespaced_modules(wheel):
    eps = _dist_file(wheel, "entry_points.txt")
    assert "tpuserve.tpu_platform.vllm_plugin:register" in eps
    assert "tpuserve.tpu_platform.sglang_plugin:register_platform" in eps
    for line in eps.splitlines():
        if "=" in line:
            assert line.split("=", 1)[1].strip().startswith("tpuserve."), line
