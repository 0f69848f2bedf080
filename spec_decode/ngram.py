"""N-gram drafting (prompt lookup) with vLLM's ``method="ngram"`` semantics, on the host in numpy.

Rule, for a sequence's tokens ``t[0:N]`` (prompt + output so far):
  * find the longest n in [prompt_lookup_min, prompt_lookup_max] such that the last n tokens
    ``t[N-n:N]`` also occur earlier, at some start s with ``s + n <= N - 1`` (the occurrence may
    overlap the suffix but must leave at least one token after it);
  * among occurrences of that length take the earliest s;
  * propose ``t[s+n : s+n+m]`` with ``m = min(k, max_model_len - N, N - (s+n))``: possibly fewer
    than k tokens, or none (no match, a context shorter than prompt_lookup_min, or a full context).

How: a match of length n starting at s is a window ending at e = s+n-1 whose last n tokens equal
the context's last n. Starting from the ends e holding the context's last token, each round keeps
the ends whose previous token also matches; the longest surviving length and its first end give
the draft. Cost O(N + candidates * prompt_lookup_max) per sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# vLLM's prompt_lookup_min / prompt_lookup_max when neither is given.
DEFAULT_PROMPT_LOOKUP = 5

_EMPTY = np.zeros(0, np.int32)


def resolve_lookup_range(prompt_lookup_min: int | None, prompt_lookup_max: int | None) -> tuple[int, int]:
    """vLLM's defaults: both unset -> (5, 5); one unset -> it copies the other. Raises ValueError
    unless 1 <= min <= max."""
    lo, hi = prompt_lookup_min, prompt_lookup_max
    if lo is None and hi is None:
        lo = hi = DEFAULT_PROMPT_LOOKUP
    elif lo is None:
        lo = hi
    elif hi is None:
        hi = lo
    assert lo is not None and hi is not None
    if lo < 1 or lo > hi:
        raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo} and {hi}")
    return int(lo), int(hi)


def propose_ngram(
    token_ids: Sequence[int] | np.ndarray, *, min_n: int, max_n: int, k: int, max_model_len: int
) -> np.ndarray:
    """Draft tokens for one sequence: token_ids [N] int -> [m] i32 with 0 <= m <= k (see module doc)."""
    tokens = np.asarray(token_ids)
    n_tok = int(tokens.shape[0])
    if n_tok < min_n:
        return _EMPTY
    k = min(int(k), int(max_model_len) - n_tok)
    if k <= 0 or n_tok < 2:
        return _EMPTY
    # Ends e <= N-2 (at least one token must follow the occurrence) matching the last token.
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    if ends.size == 0:
        return _EMPTY
    length = 1
    for t in range(1, max_n):
        # Grow every surviving match one token to the left; ends < t have no token there.
        grown = ends[ends >= t]
        grown = grown[tokens[grown - t] == tokens[n_tok - 1 - t]]
        if grown.size == 0:
            break
        ends, length = grown, t + 1
    if length < min_n:
        return _EMPTY
    start = int(ends[0]) + 1  # ends stay sorted: the first is the earliest occurrence
    return tokens[start : start + min(k, n_tok - start)].astype(np.int32)


@dataclass(frozen=True)
class NgramProposer:
    """Per-engine n-gram drafter. ``num_speculative_tokens`` is k; ``max_model_len`` caps the
    context a draft may grow to."""

    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    max_model_len: int

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        resolve_lookup_range(self.prompt_lookup_min, self.prompt_lookup_max)

    @classmethod
    def create(
        cls,
        num_speculative_tokens: int,
        max_model_len: int,
        prompt_lookup_min: int | None = None,
        prompt_lookup_max: int | None = None,
    ) -> NgramProposer:
        """From config values as vLLM spells them (unset lookup bounds take vLLM's defaults)."""
        lo, hi = resolve_lookup_range(prompt_lookup_min, prompt_lookup_max)
        return cls(int(num_speculative_tokens), lo, hi, int(max_model_len))

    def propose(self, token_ids: Sequence[int] | np.ndarray, max_tokens: int | None = None) -> np.ndarray:
        """Drafts for one sequence's tokens [N] -> [m] i32, m <= min(k, max_tokens)."""
        k = self.num_speculative_tokens
        if max_tokens is not None:
            k = min(k, max_tokens)
        return propose_ngram(
            token_ids,
            min_n=self.prompt_lookup_min,
            max_n=self.prompt_lookup_max,
            k=k,
            max_model_len=self.max_model_len,
        )

    def propose_batch(self, contexts: Sequence[Sequence[int] | np.ndarray]) -> list[np.ndarray]:
        """Drafts for many sequences, one [m_i] i32 array each (empty when nothing matches)."""
        return [self.propose(c) for c in contexts]
