"""Content hashes of full KV pages: the keys of the prefix cache (device tier and host tier).

A page's hash chains over everything that decides its K/V: the hash of the page before it, the
page's token ids, and extra keys (the request's ``cache_salt``, in the first page only, so requests
with different salts never share pages). Two sequences with the same first ``k * page_size`` tokens
(and salt) therefore agree on their first ``k`` hashes and can share those pages; any difference
changes every hash after it. Only full pages are hashed: a partial page is still being written.

The hash is SHA-256 of the pickled ``(parent, tokens, extra)`` tuple, as vLLM's default
``--prefix-caching-hash-algo sha256`` does; collisions are not a practical concern at 256 bits.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence

PageHash = bytes

# The parent of a sequence's first page. A fixed seed keeps hashes stable across processes, which
# the host tier and a KV transfer between engines rely on.
ROOT_HASH: PageHash = hashlib.sha256(b"tpuserve-prefix-cache-root").digest()


def hash_page(parent: PageHash | None, tokens: Sequence[int], extra: tuple = ()) -> PageHash:
    payload = (parent or ROOT_HASH, tuple(int(t) for t in tokens), extra)
    return hashlib.sha256(pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def extend_page_hashes(
    hashes: list[PageHash], token_ids: Sequence[int], page_size: int, cache_salt: str | None = None
) -> list[PageHash]:
    """Append the hashes of the full pages of ``token_ids`` not yet in ``hashes`` (in place).

    ``hashes`` holds the first ``len(hashes)`` pages' hashes of the same token sequence, so a
    growing sequence pays only for its new pages.
    """
    for i in range(len(hashes), len(token_ids) // page_size):
        extra = (cache_salt,) if (i == 0 and cache_salt is not None) else ()
        parent = hashes[i - 1] if i else None
        hashes.append(hash_page(parent, token_ids[i * page_size : (i + 1) * page_size], extra))
    return hashes


def page_hashes(token_ids: Sequence[int], page_size: int, cache_salt: str | None = None) -> list[PageHash]:
    """Hashes of every full page of ``token_ids``."""
    return extend_page_hashes([], token_ids, page_size, cache_salt)
