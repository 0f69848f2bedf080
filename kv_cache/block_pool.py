"""The paged block pool: which KV pages are free, which are shared, which hold cached prefixes.

Pages are reference-counted: a page a sequence computed can be shared by later sequences with the
same prefix (automatic prefix caching). A full page registered under its content hash
(``kv_cache/prefix_hash.py``) stays findable after its last user frees it: it sits in the free queue
with its contents intact until a new allocation needs it (eviction), and a hit before that
revives it. The free queue is an LRU: pages nobody will look up (never registered) are handed out
first, then cached pages, least recently freed first. Callers free a sequence's pages tail first
(``free(reversed(pages))``), so the end of a prefix is evicted before its beginning, which a
prefix match needs first.

Page 0 is reserved (padding in page tables points at it).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from tpuserve.kv_cache.layout import RESERVED_PAGE
from tpuserve.kv_cache.prefix_hash import PageHash


class BlockPool:
    def __init__(
        self, num_pages: int, page_size: int, enable_caching: bool = False, record_evictions: bool = False
    ):
        """``record_evictions``: keep (hash, page) of every cached page an allocation evicts, for a
        second cache tier to copy out before the page is overwritten (``take_evicted``)."""
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page {RESERVED_PAGE} is reserved), got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_caching = enable_caching
        self.record_evictions = record_evictions
        # Insertion order is eviction order: the front is handed out first.
        self._free: OrderedDict[int, None] = OrderedDict(
            (p, None) for p in range(num_pages) if p != RESERVED_PAGE
        )
        self._refs = [0] * num_pages
        self._hash_of: list[PageHash | None] = [None] * num_pages
        self._page_of: dict[PageHash, int] = {}
        self._evicted: list[tuple[PageHash, int]] = []

    @property
    def num_free(self) -> int:
        """Pages an allocation can take (free cached pages included: they are evictable)."""
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    @property
    def num_cached(self) -> int:
        return len(self._page_of)

    def usage(self) -> float:
        """Fraction of usable pages in use (vLLM's kv_cache_usage_perc)."""
        return 1.0 - self.num_free / self.num_usable

    def pages_needed(self, num_tokens: int, held: int) -> int:
        """Extra pages a sequence holding ``held`` pages needs to cover ``num_tokens`` tokens."""
        return max(0, -(-num_tokens // self.page_size) - held)

    def ref_count(self, page: int) -> int:
        return self._refs[page]

    def page_hash(self, page: int) -> PageHash | None:
        return self._hash_of[page]

    # ---- allocation ----

    def allocate(self, n: int) -> list[int] | None:
        """n pages with nothing anyone can look up in them, or None (and nothing taken) when fewer
        than n are free. Taking a free cached page evicts it from the cache."""
        if n > len(self._free):
            return None
        pages = []
        for _ in range(n):
            p, _ = self._free.popitem(last=False)
            self._evict(p)
            self._refs[p] = 1
            pages.append(p)
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Drop one reference from each page; pages nobody holds become free (cached ones keep
        their contents and hash until evicted)."""
        for p in pages:
            if self._refs[p] <= 0:
                raise RuntimeError(f"page {p} freed twice")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free[p] = None
                if self._hash_of[p] is None:
                    self._free.move_to_end(p, last=False)  # worthless: reuse before cached pages

    # ---- prefix cache ----

    def match(self, hashes: Sequence[PageHash]) -> list[int]:
        """Pages holding the longest cached prefix of ``hashes`` (no reference taken)."""
        out: list[int] = []
        if not self.enable_caching:
            return out
        for h in hashes:
            p = self._page_of.get(h)
            if p is None:
                break
            out.append(p)
        return out

    def acquire(self, pages: Iterable[int]) -> None:
        """Take a reference on cached pages a match returned (revives free ones)."""
        for p in pages:
            if self._hash_of[p] is None:
                raise RuntimeError(f"page {p} is not a cached page")
            if self._refs[p] == 0:
                del self._free[p]
            self._refs[p] += 1

    def register(self, page: int, h: PageHash) -> bool:
        """Make ``page`` (full, its K/V written or being written by a dispatched step) findable by
        ``h``. Returns False when the hash already has a page (the same prefix was computed twice
        concurrently): the first stays the cached copy and ``page`` stays private."""
        if not self.enable_caching:
            return False
        if self._refs[page] <= 0:
            raise RuntimeError(f"page {page} is not held; only held pages can be registered")
        if h in self._page_of or self._hash_of[page] is not None:
            return False
        self._page_of[h] = page
        self._hash_of[page] = h
        return True

    def take_evicted(self) -> list[tuple[PageHash, int]]:
        """(hash, page) of the cached pages allocations evicted since the last call. Their K/V is
        still intact until a step the caller dispatches next writes them."""
        out, self._evicted = self._evicted, []
        return out

    def reset_cache(self) -> int:
        """Forget every free cached page (a held page keeps serving its holders). Returns how many."""
        n = 0
        for p in list(self._free):
            if self._hash_of[p] is not None:
                self._evict(p, record=False)
                self._free.move_to_end(p, last=False)
                n += 1
        return n

    def _evict(self, p: int, record: bool = True) -> None:
        h = self._hash_of[p]
        if h is None:
            return
        self._hash_of[p] = None
        del self._page_of[h]
        if record and self.record_evictions:
            self._evicted.append((h, p))
