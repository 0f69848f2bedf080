"""The P/D connector in one process: a producer's scheduler + worker sides and a consumer's, over real
JAX caches and the framed-TCP transport on loopback.

vLLM's request / block objects are stand-ins with the attributes the connector reads. Oracle: the
consumer's pages after the load equal, bitwise, the producer's pages of the same request (read with
numpy before any transfer); failures come back in ``failed_recving`` as vLLM's scheduler expects.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("vllm")  # runs in the vLLM venv; test_vllm_venv_suite.py runs it from the main one

pytestmark = pytest.mark.timeout(300)

BS = 4
L, P, C, D = 2, 16, 4, 8


def _connector(role: str, kv_role: str, secret: str, monkeypatch):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from tpuserve.tpu_platform.vllm_plugin.pd_connector import TpuservePDConnector

    monkeypatch.setenv("TPUSERVE_KV_SECRET", secret)  # read when the worker side registers
    cfg = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_role=kv_role,
            kv_port=0,
            kv_connector_extra_config={"pull_timeout_s": 3},
            engine_id=f"{kv_role}-engine",
        ),
        model_config=SimpleNamespace(model="tiny"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
    )
    kv_cfg = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=BS))])
    return TpuservePDConnector(cfg, getattr(KVConnectorRole, role), kv_cfg)


class _Runner:
    def __init__(self, seed):
        import jax.numpy as jnp

        self.kv_cache = jnp.asarray(
            np.random.default_rng(seed).standard_normal((L, P, BS, C, D)).astype(np.float32)
        )


class _Blocks:
    def __init__(self, ids):
        self.ids = list(ids)

    def get_block_ids(self):
        return (self.ids,)


def _request(rid, params, num_prompt, num_computed=0, finished=False):
    status = SimpleNamespace(name="FINISHED_LENGTH_CAPPED" if finished else "WAITING")
    return SimpleNamespace(
        request_id=rid,
        kv_transfer_params=params,
        num_prompt_tokens=num_prompt,
        num_computed_tokens=num_computed,
        status=status,
        is_finished=lambda: finished,
    )


def _side(kv_role, seed, secret, monkeypatch):
    sched = _connector("SCHEDULER", kv_role, secret, monkeypatch)
    worker = _connector("WORKER", kv_role, secret, monkeypatch)
    runner = _Runner(seed)
    worker.register_runner(runner)
    sched.set_xfer_handshake_metadata({0: worker.get_handshake_metadata()})
    return sched, worker, runner


def _finish_prefill(sched, rid, blocks, num_tokens):
    delay, params = sched.request_finished(
        _request(rid, {"do_remote_decode": True}, num_tokens, num_tokens, finished=True), blocks
    )
    assert delay is True  # vLLM keeps the blocks until the worker reports the send
    return params


def _export_step(sched, worker, rid):
    worker.bind_connector_metadata(sched.build_connector_meta(None))
    worker.wait_for_save()
    done = worker.get_transfer_results({rid})
    worker.clear_connector_metadata()
    assert done.finished_sending == {rid}  # P frees its blocks: the copy is already in flight


def _produce(sched, worker, rid, blocks, num_tokens):
    """The prefill finished: request_finished, then the next step's export."""
    params = _finish_prefill(sched, rid, blocks, num_tokens)
    _export_step(sched, worker, rid)
    return params


def _start_load(sched, worker, rid, params, blocks, num_prompt, local_hit=0):
    req = _request(rid, dict(params), num_prompt)
    n, is_async = sched.get_num_new_matched_tokens(req, local_hit)
    assert (n, is_async) == (num_prompt - local_hit, True)
    sched.update_state_after_alloc(req, _Blocks(blocks), n)
    assert req.kv_transfer_params["do_remote_prefill"] is False  # pulled once
    worker.bind_connector_metadata(sched.build_connector_meta(None))
    worker.start_load_kv(None)
    worker.clear_connector_metadata()


def _wait_load(sched, worker):
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        res = worker.get_transfer_results(set())
        if res.finished_recving:
            sched.update_connector_output(SimpleNamespace(finished_recving=res.finished_recving))
            return res
        time.sleep(0.05)
    raise AssertionError("the pull did not finish")


