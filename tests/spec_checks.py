"""Checks shared by the speculative-decoding engine tests (n-gram and draft heads)."""

from __future__ import annotations

from tpuserve.server.sampling_params import SamplingParams


def check_preemption_then_abort(engine, prompt_ids: list[int]) -> None:
    """After a run that preempted while speculating: every page is free; then a request aborted
    mid-speculation frees its pages and leaves nothing unfinished."""
    assert engine.scheduler.num_preemptions > 0 and engine.stats.spec_num_draft_tokens > 0
    assert engine.pool.num_free == engine.pool.num_usable
    engine.add_request("x", prompt_ids, SamplingParams(temperature=0, max_tokens=60))
    for _ in range(4):
        engine.step()
    engine.abort_request("x")
    assert engine.pool.num_free == engine.pool.num_usable and not engine.has_unfinished_requests()
