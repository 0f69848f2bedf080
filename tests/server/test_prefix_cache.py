"""The two-tier prefix cache in the engine, on a tiny random-weight Llama with the real tokenizer.

The oracle for every cached run is the same engine with the cache off: greedy outputs must not
change, whatever the cache shares, evicts, saves to the host or loads back.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from jax import monitoring

from tpuserve.server.async_engine import AsyncEngine
from tpuserve.server.llm import LLM
from tpuserve.server.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(600)

PAGE = 16
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _page_gib(pages: int) -> float:
    # tiny llama: 2 layers x 16 rows x (2 x 2 KV heads) x 16 dims x f32
    return pages * 2 * PAGE * 4 * 16 * 4 / 2**30


def _conversations(num: int, turns: int, system_len: int = 40):
    """Multi-turn token prompts: a shared system prefix, then each conversation's growing history."""
    rng = np.random.default_rng(0)
    system = [int(t) for t in rng.integers(100, 5000, system_len)]
    history = [system + [int(t) for t in rng.integers(100, 5000, 5)] for _ in range(num)]
    rounds = []
    for _ in range(turns):
        rounds.append([list(h) for h in history])
        for h in history:
            h.extend(int(t) for t in rng.integers(100, 5000, 12))
    return rounds


def _run_rounds(llm: LLM, rounds) -> list[list[list[int]]]:
    return [
        [
            o.outputs[0].token_ids
            for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        ]
        for prompts in rounds
    ]


def _llm(path, **kw):
    base = dict(max_model_len=128, max_num_batched_tokens=64, max_num_seqs=4, block_size=PAGE, warmup=False)
    base.update(kw)
    return LLM(path, **base)


@pytest.fixture(scope="module")
def rounds():
    return _conversations(num=6, turns=3)


@pytest.fixture(scope="module")
def reference(random_checkpoints, rounds):
    llm = _llm(random_checkpoints["llama"], enable_prefix_caching=False, num_gpu_blocks=64)
    out = _run_rounds(llm, rounds)
    st = llm.engine.stats
    assert st.prefix_cache_hits == 0
    return out


def test_device_cache_gives_identical_greedy_output_and_counts_hits(random_checkpoints, rounds, reference):
    llm = _llm(random_checkpoints["llama"], num_gpu_blocks=64)
    assert _run_rounds(llm, rounds) == reference
    st = llm.engine.stats
    prompt_tokens = sum(len(p) for r in rounds for p in r)
    assert st.prefix_cache_queries == prompt_tokens
    # Round 1: the 40-token system prompt's 2 full pages are shared; later rounds reuse each
    # conversation's whole history (all but its last page or so).
    assert st.prefix_cache_hits > prompt_tokens // 2
    assert llm.engine.pool.num_free == llm.engine.pool.num_usable


def test_host_tier_recovers_evicted_pages_with_identical_output(random_checkpoints, rounds, reference):
    # 14 device pages cannot hold 6 conversations' histories: later turns find them on the host.
    llm = _llm(random_checkpoints["llama"], num_gpu_blocks=15, kv_offloading_size=_page_gib(200))
    e = llm.engine
    e.warmup()
    compiled = []  # XLA compilations after warm-up, by program name (JAX's own count)

    def on_event(name, secs, fun_name="", **kw):
        if name == "/jax/core/compile/backend_compile_duration":
            compiled.append(fun_name)

    monitoring.register_event_duration_secs_listener(on_event)
    try:
        assert _run_rounds(llm, rounds) == reference
    finally:
        monitoring.unregister_event_duration_listener(on_event)
    assert e.stats.host_cache_hits > 0 and e.host_tier.stats.loaded_pages > 0
    # Loads leave the cache as the warmed-up steps expect it, so nothing compiles again (a load
    # once returned a committed cache and recompiled every step shape: seconds per step on a real
    # model). The host tier's own transfers may meet a bigger bucket than warm-up's (its gather,
    # scatter, and jax's upload of the index array).
    assert [n for n in compiled if n not in ("jit(gather)", "jit(scatter)", "jit(stage)")] == []
    assert e.stats.host_bytes_loaded == e.host_tier.stats.loaded_pages * e.host_tier.page_bytes
    assert e.pool.num_free == e.pool.num_usable
    # Without the host tier the same small pool recomputes what was evicted.
    small = _llm(random_checkpoints["llama"], num_gpu_blocks=15)
    assert _run_rounds(small, rounds) == reference
    assert small.engine.stats.prefix_cache_hits < e.stats.prefix_cache_hits


