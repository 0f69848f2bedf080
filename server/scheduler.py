"""Continuous batching: which sequences compute how many tokens in the next step.

Policy (vLLM v1's, simplified): running sequences first, oldest first, each taking what it still
needs (one token for a decode, the next chunk of a prompt) under the per-step token budget; then
waiting sequences in arrival order while slots, budget and pages last. When pages run out for a
running sequence, the most recently admitted running sequence is preempted: its pages are freed and
it goes back to the front of the queue to be recomputed later.

Prefix caching (when the pool caches): a sequence being admitted first takes the longest run of its
full pages already on the device (shared, no compute), then the next run held by the host tier
(fresh device pages the engine fills from host memory before the step: ``SchedulerOutput.loads``);
it computes the rest, always at least its last token (a step must produce logits to sample from).
Full pages are registered in the cache as soon as a dispatched step computes them and the host
knows their tokens. The n completions of one request prefill once: the later ones wait until the
first has scheduled its whole prompt, then share its pages.

The scheduler calls nothing back: what it needs to know of a sequence beyond its state (held back
this step, drafts to verify) comes with the call, as ``ScheduleInputs``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from tpuserve.kv_cache.block_pool import BlockPool
from tpuserve.kv_cache.prefix_hash import PageHash, extend_page_hashes
from tpuserve.server.sequence import SeqStatus, Sequence


@dataclass(frozen=True)
class ScheduleInputs:
    """Per-step facts about sequences that the engine knows and the policy needs, decided before
    the schedule runs."""

    # Sequences that take no work this step (async scheduling: their last token is still on the
    # device, and their next step needs it on the host).
    held: frozenset[Sequence] = frozenset()
    # Drafts a decoding sequence would verify after its last token (speculative decoding), as
    # many as the token budget leaves room for.
    drafts: Mapping[Sequence, int] = field(default_factory=dict)


@dataclass
class ScheduledWork:
    seq: Sequence
    num_tokens: int  # tokens of this sequence computed this step, drafts included
    num_drafts: int = 0  # of which drafts, verified after the known tokens

    @property
    def completes(self) -> bool:
        """True when this step computes the sequence's last known token, so its sample is kept."""
        return self.seq.num_computed + self.num_tokens - self.num_drafts == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    work: list[ScheduledWork] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # Host-tier pages to copy into these device pages before the step runs.
    loads: list[tuple[PageHash, int]] = field(default_factory=list)
    # Cached device pages this schedule evicted (reallocated): copy them to the host tier before
    # the step overwrites them. Empty unless the pool records evictions.
    evicted: list[tuple[PageHash, int]] = field(default_factory=list)
    # Pages a prefill engine computed: (pages [L, n, page_size, C, D] host array, device page ids)
    # to scatter before the step.
    remote_loads: list[tuple[Any, list[int]]] = field(default_factory=list)


@dataclass
class PrefixCacheStats:
    """Token counts at first admission, as vLLM counts them (queries: prompt tokens looked up)."""

    queries: int = 0
    hits: int = 0  # device + host
    host_queries: int = 0  # tokens looked up in the host tier (after the device missed)
    host_hits: int = 0


class HostTierView(Protocol):
    """What the scheduler needs of a host tier: how many leading page hashes it holds."""

    def match(self, hashes: list[PageHash]) -> int: ...


