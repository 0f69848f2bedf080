"""Warm-up's compiled forwards are kept on disk (tpu_platform/executable_cache.py): a restart with
the same model and flags loads them instead of tracing, and gets the same tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from tpuserve.tpu_platform.executable_cache import ExecutableCache, signature

pytestmark = pytest.mark.timeout(600)

CHILD = """
import json, sys
from tpuserve import LLM, SamplingParams
llm = LLM(model=sys.argv[1], compilation_cache_dir=sys.argv[2], executable_cache=True, max_model_len=256, max_num_seqs=4,
          max_num_batched_tokens=32, layer_loop="scan")
runner = llm.engine.runner
after_warmup = runner.compile_count
cached = [runner._pad_tokens, runner._last_tokens, runner.sampler._argmax_jit, runner.sampler._extras_jit,
          runner.sampler._random_jit, runner.sampler._logprobs_jit]
programs_at_warmup = sum(len(c._programs) for c in cached)
outs = llm.generate(["The capital of France is", "1, 2, 3,"],
                    SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
# every sampler stage through the stored programs: random draws, penalties, logprobs
drawn = llm.generate(["The capital of France is"],
                     SamplingParams(temperature=0.8, seed=7, max_tokens=8, ignore_eos=True, logprobs=2,
                                    repetition_penalty=1.2), use_tqdm=False)[0].outputs[0]
cache = runner.executable_cache
print("RESULT", json.dumps(dict(
    hits=cache.hits, misses=cache.misses, forwards=len(runner._forward_programs),
    traces_at_warmup=after_warmup, traces_after=runner.compile_count,
    programs_at_warmup=programs_at_warmup, programs_after=sum(len(c._programs) for c in cached),
    tokens=[list(o.outputs[0].token_ids) for o in outs], drawn=list(drawn.token_ids),
    logprobs=[sorted((int(t), round(float(lp.logprob), 5)) for t, lp in step.items()) for step in drawn.logprobs])))
"""


def _start(model: str, cache_dir: str) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run(
        [sys.executable, "-c", CHILD, model, cache_dir], env=env, capture_output=True, text=True, timeout=500
    )
    assert out.returncode == 0, out.stderr[-4000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


@pytest.mark.slow
def test_a_restart_loads_the_forwards_instead_of_tracing_them(random_checkpoints, tmp_path):
    model, cache_dir = random_checkpoints["llama"], str(tmp_path / "xla")
    first = _start(model, cache_dir)
    files = os.listdir(os.path.join(cache_dir, "tpuserve-executables"))
    stored = [f for f in files if f.endswith(".exe")]
    # the forwards, and the programs around them: the sampler's stages and the step glue
    kinds = {f.rsplit("-", 1)[0] for f in stored}
    assert {"forward", "sampler-extras", "sampler-random", "sampler-logprobs", "pad-tokens"} <= kinds, kinds
    assert len([f for f in stored if f.startswith("forward-")]) == first["forwards"] > 0
    assert first["hits"] == 0 and first["misses"] == len(stored)

    again = _start(model, cache_dir)
    assert again["hits"] == len(stored) and again["forwards"] == first["forwards"] and again["misses"] == 0
    assert again["tokens"] == first["tokens"]
    assert again["drawn"] == first["drawn"] and again["logprobs"] == first["logprobs"]
    # no stored program is built on a request's path (a signature warm-up did not cover would be
    # lowered and compiled there without a new trace): none after warm-up, in either run
    for run in (first, again):
        assert run["programs_after"] == run["programs_at_warmup"] > 0, run
    # every stored program was traced the first time and none on the restart (what is left is the
    # prompt-logprobs head, compiled apart); nothing after warm-up
    assert again["traces_at_warmup"] == first["traces_at_warmup"] - len(stored)
    assert (
        first["traces_after"] == first["traces_at_warmup"]
        and again["traces_after"] == again["traces_at_warmup"]
    )

    for f in files:
        with open(os.path.join(cache_dir, "tpuserve-executables", f), "r+b") as fh:
            fh.write(b"torn")  # and a damaged file is a miss, not an error
    damaged = _start(model, cache_dir)
    assert damaged["hits"] == 0 and damaged["tokens"] == first["tokens"]


def test_key_follows_the_arguments_signature_and_the_context(tmp_path):
    a = (jnp.zeros((4, 8), jnp.float32), {"w": jnp.zeros(3, jnp.bfloat16)})
    cache = ExecutableCache(str(tmp_path), "config A")
    key = cache.key("forward", a)
    assert key == ExecutableCache(str(tmp_path), "config A").key("forward", a)
    assert key != ExecutableCache(str(tmp_path), "config B").key("forward", a)
    assert key != cache.key("sampler", a)
    for other in (
        (jnp.zeros((4, 9), jnp.float32), a[1]),
        (jnp.zeros((4, 8), jnp.int32), a[1]),
        (a[0], {"v": a[1]["w"]}),
        (jax.ShapeDtypeStruct((4, 8), jnp.float32), a[1], 3),
    ):
        assert cache.key("forward", other) != key, signature(other)
    # an abstract stand-in keys as the concrete array it stands for
    abstract = (jax.ShapeDtypeStruct((4, 8), jnp.float32, sharding=a[0].sharding), a[1])
    assert cache.key("forward", abstract) == key


ROUND_TRIP = """
import sys, jax, jax.numpy as jnp
from tpuserve.tpu_platform.executable_cache import ExecutableCache
f = jax.jit(lambda x, y: (x * 2 + y, y), donate_argnums=(0,))
x, y = jnp.arange(6.0), jnp.ones(6)
cache = ExecutableCache(sys.argv[1], "ctx")
key = cache.key("f", (x, y))
if sys.argv[2] == "save":
    assert cache.load(key) is None and cache.misses == 1
    cache.save(key, f.lower(x, y).compile())
else:
    print("RESULT", cache.load(key)(x, y)[0].tolist())
print("KEY", key)
"""


def _fresh_process(script: str, *args: str) -> str:
    """``script``'s stdout, run in a new Python process on the CPU backend."""
    out = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_load_and_save_round_trip_and_misses(tmp_path):
    # Saved in one fresh process and loaded in another, as a restart does: XLA:CPU failed to run
    # programs serialized or deserialized in a process that had compiled or cached others ("Function
    # ... not found"), which is why the cache is off on CPU by default (tpu_platform/config.py).
    saved = _fresh_process(ROUND_TRIP, str(tmp_path / "exe"), "save")
    assert "RESULT [1.0, 3.0, 5.0, 7.0, 9.0, 11.0]" in _fresh_process(
        ROUND_TRIP, str(tmp_path / "exe"), "load"
    )
    key = saved.split("KEY ")[1].split()[0]
    with open(os.path.join(str(tmp_path / "exe"), key + ".exe"), "wb") as fh:
        fh.write(b"not an executable")
    bad = ExecutableCache(str(tmp_path / "exe"), "ctx")
    assert bad.load(key) is None and bad.misses == 1


CACHED_JIT = """
import json, sys, jax, jax.numpy as jnp, numpy as np
from tpuserve.tpu_platform.executable_cache import CachedJit, ExecutableCache
traces = []
def body(x, a, *, scale):
    traces.append(scale)
    return x * scale + a["b"]
disk = None if sys.argv[2] == "none" else ExecutableCache(sys.argv[1], "ctx")
f = CachedJit("f", jax.jit(body, static_argnames=("scale",)), disk)
x, a = jnp.arange(4.0), {"b": np.ones(4, np.float32)}
out = [f(x, a, scale=2).tolist(), f(x, a, scale=2).tolist(), f(x, a, scale=3).tolist(),
       f(jnp.arange(6.0), {"b": np.ones(6, np.float32)}, scale=2).tolist()]
print("RESULT", json.dumps(dict(out=out, traces=traces, hits=disk and disk.hits, misses=disk and disk.misses)))
"""


def test_cached_jit_loads_each_signature_from_disk_on_a_restart(tmp_path):
    def run(disk):
        return json.loads(_fresh_process(CACHED_JIT, str(tmp_path / "exe"), disk).split("RESULT ")[1])

    want = [
        [1.0, 3.0, 5.0, 7.0],
        [1.0, 3.0, 5.0, 7.0],
        [1.0, 4.0, 7.0, 10.0],
        [1.0, 3.0, 5.0, 7.0, 9.0, 11.0],
    ]
    first = run("disk")
    # one program per signature (static value, shapes): the repeated call reuses the first
    assert first["out"] == want and first["traces"] == [2, 3, 2] and first["misses"] == 3
    again = run("disk")  # a restart: every program from disk, nothing traced
    assert again["out"] == want and again["traces"] == [] and again["hits"] == 3 and again["misses"] == 0
    plain = run("none")  # no disk: the jitted function itself
    assert plain["out"] == want and plain["traces"] == [2, 3, 2] and plain["hits"] is None


def test_runner_context_names_the_tpu_kernels_block_sizes(monkeypatch):
    """The TPU attention kernel reads its generation's BlockSizes while tracing, so they are part
    of the key: on a v5e (2026-12-07) a second engine with the one-item decode path switched on
    loaded the first engine's stored programs and ran without it."""
    import dataclasses
    from types import SimpleNamespace

    from tpuserve.attention import pallas_tpu
    from tpuserve.attention.names import AttentionImpl
    from tpuserve.tpu_platform.model_runner import ModelRunner

    fields = dict.fromkeys(
        "config arch layer_loop dtype kv_cache_dtype kv_storage_dtype kv_scales num_speculative_tokens "
        "draft_aux_layers max_model_len mesh".split()
    )
    runner = SimpleNamespace(**fields, attn_impl=AttentionImpl.PALLAS_TPU_INTERPRET)
    before = ModelRunner._program_context(runner)
    swapped = dataclasses.replace(pallas_tpu._FALLBACK_BLOCK_SIZES, single_item_decode=True)
    monkeypatch.setattr(pallas_tpu, "_FALLBACK_BLOCK_SIZES", swapped)
    assert ModelRunner._program_context(runner) != before
    blocked = SimpleNamespace(**fields, attn_impl=AttentionImpl.BLOCKED)
    assert "BlockSizes" not in ModelRunner._program_context(blocked)
