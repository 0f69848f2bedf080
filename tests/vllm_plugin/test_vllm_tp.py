"""``--tensor-parallel-size N`` on the tpuserve platform: the config translation, without serving.

vLLM keeps the user's tensor_parallel_size (its world_size is N), the platform forces the ``uni``
executor (one in-process worker, no torch process groups), and our worker's EngineConfig carries N
so the engine shards over a JAX mesh. Platform resolution happens once per process, so the checks
run in one child process with the platform opted in (as test_vllm_platform.py does).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("vllm")  # runs in the vLLM venv; test_vllm_venv_suite.py runs it from the main one

from vllm_helpers import child_env

pytestmark = pytest.mark.timeout(300)

CHILD = r"""
import json, sys
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.executor.abstract import Executor
from tpuserve.tpu_platform.vllm_plugin.worker import TpuserveWorker

MODEL = sys.argv[1]

def build(**kw):
    return EngineArgs(model=MODEL, dtype="float32", max_model_len=128, **kw).create_engine_config()

def view(cfg):
    p = cfg.parallel_config
    worker = TpuserveWorker(cfg, local_rank=0, rank=0, distributed_init_method="", is_driver_worker=True)
    ec = worker._engine_config()
    return {"tp": p.tensor_parallel_size, "world_size": p.world_size, "backend": p.distributed_executor_backend,
            "executor": Executor.get_class(cfg).__name__, "worker_cls": p.worker_cls,
            "engine_tp": ec.parallel.tensor_parallel_size, "engine_dp": ec.parallel.data_parallel_size}

out = {"tp1": view(build()), "tp2": view(build(tensor_parallel_size=2)),
       "tp2_mp": view(build(tensor_parallel_size=2, distributed_executor_backend="mp")),
       "refused": {}}
bad = {"pp": dict(tensor_parallel_size=2, pipeline_parallel_size=2),
       "dp": dict(data_parallel_size=2),
       "tp_not_dividing_heads": dict(tensor_parallel_size=3),
       "tp_with_host_tier": dict(tensor_parallel_size=2, kv_offloading_size=1),
       "tp_with_pd": dict(tensor_parallel_size=2, kv_transfer_config={
           "kv_connector": "TpuservePDConnector",
           "kv_connector_module_path": "tpuserve.tpu_platform.vllm_plugin.pd_connector",
           "kv_role": "kv_producer"})}
for name, kw in bad.items():
    try:
        build(**kw)
        out["refused"][name] = None
    except Exception as e:
        out["refused"][name] = f"{type(e).__name__}: {e}"
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def translated(qwen3_dir):
    # The random Qwen3 has 4 attention heads and 2 KV heads: TP=2 divides both, TP=3 neither.
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, qwen3_dir],
        env=child_env(plugin=True),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :]), proc.stdout + proc.stderr


def test_tp2_is_one_uni_worker_whose_engine_shards_over_two_devices(translated):
    out, log = translated
    worker = "tpuserve.tpu_platform.vllm_plugin.worker.TpuserveWorker"
    for case in ("tp2", "tp2_mp"):  # an explicit --distributed-executor-backend mp is overridden too
        v = out[case]
        # vLLM's own view keeps the user's TP (its logs and metrics say 2) ...
        assert v["tp"] == 2 and v["world_size"] == 2, v
        # ... but runs one in-process worker: no worker processes, no torch process groups.
        assert v["backend"] == "uni" and v["executor"] == "UniProcExecutor", v
        assert v["worker_cls"] == worker, v
        # Our engine gets the TP degree and builds its mesh from it.
        assert v["engine_tp"] == 2 and v["engine_dp"] == 1, v
    assert "tensor_parallel_size=2: one tpuserve worker drives 2 JAX devices" in log


def test_tp1_stays_the_default(translated):
    v = translated[0]["tp1"]
    assert (v["tp"], v["world_size"], v["backend"], v["engine_tp"]) == (1, 1, "uni", 1), v


def test_other_parallelism_and_unsupported_pairs_are_refused_by_name(translated):
    refused = translated[0]["refused"]
    assert all(refused.values()), refused  # none of them was accepted
    assert "pipeline_parallel_size=2" in refused["pp"]
    assert "data_parallel_size=2" in refused["dp"] and "one server per replica" in refused["dp"]
    # vLLM's own TP check stays in force (our mesh splits heads the same way).
    assert "divisible by tensor parallel size (3)" in refused["tp_not_dividing_heads"]
    assert "--kv-offloading-size with tensor_parallel_size=2" in refused["tp_with_host_tier"]
    assert "TpuservePDConnector with tensor_parallel_size=2" in refused["tp_with_pd"]
