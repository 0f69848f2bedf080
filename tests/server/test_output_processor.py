"""The output processor on a stand-in tokenizer (no model): text, stops, lengths, logprobs, the
grammar's end, and the RequestOutput it builds."""

from __future__ import annotations

import numpy as np
import pytest

from tpuserve.server.output_processor import GrammarDeadEndError, OutputProcessor
from tpuserve.server.sampling_params import SamplingParams
from tpuserve.server.sequence import RequestState, Sequence
from tpuserve.tpu_platform.step_batch import Logprobs

EOS = 26
LETTERS = "abcdefghijklmnopqrstuvwxyz"


class LetterTokenizer:
    """Token i < 26 is a letter; EOS is special (dropped when skipping special tokens)."""

    def decode(self, token_ids, skip_special_tokens=True, **kw):
        return "".join(LETTERS[t] if t < 26 else ("" if skip_special_tokens else "</s>") for t in token_ids)


def ids(text):
    return [LETTERS.index(c) for c in text]


def setup(max_model_len=100, grammar=None, **params):
    proc = OutputProcessor(LetterTokenizer(), {EOS}, max_model_len)
    p = SamplingParams(**params)
    seq = Sequence("r#0", "r", 0, ids("xyz"), p, seed=0, arrival=0.0)
    seq.grammar = grammar
    proc.start(seq)
    state = RequestState("r", "xyz", ids("xyz"), p, [seq], arrival=0.0)
    return proc, state, seq


def feed(proc, state, seq, tokens, logprobs=None):
    """Append tokens until one ends the sequence; returns how many were taken."""
    for i, t in enumerate(tokens):
        if proc.append(state, seq, t, logprobs, i):
            return i + 1
    return len(tokens)


def test_text_grows_until_eos_which_stops_without_text():
    proc, state, seq = setup(max_tokens=10)
    assert feed(proc, state, seq, ids("hi") + [EOS] + ids("zz")) == 3
    assert (seq.text, seq.finish_reason, seq.stop_reason) == ("hi", "stop", None)
    assert state.first_token_time is not None


def test_ignore_eos_runs_to_max_tokens():
    proc, state, seq = setup(max_tokens=4, ignore_eos=True)
    assert feed(proc, state, seq, [0, EOS, 1, 2, 3]) == 4
    assert seq.finish_reason == "length"


def test_stop_token_ids_name_the_token():
    proc, state, seq = setup(max_tokens=10, stop_token_ids=[5])
    feed(proc, state, seq, ids("ab") + [5])
    assert (seq.text, seq.finish_reason, seq.stop_reason) == ("ab", "stop", 5)


@pytest.mark.parametrize("include, text", [(False, "he"), (True, "hello")])
def test_stop_strings_cut_the_text(include, text):
    proc, state, seq = setup(max_tokens=20, stop=["llo"], include_stop_str_in_output=include)
    assert feed(proc, state, seq, ids("hellothere")) == 5
    assert (seq.text, seq.finish_reason, seq.stop_reason) == (text, "stop", "llo")


def test_stop_strings_wait_for_min_tokens():
    proc, state, seq = setup(max_tokens=20, stop=["a"], min_tokens=3)
    assert feed(proc, state, seq, ids("abaa")) == 3
    assert (seq.text, seq.stop_reason) == ("ab", "a")


def test_the_context_length_ends_a_sequence():
    proc, state, seq = setup(max_model_len=5, max_tokens=None)
    assert feed(proc, state, seq, ids("abcd")) == 2  # 3 prompt + 2 generated
    assert (seq.text, seq.finish_reason) == ("ab", "length")


def test_logprobs_keep_the_chosen_token_and_the_top_k():
    proc, state, seq = setup(max_tokens=2, logprobs=1)
    lp = Logprobs(
        token_logprobs=np.array([-0.5, -1.25], np.float32),
        token_ranks=np.array([2, 1], np.int32),
        top_ids=np.array([[4, 9], [1, 4]], np.int32),
        top_logprobs=np.array([[-0.25, -3.0], [-1.25, -2.0]], np.float32),
    )
    feed(proc, state, seq, [0, 1], logprobs=lp)
    first, second = seq.logprobs
    assert {t: (e.logprob, e.rank, e.decoded_token) for t, e in first.items()} == {
        0: (-0.5, 2, "a"),
        4: (-0.25, 1, "e"),
    }
    assert list(second) == [1]  # the chosen token is the top one
    assert seq.cumulative_logprob == -1.75
    out = proc.output(state)
    (c,) = out.outputs
    assert out.finished is False  # the scheduler, not the processor, finishes a sequence
    assert (c.text, c.token_ids, c.cumulative_logprob, c.finish_reason) == ("ab", [0, 1], -1.75, "length")
    assert c.logprobs == seq.logprobs and c.logprobs is not seq.logprobs


def test_no_logprobs_asked_gives_none():
    proc, state, seq = setup(max_tokens=1)
    feed(proc, state, seq, [0])
    c = proc.output(state).outputs[0]
    assert c.logprobs is None and c.cumulative_logprob is None


class Grammar:
    """Accepts ``allowed`` tokens and is done after ``length`` of them."""

    def __init__(self, allowed, length):
        self.allowed, self.length, self.n = set(allowed), length, 0

    def accept(self, token_id):
        self.n += 1
        return token_id in self.allowed

    def is_terminated(self):
        return self.n >= self.length


def test_a_grammar_that_ends_stops_the_sequence():
    proc, state, seq = setup(max_tokens=10, grammar=Grammar(ids("ab"), 2))
    assert feed(proc, state, seq, ids("abab")) == 2
    assert (seq.text, seq.finish_reason) == ("ab", "stop")


def test_a_refused_token_is_a_dead_end():
    proc, state, seq = setup(max_tokens=10, grammar=Grammar(ids("ab"), 5))
    with pytest.raises(GrammarDeadEndError, match="after 1 generated tokens"):
        feed(proc, state, seq, ids("ac"))


def test_prompt_logprobs_are_taken_chunk_by_chunk():
    proc, state, seq = setup(max_tokens=1, prompt_logprobs=0)
    state.prompt_logprobs = [None]
    lp = Logprobs(
        token_logprobs=np.array([-1.0, -2.0], np.float32),
        token_ranks=np.array([3, 4], np.int32),
        top_ids=np.zeros((2, 1), np.int32),
        top_logprobs=np.zeros((2, 1), np.float32),
    )
    # Prompt "xyz" in two chunks: [x] scores y (row 0), [y, z] scores z (row 1); z predicts no
    # prompt token.
    proc.take_prompt_logprobs(state, seq, 0, 1, lp, 0)
    proc.take_prompt_logprobs(state, seq, 1, 2, lp, 1)
    y, z = ids("yz")
    got = [
        None if p is None else {t: (e.logprob, e.rank, e.decoded_token) for t, e in p.items()}
        for p in state.prompt_logprobs
    ]
    assert got == [None, {y: (-1.0, 3, "y")}, {z: (-2.0, 4, "z")}]
    assert proc.output(state).prompt_logprobs is state.prompt_logprobs
