"""Expert-parallel checks that need several JAX devices: run as a script with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (test_expert_parallel.py does). Prints one
``OK ...`` line per passed check; any failure raises (non-zero exit).

    python ep_child.py runner NAME CHECKPOINT LOOP...   # logits vs one device, shards, collectives
    python ep_child.py engine CHECKPOINT                # LLMEngine greedy: 1 device, TP=4, EP=4

A runner or engine "EP=4" is tensor_parallel_size=4 with enable_expert_parallel: attention split
by head as under TP, the experts split on E (2 of the 8 a device).
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

from tpuserve.tpu_platform.collectives import collectives
from tpuserve.tpu_platform.config import EngineConfig
from tpuserve.tpu_platform.device import discover
from tpuserve.tpu_platform.loader import load_model
from tpuserve.tpu_platform.mesh import build_mesh
from tpuserve.tpu_platform.model_runner import ModelRunner
from tpuserve.tpu_platform.models.moe import EXPERT_ARRAYS
from tpuserve.tpu_platform.models.sharding import check_tensor_parallel, replicate_kv_heads
from tpuserve.tpu_platform.step_batch import SamplingRow, ScheduledSeq

TP = 4


def make_runner(loaded, tp: int, ep: bool, loop: str) -> ModelRunner:
    params, arch, mesh = loaded.params, loaded.arch, None
    if tp > 1:  # as Worker.load does for a dense checkpoint's attention
        check_tensor_parallel(arch, tp)
        params, arch = replicate_kv_heads(params, arch, tp)
        mesh = build_mesh(tp)
    cfg = EngineConfig.from_kwargs(
        model="tiny-moe",
        tensor_parallel_size=tp,
        enable_expert_parallel=ep,
        max_num_batched_tokens=64,
        max_num_seqs=4,
        block_size=16,
        layer_loop=loop,
    )
    return ModelRunner(cfg, arch, params, discover(), jnp.float32, num_pages=16, max_model_len=64, mesh=mesh)


def prompts(vocab: int) -> list[list[int]]:
    rng = np.random.RandomState(0)
    return [[int(t) for t in rng.randint(0, vocab, n)] for n in (7, 12, 3)]


def two_steps(r: ModelRunner):
    """Prefill three prompts (logits of each last token), then one decode step of their argmax."""
    ps = prompts(r.arch.vocab_size)
    pages = [[1 + 2 * i, 2 + 2 * i] for i in range(len(ps))]
    prefill = r.build_batch([ScheduledSeq(p, 0, pg, SamplingRow()) for p, pg in zip(ps, pages)])
    logits = r.compute_logits(prefill)
    decode = r.build_batch(
        [ScheduledSeq([int(t)], len(p), pg, SamplingRow()) for t, p, pg in zip(logits.argmax(-1), ps, pages)]
    )
    return logits, r.compute_logits(decode)


def expert_leaves(r: ModelRunner):
    """(name, array) of every per-expert array of the runner's params (a record's arrays too)."""
    layers = r.params["layers"]
    for w in layers if isinstance(layers, (list, tuple)) else [layers]:
        for name in EXPERT_ARRAYS:
            if name in w:
                for leaf in jax.tree_util.tree_leaves(w[name]):
                    yield name, leaf


def check_shards(r: ModelRunner, ep: bool) -> None:
    """Each device holds E/TP experts under EP (every expert array, biases and packed bytes
    included), all E otherwise; and no device holds another's experts."""
    e = r.arch.moe.num_experts
    stacked = not isinstance(r.params["layers"], (list, tuple))
    axis = 1 if stacked else 0  # E: after L in a stack, first in a layer's array
    seen = 0
    for name, leaf in expert_leaves(r):
        shards = leaf.addressable_shards
        assert len(shards) == TP, (name, len(shards))
        want = e // TP if ep else e
        assert all(s.data.shape[axis] == want for s in shards), (name, leaf.shape, leaf.sharding)
        if ep:  # distinct E ranges, together all of E
            starts = sorted(s.index[axis].start or 0 for s in shards)
            assert starts == list(range(0, e, e // TP)), (name, starts)
        seen += 1
    assert seen, "no expert arrays found"


def check_collectives(r: ModelRunner, ep: bool) -> str:
    """The step's collectives: a layer's all-reduce after o and, under EP, its experts' psum;
    one for the embedding; one all-gather, the logits. No weight is ever gathered. The step read is
    two_steps' prefill, whose program is compiled already."""
    ps = prompts(r.arch.vocab_size)
    pages = [[1 + 2 * i, 2 + 2 * i] for i in range(len(ps))]
    batch = r.build_batch([ScheduledSeq(p, 0, pg, SamplingRow()) for p, pg in zip(ps, pages)])
    ops = collectives(r.step_hlo(batch))
    t, h, rows = len(batch.token_ids), r.arch.hidden_size, len(batch.logits_indices)
    reduces = [c for c in ops if c.op == "all-reduce"]
    gathers = [c for c in ops if c.op == "all-gather"]
    # a scanned step's HLO holds the layer body once
    layers = 1 if r.layer_loop == "scan" else r.arch.num_layers
    assert len(reduces) == (2 * layers if ep else layers) + 1, ops
    assert all(c.shape == (t, h) for c in reduces), ops
    assert [c.shape for c in gathers] == [(rows, r.arch.vocab_size)], ops
    assert not [c for c in ops if c.op not in ("all-reduce", "all-gather")], ops
    return f"{len(reduces)} all-reduces of [{t}, {h}]"


def check_runner(name: str, path: str, loops: list[str]) -> None:
    assert jax.device_count() == 8, jax.devices()
    loaded = load_model(path, jnp.float32)
    assert loaded.arch.moe is not None and loaded.arch.moe.num_experts % TP == 0
    ref = two_steps(make_runner(loaded, 1, False, "unroll"))
    for loop in loops:
        for ep in (False, True):
            r = make_runner(loaded, TP, ep, loop)
            got = two_steps(r)
            what = f"{name} {'EP' if ep else 'TP'}={TP} {loop}"
            for step, a, b in (("prefill", got[0], ref[0]), ("decode", got[1], ref[1])):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-5, err_msg=f"{what} {step}")
                assert (a.argmax(-1) == b.argmax(-1)).all(), (what, step)
            check_shards(r, ep)
            hlo = check_collectives(r, ep)
            diff = max(np.abs(got[0] - ref[0]).max(), np.abs(got[1] - ref[1]).max())
            print(f"OK {what} max|diff|={diff:.2e}, {hlo}", flush=True)


def check_engine(path: str) -> None:
    from tpuserve.server.engine import LLMEngine
    from tpuserve.server.sampling_params import SamplingParams

    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    results, weight_bytes = {}, {}
    for tp, ep in ((1, False), (TP, False), (TP, True)):
        engine = LLMEngine(
            EngineConfig.from_kwargs(
                model=path,
                tensor_parallel_size=tp,
                enable_expert_parallel=ep,
                max_model_len=128,
                max_num_batched_tokens=64,
                max_num_seqs=4,
            )
        )
        if ep:
            check_shards(engine.runner, True)
        weight_bytes[(tp, ep)] = engine.worker.weight_bytes
        experts = sum(leaf.nbytes for _, leaf in expert_leaves(engine.runner))
        for i, p in enumerate(texts):
            engine.add_request(str(i), p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = list(out.outputs[0].token_ids)
        results[(tp, ep)] = [done[str(i)] for i in range(len(texts))]
        del engine
    assert results[(TP, False)] == results[(1, False)], results
    assert results[(TP, True)] == results[(1, False)], results
    print(f"OK engine greedy EP={TP} == TP={TP} == one device", flush=True)
    # The memory plan's weight bytes count what the devices hold: TP's replicated experts TP
    # times, EP's split ones once.
    saved = weight_bytes[(TP, False)] - weight_bytes[(TP, True)]
    assert saved == (TP - 1) * experts, (weight_bytes, experts)
    assert weight_bytes[(TP, True)] > weight_bytes[(1, False)], weight_bytes  # norms etc. replicated
    print(f"OK weight bytes on the devices: EP={TP} holds {saved} fewer than TP={TP}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "runner":
        check_runner(sys.argv[2], sys.argv[3], sys.argv[4:])
    else:
        check_engine(sys.argv[2])
