"""Tensor-parallel communication: what a sharded step sends, against the Megatron minimum.

    python benchmarks/tensor_parallel.py                          # default model, TP=3 (9 heads)
    python benchmarks/tensor_parallel.py --model DIR --tp 2 4 8 --devices 8
    python benchmarks/tensor_parallel.py --quantization none fp8 nvfp4 mxfp4
    python benchmarks/tensor_parallel.py --time                   # also time steps (accelerators)

For each TP size the engine's own worker loads the model onto a TP-device mesh (on CPU,
``--devices`` fake devices), compiles a prefill step of ``--tokens`` tokens and a decode step of
``--decode-seqs`` sequences, and reads their collectives from the optimized HLO
(``tpu_platform/collectives.py``). Reported per step:

* all-reduces per layer (Megatron: 2, after attention's ``o`` and the MLP's ``down``);
* all-reduce payload bytes per token against the Megatron minimum (2L + 1) x H x itemsize (two
  per layer plus the vocabulary-parallel embedding's), and their ratio;
* bytes one device sends per token with a ring all-reduce (2 (N-1)/N of the payload);
* the logits all-gather per sampled row (V x 4 bytes: f32 logits for the sampler).

``--time`` also runs each step (median of ``--repeats``) at TP=1 and each TP and prints the ratio;
on fake CPU devices the "devices" share the same cores, so such times say nothing about a real
mesh: it is meant for a GPU or TPU host.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _set_device_count(n: int) -> None:
    """Fake CPU devices: must happen before JAX starts (a no-op on accelerators)."""
    flag = f"--xla_force_host_platform_device_count={n}"
    if flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()


def build_runner(model: str, tp: int, tokens: int, dtype: str, quantization: str | None = None):
    from tpuserve.tpu_platform.config import EngineConfig
    from tpuserve.tpu_platform.worker import Worker

    config = EngineConfig.from_kwargs(
        model=model,
        tensor_parallel_size=tp,
        max_model_len=max(512, 2 * tokens),
        max_num_batched_tokens=tokens,
        max_num_seqs=64,
        dtype=dtype,
        quantization=quantization,
    )
    worker = Worker(config)
    worker.load()
    return worker.init_kv_cache(num_pages=1 + max(4 * 64, -(-tokens // config.cache.block_size)))


def step_batches(runner, tokens: int, decode_seqs: int):
    from tpuserve.tpu_platform.step_batch import SamplingRow, ScheduledSeq

    page = runner.page_size
    prefill = runner.build_batch(
        [ScheduledSeq(list(range(1, tokens + 1)), 0, list(range(1, 1 + -(-tokens // page))), SamplingRow())]
    )
    decode = runner.build_batch(
        [
            ScheduledSeq([7], 3 * page, list(range(1 + 4 * i, 5 + 4 * i)), SamplingRow())
            for i in range(decode_seqs)
        ]
    )
    return {"prefill": prefill, "decode": decode}


def communication(runner, batch, tp: int) -> dict:
    from tpuserve.tpu_platform.collectives import collectives, ring_bytes_sent

    a = runner.arch
    ops = collectives(runner.step_hlo(batch))
    reduces = [c for c in ops if c.op == "all-reduce"]
    gathers = [c for c in ops if c.op == "all-gather"]
    t = len(batch.token_ids)  # the padded bucket: what the program computes and sends
    itemsize = runner.kv_cache.dtype.itemsize
    minimum = (2 * a.num_layers + 1) * a.hidden_size * itemsize
    payload = sum(c.nbytes for c in reduces) / t
    rows = len(batch.logits_indices)
    return dict(
        tokens=t,
        all_reduces=len(reduces),
        per_layer=(len(reduces) - 1) / a.num_layers,
        payload_per_token=payload,
        megatron_min=minimum,
        ratio=payload / minimum,
        ring_sent_per_token=sum(ring_bytes_sent(c, tp) for c in reduces) / t,
        gather_per_row=sum(c.nbytes for c in gathers) / rows,
        other=[c.op for c in ops if c.op not in ("all-reduce", "all-gather")],
    )


def time_step(runner, batch, repeats: int) -> float:
    import jax

    runner.compute_logits(batch)  # compile
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(runner.forward(batch).logits)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="Hugging Face directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--tp", type=int, nargs="+", default=[3], help="TP sizes (the heads must split)")
    p.add_argument("--devices", type=int, default=8, help="fake CPU devices (CPU backend only)")
    p.add_argument("--tokens", type=int, default=128, help="prefill step tokens")
    p.add_argument("--decode-seqs", type=int, default=16)
    p.add_argument("--dtype", default="auto")
    p.add_argument(
        "--quantization",
        nargs="+",
        default=[None],
        type=lambda v: None if v == "none" else v,
        help="weight formats to check: none fp8 mxfp4 nvfp4",
    )
    p.add_argument("--time", action="store_true", help="time TP=1 vs each TP (accelerators)")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    _set_device_count(max(args.devices, max(args.tp)))

    import jax

    from tpuserve.tpu_platform.loader.export import default_model_hf_dir

    model = args.model or default_model_hf_dir()
    print(
        f"model {model}; backend {jax.default_backend()} x {jax.device_count()} devices; "
        f"jax {jax.__version__}"
    )
    base = {}
    if args.time:
        r1 = build_runner(model, 1, args.tokens, args.dtype, args.quantization[0])
        base = {
            k: time_step(r1, b, args.repeats)
            for k, b in step_batches(r1, args.tokens, args.decode_seqs).items()
        }
        del r1
    print(
        "| weights | TP | step | T | all-reduces (per layer) | payload B/token | Megatron min B/token | ratio "
        "| ring B sent/token/device | logits gather B/row | other collectives |"
        + (" step ms TP=1 | step ms TP | TP=1/TP |" if args.time else "")
    )
    print("|---" * (11 + 3 * args.time) + "|")
    for quant, tp in ((q, tp) for q in args.quantization for tp in args.tp):
        runner = build_runner(model, tp, args.tokens, args.dtype, quant)
        for name, batch in step_batches(runner, args.tokens, args.decode_seqs).items():
            c = communication(runner, batch, tp)
            row = (
                f"| {quant or 'dense'} | {tp} | {name} | {c['tokens']} | {c['all_reduces']} ({c['per_layer']:.1f}) "
                f"| {c['payload_per_token']:.0f} | {c['megatron_min']} | {c['ratio']:.2f} "
                f"| {c['ring_sent_per_token']:.0f} | {c['gather_per_row']:.0f} | {c['other'] or '-'} |"
            )
            if args.time:
                ms = time_step(runner, batch, args.repeats)
                row += f" {base[name] * 1e3:.2f} | {ms * 1e3:.2f} | {base[name] / ms:.2f} |"
            print(row, flush=True)
        del runner
    if args.time and jax.default_backend() == "cpu":
        print("note: fake CPU devices share this host's cores; the step times are not a mesh's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
