"""The host-tier KV connector in isolation: the scheduler side's plan, executed by the worker side.

Both roles of ``TpuserveHostOffloadConnector`` are built in this process over stand-ins for vLLM's
request, block and scheduler-output objects, and the worker side moves real pages of a JAX cache.
Oracle: page contents copied with numpy before any transfer, and hit counts worked out by hand from
the scripted hashes. The config translation (``--kv-offloading-size`` -> our connector) runs in a
child process, as vLLM resolves its platform once per process.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("vllm")  # runs in the vLLM venv; test_vllm_venv_suite.py runs it from the main one

from vllm_helpers import child_env

pytestmark = pytest.mark.timeout(300)

BS = 4  # tokens per block
L, P, C, D = 2, 24, 4, 8  # layers, device pages, combined heads, head dim


def _connector(role_name: str, num_slots: int):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from tpuserve.tpu_platform.vllm_plugin.offload_connector import TpuserveHostOffloadConnector

    layer_bytes = BS * C * D * 4  # f32
    cfg = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_connector_extra_config={"cpu_bytes_to_use": num_slots * L * layer_bytes}
        )
    )
    kv_cfg = SimpleNamespace(
        kv_cache_groups=[
            SimpleNamespace(
                kv_cache_spec=SimpleNamespace(page_size_bytes=layer_bytes, block_size=BS),
                layer_names=[f"l{i}" for i in range(L)],
            )
        ]
    )
    return TpuserveHostOffloadConnector(cfg, getattr(KVConnectorRole, role_name), kv_cfg)


class _Blocks:
    def __init__(self, ids):
        self.ids = list(ids)

    def get_block_ids(self):
        return (self.ids,)


def _request(rid: str, hashes: list[bytes], num_tokens: int):
    return SimpleNamespace(request_id=rid, block_hashes=hashes, num_tokens=num_tokens)


def _step(new=(), cached=(), blocks=None):
    """A SchedulerOutput stand-in: new/cached are (req_id, num_computed, num_scheduled)."""
    blocks = blocks or {}
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, num_computed_tokens=c) for r, c, _ in new],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _, _ in cached],
            resumed_req_ids=set(),
            num_computed_tokens=[c for _, c, _ in cached],
        ),
        num_scheduled_tokens={r: n for r, _, n in (*new, *cached)},
        kv_connector_block_state=SimpleNamespace(get_block_ids=lambda rid: (blocks[rid],)),
    )


class _Runner:
    def __init__(self, seed=0):
        import jax.numpy as jnp

        x = np.random.default_rng(seed).standard_normal((L, P, BS, C, D)).astype(np.float32)
        self.kv_cache = jnp.asarray(x)


def _h(name: str) -> bytes:
    return name.encode().ljust(32, b".")


@pytest.fixture()
def pair():
    sched, worker = _connector("SCHEDULER", 3), _connector("WORKER", 3)
    runner = _Runner()
    worker.register_runner(runner)
    return sched, worker, runner


def _run(worker, meta):
    """The worker's share of one step, in our worker's order (forward omitted: it writes nothing here)."""
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    worker.wait_for_save()
    worker.clear_connector_metadata()


def test_stored_blocks_come_back_into_new_blocks_bitwise(pair):
    sched, worker, runner = pair
    a = _request("A", [_h("a0"), _h("a1")], num_tokens=10)  # two full blocks, then 2 tokens
    assert sched.get_num_new_matched_tokens(a, 0) == (0, False)
    sched.update_state_after_alloc(a, _Blocks([1, 2, 3]), 0)
    meta = sched.build_connector_meta(_step(new=[("A", 0, 10)], blocks={"A": [1, 2, 3]}))
    assert meta.load_slots == [] and meta.store_blocks == [1, 2]  # full blocks only
    want = {b: np.asarray(runner.kv_cache[:, b]) for b in (1, 2)}
    _run(worker, meta)
    sched.request_finished(a, [1, 2, 3])

    # Same prefix, nothing on the device: both blocks come from the host into blocks 5 and 6.
    b = _request("B", [_h("a0"), _h("a1")], num_tokens=11)
    assert sched.get_num_new_matched_tokens(b, 0) == (8, False)
    sched.update_state_after_alloc(b, _Blocks([5, 6, 7]), 8)
    assert sched.get_external_cache_hit_sources(b, 8) == {_source("HOST"): 8}
    meta = sched.build_connector_meta(_step(new=[("B", 8, 3)], blocks={"B": [5, 6, 7]}))
    assert meta.load_blocks == [5, 6] and meta.store_slots == []  # already on host: not stored again
    _run(worker, meta)
    got = np.asarray(runner.kv_cache)
    assert got[:, 5].tobytes() == want[1].tobytes() and got[:, 6].tobytes() == want[2].tobytes()
    stats = worker.get_kv_connector_stats().reduce()
    assert stats["loaded_blocks"] == 2 and stats["stored_blocks"] == 2
    assert stats["load_bytes"] == 2 * L * BS * C * D * 4


def _source(name):
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    return getattr(CacheHitSource, name)


def test_hits_are_leading_whole_blocks_and_leave_the_last_token_to_compute(pair):
    sched, worker, _ = pair
    a = _request("A", [_h("x0"), _h("x1"), _h("x2")], num_tokens=12)
    sched.get_num_new_matched_tokens(a, 0)
    sched.update_state_after_alloc(a, _Blocks([1, 2, 3]), 0)
    _run(worker, sched.build_connector_meta(_step(new=[("A", 0, 12)], blocks={"A": [1, 2, 3]})))
    # A 12-token prompt of the same three blocks: the block holding its last token is computed.
    assert sched.get_num_new_matched_tokens(_request("B", [_h("x0"), _h("x1"), _h("x2")], 12), 0)[0] == 8
    # vLLM's device already has the first block: the host supplies what follows it.
    assert sched.get_num_new_matched_tokens(_request("C", [_h("x0"), _h("x1"), _h("x2")], 13), 4)[0] == 8
    # A gap stops the count: only leading blocks are hits.
    assert sched.get_num_new_matched_tokens(_request("D", [_h("x0"), _h("zz"), _h("x2")], 13), 0)[0] == 4
    assert sched.get_num_new_matched_tokens(_request("E", [_h("zz"), _h("x1")], 9), 0)[0] == 0


def test_decode_steps_store_each_block_when_it_fills(pair):
    sched, worker, _ = pair
    a = _request("A", [_h("p0")], num_tokens=6)
    sched.get_num_new_matched_tokens(a, 0)
    sched.update_state_after_alloc(a, _Blocks([1, 2]), 0)
    assert sched.build_connector_meta(_step(new=[("A", 0, 6)], blocks={"A": [1, 2]})).store_blocks == [1]
    a.num_tokens = 7  # a sampled token arrives; the block is not full yet
    assert sched.build_connector_meta(_step(cached=[("A", 6, 1)], blocks={"A": [1, 2]})).store_blocks == []
    a.num_tokens, a.block_hashes = 8, [_h("p0"), _h("p1")]  # vLLM hashes the block once it is full
    assert sched.build_connector_meta(_step(cached=[("A", 7, 1)], blocks={"A": [1, 2]})).store_blocks == [2]


def test_full_host_evicts_lru_but_never_a_block_loading_this_step(pair):
    sched, worker, runner = pair
    a = _request("A", [_h("a0"), _h("a1"), _h("a2")], num_tokens=13)
    sched.get_num_new_matched_tokens(a, 0)
    sched.update_state_after_alloc(a, _Blocks([1, 2, 3, 4]), 0)
    _run(worker, sched.build_connector_meta(_step(new=[("A", 0, 13)], blocks={"A": [1, 2, 3, 4]})))
    want = np.asarray(runner.kv_cache[:, 1])
    # B loads a0 while C, in the same step, brings three new blocks into a 3-slot host tier.
    b = _request("B", [_h("a0")], num_tokens=6)
    assert sched.get_num_new_matched_tokens(b, 0)[0] == 4
    sched.update_state_after_alloc(b, _Blocks([9, 10]), 4)
    c = _request("C", [_h("c0"), _h("c1"), _h("c2")], num_tokens=12)
    assert sched.get_num_new_matched_tokens(c, 0)[0] == 0
    sched.update_state_after_alloc(c, _Blocks([11, 12, 13]), 0)
    meta = sched.build_connector_meta(
        _step(new=[("B", 4, 2), ("C", 0, 12)], blocks={"B": [9, 10], "C": [11, 12, 13]})
    )
    assert meta.load_blocks == [9]
    # a0 is pinned (and just touched): a1 and a2 go, and only two of C's blocks fit (c2 wins c0's slot).
    assert sorted(meta.store_blocks) == [12, 13] and len(meta.store_slots) == 2
    _run(worker, meta)
    assert np.asarray(runner.kv_cache[:, 9]).tobytes() == want.tobytes()
    index = sched.scheduler_side.index
    assert _h("a0") in index and _h("a1") not in index and _h("c2") in index
    assert not index.is_pinned(_h("a0"))  # pins end with the step's metadata
    assert sched.get_kv_connector_stats().reduce()["evicted_blocks"] == 3


def test_config_translation_and_refusals(default_hf_dir, tmp_path):
    import subprocess
    import sys

    code = f"""
