"""The sampler compiles nothing after ``sampler.warmup``, whatever the batch asks for.

Two independent counters: the module's trace counter, and JAX's own backend-compile events (which
also see eager ops, e.g. a pad or a jnp.zeros a host-side path might run).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax import monitoring

from tpuserve.tpu_platform import sampler as sampler_mod
from tpuserve.tpu_platform.step_batch import SamplingBatch

# One engine's sampler: the module warms it once, then checks it compiles nothing more.
sampler = sampler_mod.Sampler()

VOCAB = 1000  # not a multiple of 32: the bitmask's last word is partial
ROW_COUNTS = (1, 2, 8)
MAX_LOGPROBS = 20
PROMPT_ROWS = 40  # buckets 8, 16, 32, 64
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


class CompileEvents:
    """Counts XLA backend compilations while registered."""

    def __init__(self):
        self.count = 0

    def __call__(self, event: str, duration: float, **kwargs) -> None:
        if event == BACKEND_COMPILE:
            self.count += 1


@pytest.fixture(scope="module")
def warm():
    events = CompileEvents()
    monitoring.register_event_duration_secs_listener(events)
    try:
        compiled = sampler.warmup(ROW_COUNTS, VOCAB, MAX_LOGPROBS, PROMPT_ROWS)
        yield compiled, events
    finally:
        monitoring.unregister_event_duration_listener(events)


def batches(num_rows: int, rng: np.random.Generator) -> dict[str, SamplingBatch]:
    """Every kind of request mix the engine can send, at one row count."""
    out: dict[str, SamplingBatch] = {}

    def new(name: str, random: bool = False) -> SamplingBatch:
        b = SamplingBatch.greedy(num_rows)
        b.seeds = rng.integers(0, 2**32, size=num_rows, dtype=np.uint64).astype(np.uint32)
        b.steps = rng.integers(0, 1000, size=num_rows).astype(np.int32)
        if random:
            b.temperature[:] = 0.8
        out[name] = b
        return b

    new("greedy")
    new("temperature", random=True)
    for k in (0, 1, 2, 3, 5, 20):
        new(f"greedy logprobs {k}").num_logprobs = k
        new(f"random logprobs {k}", random=True).num_logprobs = k
    for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
        for random in (False, True):
            b = new(f"{name} random={random}", random)
            getattr(b, name)[:] = 1.3 if name == "repetition_penalty" else 0.5
            b.output_counts = rng.integers(0, 3, size=(num_rows, VOCAB)).astype(np.int32)
            b.prompt_mask = rng.random((num_rows, VOCAB)) < 0.1
    b = new("repetition prompt only")
    b.repetition_penalty[:] = 1.5
    b.prompt_mask = rng.random((num_rows, VOCAB)) < 0.1
    for width in (1, 2, 5, 16):
        for random in (False, True):
            b = new(f"banned {width} random={random}", random)
            b.banned_ids = np.full((num_rows, width), -1, np.int32)
            b.banned_ids[0] = rng.integers(0, VOCAB, size=width)
    for random in (False, True):
        b = new(f"bitmask random={random}", random)
        b.token_bitmask = np.full((num_rows, (VOCAB + 31) // 32), -1, np.int32)
        b.token_bitmask[0, :5] = 0
    for name, fields in {
        "top_k": dict(top_k=5),
        "top_p": dict(top_p=0.9),
        "min_p": dict(min_p=0.1),
        "top_k+top_p": dict(top_k=50, top_p=0.8),
        "all filters": dict(top_k=20, top_p=0.7, min_p=0.05),
    }.items():
        b = new(name, random=True)
        for field, value in fields.items():
            getattr(b, field)[:] = value
    b = new("greedy penalty with logprobs")
    b.presence_penalty[0] = 0.4
    b.output_counts = rng.integers(0, 2, size=(num_rows, VOCAB)).astype(np.int32)
    b.num_logprobs = 2
    b = new("mixed greedy/random rows with everything")
    b.temperature[::2] = 1.1
    b.top_k[1::3], b.top_p[::4], b.min_p[::5] = 7, 0.6, 0.02
    b.repetition_penalty[::2], b.frequency_penalty[1::2] = 1.2, 0.3
    b.output_counts = rng.integers(0, 2, size=(num_rows, VOCAB)).astype(np.int32)
    b.prompt_mask = rng.random((num_rows, VOCAB)) < 0.05
    b.banned_ids = np.array([[3, 4, 5]] * num_rows, np.int32)
    b.token_bitmask = np.full((num_rows, (VOCAB + 31) // 32), -1, np.int32)
    b.token_bitmask[-1, 2] = 0x0F0F0F0F
    b.num_logprobs = 4
    return out


@pytest.mark.timeout(600)
def test_no_compile_after_warmup(warm):
    compiled, events = warm
    assert compiled > 0
    assert sampler.warmup(ROW_COUNTS, VOCAB, MAX_LOGPROBS, PROMPT_ROWS) == 0  # already warm
    rng = np.random.default_rng(0)
    traces, backend = sampler.compile_count(), events.count
    for num_rows in ROW_COUNTS:
        logits = jax.device_put(rng.normal(size=(num_rows, VOCAB)).astype(np.float32))
        for name, batch in batches(num_rows, rng).items():
            out = sampler.sample(logits, batch, MAX_LOGPROBS)
            assert out.token_ids.shape == (num_rows,), name
            if batch.num_logprobs is not None:
                assert out.logprobs.top_ids.shape == (num_rows, batch.num_logprobs), name
            # The async path is the same programs.
            sampler.sample_async(logits, batch, MAX_LOGPROBS)
            assert (sampler.compile_count(), events.count) == (traces, backend), name
    # Prompt logprobs at many row counts: a host array of any size, or a device array of bucket rows.
    for num_rows in (1, 3, 8, 9, 17, 33, 40):
        host = rng.normal(size=(num_rows, VOCAB)).astype(np.float32)
        targets = rng.integers(0, VOCAB, size=num_rows)
        for k in (0, 2, 20):
            got = sampler.compute_logprobs(host, targets, k, MAX_LOGPROBS)
            assert got.top_ids.shape == (num_rows, k) and got.token_logprobs.shape == (num_rows,)
        padded = np.zeros((sampler_mod.logprob_rows_bucket(num_rows), VOCAB), np.float32)
        padded[:num_rows] = host
        on_device = sampler.compute_logprobs(jax.device_put(padded), targets, 3, MAX_LOGPROBS)
        np.testing.assert_array_equal(on_device.top_ids, got.top_ids[:, :3])
        assert (sampler.compile_count(), events.count) == (traces, backend), num_rows


def test_at_most_eight_variants_and_programs_per_row_count(warm):
    rng = np.random.default_rng(1)
    kinds = {
        sampler_mod._prepare(b, 8, VOCAB, MAX_LOGPROBS, sampler._neutral)[0] for b in batches(8, rng).values()
    }
    assert len(kinds) == 8  # the fixture batches reach every kind, and no more exist
    # A row count not warmed yet: every kind's programs together stay within 8.
    before = sampler.compile_count()
    for b in batches(5, rng).values():
        sampler.sample(jax.device_put(np.zeros((5, VOCAB), np.float32)), b, MAX_LOGPROBS)
    assert 0 < sampler.compile_count() - before <= 8
    assert sampler.warmup([5], VOCAB, MAX_LOGPROBS) == 0


def test_logprob_columns_follow_the_request_up_to_max_logprobs():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(3, 64)).astype(np.float32)
    lp = logits - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    for k in (0, 1, 7):
        batch = SamplingBatch.greedy(3)
        batch.num_logprobs = k
        out = sampler.sample(jax.device_put(logits), batch, max_logprobs=7)
        np.testing.assert_array_equal(out.logprobs.top_ids, np.argsort(-lp, axis=-1, kind="stable")[:, :k])
        ids, parts = sampler.sample_async(jax.device_put(logits), batch, max_logprobs=7)
        assert parts[2].shape == (3, 7)  # the device side always holds max_logprobs columns
    batch.num_logprobs = 8
    with pytest.raises(ValueError, match="max_logprobs"):
        sampler.sample(jax.device_put(logits), batch, max_logprobs=7)
    with pytest.raises(ValueError, match="max_logprobs"):
        sampler.compute_logprobs(logits, [0, 1, 2], num_top=8, max_logprobs=7)


def test_compute_logprobs_ignores_padding_rows():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(16, 50)).astype(np.float32)
    targets = rng.integers(0, 50, size=5)
    whole = sampler.compute_logprobs(logits[:5], targets, 3)
    padded = sampler.compute_logprobs(logits, targets, 3)  # rows 5..15 are padding
    for a, b in zip(vars(whole).values(), vars(padded).values()):
        np.testing.assert_array_equal(a, b)
    assert padded.token_logprobs.shape == (5,)


def test_banned_ids_and_bitmask_combine():
    vocab = 70
    logits = np.tile(np.arange(vocab, dtype=np.float32), (3, 1))  # higher id = better
    batch = SamplingBatch.greedy(3)
    allowed = np.ones((3, vocab), bool)
    allowed[:, 60:] = False  # bitmask forbids the 10 best
    words = np.zeros((3, (vocab + 31) // 32), np.uint32)
    for i, v in zip(*np.nonzero(allowed)):
        words[i, v // 32] |= np.uint32(1) << np.uint32(v % 32)
    batch.token_bitmask = words.view(np.int32)
    before = batch.token_bitmask.copy()
    # Row 0 bans the best allowed token; row 1 bans one the mask already forbids and pads with -1;
    # row 2 bans an id past the vocabulary, which bans nothing.
    batch.banned_ids = np.array([[59, 58], [65, -1], [vocab + 5, -1]], np.int32)
    out = sampler.sample(jax.device_put(logits), batch)
    np.testing.assert_array_equal(out.token_ids, [57, 59, 59])
    np.testing.assert_array_equal(batch.token_bitmask, before)  # the caller's mask is not edited
