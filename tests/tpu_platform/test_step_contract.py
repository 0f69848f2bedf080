"""The StepBatch / StepOutput contract: build_batch's padding, multi-token steps with greedy draft
verification and KV rollback, and device-side token feeds (async scheduling).

The oracle for every multi-token and fed step is the plain one-token-per-step greedy decode of the
same runner, which the parity tests tie to transformers.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from tpuserve.kv_cache.layout import RESERVED_PAGE
from tpuserve.tpu_platform.config import EngineConfig
from tpuserve.tpu_platform.device import discover
from tpuserve.tpu_platform.loader import load_model
from tpuserve.tpu_platform.model_runner import ModelRunner
from tpuserve.tpu_platform.step_batch import SamplingRow, ScheduledSeq, sampling_row

pytestmark = pytest.mark.timeout(600)

PAGE = 16


@pytest.fixture(scope="module")
def runner(random_checkpoints):
    path = random_checkpoints["llama"]
    loaded = load_model(path, jnp.float32)
    config = EngineConfig.from_kwargs(model=path, max_num_batched_tokens=32, max_num_seqs=4, block_size=PAGE)
    return ModelRunner(
        config, loaded.arch, loaded.params, discover(), jnp.float32, num_pages=64, max_model_len=256
    )


def _seq(tokens, computed, pages, **kw):
    return ScheduledSeq(
        token_ids=list(tokens), num_computed=computed, page_ids=list(pages), sampling=SamplingRow(), **kw
    )


def test_build_batch_padding_contract(runner):
    seqs = [_seq([5, 6, 7], 0, [3]), _seq([9], 20, [4, 5])]
    b = runner.build_batch(seqs)
    assert b.token_ids.shape == (4,) and b.num_tokens == 4 and b.num_seqs == 2  # T bucket 4
    assert b.kv_lens.shape == (4,)  # S = min(T, max_num_seqs)
    np.testing.assert_array_equal(b.token_ids, [5, 6, 7, 9])
    np.testing.assert_array_equal(b.positions, [0, 1, 2, 20])
    np.testing.assert_array_equal(b.cu_q_lens, [0, 3, 4, 4, 4])  # padding slots repeat the total
    np.testing.assert_array_equal(b.kv_lens, [3, 21, 0, 0])
    assert b.page_table.shape[1] in runner.page_buckets
    np.testing.assert_array_equal(b.page_table[0, :2], [3, RESERVED_PAGE])
    np.testing.assert_array_equal(b.page_table[1, :3], [4, 5, RESERVED_PAGE])
    assert (b.page_table[2:] == RESERVED_PAGE).all()
    np.testing.assert_array_equal(b.logits_indices, [2, 3, 0, 0])  # each sequence's last token
    np.testing.assert_array_equal(b.cu_logits, [0, 1, 2, 2, 2])
    assert b.draft_token_ids.shape == (4, 0) and b.feed_rows is None
    np.testing.assert_array_equal(b.num_drafts, [0, 0, 0, 0])
    assert b.sampling.temperature.shape == (4,)


def test_build_batch_with_drafts_and_feeds(runner):
    seqs = [_seq([5, 6], 0, [3], draft_token_ids=[8, 9, 10]), _seq([0], 7, [4], feed_from=2)]
    b = runner.build_batch(seqs)
    np.testing.assert_array_equal(b.token_ids[:6], [5, 6, 8, 9, 10, 0])
    np.testing.assert_array_equal(b.positions[:6], [0, 1, 2, 3, 4, 7])
    np.testing.assert_array_equal(b.kv_lens[:2], [5, 8])
    # Rows of the last known token and of every draft: 4 for the first sequence, 1 for the second.
    np.testing.assert_array_equal(b.cu_logits[:3], [0, 4, 5])
    np.testing.assert_array_equal(b.logits_indices[:5], [1, 2, 3, 4, 5])
    assert len(b.logits_indices) in runner.token_buckets
    np.testing.assert_array_equal(b.draft_token_ids[:2], [[8, 9, 10, -1], [-1, -1, -1, -1]])
    np.testing.assert_array_equal(b.num_drafts[:2], [3, 0])
    np.testing.assert_array_equal(b.feed_rows[:6], [-1, -1, -1, -1, -1, 2])


@pytest.mark.parametrize(
    "seqs, match",
    [
        ([], "at least one sequence"),
        ([_seq([], 0, [1])], "at least one token"),
        ([_seq([1] * 20, 0, [1])], "cannot hold"),
        ([_seq([1], 0, [1])] * 5, "exceed"),
    ],
)
def test_build_batch_refuses_bad_work(runner, seqs, match):
    with pytest.raises(ValueError, match=match):
        runner.build_batch(seqs)


def test_drafts_refused_under_a_grammar(runner):
    words = np.full((runner.arch.vocab_size + 31) // 32, -1, np.int32)
    s = ScheduledSeq([1], 0, [1], SamplingRow(temperature=0.7, token_bitmask=words), draft_token_ids=[2])
    with pytest.raises(ValueError, match="grammar"):
        runner.build_batch([s])


def _greedy_reference(runner, prompt, pages, n, row=None):
    """n greedy tokens, one step each; ``row(output_ids)`` builds each step's SamplingRow."""
    row = row or (lambda out: SamplingRow())
    out = runner.execute(runner.build_batch([ScheduledSeq(list(prompt), 0, list(pages), row([]))]))
    tokens = [int(out.token_ids[0, 0])]
    for _ in range(n - 1):
        done = len(prompt) + len(tokens) - 1
        out = runner.execute(runner.build_batch([ScheduledSeq([tokens[-1]], done, list(pages), row(tokens))]))
        tokens.append(int(out.token_ids[0, 0]))
    return tokens


