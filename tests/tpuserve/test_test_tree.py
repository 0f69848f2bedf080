"""The test tree itself: pytest imports test helpers by their bare file name (rootdir-relative
``prepend`` import mode, no ``__init__.py``), so two helpers with one name in different folders
shadow each other, and which one wins depends on collection order. A full CI run once failed at
collection for exactly that (tests/hf_oracle.py vs tests/quant/hf_oracle.py) while partial runs
passed."""

from __future__ import annotations

import collections
import pathlib

TESTS = pathlib.Path(__file__).resolve().parents[1]


def test_every_module_name_in_the_test_tree_is_unique():
    seen: dict[str, list[str]] = collections.defaultdict(list)
    for path in TESTS.rglob("*.py"):
        if path.name != "conftest.py":  # pytest loads each conftest by path, not by name
            seen[path.stem].append(str(path.relative_to(TESTS)))
    clashes = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not clashes, f"test modules sharing a name (rename one): {clashes}"
