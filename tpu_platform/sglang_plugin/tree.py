"""SGLang's draft trees -> the chains our runner verifies. Pure numpy; no SGLang, no torch."""

from __future__ import annotations

import numpy as np


def first_path(mask: np.ndarray) -> list[int]:
    """Node indices of a draft tree's first path: the root, then each node's first child.

    ``mask`` [n, n] bool is SGLang's tree mask of one request: ``mask[i, j]`` is True when node j
    is an ancestor of node i (the diagonal may be set too). Node 0 is the root and nodes come in
    breadth-first order, so a node's parent is its highest-numbered strict ancestor and its first
    child is the lowest-numbered node whose parent it is. A chain (breadth 1) is returned whole.
    """
    mask = np.asarray(mask, dtype=bool)
    n = mask.shape[0]
    if mask.shape != (n, n) or n == 0:
        raise ValueError(f"a draft tree mask must be square and non-empty, got shape {mask.shape}")
    order = np.arange(n)
    strict = mask & (order[None, :] < order[:, None])
    parent = np.where(strict.any(axis=1), np.where(strict, order[None, :], -1).max(axis=1), -1)
    path = [0]
    while True:
        children = np.flatnonzero(parent == path[-1])
        if children.size == 0:
            return path
        path.append(int(children[0]))
