"""One timed round of greedy requests through an ``LLMEngine``, shared by the engine benchmarks
(async_scheduling.py, tpu_e2e.py)."""

from __future__ import annotations

import time


def timed_round(
    engine, num_requests: int, prompt_tokens: int, max_tokens: int, rng, temperature: float = 0.0
) -> dict:
    """Admit ``num_requests`` requests (greedy, or sampled at ``temperature`` with a seed each) of ``prompt_tokens`` random tokens and ``max_tokens``
    new ones (ignore_eos) at once, step the engine until all finish, and record when each request's
    first and last tokens reach the host.

    Returns tpot_ms (per request with > 1 token: (last - first) / (tokens - 1)), tokens (output
    tokens in all), wall_s, engine_steps and decode_step_ms: the median wall time of the steps after
    the last prompt token was processed (decode only: TPOT also counts the prefill steps that
    interleave with a large batch's decodes). A failed request raises.
    """
    from tpuserve.server.sampling_params import SamplingParams

    def params(i: int) -> SamplingParams:
        seed = None if temperature == 0.0 else i
        return SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens, ignore_eos=True)

    vocab = engine.arch.vocab_size
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    counts: dict[str, int] = {}
    steps = 0
    step_ms: list[float] = []
    last_prefill = 0  # index of the last step that processed prompt tokens
    start = time.perf_counter()
    for i in range(num_requests):
        ids = rng.integers(100, min(vocab, 30000), prompt_tokens).tolist()
        engine.add_request(f"r{i}-{start}", None, params(i), prompt_token_ids=ids)
    while engine.has_unfinished_requests():
        prompt_before, t0 = engine.stats.prompt_tokens, time.perf_counter()
        outs = engine.step()
        steps += 1
        now = time.perf_counter()
        step_ms.append((now - t0) * 1e3)
        if engine.stats.prompt_tokens != prompt_before:
            last_prefill = steps - 1
        for out in outs:
            if out.error:
                raise RuntimeError(f"request {out.request_id} failed: {out.error}")
            n = len(out.outputs[0].token_ids) if out.outputs else 0
            if n and out.request_id not in first:
                first[out.request_id] = now
            if out.finished:
                last[out.request_id], counts[out.request_id] = now, n
    wall = time.perf_counter() - start
    tpots = [(last[r] - first[r]) / (counts[r] - 1) * 1e3 for r in last if counts[r] > 1]
    # With async scheduling a step returns the previous one's tokens: skip one more step.
    decode = step_ms[last_prefill + 2 :]
    return dict(
        tpot_ms=tpots,
        tokens=sum(counts.values()),
        wall_s=wall,
        engine_steps=steps,
        decode_step_ms=sorted(decode)[len(decode) // 2] if decode else None,
    )
