"""tpuserve as it was at another git revision, for interleaved A/B benchmarks.

The benchmarks that compare a change against an older tree (``--baseline REV``) check that revision
out into a temporary worktree and import it from there in a child process, with this interpreter
and its installed dependencies:

    tree = checkout("HEAD~1")           # a detached worktree; remove(tree) when done
    LLM, SamplingParams = import_tree(tree)
    python benchmarks/baseline_tree.py TREE serve MODEL --port 8001   # that tree's `tpuserve` CLI
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Top-level folders that are not installed as tpuserve.<name> (setup.py's layout maps the rest).
_NOT_PACKAGES = ("tpuserve", "tests", "benchmarks", "scripts", "docs")


def checkout(rev: str) -> str:
    """A detached worktree of ``rev`` in a new temporary directory; its path."""
    tree = tempfile.mkdtemp(prefix="tpuserve-baseline-")
    subprocess.run(
        ["git", "-C", REPO, "worktree", "add", "--detach", tree, rev], check=True, capture_output=True
    )
    return tree


def remove(tree: str) -> None:
    subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", tree], check=False)


def import_tree(root: str):
    """Make ``import tpuserve`` load the tree at ``root`` (not the installed package); returns its
    (LLM, SamplingParams). Either layout: top-level folders imported as themselves, or mapped into
    the tpuserve namespace."""
    sys.path.insert(0, root)
    if not os.path.exists(os.path.join(root, "setup.py")):  # the layout before one import name
        return importlib.import_module("server.llm").LLM, importlib.import_module(
            "server.sampling_params"
        ).SamplingParams
    pkg = importlib.import_module("tpuserve")
    assert os.path.dirname(pkg.__file__ or "") == os.path.join(root, "tpuserve"), pkg.__file__
    for name in sorted(os.listdir(root)):
        folder = os.path.join(root, name)
        if name in _NOT_PACKAGES or not os.path.exists(os.path.join(folder, "__init__.py")):
            continue
        spec = importlib.util.spec_from_file_location(
            f"tpuserve.{name}", os.path.join(folder, "__init__.py"), submodule_search_locations=[folder]
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return (
        importlib.import_module("tpuserve.server.llm").LLM,
        importlib.import_module("tpuserve.server.sampling_params").SamplingParams,
    )


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: baseline_tree.py TREE TPUSERVE-ARGS...", file=sys.stderr)
        return 2
    import_tree(argv[0])
    cli = importlib.import_module("tpuserve.cli")
    return int(cli.main(argv[1:]) or 0)


if __name__ == "__main__":
    # Run from the tree, not from this file's folder: benchmarks/ must not shadow anything.
    sys.path.pop(0)
    sys.exit(main(sys.argv[1:]))
