"""The paged block pool: which KV pages are free, and which pages each sequence holds.

Pages are reference-counted so a later prefix cache can share full pages between sequences; today
each page has one owner. Page 0 is reserved (padding in page tables points at it).
"""

from __future__ import annotations

from collections import deque

from tpuserve.kv_cache.layout import RESERVED_PAGE


class BlockPool:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page {RESERVED_PAGE} is reserved), got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: deque[int] = deque(p for p in range(num_pages) if p != RESERVED_PAGE)
        self._refs = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    def usage(self) -> float:
        """Fraction of usable pages in use (vLLM's kv_cache_usage_perc)."""
        return 1.0 - self.num_free / self.num_usable

    def pages_needed(self, num_tokens: int, held: int) -> int:
        """Extra pages a sequence holding ``held`` pages needs to cover ``num_tokens`` tokens."""
        return max(0, -(-num_tokens // self.page_size) - held)

    def allocate(self, n: int) -> list[int] | None:
        """n fresh pages, or None (and nothing taken) when fewer than n are free."""
        if n > len(self._free):
            return None
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if self._refs[p] <= 0:
                raise RuntimeError(f"page {p} freed twice")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)