def test_multi_token_steps_verify_drafts_and_roll_back(runner):
    prompt = [11, 23, 5, 42, 17, 8, 99]
    pages = [1, 2]
    ref = _greedy_reference(runner, prompt, pages, 8)

    # Prefill, then the true continuation as drafts: every draft accepted, plus the bonus token.
    out = runner.execute(runner.build_batch([_seq(prompt, 0, pages)]))
    assert out.new_tokens(0) == ref[:1] and int(out.num_accepted[0]) == 0
    out = runner.execute(runner.build_batch([_seq([ref[0]], len(prompt), pages, draft_token_ids=ref[1:4])]))
    assert int(out.num_accepted[0]) == 3 and out.new_tokens(0) == ref[:5][1:]
    done = len(prompt) + 4  # prompt + ref[0..3] are in the cache
    # Wrong drafts from the first position: none accepted, the target's own token comes back.
    wrong = [(t + 1) % 1000 for t in ref[5:8]]
    out = runner.execute(runner.build_batch([_seq([ref[4]], done, pages, draft_token_ids=wrong)]))
    assert int(out.num_accepted[0]) == 0 and out.new_tokens(0) == [ref[5]]
    # Rollback: the rejected drafts' K/V past the accepted point are simply overwritten.
    out = runner.execute(runner.build_batch([_seq([ref[5]], done + 1, pages, draft_token_ids=ref[6:8])]))
    assert int(out.num_accepted[0]) == 2 and out.new_tokens(0)[:2] == ref[6:8]


