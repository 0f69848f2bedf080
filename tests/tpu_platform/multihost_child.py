"""One process of the multi-host checks (test_multihost.py runs each on 2 fake CPU devices).

    python multihost_child.py leader PORT CHECKPOINT [MAX_TOKENS]   host 0: LLMEngine TP=4 over
                                                        2 hosts; prints "TOKENS <json>" per prompt
    python multihost_child.py follower PORT CHECKPOINT  host 1: the follower loop
    python multihost_child.py single TP CHECKPOINT [MAX_TOKENS]   one process, TP over its own devices

Each prints "READ <bytes>", the safetensors bytes it read (loader/safetensors_raw.bytes_read),
once its weights are placed. The leader prints "STEP n" as it goes (the host-loss test kills the follower after a few), and
"HOSTLOST <rank>" when the engine raises HostLost.
"""

from __future__ import annotations

import json
import os
import sys
import time

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]


def config(checkpoint: str, tp: int, port: str | None = None, rank: int = 0):
    from tpuserve.tpu_platform.config import EngineConfig

    hosts = (
        {} if port is None else dict(distributed_coordinator=f"127.0.0.1:{port}", num_hosts=2, host_rank=rank)
    )
    if os.environ.get("MULTIHOST_QUANTIZATION"):  # online quantization (test_multihost sets it)
        hosts["quantization"] = os.environ["MULTIHOST_QUANTIZATION"]
    return EngineConfig.from_kwargs(
        model=checkpoint,
        tensor_parallel_size=tp,
        max_model_len=128,
        max_num_batched_tokens=64,
        max_num_seqs=4,
        **hosts,
    )


def generate(engine, max_tokens: int) -> list[list[int]]:
    from tpuserve.server.sampling_params import SamplingParams

    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    done: dict[str, list[int]] = {}
    steps = 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        steps += 1
        print(f"STEP {steps}", flush=True)
    print(f"TIME {steps} steps in {time.perf_counter() - t0:.2f} s", flush=True)
    return [done[str(i)] for i in range(len(PROMPTS))]


def print_read() -> None:
    from tpuserve.tpu_platform.loader.safetensors_raw import bytes_read

    print(f"READ {bytes_read()}", flush=True)


def main() -> None:
    mode = sys.argv[1]
    if mode == "follower":
        from tpuserve.tpu_platform.multihost import run_follower

        done = run_follower(config(sys.argv[3], 4, sys.argv[2], rank=1))
        print_read()  # the weights load once, before the first step: the count is final
        print("FOLLOWER", done, flush=True)
        return
    from tpuserve.server.engine import LLMEngine

    if mode == "single":
        engine = LLMEngine(config(sys.argv[3], int(sys.argv[2])))
        print_read()
        # No warm-up: this process is the oracle the two hosts are compared with, and without a
        # warm-up every step shape is allowed and compiled as it is first met (the same programs,
        # so the same tokens); the leader's warm-up, replayed by the follower, is what is tested.
        max_tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 12
        print("TOKENS", json.dumps(generate(engine, max_tokens)), flush=True)
        return
    from tpuserve.tpu_platform.multihost import HostLost

    max_tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 12
    engine = LLMEngine(config(sys.argv[3], 4, sys.argv[2], rank=0))
    print_read()
    engine.warmup(progress=False)
    t0 = time.perf_counter()
    try:
        tokens = generate(engine, max_tokens)
    except HostLost as e:
        print(f"HOSTLOST {e.rank} after {time.perf_counter() - t0:.1f} s: {e}", flush=True)
        # Not sys.exit: jax.distributed's exit barrier would wait for the dead host.
        os._exit(3)
    print("TOKENS", json.dumps(tokens), flush=True)
    engine.shutdown()


if __name__ == "__main__":
    main()
