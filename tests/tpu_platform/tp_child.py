"""Tensor-parallel checks that need several JAX devices: run as a script with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (test_tensor_parallel.py does), since the
device count is fixed when JAX starts. Prints one ``OK ...`` line per passed check; any failure
raises (non-zero exit).

    python tp_child.py runner   # logits / greedy vs TP=1, warm-up, collectives in the HLO
    python tp_child.py engine CHECKPOINT   # LLMEngine greedy output, TP=1 vs TP=2 and TP=4
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
from tiny_models import tiny_model

from tpuserve.tpu_platform.collectives import collectives
from tpuserve.tpu_platform.config import EngineConfig
from tpuserve.tpu_platform.device import discover
from tpuserve.tpu_platform.mesh import build_mesh
from tpuserve.tpu_platform.model_runner import ModelRunner
from tpuserve.tpu_platform.models.sharding import group_gate_up_by_device, replicate_kv_heads
from tpuserve.tpu_platform.step_batch import SamplingRow, ScheduledSeq

LAYERS, HEADS, VOCAB = 2, 8, 128


def make_runner(kv_heads: int, tp: int, quantization: str | None = None, **config) -> ModelRunner:
    arch, _, params = tiny_model("qwen3", layers=LAYERS, heads=HEADS, kv_heads=kv_heads, ffn=128, vocab=VOCAB)
    mesh = None
    if tp > 1:
        params, arch = replicate_kv_heads(params, arch, tp)
        mesh = build_mesh(tp)
    if quantization is not None:  # after replication and grouping, as Worker.load does
        from tpuserve.tpu_platform.models.quantize import quantize_params

        if tp > 1:
            params = group_gate_up_by_device(params, tp)
        params, _ = quantize_params(params, quantization)
    cfg = EngineConfig.from_kwargs(
        model="tiny",
        tensor_parallel_size=tp,
        max_num_batched_tokens=32,
        max_num_seqs=4,
        block_size=16,
        **config,
    )
    return ModelRunner(cfg, arch, params, discover(), jnp.float32, num_pages=16, max_model_len=64, mesh=mesh)


PROMPTS = [list(np.random.RandomState(0).randint(0, VOCAB, n)) for n in (7, 12, 3)]


def two_steps(r: ModelRunner):
    """Prefill three prompts (logits of each last token), then one greedy decode step."""
    pages = [[1 + 2 * i, 2 + 2 * i] for i in range(len(PROMPTS))]
    prefill = r.build_batch([ScheduledSeq(p, 0, pg, SamplingRow()) for p, pg in zip(PROMPTS, pages)])
    logits = r.compute_logits(prefill)
    first = logits.argmax(-1)
    decode = r.build_batch(
        [
            ScheduledSeq([int(t)], len(p), pg, SamplingRow(temperature=0.8, seed=3))
            for t, p, pg in zip(first, PROMPTS, pages)
        ]
    )
    decode_logits = r.compute_logits(decode)
    return logits, decode_logits


def check_runner() -> None:
    assert jax.device_count() == 8, jax.devices()
    # The one-device references, each computed once: "blocked" (the CPU default) named, as the
    # Pallas check below compares with it.
    refs = {}
    # Each way the KV heads meet the devices: replicated 2x, 8x and (2 heads) 2x, one a device,
    # several a device (the other four pairs of the 3 x 3 grid repeat these paths: CI time).
    for kv_heads, tps in ((1, (2, 8)), (2, (4,)), (8, (2, 8))):
        ref = refs[kv_heads] = two_steps(make_runner(kv_heads, 1, attention_impl="blocked"))
        for tp in tps:
            r = make_runner(kv_heads, tp)
            got = two_steps(r)
            for name, a, b in (("prefill", got[0], ref[0]), ("decode", got[1], ref[1])):
                np.testing.assert_allclose(
                    a, b, rtol=1e-5, atol=2e-5, err_msg=f"Hkv={kv_heads} TP={tp} {name}"
                )
                assert (a.argmax(-1) == b.argmax(-1)).all(), (kv_heads, tp, name)
            shard = r.kv_cache.addressable_shards[0].data.shape
            assert shard[3] == 2 * max(kv_heads, tp) // tp, (kv_heads, tp, shard)  # heads per device
            print(
                f"OK logits Hkv={kv_heads} TP={tp} max|diff|="
                f"{max(np.abs(got[0] - ref[0]).max(), np.abs(got[1] - ref[1]).max()):.2e}",
                flush=True,
            )

    # Scanned layers (the accelerator default): the sharded [L, ...] stacks under lax.scan.
    got = two_steps(make_runner(2, 4, layer_loop="scan"))
    for a, b in zip(got, refs[2]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-5, err_msg="layer_loop=scan")
    print("OK scanned layers TP=4", flush=True)

    # Warm-up covers serving: sampled steps (greedy, random, logprobs) compile nothing new.
    r = make_runner(2, 4)
    assert r.warmup() > 0
    before = r.compile_count
    pages = [[1 + 2 * i, 2 + 2 * i] for i in range(len(PROMPTS))]
    rows = [
        SamplingRow(),
        SamplingRow(temperature=1.0, seed=1, num_logprobs=2),
        SamplingRow(top_k=5, temperature=0.7, seed=2),
    ]
    out = r.execute(r.build_batch([ScheduledSeq(p, 0, pg, row) for p, pg, row in zip(PROMPTS, pages, rows)]))
    step = r.forward(
        r.build_batch(
            [
                ScheduledSeq([int(t)], len(p), pg, row)
                for t, p, pg, row in zip(out.token_ids[:, 0], PROMPTS, pages, rows)
            ]
        )
    )
    r.fetch(r.sample(step))
    assert r.compile_count == before, f"compiled {r.compile_count - before} programs after warm-up"
    print("OK no compile after warm-up (TP=4)", flush=True)

    t, h, rows = check_collectives(r)
    print(
        f"OK collectives: {2 * LAYERS + 1} all-reduces of [{t}, {h}] for {LAYERS} layers, "
        f"one all-gather of [{rows}, {VOCAB}] logits",
        flush=True,
    )

    # Quantized weights shard like dense ones (scales alike) and compute what TP=1 computes.
    for method in ("fp8", "nvfp4"):
        ref = two_steps(make_runner(2, 1, method))
        r = make_runner(2, 2, method)
        got = two_steps(r)
        np.testing.assert_allclose(got[0], ref[0], rtol=1e-5, atol=2e-5, err_msg=method)
        np.testing.assert_allclose(got[1], ref[1], rtol=1e-5, atol=2e-5, err_msg=method)
        check_collectives(r)
        data = "qweight" if method == "fp8" else "packed"
        for name in ("qkv", "gate_up", "o", "down"):  # every record split over the 2 devices
            arr = getattr(r.params["layers"][0][name], data)
            assert arr.addressable_shards[0].data.size * 2 == arr.size, (method, name, arr.sharding)
        print(f"OK quantized {method} TP=2", flush=True)

    # The Pallas TPU kernel (interpret mode) under shard_map, against the blocked path at TP=1.
    got = two_steps(make_runner(2, 2, attention_impl="pallas_tpu_interpret"))
    for a, b in zip(got, refs[2]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-5, err_msg="pallas_tpu_interpret")
    print("OK pallas_tpu_interpret TP=2", flush=True)


def check_collectives(r: ModelRunner) -> tuple[int, int, int]:
    """The compiled step holds 2 all-reduces per layer (after o, after down), one for the
    vocabulary-parallel embedding, and one all-gather: the logits rows, never a weight.
    Returns (T, H, R) of the step checked: two_steps' prefill, whose program is compiled already."""
    pages = [[1 + 2 * i, 2 + 2 * i] for i in range(len(PROMPTS))]
    batch = r.build_batch([ScheduledSeq(p, 0, pg, SamplingRow()) for p, pg in zip(PROMPTS, pages)])
    ops = collectives(r.step_hlo(batch))
    reduces = [c for c in ops if c.op == "all-reduce"]
    gathers = [c for c in ops if c.op == "all-gather"]
    t, h, rows = len(batch.token_ids), r.arch.hidden_size, len(batch.logits_indices)
    assert len(reduces) == 2 * LAYERS + 1, ops
    assert all(c.shape == (t, h) for c in reduces), ops
    assert [c.shape for c in gathers] == [(rows, VOCAB)], ops
    assert not [c for c in ops if c.op not in ("all-reduce", "all-gather")], ops
    return t, h, rows


def check_engine(checkpoint: str) -> None:
    from tpuserve.server.engine import LLMEngine
    from tpuserve.server.sampling_params import SamplingParams

    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]
    results = {}
    for tp in (1, 2, 4):
        engine = LLMEngine(
            EngineConfig.from_kwargs(
                model=checkpoint,
                tensor_parallel_size=tp,
                max_model_len=128,
                max_num_batched_tokens=64,
                max_num_seqs=4,
            )
        )
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        results[tp] = [list(done[str(i)]) for i in range(len(prompts))]
        if tp > 1:
            assert results[tp] == results[1], (tp, results[tp], results[1])
            print(f"OK engine greedy TP={tp} == TP=1", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "runner":
        check_runner()
    else:
        check_engine(sys.argv[2])