def test_random_rows_verify_drafts(runner):
    """Drafts of sampling rows go through the rejection sampler. At a temperature just above greedy,
    p is the argmax's point mass: the true continuation is accepted in full with the target's bonus,
    a wrong first draft is rejected and replaced by the target's token. A greedy sequence in the
    same batch keeps its greedy behaviour."""
    prompt, pages = [11, 23, 5, 42, 17, 8, 99], [1, 2]
    other, other_pages = [3, 1, 4, 1, 5], [3]
    ref = _greedy_reference(runner, prompt, pages, 6)
    ref_other = _greedy_reference(runner, other, other_pages, 4)
    hot = SamplingRow(temperature=1e-4, seed=5)
    out = runner.execute(
        runner.build_batch([ScheduledSeq(list(prompt), 0, pages, hot), _seq(other, 0, other_pages)])
    )
    assert out.new_tokens(0) == ref[:1] and out.new_tokens(1) == ref_other[:1]
    hot = SamplingRow(temperature=1e-4, seed=5, step=1)
    out = runner.execute(
        runner.build_batch(
            [
                ScheduledSeq([ref[0]], len(prompt), pages, hot, draft_token_ids=ref[1:4]),
                _seq([ref_other[0]], len(other), other_pages, draft_token_ids=[ref_other[1], 7, 7]),
            ]
        )
    )
    assert int(out.num_accepted[0]) == 3 and out.new_tokens(0) == ref[1:5]
    assert int(out.num_accepted[1]) == 1 and out.new_tokens(1) == ref_other[1:3]
    done = len(prompt) + 4
    wrong = (ref[5] + 1) % runner.arch.vocab_size
    hot = SamplingRow(temperature=1e-4, seed=5, step=5)
    out = runner.execute(
        runner.build_batch([ScheduledSeq([ref[4]], done, pages, hot, draft_token_ids=[wrong, wrong])])
    )
    assert int(out.num_accepted[0]) == 0 and out.new_tokens(0) == [ref[5]]


def test_penalties_count_earlier_drafts(runner):
    """A draft row's penalties see the drafts before it as output, so greedy decoding with a
    repetition penalty accepts exactly its own one-step-at-a-time continuation."""
    prompt, pages = [7, 7, 3, 9, 7, 3], [4, 5]

    def row(output_ids):
        return sampling_row(
            prompt_ids=prompt, output_ids=list(output_ids), repetition_penalty=3.0, frequency_penalty=0.5
        )

    ref = _greedy_reference(runner, prompt, pages, 7, row)
    runner.execute(runner.build_batch([ScheduledSeq(list(prompt), 0, pages, row([]))]))
    out = runner.execute(
        runner.build_batch(
            [ScheduledSeq([ref[0]], len(prompt), pages, row(ref[:1]), draft_token_ids=ref[1:6])]
        )
    )
    assert int(out.num_accepted[0]) == 5 and out.new_tokens(0) == ref[1:7]


def test_fed_steps_equal_host_steps(runner):
    """Async scheduling's device feed gives the tokens the host loop gives."""
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8]]
    pages = [[3, 4], [5, 6]]
    refs = [_greedy_reference(runner, p, pg, 5) for p, pg in zip(prompts, pages)]
    step = runner.sample(
        runner.forward(runner.build_batch([_seq(p, 0, pg) for p, pg in zip(prompts, pages)]))
    )
    got = [[], []]
    for j in range(4):
        # Slot i's next input is the token still on the device: fed, never read by the host first.
        seqs = [_seq([0], len(p) + j, pg, feed_from=i) for i, (p, pg) in enumerate(zip(prompts, pages))]
        nxt = runner.sample(runner.forward(runner.build_batch(seqs), step))
        prev = runner.fetch(step)
        for i in range(2):
            got[i].append(int(prev.token_ids[i, 0]))
        step = nxt
    last = runner.fetch(step)
    for i in range(2):
        got[i].append(int(last.token_ids[i, 0]))
        assert got[i] == refs[i]