from vllm.engine.arg_utils import EngineArgs
base = dict(model={default_hf_dir!r}, dtype="float32", max_model_len=256)
cfg = EngineArgs(**base, kv_offloading_size=0.5).create_engine_config()
k = cfg.kv_transfer_config
print("OURS", k.kv_connector, k.kv_connector_module_path, k.kv_role,
      k.kv_connector_extra_config["cpu_bytes_to_use"], cfg.cache_config.kv_offloading_size)
from vllm.config import KVTransferConfig
native = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                          kv_connector_extra_config={{"cpu_bytes_to_use": 1 << 20}})
print("NATIVE", EngineArgs(**base, kv_transfer_config=native).create_engine_config().kv_transfer_config.kv_connector)
for bad in (dict(kv_transfer_config=KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_both")),
            dict(kv_offloading_size=1, kv_offloading_backend="lmcache"),
            dict(kv_transfer_config=KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both"))):
    try:
        EngineArgs(**base, **bad).create_engine_config()
        print("ACCEPTED", bad)
    except Exception as e:
        print("REFUSED", str(e).replace(chr(10), " ")[:400])
"""
    proc = subprocess.run(
        [sys.executable, "-c", code], env=child_env(plugin=True), capture_output=True, text=True, timeout=240
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert (
        "OURS TpuserveHostOffloadConnector tpuserve.tpu_platform.vllm_plugin.offload_connector "
        f"kv_both {1 << 29} None"
    ) in out, out
    assert "NATIVE TpuserveHostOffloadConnector" in out, out
    refused = [line for line in out.splitlines() if line.startswith("REFUSED")]
    assert "ACCEPTED" not in out and len(refused) == 3, out
    assert "NixlConnector" in refused[0] and "--kv-offloading-size" in refused[0]
    assert "--kv-offloading-backend lmcache" in refused[1]
    assert "cpu_bytes_to_use" in refused[2]
