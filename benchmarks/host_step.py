"""The host's share of a decode step: ms per engine step on a tiny random-weight model.

On an accelerator the host (scheduling, batch building, detokenizing, outputs) sets the step time at
batch 128 (benchmarks/RESULTS.md, "the host's share"). Here the model is so small (2 layers, hidden
64, the default model's tokenizer and vocabulary, so detokenization is real) that a step on the CPU
is mostly that host work. The offline ``LLM`` API runs ``--batch`` prompts of 128 random tokens, 128
new tokens each, ignore_eos; greedy, then temperature 1 with a seed per request. Printed: the
median wall time of an ``engine.step()`` (decode steps are nearly all of them), and the host's share,
that wall time less the time blocked on the device's results (``runner.fetch``), and the CPU time of
the engine's thread per step (``time.thread_time``: XLA runs the "device" on threads of its own, so
this is the host's Python and dispatch alone). On the CPU the device shares the cores with the host,
so the wall times mix both; the thread's CPU time is the cleanest measure of the host's share.

    python benchmarks/host_step.py --batches 1 32 128                    # this tree
    python benchmarks/host_step.py --baseline HEAD~1 --repeats 3        # A/B, interleaved runs
    python benchmarks/host_step.py --batches 128 --profile /tmp/hs      # cProfile, top by own time

With ``--baseline REV`` the other revision runs from a temporary git worktree in a child process,
alternating with this tree's child, and the ratio of the medians is printed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import baseline_tree

TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}


def build_tiny(out: str) -> str:
    """A 2-layer, hidden-64 Llama with the default model's tokenizer and vocabulary."""
    from tpuserve.tpu_platform.loader.export import default_model_hf_dir

    src = default_model_hf_dir()
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(TINY)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "generation_config.json",
    ):
        if os.path.exists(os.path.join(src, name)):
            with open(os.path.join(src, name), "rb") as a, open(os.path.join(out, name), "wb") as b:
                b.write(a.read())
    h, f_, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    nq, nkv, v = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]
    rng = np.random.default_rng(0)
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (nq * hd, h),
                p + "self_attn.k_proj.weight": (nkv * hd, h),
                p + "self_attn.v_proj.weight": (nkv * hd, h),
                p + "self_attn.o_proj.weight": (h, nq * hd),
                p + "mlp.gate_proj.weight": (f_, h),
                p + "mlp.up_proj.weight": (f_, h),
                p + "mlp.down_proj.weight": (h, f_),
            }
        )
    from safetensors.numpy import save_file

    tensors = {
        k: np.ones(s, np.float32) if len(s) == 1 else (rng.standard_normal(s, np.float32) * 0.02)
        for k, s in shapes.items()
    }
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    return out


def child(args) -> None:
    """Serve runs: read a batch size per line from stdin, answer one JSON line per run."""
    if args.tree:
        LLM, SamplingParams = baseline_tree.import_tree(args.tree)
    else:
        from tpuserve.server.llm import LLM
        from tpuserve.server.sampling_params import SamplingParams
    llm = LLM(
        args.model,
        max_num_seqs=max(args.batches),
        max_model_len=512,
        max_num_batched_tokens=2048,
        warmup=False,
    )
    engine = llm.engine
    steps: list[float] = []
    waits: list[float] = []  # per step: time blocked on the device's results (runner.fetch)
    cpu: list[float] = []  # per step: CPU time of this (the engine's) thread
    real_step, real_fetch = engine.step, engine.runner.fetch

    def timed_step(**kwargs):
        waits.append(0.0)
        t0, c0 = time.perf_counter(), time.thread_time()
        out = real_step(**kwargs)
        steps.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
        return out

    def timed_fetch(*a, **kw):
        t0 = time.perf_counter()
        out = real_fetch(*a, **kw)
        waits[-1] += time.perf_counter() - t0
        return out

    engine.step, engine.runner.fetch = timed_step, timed_fetch
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(100, 30000, 128).tolist()} for _ in range(max(args.batches))]
    for t in args.temperatures:  # compile every step shape outside the timed runs
        run(llm, SamplingParams, prompts, t, args.new_tokens)
    for line in sys.stdin:
        batch, temperature = json.loads(line)
        steps.clear()
        waits.clear()
        cpu.clear()
        prof = None
        if args.profile:
            import cProfile

            prof = cProfile.Profile()
            prof.enable()
        texts = run(llm, SamplingParams, prompts[:batch], temperature, args.new_tokens)
        if prof is not None:
            prof.disable()
            write_profile(prof, f"{args.profile}_{args.label}_b{batch}_t{temperature:g}.txt", steps)
        digest = hashlib.sha256("\0".join(texts).encode()).hexdigest()[:12]
        print(
            json.dumps(
                {
                    "ms": statistics.median(steps) * 1e3,
                    "host_ms": statistics.median([s - w for s, w in zip(steps, waits)]) * 1e3,
                    "cpu_ms": statistics.median(cpu) * 1e3,
                    "steps": len(steps),
                    "digest": digest,
                }
            ),
            flush=True,
        )


