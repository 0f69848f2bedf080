"""SGLang's KV slot ids -> our page tables. Pure numpy on int32 metadata; no SGLang, no torch.

How the two caches line up (the one decision this plugin rests on):
  * SGLang runs with ``page_size`` equal to our ``block_size`` (the platform sets it; see
    platform.py). Its paged allocator hands out whole pages, numbered 1..num_pages, and a token at
    position ``p`` of a request sits in slot ``page * page_size + p % page_size``. Slot 0 / page 0
    is SGLang's padding target and is never handed to a request.
  * Our cache ``[L, num_pages + 1, page_size, 2*Hkv, D]`` uses the very same page numbers: page 0
    is our reserved page too, so SGLang's page ``k`` *is* our page ``k``. No translation table, no
    copy: a request's page table is ``req_to_token[row, 0:seq_len:page_size] // page_size``.
  * SGLang writes ``req_to_token`` (and chooses ``out_cache_loc``) before the forward; our runner
    writes the new K/V at ``page_table[p // page_size]``, row ``p % page_size``. ``check_new_slots``
    proves, per step, that this is exactly ``out_cache_loc`` - the contract with SGLang's
    allocator and radix cache (a prefix hit is simply pages another request filled earlier).
"""

from __future__ import annotations

import numpy as np


class SlotLayoutError(RuntimeError):
    """SGLang's slot ids do not follow the page layout this plugin relies on."""


def page_table(token_slots: np.ndarray, page_size: int) -> np.ndarray:
    """Slots of one request's tokens 0..n-1 -> its page ids (one per started page)."""
    return (token_slots[::page_size] // page_size).astype(np.int32)


def check_new_slots(
    token_slots: np.ndarray, start: int, new_slots: np.ndarray, page_size: int, where: str = ""
) -> None:
    """Positions start..start+len(new_slots)-1 must map to ``new_slots`` through the page table.

    ``token_slots`` is the request's ``req_to_token`` row up to its new length. A mismatch means our
    write location would differ from SGLang's ``out_cache_loc``; that would corrupt the cache
    silently, so it fails loudly instead.
    """
    n = len(new_slots)
    pos = np.arange(start, start + n)
    pages = page_table(token_slots, page_size)
    ours = pages[pos // page_size].astype(np.int64) * page_size + pos % page_size
    if not np.array_equal(ours, np.asarray(new_slots, np.int64)):
        bad = int(np.flatnonzero(ours != np.asarray(new_slots, np.int64))[0])
        raise SlotLayoutError(
            f"{where}position {start + bad}: SGLang's out_cache_loc is slot {int(new_slots[bad])} "
            f"but the page table gives slot {int(ours[bad])} (page_size={page_size}); the KV slot "
            f"layout is not page-aligned as this plugin requires"
        )
    if np.any(pages == 0):
        raise SlotLayoutError(f"{where}a page table points at page 0, SGLang's padding page")
