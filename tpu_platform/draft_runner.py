"""DraftRunner: a draft head's KV cache and its two jitted programs, beside the target's ModelRunner.

The head keeps one layer of paged KV with the target's page geometry, so a sequence's draft K/V
lives at the same (page, slot) as its target K/V and needs no pages of its own.

    catch_up   after a target step: over every verified position q of every sequence in it, feed
               (token q+1, target features of q) through the head, writing its K/V; the output at
               each sequence's last position gives the first draft and the hidden state to recycle.
    propose    before the next target step (pages for the drafts are allocated by then): k - 1 more
               single-token steps per drafting sequence, each on the head's own output.

Both are bucketed like the target step (catch-up on the step's own T and S slots; propose on the
sequence buckets) and compiled by ``warmup``. Drafting is greedy (vLLM's default for EAGLE/MTP):
drafts are verified as one-hot proposals, so the output distribution is the target's exactly.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tpuserve.attention.metadata import AttentionMetadata
from tpuserve.kv_cache.layout import RESERVED_PAGE, KVCacheSpec, cache_out_format
from tpuserve.tpu_platform.models.draft_head import DraftHead, draft_forward, greedy_draft


@dataclass
class CatchUpSeq:
    """One sequence's share of a catch-up: the ``num_rows`` verified positions starting at
    ``start`` (rows ``row0`` onward of the target step), each with its next token."""

    row0: int
    start: int
    next_tokens: list[int]
    page_ids: list[int]


@dataclass
class DraftSeed:
    """Where a sequence's drafting starts: its first draft (a target id) and the head's output at
    its last verified position, recycled as the next step's hidden state."""

    first_token: int
    hidden: np.ndarray  # [H]


