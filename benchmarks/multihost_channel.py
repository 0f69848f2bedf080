"""Per-step cost of the multi-host step broadcast (tpu_platform/multihost.py) on this machine.

Two processes join with jax.distributed on localhost; host 0 sends N ``RunStep`` messages holding
a decode StepBatch of the given shape through the coordinator's key-value store and host 1
receives them; then the same bytes go through ``multihost_utils.broadcast_one_to_all`` (a device
collective, the alternative the design weighed). Prints one JSON line per method from host 0:
the message size and the mean / p50 / p99 microseconds per step: for the store, what the leader's
send costs its step and a round trip (host 1 echoes each number back through the store, so the
one-way delivery is about half); for the collective, one broadcast.

    python benchmarks/multihost_channel.py [--steps 300] [--seqs 64] [--pages 32]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import time

import numpy as np


def make_batch(seqs: int, pages: int, vocab: int):
    from tpuserve.tpu_platform.step_batch import StepBatch, pack_sampling_rows

    return StepBatch(
        token_ids=np.zeros(seqs, np.int32),
        positions=np.arange(seqs, dtype=np.int32),
        cu_q_lens=np.arange(seqs + 1, dtype=np.int32),
        kv_lens=np.full(seqs, 100, np.int32),
        page_table=np.ones((seqs, pages), np.int32),
        num_seqs=seqs,
        num_tokens=seqs,
        logits_indices=np.arange(seqs, dtype=np.int32),
        cu_logits=np.arange(seqs + 1, dtype=np.int32),
        draft_token_ids=np.full((seqs, 0), -1, np.int32),
        sampling=pack_sampling_rows([], seqs, vocab),
        feed_rows=np.arange(seqs, dtype=np.int32),
    )


def stats(us: list[float]) -> dict:
    a = np.asarray(us)
    return {
        "mean_us": round(float(a.mean()), 1),
        "p50_us": round(float(np.percentile(a, 50)), 1),
        "p99_us": round(float(np.percentile(a, 99)), 1),
    }


def child(rank: int, port: int, steps: int, seqs: int, pages: int) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=rank)
    from jax.experimental import multihost_utils

    from tpuserve.tpu_platform import multihost

    group = multihost.HostGroup(2, rank)
    chan = multihost.StepChannel(group)
    client = chan.client
    batch = make_batch(seqs, pages, 49152)
    size = len(pickle.dumps(multihost.Message(0, multihost.RunStep(batch, 0))))
    times, sends = [], []
    for i in range(steps):
        if rank == 0:
            t0 = time.perf_counter()
            seq = chan.send(multihost.RunStep(batch, i - 1))
            sends.append((time.perf_counter() - t0) * 1e6)  # what the leader's step pays
            client.blocking_key_value_get(f"bench/echo/{seq}", 10_000)  # host 1 got it
            times.append((time.perf_counter() - t0) * 1e6)
        else:
            msg = chan.recv(10.0)
            assert msg is not None and isinstance(msg.op, multihost.RunStep)
            client.key_value_set(f"bench/echo/{msg.seq}", "1")
    if rank == 0:
        # The echo is a second store round trip; half the total is the one-way cost.
        out = {"method": "kv_store", "bytes": size, "leader_send": stats(sends), "round_trip": stats(times)}
        print(json.dumps(out), flush=True)
    # The same bytes as a device broadcast (fixed shape: padded to the message size).
    buf = np.zeros(size, np.uint8)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = multihost_utils.broadcast_one_to_all(buf)
        np.asarray(out)
        times.append((time.perf_counter() - t0) * 1e6)
    if rank == 0:
        print(
            json.dumps({"method": "broadcast_one_to_all", "bytes": size, "one_way": stats(times[5:])}),
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--pages", type=int, default=32)
    ap.add_argument("--child", type=int, default=None)
    ap.add_argument("--port", type=int, default=0)
    a = ap.parse_args()
    if a.child is not None:
        child(a.child, a.port, a.steps, a.seqs, a.pages)
        return
    from tpuserve.server.launcher import free_port

    port = free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    args = ["--steps", str(a.steps), "--seqs", str(a.seqs), "--pages", str(a.pages), "--port", str(port)]
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--child", str(r), *args],
            env=env,
            stdout=None if r == 0 else subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for r in (0, 1)
    ]
    for p in procs:
        p.wait(timeout=600)


if __name__ == "__main__":
    main()
