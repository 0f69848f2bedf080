"""The per-step attention metadata every attention implementation receives."""

from __future__ import annotations

from dataclasses import dataclass

import jax


@jax.tree_util.register_dataclass
@dataclass
class AttentionMetadata:
    """Device arrays describing one ragged step (shapes in attention/reference.py).

    kv_lens [S] int32, page_indices [S, pages_per_seq] int32, cu_q_lens [S+1] int32, num_seqs [1] int32.
    """

    kv_lens: jax.Array
    page_indices: jax.Array
    cu_q_lens: jax.Array
    num_seqs: jax.Array