class DraftRunner:
    def __init__(self, head: DraftHead, params: dict, target_runner):
        """target_runner: the ModelRunner whose pages, buckets and attention backend the head shares."""
        r = target_runner
        self.head, self.params, self.target = head, params, r
        self.spec = KVCacheSpec(
            1, r.kv_spec.num_pages, r.page_size, head.arch.num_kv_heads, head.arch.head_dim, r.dtype
        )
        self.kv_cache = self.spec.allocate(r.attn_impl)
        self._traces = 0
        inv_freq = jnp.asarray(head.arch.inv_freq())
        # Outputs keep the cache's format, so its donated buffer is updated in place
        # (kv_cache/layout.py: cache_out_format).
        fmt = cache_out_format(self.kv_cache)
        catch_up_out: dict[str, Any] = {} if fmt is None else dict(out_shardings=(None, None, fmt))
        propose_out: dict[str, Any] = {} if fmt is None else dict(out_shardings=(None, fmt))
        self._catch_up = jax.jit(
            functools.partial(self._traced_catch_up, inv_freq=inv_freq), donate_argnums=(1,), **catch_up_out
        )
        self._propose = jax.jit(
            functools.partial(self._traced_propose, inv_freq=inv_freq),
            donate_argnums=(1,),
            static_argnames=("k",),
            **propose_out,
        )

    @property
    def compile_count(self) -> int:
        return self._traces

    @property
    def kv_bytes(self) -> int:
        return self.spec.page_bytes(self.target.attn_impl) * self.spec.num_pages

    # ---- traced programs ----

    def _traced_catch_up(self, params, kv, features, rows, token_ids, positions, md, last_rows, *, inv_freq):
        self._traces += 1
        with self.target.linears.active():  # the target's table: the head may share its weights
            return self._catch_up_body(
                params, kv, features, rows, token_ids, positions, md, last_rows, inv_freq
            )

    def _catch_up_body(self, params, kv, features, rows, token_ids, positions, md, last_rows, inv_freq):
        out, kv = draft_forward(
            self.head,
            params,
            kv,
            token_ids,
            positions,
            features[rows],
            md,
            attn_impl=self.target.attn_impl,
            inv_freq=inv_freq,
        )
        last = out[last_rows]
        return greedy_draft(self.head, params, last), last, kv

    def _traced_propose(self, params, kv, first, hidden, start, page_table, num_seqs, *, k, inv_freq):
        self._traces += 1
        with self.target.linears.active():
            return self._propose_body(params, kv, first, hidden, start, page_table, num_seqs, k, inv_freq)

    def _propose_body(self, params, kv, first, hidden, start, page_table, num_seqs, k, inv_freq):
        s = first.shape[0]
        real = jnp.arange(s) < num_seqs[0]
        cu = jnp.minimum(jnp.arange(s + 1, dtype=jnp.int32), num_seqs[0])
        drafts, tok, h = [first], first, hidden
        for j in range(k - 1):  # k is small and static: unrolled
            pos = start + j
            md = AttentionMetadata(
                kv_lens=jnp.where(real, pos + 1, 0), page_indices=page_table, cu_q_lens=cu, num_seqs=num_seqs
            )
            h, kv = draft_forward(
                self.head, params, kv, tok, pos, h, md, attn_impl=self.target.attn_impl, inv_freq=inv_freq
            )
            tok = greedy_draft(self.head, params, h)
            drafts.append(tok)
        return jnp.stack(drafts, axis=1), kv

    # ---- host side ----

    def _page_table(self, page_lists: list[list[int]], num_slots: int) -> np.ndarray:
        width = self.target.page_bucket(max(len(p) for p in page_lists))
        table = np.full((num_slots, width), RESERVED_PAGE, np.int32)
        for i, pages in enumerate(page_lists):
            table[i, : len(pages)] = pages
        return table

    def catch_up(self, features: jax.Array, seqs: list[CatchUpSeq]) -> list[DraftSeed]:
        """Run the head over a finished target step's verified positions (features [T, A]: the
        step's feature rows, see ModelRunner); returns each sequence's DraftSeed, in order."""
        t_slots = features.shape[0]
        s_slots = min(t_slots, self.target.max_num_seqs)
        if len(seqs) > s_slots:
            raise ValueError(f"{len(seqs)} sequences exceed the {s_slots} slots of a {t_slots}-row catch-up")
        rows, tokens, positions = (np.zeros(t_slots, np.int32) for _ in range(3))
        cu, kv_lens, last = (
            np.zeros(s_slots + 1, np.int32),
            np.zeros(s_slots, np.int32),
            np.zeros(s_slots, np.int32),
        )
        off = 0
        for i, s in enumerate(seqs):
            n = len(s.next_tokens)
            if n == 0 or off + n > t_slots:
                raise ValueError(f"catch-up sequence {i}: {n} rows do not fit the step's {t_slots}")
            rows[off : off + n] = np.arange(s.row0, s.row0 + n)
            tokens[off : off + n] = s.next_tokens
            positions[off : off + n] = np.arange(s.start, s.start + n)
            kv_lens[i] = s.start + n
            last[i] = off + n - 1
            off += n
            cu[i + 1] = off
        cu[len(seqs) + 1 :] = off
        put = self.target._put
        md = AttentionMetadata(
            kv_lens=put(kv_lens),
            page_indices=put(self._page_table([s.page_ids for s in seqs], s_slots)),
            cu_q_lens=put(cu),
            num_seqs=put(np.asarray([len(seqs)], np.int32)),
        )
        first, hidden, self.kv_cache = self._catch_up(
            self.params, self.kv_cache, features, put(rows), put(tokens), put(positions), md, put(last)
        )
        first, hidden = np.asarray(first), np.asarray(hidden)
        return [DraftSeed(int(first[i]), hidden[i]) for i in range(len(seqs))]

    def propose(
        self, seeds: list[DraftSeed], starts: list[int], page_lists: list[list[int]], k: int
    ) -> np.ndarray:
        """Drafts [n, k] (target ids) for n sequences: seed i's first token, then k - 1 more, the
        j-th at position starts[i] + j - 1 (starts[i]: the sequence's computed length, i.e. the
        position of its last, not yet computed, token), written into page_lists[i]."""
        n = len(seeds)
        first = np.asarray([s.first_token for s in seeds], np.int32)
        if k <= 1 or n == 0:
            return first[:, None][:, : max(k, 0)]
        s_slots = (
            next(b for b in self.target.seq_buckets if b >= n) if n <= self.target.seq_buckets[-1] else n
        )
        pad = s_slots - n
        put = self.target._put
        hidden = np.stack([s.hidden for s in seeds])
        drafts, self.kv_cache = self._propose(
            self.params,
            self.kv_cache,
            put(np.pad(first, (0, pad))),
            put(np.pad(hidden, ((0, pad), (0, 0)))),
            put(np.pad(np.asarray(starts, np.int32), (0, pad))),
            put(self._page_table(page_lists, s_slots)),
            put(np.asarray([n], np.int32)),
            k=k,
        )
        return np.asarray(drafts)[:n]

    def warmup(self, feature_dtype, k: int) -> int:
        """Compile catch-up at every (token bucket, page bucket) and propose at every (sequence
        bucket, page bucket) for k drafts. Returns the programs compiled."""
        before = self._traces
        r = self.target
        for t in r.token_buckets:
            feats = r._put(np.zeros((t, self.head.feature_width), feature_dtype))
            for p in r.page_buckets:
                pages = [[RESERVED_PAGE] * p]
                self.catch_up(feats, [CatchUpSeq(0, 0, [0], pages[0])])
        h = np.zeros(self.head.arch.hidden_size, np.dtype(self.target.dtype))
        if k > 1:
            for s in r.seq_buckets:
                for p in r.page_buckets:
                    self.propose([DraftSeed(0, h)] * s, [0] * s, [[RESERVED_PAGE] * p] * s, k)
        jax.block_until_ready(self.kv_cache)
        return self._traces - before