def test_full_host_pool_evicts_without_errors(random_checkpoints, rounds, reference):
    llm = _llm(random_checkpoints["llama"], num_gpu_blocks=15, kv_offloading_size=_page_gib(6))
    assert _run_rounds(llm, rounds) == reference
    tier = llm.engine.host_tier
    assert tier.num_slots == 6 and tier.stats.evicted_pages > 0 and len(tier) <= 6


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_reloaded_pages_are_bitwise_equal_to_the_originals(random_checkpoints, kv_cache_dtype):
    # fp8: the host tier moves the pages as stored (e4m3 bytes, uint8 on CPU); the engine's one
    # k/v scale pair reads them.
    llm = _llm(
        random_checkpoints["llama"],
        num_gpu_blocks=9,
        kv_offloading_size=_page_gib(64),
        kv_cache_dtype=kv_cache_dtype,
    )
    e = llm.engine
    prompt = [int(t) for t in np.random.default_rng(1).integers(100, 5000, 70)]  # 4 full pages
    llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)
    from tpuserve.kv_cache.prefix_hash import page_hashes

    hashes = page_hashes(prompt, PAGE)
    pages = e.pool.match(hashes)
    assert len(pages) == 4
    originals = np.asarray(e.runner.kv_cache[:, np.array(pages)])
    # Other prompts take every device page: the prompt's pages are evicted to the host.
    other = [[int(t) for t in np.random.default_rng(2 + i).integers(100, 5000, 100)] for i in range(2)]
    llm.generate([{"prompt_token_ids": p} for p in other], GREEDY, use_tqdm=False)
    assert e.pool.match(hashes) == [] and all(h in e.host_tier for h in hashes)
    e.add_request("again", prompt, SamplingParams(temperature=0, max_tokens=1))
    e.step()  # admits it: its 4 pages come back from the host before the step runs
    back = e.pool.match(hashes)
    assert len(back) == 4 and e.host_tier.stats.loaded_pages == 4
    assert np.asarray(e.runner.kv_cache[:, np.array(back)]).tobytes() == originals.tobytes()
    while e.has_unfinished_requests():
        e.step()


def test_abort_during_a_reload_frees_every_page(random_checkpoints):
    llm = _llm(random_checkpoints["llama"], num_gpu_blocks=9, kv_offloading_size=_page_gib(64))
    e = llm.engine
    prompts = [[int(t) for t in np.random.default_rng(10 + i).integers(100, 5000, 100)] for i in range(3)]
    for p in prompts:  # each evicts the one before it to the host
        llm.generate([{"prompt_token_ids": p}], GREEDY, use_tqdm=False)
    loaded = e.host_tier.stats.loaded_pages
    e.add_request("reload", prompts[0], SamplingParams(temperature=0, max_tokens=50))
    e.step()  # dispatched with its host pages being copied in
    assert e.host_tier.stats.loaded_pages > loaded
    e.abort_request("reload")
    while e.has_unfinished_requests():
        e.step()
    e.host_tier.wait()
    assert e.pool.num_free == e.pool.num_usable
    # The pages it loaded stay valid cache entries: the same prompt now hits on the device.
    out = llm.generate([{"prompt_token_ids": prompts[0]}], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 96


def test_n_completions_prefill_the_prompt_once(random_checkpoints):
    llm = _llm(random_checkpoints["llama"], num_gpu_blocks=64)
    prompt = [int(t) for t in np.random.default_rng(3).integers(100, 5000, 100)]
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=4, n=4, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    assert len(out.outputs) == 4 and all(len(c.token_ids) == 4 for c in out.outputs)
    # 6 full pages; siblings hit them all ((100 - 1) // 16 = 6) and compute the last 4 tokens.
    assert llm.engine.stats.prefix_cache_hits == 3 * 96
    off = _llm(random_checkpoints["llama"], num_gpu_blocks=64, enable_prefix_caching=False)
    ref = off.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in ref.outputs]


def test_cache_salt_isolates_requests(random_checkpoints):
    llm = _llm(random_checkpoints["llama"], num_gpu_blocks=64)
    e = llm.engine
    prompt = [int(t) for t in np.random.default_rng(4).integers(100, 5000, 50)]

    def run(rid, salt):
        e.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=2), cache_salt=salt)
        outs = []
        while e.has_unfinished_requests():
            outs += [o for o in e.step() if o.finished]
        return outs[-1].num_cached_tokens

    assert run("a", None) == 0
    assert run("b", None) == 48
    assert run("c", "tenant") == 0
    assert run("d", "tenant") == 48
    with pytest.raises(ValueError, match="cache_salt"):
        e.add_request("e", prompt, cache_salt="")


def test_64_concurrent_streams_sharing_a_system_prompt_lose_nothing(random_checkpoints):
    system = [int(t) for t in np.random.default_rng(5).integers(100, 5000, 64)]
    prompts = [system + [100 + i, 200 + i, 300 + i] for i in range(64)]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    kw = dict(max_num_seqs=16, num_gpu_blocks=48)

    async def serve_all(engine):
        async def one(i):
            toks = []
            async for out in engine.generate(f"r{i}", None, params, prompts[i]):
                toks = out.outputs[0].token_ids
                if out.finished:
                    assert out.outputs[0].finish_reason == "length"
            return toks

        engine.start()
        try:
            return await asyncio.gather(*(one(i) for i in range(64)))
        finally:
            await engine.shutdown()

    results = {}
    for caching in (True, False):
        engine = AsyncEngine(_llm(random_checkpoints["llama"], enable_prefix_caching=caching, **kw).engine)
        results[caching] = asyncio.run(serve_all(engine))
        if caching:
            assert engine.engine.stats.prefix_cache_hits >= 60 * 64
            assert engine.engine.pool.num_free == engine.engine.pool.num_usable
    assert all(len(t) == 5 for t in results[True])
    assert results[True] == results[False]
