"""Serving while the warm-up compiles in the background: steps keep to the compiled shapes (padded
up, or split by a smaller token budget), their outputs equal a fully warmed engine's, and nothing
compiles on the thread that runs the steps. JAX's own compile events are the oracle."""

from __future__ import annotations

import os
import signal
import threading

import httpx
import numpy as np
import pytest
from jax import monitoring
from polling import wait_until  # tests/polling.py

from tpuserve.server.launcher import ServerProcess, free_port, tpuserve_argv
from tpuserve.server.llm import LLM
from tpuserve.server.sampling_params import SamplingParams
from tpuserve.tpu_platform.warmup import CompileTask, WarmupPlan

ENGINE = dict(
    max_model_len=256,
    max_num_batched_tokens=64,
    max_num_seqs=4,
    num_gpu_blocks=80,
    enable_prefix_caching=False,
)
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


def _held_back(plan: WarmupPlan, gate: threading.Event) -> WarmupPlan:
    """``plan`` with every task outside its first groups waiting for ``gate`` before it compiles."""
    first = {k for g in plan.groups if g.first for k in g.tasks}

    def after_gate(run):
        def run_when_open():
            assert gate.wait(300), "the test never opened the gate"
            return run()

        return run_when_open

    tasks = tuple(t if t.key in first else CompileTask(t.key, after_gate(t.run)) for t in plan.tasks)
    return WarmupPlan(tasks, plan.groups)


def _requests(rng) -> tuple[list[list[int]], list[SamplingParams]]:
    # 150 tokens: more than the largest compiled step (split); 63 and 3: padded to a larger bucket.
    lengths = [3, 20, 63, 150, 9]
    prompts = [rng.integers(0, 1000, n).tolist() for n in lengths]
    greedy = dict(temperature=0.0, max_tokens=12, ignore_eos=True)
    params = [SamplingParams(**greedy) for _ in lengths]
    params[1] = SamplingParams(**greedy, prompt_logprobs=1, logprobs=2)
    params[4] = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
    return prompts, params


def test_requests_during_warmup_use_compiled_shapes_only(random_checkpoints):
    prompts, params = _requests(np.random.default_rng(0))
    llm = LLM(random_checkpoints["llama"], **ENGINE, warmup=False)
    runner = llm.engine.runner
    gate = threading.Event()
    warmup = runner.start_warmup(progress=False, plan=_held_back(runner.warmup_plan(), gate))
    compiles_here = []
    me = threading.current_thread()

    def on_event(name, secs, **kw):
        if name == BACKEND_COMPILE and threading.current_thread() is me:
            compiles_here.append(secs)

    def generate():
        monitoring.register_event_duration_secs_listener(on_event)
        try:
            return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        finally:
            monitoring.unregister_event_duration_listener(on_event)

    try:
        warmup.wait_first()
        widest = runner.page_buckets[-1]
        # The first shapes: a decode of one sequence, and a short prompt's bucket (here the largest).
        assert runner.max_ready_tokens() == 64
        assert runner.step_shape(1, 1) == (1, widest)
        assert runner.step_shape(3, 1) == (64, widest)  # padded up to what is compiled
        during = generate()
        assert warmup.remaining > 0  # all of it ran while the rest of the warm-up was held back
        assert compiles_here == [], f"{len(compiles_here)} programs compiled on the stepping thread"
        # CPU runs its layers unrolled; until those programs compile, steps run the quick scan ones
        assert runner.scan_tier_steps > 0
    finally:
        gate.set()
    assert warmup.wait(300) and not warmup.failed
    assert runner.step_shape(3, 1) == (4, widest)  # every bucket compiled now
    # Fully warmed, every step takes its own bucket, and still compiles nothing: the forwards
    # compiled ahead of time are the programs the jitted calls find.
    scan_steps = runner.scan_tier_steps
    after = generate()
    assert compiles_here == []
    assert runner.scan_tier_steps == scan_steps, "a warmed engine still ran the scan tier"
    assert not runner.holds_scan_tier, "the stacked weights outlived the warm-up"
    for d, a, p in zip(during, after, params):
        assert d.error is None and len(d.outputs[0].token_ids) == 12
        if p.temperature == 0.0:
            assert d.outputs[0].token_ids == a.outputs[0].token_ids
        if p.logprobs:  # the scan computes the unrolled layers' values, not just the same argmax
            for ld, la in zip(d.outputs[0].logprobs, a.outputs[0].logprobs):
                assert {t: x.logprob for t, x in ld.items()} == pytest.approx(
                    {t: x.logprob for t, x in la.items()}, abs=1e-5
                )