class Scheduler:
    def __init__(
        self,
        pool: BlockPool,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        chunked_prefill: bool = True,
        host_tier: HostTierView | None = None,
    ):
        """``host_tier``: the second prefix-cache tier consulted after the device (needs a caching
        pool)."""
        if host_tier is not None and not pool.enable_caching:
            raise ValueError("a host tier needs a pool with prefix caching enabled")
        self.pool = pool
        self.host_tier = host_tier
        self.prefix_stats = PrefixCacheStats()
        self.max_num_seqs = max_num_seqs
        self.token_budget = max_num_batched_tokens
        self.chunked_prefill = chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """Remove a sequence (finished or aborted) wherever it is, and free its pages."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = SeqStatus.FINISHED

    def _release(self, seq: Sequence) -> None:
        self.pool.free(reversed(seq.page_ids))  # tail first: a prefix's end is evicted first
        seq.page_ids = []
        seq.num_registered_pages = 0

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed = 0
        seq.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        need = self.pool.pages_needed(seq.num_computed + num_tokens, len(seq.page_ids))
        if not need:
            return True  # most decode steps: the last page has room
        pages = self.pool.allocate(need)
        if pages is None:
            return False
        seq.page_ids.extend(pages)
        return True

    # ---- prefix cache ----

    def _hashes(self, seq: Sequence) -> list[PageHash]:
        """Hashes of the full pages of the tokens the host knows (extended as the sequence grows)."""
        known = seq.num_known
        if known // self.pool.page_size > len(seq.page_hashes):
            extend_page_hashes(seq.page_hashes, seq.tokens(0, known), self.pool.page_size, seq.cache_salt)
        return seq.page_hashes

    def _register(self, seq: Sequence, computed: int) -> None:
        """Register the sequence's pages that are full, computed (by ``computed`` tokens) and whose
        tokens the host knows."""
        if not self.pool.enable_caching:
            return
        full = min(computed, seq.num_known) // self.pool.page_size
        if full <= seq.num_registered_pages:
            return
        hashes = self._hashes(seq)
        for i in range(seq.num_registered_pages, full):
            self.pool.register(seq.page_ids[i], hashes[i])
        seq.num_registered_pages = full

    def _cached_prefix(self, seq: Sequence) -> tuple[list[int], list[PageHash]]:
        """(device pages, host-tier hashes) of the sequence's cached prefix, leaving at least its
        last known token to compute."""
        if not self.pool.enable_caching or seq.params.prompt_logprobs is not None:
            return [], []  # prompt logprobs need every prompt position computed
        hashes = self._hashes(seq)[: (seq.num_known - 1) // self.pool.page_size]
        device = self.pool.match(hashes)
        host: list[PageHash] = []
        if self.host_tier is not None and len(device) < len(hashes):
            host = hashes[len(device) : len(device) + self.host_tier.match(hashes[len(device) :])]
        return device, host

    def _count_lookup(self, seq: Sequence, device: list[int], host: list[PageHash]) -> None:
        if seq.num_preemptions:
            return  # a preempted sequence coming back is not a new query
        page = self.pool.page_size
        st = self.prefix_stats
        seq.num_cached_tokens = (len(device) + len(host)) * page
        if not self.pool.enable_caching:
            return
        st.queries += seq.num_tokens
        st.hits += seq.num_cached_tokens
        if self.host_tier is not None:
            st.host_queries += seq.num_tokens - len(device) * page
            st.host_hits += len(host) * page

    def _admit_remote(self, seq: Sequence, budget: int, out: SchedulerOutput) -> int | None:
        """Admit a sequence whose prompt a prefill engine computed: fresh pages take its pages, and
        only what they do not cover (at least the last prompt token) is computed here."""
        batch = seq.remote_kv
        assert batch is not None
        have = min(batch.num_tokens, seq.num_tokens - 1)
        n = min(seq.num_tokens - have, budget)
        if n < seq.num_tokens - have and not self.chunked_prefill:
            return None
        fresh = self.pool.allocate(self.pool.pages_needed(have + n, 0))
        if fresh is None:
            return None
        self._count_lookup(seq, [], [])
        seq.num_cached_tokens = have
        used = -(-have // self.pool.page_size)
        out.remote_loads.append((batch.pages[:, :used], fresh[:used]))
        seq.remote_kv = None
        seq.page_ids = fresh
        seq.num_computed = have
        seq.num_registered_pages = 0
        return n

    def _admit(self, seq: Sequence, budget: int, out: SchedulerOutput) -> int | None:
        """Give a waiting sequence its cached prefix and pages for its next chunk. Returns the
        tokens it computes this step, or None (nothing held) when it cannot start now."""
        if seq.remote_kv is not None:  # cleared once admitted
            return self._admit_remote(seq, budget, out)
        device, host = self._cached_prefix(seq)
        cached = (len(device) + len(host)) * self.pool.page_size
        remaining = seq.num_tokens - cached
        n = min(remaining, budget)
        if n < remaining and not self.chunked_prefill:
            return None
        self.pool.acquire(device)
        fresh = self.pool.allocate(self.pool.pages_needed(cached + n, len(device)))
        if fresh is None:
            self.pool.free(reversed(device))
            return None
        self._count_lookup(seq, device, host)
        seq.page_ids = device + fresh
        seq.num_computed = cached
        seq.num_registered_pages = len(device)
        for h, page in zip(host, fresh):
            out.loads.append((h, page))
            self.pool.register(page, h)  # filled from the host before the step that reads it
        seq.num_registered_pages += len(host)
        return n

    def _sibling_prefilling(self, seq: Sequence, scheduled: dict[int, int]) -> bool:
        """Whether another completion of the same request is still computing the shared prompt
        (this one then waits and shares its pages instead of computing them again)."""
        if not self.pool.enable_caching:
            return False
        for r in self.running:
            if r.request_id == seq.request_id and r.num_computed + scheduled.get(id(r), 0) < len(
                r.prompt_token_ids
            ):
                return True
        return False

    # ---- one step ----

    def schedule(self, inputs: ScheduleInputs | None = None) -> SchedulerOutput:
        inputs = inputs or ScheduleInputs()
        out = SchedulerOutput()
        budget = self.token_budget
        scheduled: dict[int, int] = {}
        held, all_drafts, page_size = inputs.held, inputs.drafts, self.pool.page_size
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if held and seq in held:
                self._register(seq, seq.num_computed)
                i += 1
                continue
            need = seq.num_tokens - seq.num_computed
            # A decoding sequence also verifies its drafts, as many as the budget leaves room for.
            drafts = all_drafts.get(seq, 0) if need == 1 and all_drafts else 0
            n = need + drafts if need + drafts <= budget else budget
            # Most decode steps: the last page has room (the check _grow starts with).
            while seq.num_computed + n > len(seq.page_ids) * page_size and not self._grow(seq, n):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                break  # seq itself was the last running sequence and got preempted
            out.work.append(ScheduledWork(seq, n, max(0, n - need)))
            scheduled[id(seq)] = n
            computed = seq.num_computed + n
            if computed // page_size > seq.num_registered_pages:  # else nothing to register
                self._register(seq, computed)
            budget -= n
            i += 1
        if not out.preempted:  # memory is tight after a preemption: admit nothing new this step
            self._admit_waiting(out, budget, scheduled, inputs.held)
        out.evicted = self.pool.take_evicted()
        return out

    def _admit_waiting(
        self, out: SchedulerOutput, budget: int, scheduled: dict[int, int], held: frozenset[Sequence]
    ) -> None:
        skipped: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq in held:
                break  # a preempted sequence waits until its last token reaches the host
            if self._sibling_prefilling(seq, scheduled):
                skipped.append(self.waiting.popleft())
                continue
            n = self._admit(seq, budget, out)
            if n is None:
                break
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.work.append(ScheduledWork(seq, n))
            scheduled[id(seq)] = n
            self._register(seq, seq.num_computed + n)
            budget -= n
        self.waiting.extendleft(reversed(skipped))