def test_a_greedy_step_ships_one_input_and_runs_one_program(runner, monkeypatch):
    """What a small model's step costs the host on a TPU: each host->device copy and each dispatch.
    A greedy fed decode step copies its int32 inputs as one array and takes its tokens (and the
    next step's feed) from the forward program itself: no sampler or glue program runs."""
    first = runner.sample(runner.forward(runner.build_batch([_seq([3, 1, 4], 0, [3]), _seq([2, 7], 0, [4])])))
    puts, dispatched = [], []
    real_put = runner._put
    monkeypatch.setattr(runner, "_put", lambda x: puts.append(np.shape(x)) or real_put(x))
    for name in ("_run_stages", "_logprobs_jit"):
        monkeypatch.setattr(runner.sampler, name, lambda *a, _n=name, **k: dispatched.append(_n))
    for name in ("_pad_tokens", "_last_tokens"):
        monkeypatch.setattr(runner, name, lambda *a, _n=name, **k: dispatched.append(_n))
    fwd = runner.forward(
        runner.build_batch([_seq([0], 3, [3], feed_from=0), _seq([0], 2, [4], feed_from=1)]), first
    )
    step = runner.sample(fwd)
    assert len(puts) == 1 and dispatched == []
    # The forward's argmax is the sampler's greedy choice over the same logits.
    out = runner.fetch(step)
    np.testing.assert_array_equal(out.token_ids[:2, 0], np.argmax(np.asarray(fwd.logits), -1)[:2])
    np.testing.assert_array_equal(out.num_accepted, 0)


def test_feed_without_previous_step_is_refused(runner):
    with pytest.raises(ValueError, match="previous step"):
        runner.forward(runner.build_batch([_seq([0], 4, [1], feed_from=0)]))


@pytest.mark.slow
def test_drafted_steps_compile_nothing_after_warmup(random_checkpoints):
    """With num_speculative_tokens set, warm-up covers drafted steps: greedy, sampling and mixed
    rows, 1..k drafts, logprobs, penalties, every batch size. Two counters: the runner's traces and
    JAX's own backend compilations (which also see eager ops)."""
    from jax import monitoring

    path = random_checkpoints["llama"]
    loaded = load_model(path, jnp.float32)
    config = EngineConfig.from_kwargs(model=path, max_num_batched_tokens=16, max_num_seqs=4, block_size=PAGE)
    runner = ModelRunner(
        config,
        loaded.arch,
        loaded.params,
        discover(),
        jnp.float32,
        num_pages=64,
        max_model_len=256,
        num_speculative_tokens=3,
    )
    assert runner.warmup() > 0
    before = runner.compile_count
    compiles = []

    def on_event(name, secs, **kw):
        if name == "/jax/core/compile/backend_compile_duration":
            compiles.append(name)

    rng = np.random.default_rng(0)
    monitoring.register_event_duration_secs_listener(on_event)
    try:
        prompts = [rng.integers(0, 1000, 5).tolist() for _ in range(4)]
        pages = [[1 + 2 * i, 2 + 2 * i] for i in range(4)]
        runner.execute(runner.build_batch([_seq(p, 0, pg) for p, pg in list(zip(prompts, pages))[:2]]))
        runner.execute(runner.build_batch([_seq(p, 0, pg) for p, pg in list(zip(prompts, pages))[2:]]))
        rows = [
            SamplingRow(),
            SamplingRow(temperature=0.8, top_p=0.9, seed=1, step=1),
            SamplingRow(temperature=1.0, seed=2, step=1, num_logprobs=2),
            sampling_row(
                prompt_ids=prompts[3], output_ids=[1], repetition_penalty=1.3, temperature=0.7, seed=3
            ),
        ]
        for round_ in range(6):
            n = int(rng.integers(1, 5))
            chosen = rng.permutation(4)[:n]
            seqs = []
            for i in chosen:
                k = int(rng.integers(1, 4))
                seqs.append(
                    ScheduledSeq(
                        [int(rng.integers(0, 1000))],
                        5 + 4 * round_,
                        pages[i],
                        rows[i],
                        draft_token_ids=rng.integers(0, 1000, k).tolist(),
                    )
                )
            out = runner.execute(runner.build_batch(seqs))
            assert ((out.num_accepted[:n] >= 0) & (out.num_accepted[:n] <= 3)).all()
        # Plain steps stay warm too.
        runner.execute(runner.build_batch([_seq([1], 28, pages[0])]))
    finally:
        monitoring.unregister_event_duration_listener(on_event)
    assert runner.compile_count == before
    assert compiles == []