@pytest.mark.parametrize("layer_loop", ["unroll", "scan"])
def test_scan_tier_leads_the_plan_of_an_unrolled_runner_only(random_checkpoints, layer_loop):
    """Unrolled (CPU): the first groups are the two first shapes as layer scans, every other shape
    waits for its unrolled forward. Already scanned: no such tier, and nothing kept for it."""
    llm = LLM(random_checkpoints["llama"], **ENGINE, layer_loop=layer_loop, warmup=False)
    runner = llm.engine.runner
    plan = runner.warmup_plan()
    widest = runner.page_buckets[-1]
    scan = [g.shape for g in plan.groups if len(g.shape) == 3]
    first = [g.shape for g in plan.groups if g.first]
    unrolled = {g.shape for g in plan.groups if len(g.shape) == 2}
    assert unrolled == {(t, p) for t in runner.token_buckets for p in runner.page_buckets}
    if layer_loop == "unroll":
        assert runner.holds_scan_tier
        assert sorted(scan) == sorted(first) == [(1, widest, "scan"), (64, widest, "scan")]
        assert [g.shape for g in plan.groups[:2]] == first  # started before any unrolled forward
    else:
        assert not runner.holds_scan_tier and scan == []
        assert sorted(first) == [(1, widest), (64, widest)]


@pytest.mark.slow
def test_server_killed_while_warming_up_restarts_from_the_cache(random_checkpoints, tmp_path):
    """The server listens once its first programs are compiled; killed (SIGKILL) then, the
    persistent compilation cache it filled serves a restart (JAX logs each cache hit)."""
    cache = tmp_path / "xla"
    serve = (
        "serve",
        random_checkpoints["llama"],
        "--compilation-cache-dir",
        str(cache),
        "--max-model-len",
        "256",
        "--max-num-batched-tokens",
        "64",
        "--max-num-seqs",
        "4",
        "--num-gpu-blocks",
        "80",
        "--no-ui",
    )

    def server(name: str, env: dict) -> ServerProcess:
        port = free_port()
        return ServerProcess(
            tpuserve_argv(*serve, "--port", str(port)),
            port,
            env={"JAX_PLATFORMS": "cpu", **env},
            log_path=str(tmp_path / f"{name}.log"),
            health_path="/v1/models",  # listening: /health says 503 until the warm-up is done
        )

    first = server("first", {}).start()
    try:
        remaining = _gauge(httpx.get(first.base_url + "/metrics").text, "tpuserve:warmup_remaining")
        health = httpx.get(first.base_url + "/health")
        if remaining > 0:
            assert health.status_code == 503 and "starting" in health.json()["error"]["message"]
    finally:
        os.killpg(first.proc.pid, signal.SIGKILL)
        first.proc.wait(30)
    assert any(cache.iterdir()), "the first server cached nothing"

    second = server("second", {"JAX_LOG_COMPILES": "1"}).start()
    try:
        r = httpx.post(
            second.base_url + "/v1/completions",
            json={"model": random_checkpoints["llama"], "prompt": "hello", "max_tokens": 4},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        wait_until(lambda: httpx.get(second.base_url + "/health").status_code == 200, 300, 0.2, "warm-up")
        assert _gauge(httpx.get(second.base_url + "/metrics").text, "tpuserve:warmup_remaining") == 0
    finally:
        assert second.stop() == 0, second.log_tail()
    with open(second.log_path) as f:
        hits = f.read().count("Persistent compilation cache hit")
    assert hits > 0, second.log_tail()


def _gauge(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")
