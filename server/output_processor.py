"""Sampled ids -> what a request returns: text (detokenized, cut at stop strings), logprobs, the
finish decision (stop tokens, stop strings, grammar end, length) and the ``RequestOutput``.

The engine hands over each token a step sampled; this module decides what it means for the
sequence and leaves acting on a finish (freeing pages, exporting KV) to the engine.
"""

from __future__ import annotations

import time
from collections.abc import Set

from tpuserve.server.detokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer, decode_token
from tpuserve.server.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from tpuserve.server.sequence import RequestState, Sequence
from tpuserve.tpu_platform.step_batch import Logprobs


class GrammarDeadEndError(ValueError):
    """A request's grammar admits no token where decoding stands (it matches no complete text)."""


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, eos_token_ids: Set[int], max_model_len: int):
        """``eos_token_ids``: end a sequence unless its params say ``ignore_eos``."""
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def start(self, seq: Sequence) -> None:
        """Give a new sequence its text state (and a logprobs list when it asks for them)."""
        p = seq.params
        seq.detok = IncrementalDetokenizer(
            self.tokenizer, seq.prompt_token_ids, p.skip_special_tokens, p.spaces_between_special_tokens
        )
        seq.stopper = StopStringMatcher(p.stop or [], p.include_stop_str_in_output)
        if p.logprobs is not None:
            seq.logprobs = []

    def append(
        self, state: RequestState, seq: Sequence, token: int, logprobs: Logprobs | None, row: int
    ) -> bool:
        """Append one sampled token (scored at row ``row`` of ``logprobs``). Returns True when it
        ends the sequence, with ``finish_reason`` and ``stop_reason`` set. Raises
        GrammarDeadEndError when the sequence's grammar refuses it."""
        p = seq.params
        detok, stopper = seq.detok, seq.stopper
        assert detok is not None and stopper is not None, "start() gives a sequence its text state"
        out = seq.output_token_ids
        out.append(token)
        if state.first_token_time is None:
            state.first_token_time = time.monotonic()
        if seq.logprobs is not None and logprobs is not None:
            seq.logprobs.append(self._position_logprobs(logprobs, row, token, p.logprobs or 0))
        if seq.grammar is not None and not seq.grammar.accept(token):
            raise GrammarDeadEndError(
                f"structured_outputs: the grammar admits no token after {len(out) - 1} "
                f"generated tokens (token {token} was sampled from an empty mask): it matches no "
                f"complete text"
            )
        n_out = len(out)
        reason: str | None = None
        stop_reason: int | str | None = None
        if token in self.eos_token_ids and not p.ignore_eos:
            reason = "stop"
        elif p.stop_token_ids and token in p.stop_token_ids:
            reason, stop_reason = "stop", token
        if reason is None:
            delta = detok.add_tokens((token,))
            if n_out >= p.min_tokens:
                emit, matched = stopper.feed(delta)
                if emit:
                    seq.text += emit
                if matched is not None:
                    reason, stop_reason = "stop", matched
            elif delta:
                seq.text += delta  # stop strings only count once min_tokens are out
        if reason is None and seq.grammar is not None and seq.grammar.is_terminated():
            reason = "stop"
        if reason is None and p.max_tokens is not None and n_out >= p.max_tokens:
            reason = "length"
        if reason is None and len(seq.prompt_token_ids) + n_out >= self.max_model_len:
            reason = "length"
        if reason is None:
            return False
        if not isinstance(stop_reason, str):
            seq.text += stopper.feed(detok.flush())[0] + stopper.flush()
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        return True

    def take_prompt_logprobs(
        self,
        state: RequestState,
        seq: Sequence,
        start: int,
        num_tokens: int,
        logprobs: Logprobs | None,
        row: int,
    ) -> None:
        """Record the prompt logprobs of a chunk of ``num_tokens`` from ``start`` (rows from
        ``row`` of the step's prompt logprobs)."""
        if state.prompt_logprobs is None or seq.index != 0 or logprobs is None:
            return
        end = min(start + num_tokens, len(seq.prompt_token_ids) - 1)
        if seq.num_preemptions and len(state.prompt_logprobs) > start + 1:
            return  # recomputed after preemption: already recorded
        k = seq.params.prompt_logprobs or 0
        for j in range(max(0, end - start)):
            target = seq.prompt_token_ids[start + 1 + j]
            state.prompt_logprobs.append(self._position_logprobs(logprobs, row + j, target, k))

    def _position_logprobs(self, lp: Logprobs, row: int, token: int, k: int) -> PositionLogprobs:
        """The chosen token's entry plus the top ``k`` (the step computed max_logprobs of them)."""
        entry = {
            int(token): Logprob(
                float(lp.token_logprobs[row]),
                int(lp.token_ranks[row]),
                decode_token(self.tokenizer, int(token)),
            )
        }
        for rank, (tid, val) in enumerate(zip(lp.top_ids[row][:k], lp.top_logprobs[row][:k]), start=1):
            entry.setdefault(int(tid), Logprob(float(val), rank, decode_token(self.tokenizer, int(tid))))
        return entry

    def output(self, state: RequestState) -> RequestOutput:
        """The request's cumulative output so far."""
        outs = [
            CompletionOutput(
                index=s.index,
                text=s.text,
                token_ids=list(s.output_token_ids),
                cumulative_logprob=s.cumulative_logprob if s.logprobs is not None else None,
                logprobs=list(s.logprobs) if s.logprobs is not None else None,
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
            )
            for s in state.seqs
        ]
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=outs,
            finished=state.finished,
            prompt_logprobs=state.prompt_logprobs,
            num_cached_tokens=state.seqs[0].num_cached_tokens,
            error=state.error,
            error_status=state.error_status,
            kv_transfer_params=state.kv_transfer_params,
        )
