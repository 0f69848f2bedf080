"""Serving while the warm-up compiles in the background: steps keep to the compiled shapes (padded
up, or split by a smaller token budget), their outputs equal a fully warmed engine's, and nothing
compiles on the thread that runs the steps. JAX's own compile events are the oracle."""

from __future__ import annotations

import threading

import numpy as np
from jax import monitoring

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
    path = random_checkpoints["llama"]
    prompts, params = _requests(np.random.default_rng(0))
    warm = LLM(path, **ENGINE)  # warms up in its constructor
    want = warm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    llm = LLM(path, **ENGINE, warmup=False)
    runner = llm.engine.runner
    gate = threading.Event()
    warmup = runner.start_warmup(progress=False, plan=_held_back(runner.warmup_plan(), gate))
    compiles_here = []
    me = threading.current_thread()

    def on_event(name, secs, **kw):
        if name == BACKEND_COMPILE and threading.current_thread() is me:
            compiles_here.append(secs)

    try:
        warmup.wait_first()
        widest = runner.page_buckets[-1]
        # The first shapes: a decode of one sequence, and a short prompt's bucket (here the largest).
        assert runner.max_ready_tokens() == 64
        assert runner.step_shape(1, 1) == (1, widest)
        assert runner.step_shape(3, 1) == (64, widest)  # padded up to what is compiled
        assert warmup.remaining > 0
        monitoring.register_event_duration_secs_listener(on_event)
        got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert warmup.remaining > 0  # all of it ran while the rest of the warm-up was held back
        assert compiles_here == [], f"{len(compiles_here)} programs compiled on the stepping thread"
    finally:
        gate.set()
        monitoring.unregister_event_duration_listener(on_event)
    assert warmup.wait(300) and not warmup.failed
    assert runner.step_shape(3, 1) == (4, widest)  # every bucket compiled now
    for g, w, p in zip(got, want, params):
        assert g.error is None and len(g.outputs[0].token_ids) == 12
        if p.temperature == 0.0:
            assert g.outputs[0].token_ids == w.outputs[0].token_ids
    # After the warm-up, steps of every shape still compile nothing (the forwards compiled ahead of
    # time are the ones the jitted calls find).
    monitoring.register_event_duration_secs_listener(on_event)
    try:
        again = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        monitoring.unregister_event_duration_listener(on_event)
    assert compiles_here == []
    assert [a.outputs[0].token_ids for a in again[:4]] == [w.outputs[0].token_ids for w in want[:4]]