def _consume(sched, worker, rid, params, blocks, num_prompt, local_hit=0):
    _start_load(sched, worker, rid, params, blocks, num_prompt, local_hit)
    return _wait_load(sched, worker)


def test_pages_arrive_bitwise_with_a_local_prefix_hit(monkeypatch):
    p_sched, p_worker, p_runner = _side("kv_producer", 1, "s3cret-s3cret-s3cret", monkeypatch)
    d_sched, d_worker, d_runner = _side("kv_consumer", 2, "s3cret-s3cret-s3cret", monkeypatch)
    try:
        src_blocks = [3, 7, 5, 9]  # 14 prompt tokens: pages 3, 7, 5 and part of 9
        want = np.asarray(p_runner.kv_cache)[:, src_blocks]
        params = _finish_prefill(p_sched, "r1", src_blocks, 14)
        assert params["remote_num_pages"] == 4 and params["remote_num_tokens"] == 14
        assert params["remote_port"] == p_worker.worker_side.sender.port
        # vLLM's own producers' keys, which proxies written for vLLM's P/D read
        assert params["remote_block_ids"] == src_blocks and params["tp_size"] == 1
        assert params["remote_engine_id"] == "kv_producer-engine"

        dst_blocks = [2, 11, 4, 6]
        before = np.asarray(d_runner.kv_cache).copy()
        # D's own prefix cache already holds the first block: only pages 1.. are written. D starts
        # pulling before P's next step has offered the pages (the router is that fast).
        _start_load(d_sched, d_worker, "r1", params, dst_blocks, 14, local_hit=BS)
        time.sleep(0.3)
        _export_step(p_sched, p_worker, "r1")
        res = _wait_load(d_sched, d_worker)
        assert res.finished_recving == {"r1"} and not res.failed_recving
        got = np.asarray(d_runner.kv_cache)
        np.testing.assert_array_equal(got[:, dst_blocks[1:]], want[:, 1:])
        np.testing.assert_array_equal(got[:, 2], before[:, 2])  # the local hit is untouched
        untouched = [i for i in range(P) if i not in dst_blocks]
        np.testing.assert_array_equal(got[:, untouched], before[:, untouched])
        # Once loaded, the request frees normally; an aborted load would hold its blocks.
        assert d_sched.request_finished(_request("r1", {}, 14), dst_blocks) == (False, None)
    finally:
        p_worker.shutdown()
        d_worker.shutdown()


def test_unknown_transfer_and_wrong_secret_fail_the_load(monkeypatch):
    p_sched, p_worker, _ = _side("kv_producer", 1, "right-right-right-right", monkeypatch)
    d_sched, d_worker, _ = _side("kv_consumer", 2, "wrong-wrong-wrong-wrong", monkeypatch)
    ok_sched, ok_worker, _ = _side("kv_consumer", 3, "right-right-right-right", monkeypatch)
    try:
        params = _produce(p_sched, p_worker, "r2", [1, 2], 8)
        res = _consume(d_sched, d_worker, "r2", params, [5, 6], 8)
        assert res.failed_recving == {"r2"} and res.finished_recving == {"r2"}
        bogus = dict(params, remote_transfer_id="0" * 32)
        res = _consume(ok_sched, ok_worker, "r3", bogus, [5, 6], 8)
        assert res.failed_recving == {"r3"}
        res = _consume(ok_sched, ok_worker, "r2", params, [5, 6], 8)  # the real one still works
        assert res.finished_recving == {"r2"} and not res.failed_recving
    finally:
        for w in (p_worker, d_worker, ok_worker):
            w.shutdown()


def test_requests_without_params_pass_through(monkeypatch):
    sched, worker, _ = _side("kv_both", 1, "s-s-s-s-s-s-s-s-s-s", monkeypatch)
    try:
        req = _request("plain", None, 10)
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
        assert sched.request_finished(_request("plain", None, 10, 10, finished=True), [1, 2, 3]) == (
            False,
            None,
        )
        # An aborted prefill offers nothing.
        aborted = _request("ab", {"do_remote_decode": True}, 10, 10, finished=True)
        aborted.status = SimpleNamespace(name="FINISHED_ABORTED")
        assert sched.request_finished(aborted, [1, 2, 3]) == (False, None)
    finally:
        worker.shutdown()
