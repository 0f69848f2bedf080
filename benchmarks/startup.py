"""Where start-up time goes: time to ready of ``LLM(model)`` and of the serving engine, and the
warm-up's compile tasks broken down into tracing + lowering (Python, under the GIL), XLA compile,
and persistent-cache hits, with the programs counted by kind.

Each measurement runs in a fresh subprocess (JAX's in-memory caches start empty); ``cold`` uses a
new, empty compilation-cache directory, ``warm`` the same directory again (a restart with the same
model and flags). Offline: no sockets, no downloads beyond what loading the model does anyway, so
it runs on a TPU host as it does here.

    python benchmarks/startup.py                         # default model, llm + engine, cold + warm
    python benchmarks/startup.py --what engine --runs warm --cache-dir /tmp/xla  # one restart
    python benchmarks/startup.py --model PATH --max-model-len 2048 --json out.json
    python benchmarks/startup.py --model PATH --what llm --runs warm --load-only --dtype bfloat16

Every result carries the engine's start-up phases (``phases``: tpu_platform/startup_timing.py,
the record the engine logs in one line): devices, config, import transformers and tokenizer (on a
helper thread: "(bg)"), layer transforms, stack layers, to device, runner setup, memory plan, kv
cache, warm-up. ``--load-only`` stops after ``LLM(warmup=False)`` (the load, no compiling).

Columns per task: wall seconds, trace (jaxpr tracing), lower (jaxpr -> StableHLO), compile (XLA,
cache lookup included), hits (programs the persistent cache supplied) / programs (executables
made). Program kinds come from the traced function's name: forward (the step), sampler stages,
prompt-logits, glue (the step's small helpers and eager ops).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict

TRACE = "/jax/core/compile/jaxpr_trace_duration"
LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
COMPILE = "/jax/core/compile/backend_compile_duration"
HIT = "/jax/compilation_cache/cache_hits"

# Traced function name -> program kind (anything else: glue).
KINDS = {
    "_traced_step": "forward",
    "_argmax": "sampler",
    "_extras": "sampler",
    "_random": "sampler",
    "_logprobs": "logprobs",
    "_traced_prompt_logits": "prompt-logits",
    "_traced_last_tokens": "glue",
    "_traced_pad_tokens": "glue",
}


class Recorder:
    """JAX monitoring listeners that charge each event to the compile task running on its thread
    (or to the phase the main thread is in)."""

    def __init__(self):
        self.local = threading.local()
        self.lock = threading.Lock()
        self.tasks: dict[str, dict] = defaultdict(
            lambda: {"wall": 0.0, "trace": 0.0, "lower": 0.0, "compile": 0.0, "hits": 0, "programs": 0}
        )
        self.kinds: Counter = Counter()
        self.phase = "setup"

    def current(self) -> str:
        return getattr(self.local, "task", None) or f"[{self.phase}]"

    def on_duration(self, event, secs, **kw):
        col = {TRACE: "trace", LOWER: "lower", COMPILE: "compile"}.get(event)
        if col is None:
            return
        with self.lock:
            row = self.tasks[self.current()]
            row[col] += secs
            if event == COMPILE:
                row["programs"] += 1
                name = str(kw.get("fun_name", ""))  # e.g. "jit(_traced_step)"
                name = name.removeprefix("jit(").removesuffix(")")
                self.kinds[KINDS.get(name, f"glue ({name})")] += 1

    def on_event(self, event, **kw):
        if event == HIT:
            with self.lock:
                self.tasks[self.current()]["hits"] += 1

    def wrap(self, task):
        from tpuserve.tpu_platform.warmup import CompileTask

        def run():
            self.local.task = task.key
            t0 = time.perf_counter()
            try:
                return task.run()
            finally:
                with self.lock:
                    self.tasks[task.key]["wall"] += time.perf_counter() - t0
                self.local.task = None

        return CompileTask(task.key, run)


def _install(rec: Recorder) -> None:
    from jax import monitoring

    from tpuserve.tpu_platform.model_runner import ModelRunner
    from tpuserve.tpu_platform.warmup import WarmupPlan

    monitoring.register_event_duration_secs_listener(rec.on_duration)
    monitoring.register_event_listener(rec.on_event)
    plan_of = ModelRunner.warmup_plan

    def warmup_plan(self):
        plan = plan_of(self)
        return WarmupPlan(tuple(rec.wrap(t) for t in plan.tasks), plan.groups)

    ModelRunner.warmup_plan = warmup_plan


def _child(args) -> dict:
    """One measurement in this (fresh) process."""
    t_start = time.perf_counter()
    rec = Recorder()
    _install(rec)
    if args.workers:
        from tpuserve.tpu_platform import warmup

        warmup.default_workers = lambda: args.workers
    from tpuserve.server.engine import LLMEngine
    from tpuserve.server.llm import LLM
    from tpuserve.server.sampling_params import SamplingParams
    from tpuserve.tpu_platform.config import EngineConfig

    kwargs = dict(model=args.model, compilation_cache_dir=args.cache_dir)
    if args.max_model_len:
        kwargs["max_model_len"] = args.max_model_len
    if args.dtype:
        kwargs["dtype"] = args.dtype
    out: dict = {"what": args.what}
    t0 = time.perf_counter()
    out["import_s"] = t0 - t_start
    if args.what == "llm":
        rec.phase = "load"
        llm = LLM(warmup=False, **kwargs)
        out["load_s"] = time.perf_counter() - t0
        if args.load_only:
            out["ready_s"] = out["load_s"]
            out["ready_cpu_s"] = time.process_time()
            return _finish(out, llm.engine, rec, t_start)
        rec.phase = "warmup"
        t1 = time.perf_counter()
        llm.engine.warmup(progress=False)
        out["warmup_s"] = time.perf_counter() - t1
        out["ready_s"] = time.perf_counter() - t0
        out["ready_cpu_s"] = time.process_time()
        engine = llm.engine
        rec.phase = "first-generate"
        t2 = time.perf_counter()
        before = engine.runner.compile_count
        llm.generate(["Hello, my name is"], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
        out["first_generate_s"] = time.perf_counter() - t2
        out["traced_after_warmup"] = engine.runner.compile_count - before
    else:
        rec.phase = "load"
        engine = LLMEngine(EngineConfig.from_kwargs(**kwargs))
        out["load_s"] = time.perf_counter() - t0
        rec.phase = "warmup-first"
        t1 = time.perf_counter()
        warm = engine.start_warmup(progress=False)
        out["first_programs_s"] = time.perf_counter() - t1
        rec.phase = "first-request"
        msgs = [{"role": "user", "content": "What is the capital of France?"}]
        text = engine.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        ids = list(engine.tokenizer.encode(text, add_special_tokens=False))
        engine.add_request(
            "first", None, SamplingParams(temperature=0.0, max_tokens=16), prompt_token_ids=ids
        )
        while engine.has_unfinished_requests():
            engine.step()
        out["first_answer_s"] = time.perf_counter() - t0
        rec.phase = "warmup-rest"
        warm.wait()
        out["ready_s"] = time.perf_counter() - t0
        out["ready_cpu_s"] = time.process_time()
        out["failed"] = sorted(warm.failed)
    return _finish(out, engine, rec, t_start)


def _finish(out: dict, engine, rec: Recorder, t_start: float) -> dict:
    # The engine's own start-up record (absent in a tree from before it existed: A/B runs).
    timings = getattr(engine, "startup_timings", None)
    out["phases"] = {} if timings is None else timings.as_dict()
    out["programs_traced"] = engine.runner.compile_count
    out["kinds"] = dict(rec.kinds)
    out["tasks"] = {k: dict(v) for k, v in rec.tasks.items()}
    out["total_s"] = time.perf_counter() - t_start
    return out


def _run_child(args, what: str, cache_dir: str) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    cmd = [sys.executable, __file__, "--child", "--what", what, "--cache-dir", cache_dir, "--out", path]
    if args.model:
        cmd += ["--model", args.model]
    if args.max_model_len:
        cmd += ["--max-model-len", str(args.max_model_len)]
    if args.workers:
        cmd += ["--workers", str(args.workers)]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    if args.load_only:
        cmd += ["--load-only"]
    subprocess.run(cmd, check=True)
    with open(path) as f:
        res = json.load(f)
    os.unlink(path)
    return res


def _task_kind(key: str) -> str:
    if key.startswith("["):
        return key
    if key.startswith("forward"):
        return "forward (drafted)" if " k=" in key else "forward"
    return key.split(" ")[0] + (" " + key.split(" ")[1] if key.startswith("prompt") else "")


def _report(label: str, res: dict) -> None:
    print(f"\n== {label}: {res['what']} ==")
    keys = ("import_s", "load_s", "first_programs_s", "first_answer_s", "warmup_s", "ready_s", "ready_cpu_s")
    for k in keys + ("first_generate_s",):
        if k in res:
            print(f"  {k:18s} {res[k]:8.1f}")
    if res.get("phases"):
        print("  start-up phases (s): " + ", ".join(f"{k} {v:.2f}" for k, v in res["phases"].items()))
    print(f"  programs traced by the runner: {res['programs_traced']}")
    if "traced_after_warmup" in res:
        print(f"  traced after warm-up: {res['traced_after_warmup']}")
    print("  executables by kind: " + ", ".join(f"{k} {v}" for k, v in sorted(res["kinds"].items())))
    tasks = res["tasks"]
    by_kind: dict[str, dict] = defaultdict(lambda: Counter())
    for key, row in tasks.items():
        agg = by_kind[_task_kind(key)]
        agg["n"] += 1
        for c, v in row.items():
            agg[c] += v
    cols = ("wall", "trace", "lower", "compile", "hits", "programs")
    print(f"  {'task kind':22s} {'tasks':>5s} " + " ".join(f"{c:>8s}" for c in cols))
    for kind, agg in sorted(by_kind.items(), key=lambda kv: -kv[1]["wall"] - kv[1]["compile"]):
        vals = " ".join(
            f"{agg[c]:8.1f}" if c in ("wall", "trace", "lower", "compile") else f"{int(agg[c]):8d}"
            for c in cols
        )
        print(f"  {kind:22s} {int(agg['n']):5d} {vals}")
    total = Counter()
    for row in tasks.values():
        total.update(row)
    print(
        f"  sum over tasks: trace {total['trace']:.1f} s, lower {total['lower']:.1f} s, "
        f"compile {total['compile']:.1f} s, {int(total['hits'])} of {int(total['programs'])} "
        f"programs from the persistent cache"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model path or id (default: the default model)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--what", default="llm,engine", help="llm, engine, or both (comma-separated)")
    p.add_argument("--runs", default="cold,warm", help="cold (empty cache), warm (reuse it), or both")
    p.add_argument("--cache-dir", default=None, help="compilation cache dir (default: a new temp dir)")
    p.add_argument("--workers", type=int, default=None, help="compile threads (default: the runner's)")
    p.add_argument(
        "--dtype", default=None, help="model dtype (default: the engine's, bf16 on TPU, f32 on CPU)"
    )
    p.add_argument("--load-only", action="store_true", help="llm: stop after LLM(warmup=False)")
    p.add_argument("--json", default=None, help="write every result here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        res = _child(args)
        with open(args.out, "w") as f:
            json.dump(res, f)
        return
    results = []
    for what in args.what.split(","):
        cache = args.cache_dir or tempfile.mkdtemp(prefix=f"tpuserve-startup-{what}-")
        for run in args.runs.split(","):
            res = _run_child(args, what, cache)
            res["run"] = run
            results.append(res)
            _report(f"{run} ({cache})", res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    ready = [r["ready_s"] for r in results]
    print(f"\nready_s: {', '.join(f'{r:.1f}' for r in ready)} (median {statistics.median(ready):.1f})")


if __name__ == "__main__":
    main()
