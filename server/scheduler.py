"""Continuous batching: which sequences compute how many tokens in the next step.

Policy (vLLM v1's, simplified): running sequences first, oldest first, each taking what it still
needs (one token for a decode, the next chunk of a prompt) under the per-step token budget; then
waiting sequences in arrival order while slots, budget and pages last. When pages run out for a
running sequence, the most recently admitted running sequence is preempted: its pages are freed and
it goes back to the front of the queue to be recomputed later.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tpuserve.kv_cache.block_pool import BlockPool
from tpuserve.server.sequence import Sequence, SeqStatus


@dataclass
class ScheduledWork:
    seq: Sequence
    num_tokens: int  # tokens of this sequence computed this step

    @property
    def completes(self) -> bool:
        """True when this step computes the sequence's last known token, so its sample is kept."""
        return self.seq.num_computed + self.num_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    work: list[ScheduledWork] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)


class Scheduler:
    def __init__(self, pool: BlockPool, max_num_seqs: int, max_num_batched_tokens: int,
                 chunked_prefill: bool = True, can_schedule: Callable[[Sequence], bool] | None = None):
        """``can_schedule(seq)`` lets the engine hold a sequence back for a step (async scheduling:
        its last token is not on the host yet and its next step needs it there)."""
        self.pool = pool
        self.can_schedule = can_schedule or (lambda seq: True)
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
        self.pool.free(seq.page_ids)
        seq.page_ids = []

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
        pages = self.pool.allocate(need)
        if pages is None:
            return False
        seq.page_ids.extend(pages)
        return True

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.token_budget
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if not self.can_schedule(seq):
                i += 1
                continue
            n = min(seq.num_tokens - seq.num_computed, budget)
            while not self._grow(seq, n):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                break  # seq itself was the last running sequence and got preempted
            out.work.append(ScheduledWork(seq, n))
            budget -= n
            i += 1
        if out.preempted:
            return out  # memory is tight: do not admit new work this step
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self.can_schedule(seq):
                break  # a preempted sequence waits until its last token reaches the host
            remaining = seq.num_tokens - seq.num_computed
            n = min(remaining, budget)
            if n < remaining and not self.chunked_prefill:
                break
            if not self._grow(seq, n):
                break
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.work.append(ScheduledWork(seq, n))
            budget -= n
        return out
