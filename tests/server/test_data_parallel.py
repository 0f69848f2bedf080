"""Data parallel: replicas behind one server, routed by prefix-cache hits.

The end-to-end test serves DP=2 x TP=2 on 4 fake CPU devices and checks concurrent requests against
a single-device engine's greedy output (the official openai client as the HTTP oracle), and that a
repeated prompt goes back to the replica holding its pages (cached_tokens in the usage).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import types

import httpx
import pytest
from server_fixtures import openai_client, running_server

from tpuserve.kv_cache.block_pool import BlockPool
from tpuserve.kv_cache.prefix_hash import page_hashes
from tpuserve.server.async_engine import EngineSnapshot
from tpuserve.server.data_parallel import DataParallelEngine, merge_snapshots
from tpuserve.tpu_platform.config import ConfigError, EngineConfig

PAGE = 16


class _FakeReplica:
    """What the router reads of a replica: its snapshot and its engine's block pool."""

    def __init__(self, unfinished: int = 0):
        config = EngineConfig.from_kwargs(block_size=PAGE, max_num_seqs=4)
        self.engine = types.SimpleNamespace(
            pool=BlockPool(64, PAGE, enable_caching=True),
            config=config,
            tokenize=lambda text: [ord(c) for c in text],
        )
        self.tokenizer, self.max_model_len, self.vocab_size = None, 1024, 256
        self.snapshot = EngineSnapshot(num_unfinished_requests=unfinished)
        self._streams: dict = {}

    def cache(self, tokens: list[int]) -> None:
        pages = self.engine.pool.allocate(len(tokens) // PAGE)
        for p, h in zip(pages, page_hashes(tokens, PAGE)):
            self.engine.pool.register(p, h)


def test_route_prefers_the_cached_prefix_then_load_then_round_robin():
    a, b = _FakeReplica(), _FakeReplica()
    dp = DataParallelEngine([a, b], balance_slack=2)
    prompt = list(range(5 * PAGE + 3))
    assert dp.route(prompt) == 0  # nothing cached, equal load: lowest index
    dp.routed = [1, 0]
    assert dp.route(prompt) == 1  # round robin among equals
    b.cache(prompt[: 2 * PAGE])
    a.cache(prompt[: 4 * PAGE])
    assert dp.route(prompt) == 0  # longest cached prefix wins
    assert dp.route(prompt, cache_salt="other tenant") == 1  # a salt sees no one's pages: fewer routed
    a.snapshot = EngineSnapshot(num_unfinished_requests=2)
    assert dp.route(prompt) == 0  # busier, but within the slack: the hit still wins
    a.snapshot = EngineSnapshot(num_unfinished_requests=3)
    assert dp.route(prompt) == 1  # beyond the slack: load wins over the hit


def test_merge_snapshots_sums_and_weights_usage():
    s = merge_snapshots(
        [
            EngineSnapshot(num_running=2, total_blocks=100, kv_cache_usage=0.5, spec_accepted_per_pos=(1, 2)),
            EngineSnapshot(num_running=1, total_blocks=300, kv_cache_usage=0.1, spec_accepted_per_pos=(3,)),
        ]
    )
    assert s.num_running == 3 and s.total_blocks == 400 and s.spec_accepted_per_pos == (4, 2)
    assert abs(s.kv_cache_usage - (50 + 30) / 400) < 1e-9


def test_duplicate_request_id_across_replicas_is_refused():
    a, b = _FakeReplica(), _FakeReplica()
    b._streams["r1"] = object()
    with pytest.raises(ValueError, match="'r1' is already in use"):
        asyncio.run(DataParallelEngine([a, b]).add_request("r1", "hi", None))


def test_data_parallel_refuses_pd_and_offline():
    with pytest.raises(ConfigError, match="run one server per replica"):
        EngineConfig.from_kwargs(data_parallel_size=2, kv_transfer_config={"kv_role": "kv_producer"})
    from tpuserve.server.llm import LLM

    with pytest.raises(ConfigError, match="offline LLM runs one engine"):
        LLM("unused", data_parallel_size=2, warmup=False)


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory):
    from conftest import build_random_checkpoint

    # 8 query heads over 2 KV heads; Llama-3's vocabulary (128256) splits over 2.
    return build_random_checkpoint(
        "llama", str(tmp_path_factory.mktemp("dp-llama")), num_attention_heads=8, num_key_value_heads=2
    )


@pytest.fixture(scope="module")
def dp_server(tmp_path_factory, llama_checkpoint):
    yield from running_server(
        tmp_path_factory,
        "dp2-tp2",
        llama_checkpoint,
        "--data-parallel-size",
        "2",
        "--tensor-parallel-size",
        "2",
        "--max-model-len",
        "256",
        "--max-num-batched-tokens",
        "64",
        "--max-num-seqs",
        "4",
        "--block-size",
        str(PAGE),
        "--served-model-name",
        "dp",
        env={"XLA_FLAGS": "--xla_force_host_platform_device_count=4"},
    )


PROMPTS = [
    "The quick brown fox",
    "In 1492, Columbus",
    "def add(a, b):",
    "Water boils at",
    "The moon is",
    "Tokyo is the capital of",
    "Rain falls when",
    "My favourite colour is",
]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_dp2_tp2_serves_concurrent_requests_like_one_engine(dp_server, llama_checkpoint):
    from tpuserve.server.llm import LLM
    from tpuserve.server.sampling_params import SamplingParams

    ref = LLM(llama_checkpoint, max_model_len=256, max_num_batched_tokens=64, max_num_seqs=4, warmup=False)
    want = [
        o.outputs[0].text
        for o in ref.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    ]
    client = openai_client(dp_server)

    def one(prompt):
        return (
            client.completions.create(
                model="dp", prompt=prompt, max_tokens=10, temperature=0.0, extra_body={"ignore_eos": True}
            )
            .choices[0]
            .text
        )

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(one, PROMPTS))
    assert got == want

    # Prefix-aware routing. With nothing cached and idle replicas the router goes round robin; send
    # A, then fillers until round robin would pick the other replica, then A again: it must go
    # back to A's replica (the /metrics routing counter says which) and hit the cache there.
    def routed():
        text = httpx.get(dp_server.base_url + "/metrics").text
        counts = {}
        for line in text.splitlines():
            if line.startswith("tpuserve:data_parallel_requests_routed_total{"):
                counts[int(line.split('replica="')[1].split('"')[0])] = float(line.split()[-1])
        return [counts[0], counts[1]]

    def complete(prompt):
        return client.completions.create(model="dp", prompt=prompt, max_tokens=1, temperature=0.0).usage

    long_a = "alpha beta gamma delta " * 12
    before = routed()
    first = complete(long_a)
    after = routed()
    home = 0 if after[0] > before[0] else 1
    fillers = iter(["bravo charlie echo " * 10, "x-ray yankee zulu " * 10, "kilo lima mike " * 10])
    while min(range(2), key=lambda i: (after[i], i)) == home:
        complete(next(fillers))
        after = routed()
    again = complete(long_a)
    assert routed()[home] == after[home] + 1, "the repeated prompt left the replica holding its pages"
    cached = again.prompt_tokens_details.cached_tokens
    assert cached == (first.prompt_tokens - 1) // PAGE * PAGE and cached >= 2 * PAGE, again