def run(llm, SamplingParams, prompts, temperature: float, new_tokens: int) -> list[str]:
    params = [
        SamplingParams(temperature=temperature, max_tokens=new_tokens, ignore_eos=True, seed=i)
        for i in range(len(prompts))
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].text for o in outs]


def write_profile(prof, path: str, steps: list[float]) -> None:
    import io
    import pstats

    text = io.StringIO()
    text.write(
        f"{len(steps)} engine steps, median {statistics.median(steps) * 1e3:.2f} ms under the profiler\n"
    )
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(35)
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(r"tpuserve|hostb128", 30)
    with open(path, "w") as f:
        f.write(text.getvalue())


class Child:
    def __init__(self, label: str, tree: str | None, args):
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--label", label, "--model", args.model]
        cmd += ["--new-tokens", str(args.new_tokens), "--batches", *map(str, args.batches)]
        cmd += ["--temperatures", *map(str, args.temperatures)]
        if tree:
            cmd += ["--tree", tree]
        if args.profile:
            cmd += ["--profile", args.profile]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def run(self, batch: int, temperature: float) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps([batch, temperature]) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("child ended")
        return json.loads(line)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--baseline", metavar="REV", help="also run this git revision, interleaved")
    ap.add_argument("--profile", metavar="PREFIX", help="write cProfile's top functions per run here")
    ap.add_argument("--model", help="checkpoint dir (default: a tiny random one built in /tmp)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tree", help=argparse.SUPPRESS)
    ap.add_argument("--label", default="this", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    if args.model is None:
        args.model = build_tiny(os.path.join(tempfile.gettempdir(), "tpuserve-host-step-tiny"))
    children = {"this": Child("this", None, args)}
    tree = None
    if args.baseline:
        tree = baseline_tree.checkout(args.baseline)
        children[args.baseline] = Child("base", tree, args)
    try:
        for b in args.batches:
            for t in args.temperatures:
                ms: dict[str, list[float]] = {k: [] for k in children}
                host: dict[str, list[float]] = {k: [] for k in children}
                cpu: dict[str, list[float]] = {k: [] for k in children}
                digests: dict[str, set[str]] = {k: set() for k in children}
                for _ in range(args.repeats):
                    for k, c in children.items():
                        r = c.run(b, t)
                        ms[k].append(r["ms"])
                        host[k].append(r["host_ms"])
                        cpu[k].append(r["cpu_ms"])
                        digests[k].add(r["digest"])
                med = {k: statistics.median(v) for k, v in ms.items()}
                hmed = {k: statistics.median(v) for k, v in host.items()}
                cmed = {k: statistics.median(v) for k, v in cpu.items()}
                line = f"b{b:<4} T={t:g}  " + "  ".join(
                    f"{k}: step {med[k]:.2f} ms, host {hmed[k]:.2f} ms, thread CPU {cmed[k]:.2f} ms "
                    f"{sorted(round(x, 2) for x in cpu[k])}"
                    for k in children
                )
                if args.baseline:
                    same = digests["this"] == digests[args.baseline]
                    line += (
                        f"  thread CPU ratio {cmed[args.baseline] / cmed['this']:.2f}x"
                        f"  host ratio {hmed[args.baseline] / hmed['this']:.2f}x"
                        f"  step ratio {med[args.baseline] / med['this']:.2f}x  same text: {same}"
                    )
                print(line, flush=True)
    finally:
        for c in children.values():
            c.close()
        if tree is not None:
            baseline_tree.remove(tree)


if __name__ == "__main__":
    main()
