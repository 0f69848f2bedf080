"""The serve venv (scripts/env.sh serve) holds only requirements/serve.txt, its dependencies, and the
--no-deps files; the tests run in a larger venv, so an import of a test-only package (torch
oracles, openai, pytest, ...) in the runtime would pass here and break ``scripts/serve.sh``. Every
third-party module the runtime imports, at module level or inside a function, must come from a
distribution the serve venv installs. The vLLM and SGLang plugins run inside those projects' own
venvs (scripts/vllm_env.sh, sglang_env.sh) and are left out."""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import sys
from pathlib import Path

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
RUNTIME = ("tpuserve", "attention", "kv_cache", "quant", "server", "spec_decode", "tpu_platform")
OTHER_VENVS = ("tpu_platform/vllm_plugin", "tpu_platform/sglang_plugin")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pinned(path: Path) -> list[Requirement]:
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [Requirement(line) for line in lines if line and not line.startswith("-")]


def _with_dependencies(roots: list[Requirement]) -> set[str]:
    """The distributions pip installs for ``roots``, read from the installed metadata."""
    seen: set[str] = set()
    todo = [(r.name, set(r.extras)) for r in roots]
    while todo:
        name, extras = todo.pop()
        if _norm(name) in seen and not extras:
            continue
        seen.add(_norm(name))
        for spec in md.requires(name) or []:
            req = Requirement(spec)
            env_ok = req.marker is None or any(req.marker.evaluate({"extra": e}) for e in (extras or {""}))
            if env_ok:
                todo.append((req.name, set(req.extras)))
    return seen


def _serve_venv_distributions() -> set[str]:
    req = REPO / "requirements"
    no_deps = _pinned(req / "serve-nodeps.txt") + _pinned(req / "nodeps.txt")
    return _with_dependencies(_pinned(req / "serve.txt")) | {_norm(r.name) for r in no_deps}


def _runtime_imports() -> dict[str, str]:
    """Top-level third-party module -> one file that imports it."""
    found: dict[str, str] = {}
    for folder in RUNTIME:
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel.startswith(OTHER_VENVS):
                continue
            for node in ast.walk(ast.parse(path.read_text(), rel)):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top != "tpuserve":
                        found.setdefault(top, rel)
    return found


def test_runtime_imports_only_what_the_serve_venv_installs():
    allowed = _serve_venv_distributions()
    providers = md.packages_distributions()
    imports = _runtime_imports()
    assert {"jax", "xgrammar", "transformers"} <= imports.keys()  # the walk sees the real imports
    missing = {}
    for module, where in imports.items():
        dists = {_norm(d) for d in providers.get(module, [])}
        if not dists & allowed:
            missing[module] = (where, sorted(dists) or "not installed")
    assert not missing, (
        f"imported by the runtime but not installed by requirements/serve.txt (+ its dependencies, "
        f"serve-nodeps.txt, nodeps.txt): {missing}"
    )


def test_serve_venv_leaves_out_the_test_tools():
    allowed = _serve_venv_distributions()
    for tool in ("pytest", "openai", "accelerate", "torchao", "lm-eval", "triton", "schemathesis"):
        assert tool not in allowed, tool
    # torch stays, for one reason: xgrammar imports it at import time.
    assert "torch" in allowed and "xgrammar" in allowed
