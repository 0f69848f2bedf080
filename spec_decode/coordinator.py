"""A request's drafts from proposal to verification and catch-up, between the engine and the runner.

One step of speculative decoding, as the engine drives it:

    propose   before scheduling: how many drafts each sequence that decodes next would verify
              (n-gram drafts are found here; a draft head's only once their pages exist). The
              scheduler sizes the step by these counts and may cut them to its token budget.
    drafts    after scheduling: the draft tokens of what was scheduled (the head drafts now).
    verified  after the step: count a verification; the accepted drafts' K/V stays.
    catch_up  after the step, with a draft head: run it over every verified position, so its K/V
              follows the target's and each sequence has a seed to draft its next step from.

Whether a request may draft at all is one rule, :func:`may_draft`, shared by the engine and the
vLLM plugin. The callers' verification paths differ in what they can verify beyond plain drafts,
and say so through :class:`DraftSupport` rather than rules of their own.

Nothing here knows the engine's types: a sequence is anything with the attributes of
:class:`DraftingSequence`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

import numpy as np

from tpuserve.spec_decode.ngram import propose_ngram

if TYPE_CHECKING:
    import jax

    from tpuserve.tpu_platform.draft_runner import DraftRunner, DraftSeed

# drafter(token_ids [N], k) -> up to k draft ids for the sequence whose tokens those are.
Drafter = Callable[[np.ndarray, int], list[int]]


@dataclass(frozen=True)
class DraftSupport:
    """What a caller's verification path handles beyond plain drafts under one sampling row.

    token_masks: it gives each verification row the mask of the state after the drafts before it
        (the engine walks its host-side grammar matcher over the drafts; the vLLM worker takes one
        mask row per request from vLLM, so it cannot).
    logprobs / penalties: requests asking for per-token logprobs, or with repetition / presence /
        frequency penalties, may draft (the vLLM worker returns logprob rows per verified position
        and the runner counts drafts into the penalties; the engine keeps such requests on plain
        decoding).
    """

    token_masks: bool
    logprobs: bool
    penalties: bool


@dataclass(frozen=True)
class DraftFacts:
    """What the rule reads of one request, as its caller knows it."""

    num_output_tokens: int
    min_tokens: int
    token_mask: bool  # sampled under a grammar or an allowed-token mask
    logprobs: bool  # asks for per-token logprobs
    penalties: bool  # any repetition / presence / frequency penalty
    tokens_left: int | None = None  # what max_tokens still allows; None: no cap known here


def may_draft(facts: DraftFacts, support: DraftSupport) -> bool:
    """Whether drafts for this request verify to what plain decoding would give.

    Drafts are verified with the request's sampling row repeated per position (its key and penalty
    counts advanced per position). A pending min_tokens stop ban never drafts: it lifts part-way
    through the drafts. A token mask, logprobs or penalties draft only where the caller's
    verification handles them (``support``).
    """
    if facts.num_output_tokens < facts.min_tokens:
        return False
    if facts.token_mask and not support.token_masks:
        return False
    if facts.logprobs and not support.logprobs:
        return False
    return support.penalties or not facts.penalties


class DraftingSequence(Protocol):
    """What the coordinator reads of a sequence (the engine's ``Sequence`` has it all)."""

    num_computed: int  # tokens whose K/V is in the cache
    num_pending: int  # tokens sampled on the device the host has not seen
    page_ids: list[int]

    @property
    def num_tokens(self) -> int: ...

    @property
    def is_finished(self) -> bool: ...

    def tokens(self, start: int, end: int) -> list[int]: ...


class MaskWalker(Protocol):
    """What building per-draft masks needs of a grammar matcher."""

    def fill_bitmask(self) -> np.ndarray: ...

    def accept(self, token_id: int) -> bool: ...

    def rollback(self, num_tokens: int) -> None: ...


def draft_masks(grammar: MaskWalker, drafts: Sequence[int], first: np.ndarray) -> np.ndarray:
    """[1 + k, W]: a grammar's mask at each verification row of ``drafts`` (``first``: its mask now).

    The matcher walks the drafts and is rolled back. A draft the grammar refuses ends the walk: its
    row's mask excludes it, so it is rejected there and the rows after it are never reached (they
    reuse the mask)."""
    masks = [first]
    walked = 0
    for d in drafts:
        if not grammar.accept(int(d)):
            break
        walked += 1
        masks.append(grammar.fill_bitmask())
    if walked:
        grammar.rollback(walked)
    masks += [masks[-1]] * (len(drafts) + 1 - len(masks))
    return np.stack(masks)


@dataclass
class SpecDecodeStats:
    """vLLM's counts: steps that verified drafts, drafts, accepted drafts, and accepted drafts by
    position (index j: the (j+1)-th draft of a verification was accepted)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class _Seed:
    seed: DraftSeed
    at: int  # the num_computed it was made at: it seeds drafting only from there


S = TypeVar("S", bound=DraftingSequence)


class SpecDecodeCoordinator(Generic[S]):
    """Owns every sequence's drafts and draft-head seeds across a step (see the module doc)."""

    def __init__(
        self,
        num_speculative_tokens: int,
        max_model_len: int,
        support: DraftSupport,
        lookup_range: tuple[int, int] = (5, 5),
        draft_runner: DraftRunner | None = None,
    ):
        """``lookup_range``: the n-gram drafter's (prompt_lookup_min, prompt_lookup_max).
        ``draft_runner``: an EAGLE-3 / MTP head; None drafts by n-gram (or ``drafter``)."""
        self.num_speculative_tokens = num_speculative_tokens
        self.max_model_len = max_model_len
        self.support = support
        self.lookup_range = lookup_range
        self.draft_runner = draft_runner
        # Without a head: drafts come from here (tests swap in replaying / adversarial ones).
        self.drafter: Drafter = self.ngram_drafter
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * num_speculative_tokens)
        self._proposed: dict[S, list[int]] = {}  # drafter output, from propose to drafts
        self._seeds: dict[S, _Seed] = {}

    def ngram_drafter(self, token_ids: np.ndarray, k: int) -> list[int]:
        lo, hi = self.lookup_range
        return [
            int(t)
            for t in propose_ngram(token_ids, min_n=lo, max_n=hi, k=k, max_model_len=self.max_model_len)
        ]

    # ---- before the step ----

    def propose(self, candidates: Iterable[tuple[S, DraftFacts]]) -> dict[S, int]:
        """How many drafts each candidate would verify if it decodes in the next step (absent:
        none). Sequences that do not decode next (a prompt chunk to go) do not draft."""
        self._proposed.clear()
        counts: dict[S, int] = {}
        for seq, facts in candidates:
            if seq.num_tokens - seq.num_computed != 1 or not may_draft(facts, self.support):
                continue
            k = self.num_speculative_tokens
            if facts.tokens_left is not None:
                k = min(k, facts.tokens_left - 1)  # a step that accepts them all samples one more
            if k <= 0:
                continue
            if self.draft_runner is not None:
                # The head drafts once the scheduler has given the drafts pages (``drafts``), and
                # only from a seed made at the sequence's current length.
                k = min(k, self.max_model_len - seq.num_tokens)
                seed = self._seeds.get(seq)
                if seed is not None and seed.at == seq.num_computed and k > 0:
                    counts[seq] = k
                continue
            tokens = np.asarray(seq.tokens(0, seq.num_tokens), np.int64)
            drafts = list(self.drafter(tokens, k))[:k]
            if drafts:
                self._proposed[seq] = drafts
                counts[seq] = len(drafts)
        return counts

    def drafts(self, scheduled: Sequence[tuple[S, int]]) -> list[list[int]]:
        """The draft tokens of each scheduled (sequence, number of drafts it verifies), in order."""
        out: list[list[int]] = [[] for _ in scheduled]
        if self.draft_runner is None:
            for i, (seq, n) in enumerate(scheduled):
                if n:
                    out[i] = self._proposed[seq][:n]
            self._proposed.clear()
            return out
        drafting = [i for i, (_, n) in enumerate(scheduled) if n]
        if not drafting:
            return out
        seqs = [scheduled[i][0] for i in drafting]
        # Always the configured k (one compiled program): a sequence near its end drafts fewer,
        # and the head's extra writes land past its pages (the reserved page) or its length.
        rows = self.draft_runner.propose(
            [self._seeds[s].seed for s in seqs],
            [s.num_computed for s in seqs],
            [s.page_ids for s in seqs],
            self.num_speculative_tokens,
        )
        for i, row in zip(drafting, rows):
            out[i] = [int(t) for t in row[: scheduled[i][1]]]
        return out

    # ---- after the step ----

    def verified(self, num_drafts: int, num_accepted: int) -> int:
        """Count one verification of ``num_drafts`` drafts; returns how many drafts' K/V the
        sequence keeps (the accepted ones; the rest lies past its length, to be overwritten)."""
        st = self.stats
        st.num_drafts += 1
        st.num_draft_tokens += num_drafts
        st.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            st.accepted_per_pos[j] += 1
        return num_accepted

    def catch_up(self, features: jax.Array, stepped: Sequence[tuple[S, int, int]]) -> None:
        """With a draft head, after a step: ``stepped`` lists each (sequence, num_computed when the
        step was dispatched, tokens it computed), in step order; ``features`` are the step's feature
        rows. Every sequence that goes on gets a fresh seed; the others lose theirs."""
        if self.draft_runner is None:
            return
        # Here, not at the top: draft_runner loads JAX, and the vLLM front end imports this module
        # for the drafting rule alone.
        from tpuserve.tpu_platform.draft_runner import CatchUpSeq

        items, seqs, row0 = [], [], 0
        for seq, start, num_tokens in stepped:
            first_row = row0
            row0 += num_tokens
            self._seeds.pop(seq, None)
            n = seq.num_computed - start  # verified positions (rejected drafts are not computed)
            if seq.is_finished or n <= 0 or seq.num_tokens < seq.num_computed + 1 or seq.num_pending:
                continue
            items.append(
                CatchUpSeq(first_row, start, seq.tokens(start + 1, seq.num_computed + 1), list(seq.page_ids))
            )
            seqs.append(seq)
        if not items:
            return
        for seq, seed in zip(seqs, self.draft_runner.catch_up(features, items)):
            self._seeds[seq] = _Seed(seed, seq.num_computed)

    def forget(self, seq: S) -> None:
        """Drop what is held for a sequence that ended (finished, failed or aborted)."""
        self._seeds.pop(seq, None)
        self._proposed.pop(seq, None)
