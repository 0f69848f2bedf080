"""Disaggregated prefill/decode benchmark: KV transfer bandwidth, and decode TPOT under concurrent
long prefills with one colocated server against a producer + consumer behind ``tpuserve router``.

    python benchmarks/disagg.py                               # both parts, default sizes (~10 min, 2 cores)
    python benchmarks/disagg.py --skip-serving                # transfer bandwidth only (~1 min)
    python benchmarks/disagg.py --skip-transfer --rounds 1 --long-prompt-tokens 512   # quick serving
    python benchmarks/disagg.py --rounds 4 --short-requests-per-client 2 --json /tmp/disagg.json

Part 1, transfer (``kv_cache/transfer``): a producer child process holds leases (``TcpKVSender``) on
page arrays ``[L, n, page_size, C, D]`` of the default model's layout (SmolLM2-135M: L=30, page 16,
C=2*Hkv=6, D=64, f32; 0.74 MB a page) for each ``--pages`` n; this process pulls each lease with a
``TcpKVReceiver`` over loopback (one connection per pull, as the engine does: connect, HMAC
handshake, pull, ack). Peers in the same run, on the same bytes:
- raw socket: the same child process sends the same bytes over a plain loopback TCP connection (one
  connection per transfer, no framing, no handshake, no ack) into a fresh ``np.empty`` buffer here,
  as our receiver does;
- memcpy: ``np.copyto`` of the same number of bytes into a preallocated (already touched) array in
  this process: the host's memory bandwidth, the ceiling of any copy.
The three take turns each repeat (so load drift hits them alike); GB/s (1e9 bytes/s) is the median
over ``--transfer-repeats``. The first pull of each size is checked bitwise (CRC-32) against the
producer's array. Then the device side on this host's JAX backend: ``DevicePageMover.gather`` of n
random pages of a ``[L, P, ...]`` cache to a numpy array (the producer's export), and
``DevicePageMover.scatter`` of n host pages into the cache (the consumer's import), per page; P is
by default what the engine's default CPU KV cache (1 GiB) holds, since the cost can depend on the
whole cache and not only on the pages moved.

Part 2, serving: decode TPOT while long prompts keep arriving, in two setups:
- colocated: one ``tpuserve serve`` doing prefill and decode, given both cores (``taskset -c 0,1``);
- P/D: ``tpuserve router`` in front of a producer ``tpuserve serve`` (``kv_role kv_producer``, pinned to
  core 0) and a consumer (``kv_consumer``, pinned to core 1). The router and this client run unpinned
  (they are light, and the colocated run has the same client).
Load of one round: ``--short-concurrency`` clients each stream ``--short-requests-per-client``
short requests (``--short-prompt-tokens`` prompt tokens, ``--short-max-tokens`` output tokens,
``ignore_eos``) one after another, while long requests (``--long-prompt-tokens`` prompt tokens,
``max_tokens`` cycling over ``--long-max-tokens``) keep arriving until the short clients are done: by
default the next one as soon as the previous finished (``--long-max-inflight 1``: a long prefill is
always in flight), or with ``--long-interval S`` one every S seconds, skipped (and counted) while
``--long-max-inflight`` are outstanding. Prompts are token-id lists drawn from a seeded RNG, unique
per request (no prefix-cache hits); greedy. Every server gets the default model's Hugging Face
directory (SmolLM2-135M-Instruct exported from its GGUF), f32 on CPU, and the same engine flags;
each setup first serves one unmeasured warm-up round (it compiles the page gather/scatter programs,
which the engine's warm-up does not). Setups take turns per round, the first alternating.
TPOT = (last token time - first token time) / (tokens - 1) per short request, as the client sees
the stream; p50 / p99 over all short requests of all rounds. Also reported: the short requests'
TTFT (in P/D it includes the producer's queue and the transfer) and per-token gaps (ITL), and the
long requests' latency, and (unless ``--no-baseline``) the TPOT of one last round per setup with no
long prompts. Ratio: P/D / colocated (lower is better for TPOT).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx
import numpy as np
from serving import RequestResult, _compiled_programs, _pct, model_dir, one_request

from tpuserve.kv_cache.transfer.layout import KVLayout
from tpuserve.server.launcher import ServerProcess, free_port, tpuserve_argv
from tpuserve.tpu_platform.worker import CPU_KV_CACHE_BYTES

SERVED_NAME = "bench-model"
GB = 1e9


# ---------------------------------------------------------------------------------------------
# Part 1: transfer bandwidth
# ---------------------------------------------------------------------------------------------


def _layout(cfg: dict) -> KVLayout:
    return KVLayout(SERVED_NAME, cfg["layers"], cfg["page_size"], cfg["heads"], cfg["head_dim"], "float32")


def _pages_array(layout: KVLayout, n: int, seed: int) -> np.ndarray:
    """Random f32 pages (real bytes: untouched zero pages would make every read nearly free)."""
    return np.random.default_rng(seed).random(layout.pages_shape(n), dtype=np.float32)


def producer_main(cfg_json: str) -> int:
    """The producer child: leases for every size, plus a raw-socket server of the same bytes.

    Prints one JSON line (the handles, the raw port, the CRC of each size), then serves until its
    stdin closes.
    """
    from tpuserve.kv_cache.transfer.tcp import TcpKVSender

    cfg = json.loads(cfg_json)
    layout = _layout(cfg)
    arrays = {n: _pages_array(layout, n, seed=n) for n in cfg["pages"]}
    sender = TcpKVSender(layout, default_ttl_s=3600.0, io_timeout_s=120.0)
    handles = {
        str(n): [
            sender.offer(f"bench-{n}-{i}", arr, n * layout.page_size).to_kv_transfer_params()
            for i in range(cfg["leases"])
        ]
        for n, arr in arrays.items()
    }
    raw = socket.create_server(("127.0.0.1", 0))

    def serve_raw():
        while True:
            try:
                conn, _ = raw.accept()
            except OSError:
                return
            with conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                want = bytearray(8)
                view, got = memoryview(want), 0
                while got < 8:
                    k = conn.recv_into(view[got:])
                    if not k:
                        break
                    got += k
                if got < 8:
                    continue
                arr = arrays[int.from_bytes(want, "big")]
                conn.sendall(memoryview(arr.reshape(-1).view(np.uint8)))

    threading.Thread(target=serve_raw, daemon=True).start()
    crcs = {str(n): zlib.crc32(memoryview(a.reshape(-1).view(np.uint8))) for n, a in arrays.items()}
    print(json.dumps({"handles": handles, "raw_port": raw.getsockname()[1], "crc": crcs}), flush=True)
    sys.stdin.read()  # the parent closes our stdin when it is done
    raw.close()
    sender.close()
    return 0


def _raw_pull(port: int, n: int, nbytes: int) -> np.ndarray:
    buf = np.empty(nbytes, np.uint8)  # fresh, as TcpKVReceiver allocates per pull
    view, got = memoryview(buf), 0
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(n.to_bytes(8, "big"))
        while got < nbytes:
            k = s.recv_into(view[got : got + (1 << 22)])
            if not k:
                raise RuntimeError(f"raw peer closed after {got} of {nbytes} bytes")
            got += k
    return buf


def bench_transfer(args) -> dict:
    from tpuserve.kv_cache.transfer.tcp import TcpKVReceiver
    from tpuserve.kv_cache.transfer.transport import TransferHandle

    cfg = {
        "layers": args.layers,
        "page_size": args.page_size,
        "heads": args.heads,
        "head_dim": args.head_dim,
        "pages": args.pages,
        "leases": args.transfer_repeats + 1,
    }
    layout = _layout(cfg)
    secret = secrets.token_hex(16)
    env = {**os.environ, "TPUSERVE_KV_SECRET": secret}
    print(
        f"[transfer] layout {layout.pages_shape(0)} {layout.dtype}: "
        f"{layout.pages_nbytes(1) / 1e6:.3f} MB a page; pages {args.pages}",
        flush=True,
    )
    child = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--producer-child", json.dumps(cfg)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    results: dict[int, dict] = {}
    try:
        line = child.stdout.readline()
        if not line:
            raise RuntimeError(f"the producer child exited with {child.wait()} before offering pages")
        info = json.loads(line)
        receiver = TcpKVReceiver(layout, secret=secret, io_timeout_s=120.0)
        for n in args.pages:
            nbytes = layout.pages_nbytes(n)
            handles = [TransferHandle.from_kv_transfer_params(p) for p in info["handles"][str(n)]]
            # Warm-up pull (its pages checked bitwise) and raw transfer, not timed.
            batch = receiver.pull(handles[0])
            got = zlib.crc32(memoryview(batch.pages.reshape(-1).view(np.uint8)))
            if got != info["crc"][str(n)]:
                raise RuntimeError(f"{n} pages: CRC {got:#x} != the producer's {info['crc'][str(n)]:#x}")
            del batch
            _raw_pull(info["raw_port"], n, nbytes)
            src = _pages_array(layout, n, seed=1000 + n)
            dst = np.empty_like(src)
            np.copyto(dst, src)
            t_ours, t_raw, t_copy = [], [], []
            for h in handles[1:]:
                t0 = time.perf_counter()
                batch = receiver.pull(h)
                t_ours.append(time.perf_counter() - t0)
                del batch
                t0 = time.perf_counter()
                buf = _raw_pull(info["raw_port"], n, nbytes)
                t_raw.append(time.perf_counter() - t0)
                del buf
                t0 = time.perf_counter()
                np.copyto(dst, src)
                t_copy.append(time.perf_counter() - t0)
            del src, dst
            r = {
                "bytes": nbytes,
                "ours_s": t_ours,
                "raw_s": t_raw,
                "memcpy_s": t_copy,
                "ours_gbps": nbytes / statistics.median(t_ours) / GB,
                "raw_gbps": nbytes / statistics.median(t_raw) / GB,
                "memcpy_gbps": nbytes / statistics.median(t_copy) / GB,
            }
            results[n] = r
            print(
                f"[transfer] {n:>4} pages ({nbytes / 1e6:7.1f} MB): ours {r['ours_gbps']:6.2f} GB/s  "
                f"raw socket {r['raw_gbps']:6.2f} GB/s  memcpy {r['memcpy_gbps']:6.2f} GB/s",
                flush=True,
            )
    finally:
        try:
            child.stdin.close()
            child.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            child.kill()
            child.wait()
    return results


def bench_device_pages(args) -> dict:
    """DevicePageMover gather (device cache -> numpy pages) and scatter (numpy -> device), per page."""
    import jax

    from tpuserve.kv_cache.transfer.device_pages import DevicePageMover

    layout = _layout(
        {"layers": args.layers, "page_size": args.page_size, "heads": args.heads, "head_dim": args.head_dim}
    )
    # The cache's size matters, not only the pages moved (see --device-cache-pages).
    total = args.device_cache_pages or CPU_KV_CACHE_BYTES // layout.pages_nbytes(1)
    total = max(total, max(args.pages) + 1)  # page 0 reserved, as in the engine
    # Committed to the device, as the engine's cache is (an uncommitted argument is another jit key).
    kv = jax.device_put(_pages_array(layout, total, seed=7), jax.devices()[0])
    kv.block_until_ready()
    mover = DevicePageMover()
    rng = np.random.default_rng(0)
    out: dict = {"cache_pages": total}
    print(
        f"[device] backend {jax.default_backend()}, cache {tuple(kv.shape)} ({kv.nbytes / 1e6:.0f} MB)",
        flush=True,
    )
    for n in args.pages:
        ids = (rng.permutation(total - 1)[:n] + 1).tolist()  # scattered page ids, as a real cache has
        host = _pages_array(layout, n, seed=11)
        for _ in range(2):  # warm-up: compiles this size's bucket (for the scatter's output too)
            mover.gather(kv, ids).numpy()
            kv = mover.scatter(kv, host, ids)
            kv.block_until_ready()
        t_g, t_s = [], []
        traces = mover.compile_count
        for _ in range(args.transfer_repeats):
            t0 = time.perf_counter()
            pages = mover.gather(kv, ids).numpy()
            t_g.append(time.perf_counter() - t0)
            del pages
            t0 = time.perf_counter()
            kv = mover.scatter(kv, host, ids)
            kv.block_until_ready()
            t_s.append(time.perf_counter() - t0)
        if mover.compile_count != traces:
            print(f"[device] note: {mover.compile_count - traces} program(s) compiled while timing {n} pages")
        nbytes = layout.pages_nbytes(n)
        g, s = statistics.median(t_g), statistics.median(t_s)
        out[n] = {
            "bytes": nbytes,
            "gather_s": t_g,
            "scatter_s": t_s,
            "gather_ms_per_page": 1e3 * g / n,
            "scatter_ms_per_page": 1e3 * s / n,
            "gather_gbps": nbytes / g / GB,
            "scatter_gbps": nbytes / s / GB,
        }
        print(
            f"[device] {n:>4} pages: gather->numpy {1e3 * g:8.1f} ms ({1e3 * g / n:.3f} ms/page, "
            f"{nbytes / g / GB:.2f} GB/s)  scatter {1e3 * s:8.1f} ms ({1e3 * s / n:.3f} ms/page, "
            f"{nbytes / s / GB:.2f} GB/s)",
            flush=True,
        )
    del kv
    return out


def print_transfer_tables(tr: dict, dev: dict) -> None:
    if tr:
        print("\nKV transfer producer -> consumer, loopback (GB/s = 1e9 B/s, median of repeats):")
        cols = [
            "pages",
            "MB",
            "ours GB/s",
            "raw socket GB/s",
            "memcpy GB/s",
            "ours/raw",
            "ours/memcpy",
            "ours ms",
        ]
        rows = [
            [
                str(n),
                f"{r['bytes'] / 1e6:.1f}",
                f"{r['ours_gbps']:.2f}",
                f"{r['raw_gbps']:.2f}",
                f"{r['memcpy_gbps']:.2f}",
                f"{r['ours_gbps'] / r['raw_gbps']:.2f}",
                f"{r['ours_gbps'] / r['memcpy_gbps']:.2f}",
                f"{1e3 * statistics.median(r['ours_s']):.1f}",
            ]
            for n, r in tr.items()
        ]
        _print_rows(cols, rows)
    if dev:
        print(
            f"\nDevicePageMover on this host's backend, cache of {dev['cache_pages']} pages "
            "(median of repeats):"
        )
        cols = ["pages", "gather->numpy ms", "ms/page", "GB/s", "scatter ms", "ms/page", "GB/s"]
        rows = [
            [
                str(n),
                f"{r['gather_ms_per_page'] * n:.1f}",
                f"{r['gather_ms_per_page']:.3f}",
                f"{r['gather_gbps']:.2f}",
                f"{r['scatter_ms_per_page'] * n:.1f}",
                f"{r['scatter_ms_per_page']:.3f}",
                f"{r['scatter_gbps']:.2f}",
            ]
            for n, r in dev.items()
            if n != "cache_pages"
        ]
        _print_rows(cols, rows)


def _print_rows(cols: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(cols)]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(x.rjust(w) for x, w in zip(r, widths)))


# ---------------------------------------------------------------------------------------------
# Part 2: decode TPOT under concurrent long prefills
# ---------------------------------------------------------------------------------------------


class Prompts:
    """Unique token-id prompts: every request's first page differs, so no prefix-cache hits."""

    def __init__(self, seed: int, vocab_lo: int = 1000, vocab_hi: int = 30000):
        self.rng = np.random.default_rng(seed)
        self.lo, self.hi = vocab_lo, vocab_hi

    def next(self, n: int) -> list[int]:
        return self.rng.integers(self.lo, self.hi, n).tolist()


async def run_round(
    base_url: str,
    args,
    prompts: Prompts,
    short_per_client: int,
    short_max_tokens: int,
    with_long: bool = True,
) -> dict:
    """One round of load; returns the short and long requests' results and the wall times.

    Long arrivals: with ``--long-interval`` 0 a new long request is sent whenever fewer than
    ``--long-max-inflight`` are outstanding (with 1: a long prefill always in flight); otherwise one
    arrives every interval and is skipped (counted) while that many are outstanding. Arrivals stop
    when the short clients are done; the outstanding long requests are then awaited (cancelling
    them would leave their work running in the servers, into the next round).
    """
    url = base_url + "/v1/completions"
    limits = httpx.Limits(max_connections=args.short_concurrency + args.long_max_inflight + 8)
    shorts: list[RequestResult] = []
    longs: list[tuple[RequestResult, float]] = []  # result, latency to the last token
    skipped = 0
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0), limits=limits) as client:
        done = asyncio.Event()

        async def short_client():
            for _ in range(short_per_client):
                shorts.append(
                    await one_request(
                        client, url, SERVED_NAME, prompts.next(args.short_prompt_tokens), short_max_tokens
                    )
                )

        async def one_long(i: int):
            t0 = time.perf_counter()
            res = await one_request(
                client,
                url,
                SERVED_NAME,
                prompts.next(args.long_prompt_tokens),
                args.long_max_tokens[i % len(args.long_max_tokens)],
            )
            longs.append((res, time.perf_counter() - t0))

        async def long_stream():
            nonlocal skipped
            pending: set[asyncio.Task] = set()
            stop = asyncio.create_task(done.wait())
            i, next_at = 0, time.perf_counter()
            while not done.is_set():
                timeout = None
                if args.long_interval <= 0:
                    while len(pending) < args.long_max_inflight:
                        pending.add(asyncio.create_task(one_long(i)))
                        i += 1
                else:
                    now = time.perf_counter()
                    while next_at <= now:
                        if len(pending) < args.long_max_inflight:
                            pending.add(asyncio.create_task(one_long(i)))
                            i += 1
                        else:
                            skipped += 1
                        next_at += args.long_interval
                    timeout = next_at - now
                finished, _ = await asyncio.wait(
                    pending | {stop}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
                )
                pending -= finished
            if pending:
                await asyncio.gather(*pending)

        start = time.perf_counter()
        stream = asyncio.create_task(long_stream()) if with_long else None
        await asyncio.gather(*(short_client() for _ in range(args.short_concurrency)))
        shorts_wall = time.perf_counter() - start
        done.set()
        if stream is not None:
            await stream
        wall = time.perf_counter() - start
    return {"shorts": shorts, "longs": longs, "skipped": skipped, "shorts_wall": shorts_wall, "wall": wall}


def summarize(rounds: list[dict]) -> dict:
    shorts = [r for rd in rounds for r in rd["shorts"]]
    ok = [r for r in shorts if r.error is None and r.ttft is not None]
    tpots = [r.decode_time / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itls = [x for r in ok for x in r.itls]
    ttfts = [r.ttft for r in ok]
    longs = [x for rd in rounds for x in rd["longs"]]
    long_ok = [(r, lat) for r, lat in longs if r.error is None]
    errors = sorted({r.error for r in shorts if r.error} | {r.error for r, _ in longs if r.error})
    ms = lambda xs, q: 1e3 * _pct(xs, q) if xs else float("nan")  # noqa: E731
    shorts_wall = sum(rd["shorts_wall"] for rd in rounds)
    return {
        "short_requests": len(shorts),
        "short_failed": len(shorts) - len(ok),
        "tpot_p50_ms": ms(tpots, 0.5),
        "tpot_p99_ms": ms(tpots, 0.99),
        "tpot_mean_ms": 1e3 * statistics.fmean(tpots) if tpots else float("nan"),
        "itl_p50_ms": ms(itls, 0.5),
        "itl_p99_ms": ms(itls, 0.99),
        "itl_max_ms": ms(itls, 1.0),
        "ttft_p50_ms": ms(ttfts, 0.5),
        "ttft_p99_ms": ms(ttfts, 0.99),
        "short_tok_s": sum(r.output_tokens for r in ok) / shorts_wall if shorts_wall else float("nan"),
        "long_requests": len(longs),
        "long_failed": len(longs) - len(long_ok),
        "long_skipped": sum(rd["skipped"] for rd in rounds),
        "long_latency_p50_ms": ms([lat for _, lat in long_ok], 0.5),
        "long_ttft_p50_ms": ms([r.ttft for r, _ in long_ok if r.ttft is not None], 0.5),
        "long_per_min": 60 * len(long_ok) / shorts_wall if shorts_wall else float("nan"),
        "wall_s": sum(rd["wall"] for rd in rounds),
        "errors": errors[:3],
    }


def _pin(cores: list[int] | None) -> list[str]:
    return ["taskset", "-c", ",".join(map(str, cores))] if cores else []


def bench_serving(args) -> dict:
    path = model_dir(args)
    common = [
        "--served-model-name",
        SERVED_NAME,
        "--log-level",
        "warning",
        "--max-model-len",
        str(args.max_model_len),
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        "--kv-cache-memory-bytes",
        str(args.kv_cache_mib << 20),
    ]
    cores = sorted(os.sched_getaffinity(0))
    pin = not args.no_pin and shutil.which("taskset") is not None and len(cores) >= 2
    if pin:
        colo_cores, p_cores, d_cores = cores[:2], cores[:1], cores[1:2]
        print(
            f"[serving] pinning: colocated taskset -c {colo_cores[0]},{colo_cores[1]}; producer "
            f"-c {p_cores[0]}; consumer -c {d_cores[0]}; router and client unpinned",
            flush=True,
        )
    else:
        colo_cores = p_cores = d_cores = None
        print(
            f"[serving] NOT pinned ({'--no-pin' if args.no_pin else 'taskset missing or < 2 cores'}): "
            f"every process shares the {len(cores)} core(s)",
            flush=True,
        )
    secret = secrets.token_hex(16)
    kv_env = {"TPUSERVE_KV_SECRET": secret}

    def serve(role: str | None, pin_cores) -> ServerProcess:
        port = free_port()
        extra = []
        if role:
            extra = ["--kv-transfer-config", json.dumps({"kv_role": role, "kv_port": 0})]
        argv = _pin(pin_cores) + tpuserve_argv("serve", path, "--port", str(port), *common, *extra)
        return ServerProcess(argv, port, env=kv_env if role else None, startup_timeout=args.startup_timeout)

    colo = serve(None, colo_cores)
    print(f"[serving] engines: {' '.join(colo.argv)} (+ --kv-transfer-config for P and D)", flush=True)
    prod = serve("kv_producer", p_cores)
    cons = serve("kv_consumer", d_cores)
    router_port = free_port()
    router = ServerProcess(
        tpuserve_argv(
            "router",
            "--prefill",
            prod.base_url,
            "--decode",
            cons.base_url,
            "--port",
            str(router_port),
            "--log-level",
            "warning",
        ),
        router_port,
        startup_timeout=120,
    )
    started: list[ServerProcess] = []

    def start(name: str, srvs: list[ServerProcess]) -> None:
        t0 = time.perf_counter()
        errs: list[BaseException] = []

        def go(s):
            try:
                s.start()
            except BaseException as e:
                errs.append(e)

        threads = [threading.Thread(target=go, args=(s,)) for s in srvs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        started.extend(s for s in srvs if s.proc is not None)
        if errs:
            raise RuntimeError(f"{name} failed to start: {errs[0]}")
        print(
            f"[serving] {name} ready after {time.perf_counter() - t0:.1f}s "
            f"(logs {', '.join(s.log_path for s in srvs)})",
            flush=True,
        )

    modes = {"colocated": colo.base_url, "P/D": router.base_url}
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    compiled: dict[str, int] = {m: 0 for m in modes}
    engines = {"colocated": [colo], "P/D": [prod, cons]}
    baseline: dict[str, dict] = {}
    try:
        # The colocated server first, alone, with both cores: a cold XLA cache is filled at full speed
        # and the pinned engines then load the same programs from it.
        start("colocated server", [colo])
        start("producer + consumer", [prod, cons])
        start("router", [router])
        prompts = Prompts(args.seed)
        for m, url in modes.items():  # warm-up: not measured
            t0 = time.perf_counter()
            warm = asyncio.run(run_round(url, args, prompts, 1, min(8, args.short_max_tokens)))
            bad = [r.error for r in warm["shorts"] if r.error] + [
                r.error for r, _ in warm["longs"] if r.error
            ]
            print(
                f"[serving] {m} warm-up round {time.perf_counter() - t0:.1f}s"
                + (f"  FAILED: {bad[:2]}" if bad else ""),
                flush=True,
            )
            if bad:
                raise RuntimeError(f"{m} warm-up failed: {bad[0]}")
        for rnd in range(args.rounds):
            order = list(modes) if rnd % 2 == 0 else list(reversed(modes))  # alternate who goes first
            for m in order:
                before = [_compiled_programs(s.base_url) for s in engines[m]]
                rd = asyncio.run(
                    run_round(modes[m], args, prompts, args.short_requests_per_client, args.short_max_tokens)
                )
                after = [_compiled_programs(s.base_url) for s in engines[m]]
                compiled[m] += sum(a - b for a, b in zip(after, before) if a is not None and b is not None)
                runs[m].append(rd)
                s = summarize([rd])
                print(
                    f"[serving] round {rnd + 1} {m:>9}: TPOT p50 {s['tpot_p50_ms']:7.1f} ms  "
                    f"p99 {s['tpot_p99_ms']:7.1f} ms  ITL p99 {s['itl_p99_ms']:7.1f} ms  "
                    f"TTFT p50 {s['ttft_p50_ms']:7.1f} ms  long done {s['long_requests'] - s['long_failed']}"
                    f" (skipped {s['long_skipped']})  {rd['wall']:.1f}s"
                    + (f"  FAILED: {s['errors']}" if s["short_failed"] or s["long_failed"] else ""),
                    flush=True,
                )
        for m in modes if args.baseline else ():
            rd = asyncio.run(run_round(modes[m], args, prompts, 1, args.short_max_tokens, with_long=False))
            baseline[m] = summarize([rd])
            print(
                f"[serving] baseline {m:>9} (no long prompts): TPOT p50 {baseline[m]['tpot_p50_ms']:7.1f} ms"
                f"  TTFT p50 {baseline[m]['ttft_p50_ms']:7.1f} ms  {rd['wall']:.1f}s",
                flush=True,
            )
    finally:
        for s in reversed(started):
            s.stop()
    out = {m: summarize(runs[m]) for m in modes}
    for m in modes:
        out[m]["compiled_during_rounds"] = compiled[m]
        if compiled[m]:
            print(
                f"[serving] note: {m} compiled {compiled[m]} program(s) during the measured rounds; "
                "its latencies include compile time",
                flush=True,
            )
        if m in baseline:
            out[m]["baseline"] = baseline[m]
    out["pinned"] = pin
    return out


def print_serving_table(res: dict, args) -> None:
    c, p = res["colocated"], res["P/D"]
    print(
        f"\nDecode under concurrent long prefills: {args.short_concurrency} streams x "
        f"{args.short_requests_per_client} x {args.rounds} rounds of {args.short_prompt_tokens}+"
        f"{args.short_max_tokens} tokens, long prompts of {args.long_prompt_tokens} tokens "
        f"(max_tokens {','.join(map(str, args.long_max_tokens))}) "
        + (f"every {args.long_interval:g}s, " if args.long_interval > 0 else "back to back, ")
        + f"at most {args.long_max_inflight} in flight; "
        + ("colocated on cores 0,1, P on core 0, D on core 1" if res.get("pinned") else "unpinned")
        + ":"
    )
    rows_spec = [
        ("TPOT p50 ms", "tpot_p50_ms"),
        ("TPOT p99 ms", "tpot_p99_ms"),
        ("TPOT mean ms", "tpot_mean_ms"),
        ("ITL p50 ms", "itl_p50_ms"),
        ("ITL p99 ms", "itl_p99_ms"),
        ("ITL max ms", "itl_max_ms"),
        ("short TTFT p50 ms", "ttft_p50_ms"),
        ("short TTFT p99 ms", "ttft_p99_ms"),
        ("short output tok/s", "short_tok_s"),
        ("long requests done", None),
        ("long done / min", "long_per_min"),
        ("long latency p50 ms", "long_latency_p50_ms"),
    ]
    rows = []
    for label, key in rows_spec:
        if key is None:
            rows.append(
                [
                    label,
                    f"{c['long_requests'] - c['long_failed']} (+{c['long_skipped']} skipped)",
                    f"{p['long_requests'] - p['long_failed']} (+{p['long_skipped']} skipped)",
                    "",
                ]
            )
            continue
        ratio = p[key] / c[key] if c[key] else float("nan")
        rows.append([label, f"{c[key]:.1f}", f"{p[key]:.1f}", f"{ratio:.2f}"])
    if "baseline" in c and "baseline" in p:
        for label, key in (
            ("no long prompts: TPOT p50 ms", "tpot_p50_ms"),
            ("no long prompts: TTFT p50 ms", "ttft_p50_ms"),
        ):
            b, q = c["baseline"][key], p["baseline"][key]
            rows.append([label, f"{b:.1f}", f"{q:.1f}", f"{q / b:.2f}" if b else "nan"])
    _print_rows(["metric", "colocated", "P/D", "P/D / colocated"], rows)
    for m in ("colocated", "P/D"):
        if res[m]["short_failed"] or res[m]["long_failed"]:
            print(
                f"  {m}: {res[m]['short_failed']} short and {res[m]['long_failed']} long requests failed: "
                f"{res[m]['errors']}"
            )


# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--producer-child", metavar="JSON", help=argparse.SUPPRESS)
    g = p.add_argument_group("part 1: transfer")
    g.add_argument("--skip-transfer", action="store_true")
    g.add_argument("--pages", type=int, nargs="+", default=[64, 256, 512], help="page counts to move")
    g.add_argument("--transfer-repeats", type=int, default=5)
    g.add_argument("--layers", type=int, default=30)
    g.add_argument("--page-size", type=int, default=16)
    g.add_argument("--heads", type=int, default=6, help="combined K/V heads C = 2*Hkv")
    g.add_argument("--head-dim", type=int, default=64)
    g.add_argument("--skip-device", action="store_true", help="skip the DevicePageMover timings")
    g.add_argument(
        "--device-cache-pages",
        type=int,
        default=0,
        help="pages of the device cache gathered from / scattered into (default: what the "
        "engine's default CPU KV cache of 1 GiB holds)",
    )
    g = p.add_argument_group("part 2: serving")
    g.add_argument("--skip-serving", action="store_true")
    g.add_argument(
        "--model",
        help="Hugging Face model directory (default: SmolLM2-135M-Instruct exported from the bundled GGUF)",
    )
    g.add_argument("--rounds", type=int, default=2, help="measured rounds per setup, setups in turns")
    g.add_argument("--short-concurrency", type=int, default=4)
    g.add_argument("--short-requests-per-client", type=int, default=1, help="per round")
    g.add_argument("--short-prompt-tokens", type=int, default=32)
    g.add_argument("--short-max-tokens", type=int, default=64)
    g.add_argument("--long-prompt-tokens", type=int, default=1536)
    g.add_argument(
        "--long-max-tokens",
        type=int,
        nargs="+",
        default=[1, 4, 8],
        help="max_tokens of successive long requests (cycled)",
    )
    g.add_argument(
        "--long-interval",
        type=float,
        default=0.0,
        help="seconds between long arrivals (0: the next one as soon as fewer than "
        "--long-max-inflight are outstanding)",
    )
    g.add_argument("--long-max-inflight", type=int, default=1)
    g.add_argument("--max-model-len", type=int, default=2048)
    g.add_argument("--max-num-seqs", type=int, default=16)
    g.add_argument("--max-num-batched-tokens", type=int, default=256)
    g.add_argument("--kv-cache-mib", type=int, default=384, help="KV cache of each server (MiB)")
    g.add_argument("--no-pin", action="store_true", help="do not pin the servers to cores")
    g.add_argument(
        "--no-baseline",
        dest="baseline",
        action="store_false",
        help="skip the last round per setup without long prompts (decode alone)",
    )
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--startup-timeout", type=float, default=1200.0)
    p.add_argument("--json", help="also write all numbers to this JSON file")
    args = p.parse_args(argv)
    if args.producer_child:
        return producer_main(args.producer_child)
    if args.long_prompt_tokens + max(args.long_max_tokens) > args.max_model_len:
        p.error("--long-prompt-tokens plus the largest --long-max-tokens must fit --max-model-len")

    t0 = time.perf_counter()
    transfer = device = serving = None
    if not args.skip_transfer:
        transfer = bench_transfer(args)
        if not args.skip_device:
            device = bench_device_pages(args)
        print_transfer_tables(transfer, device or {})
    if not args.skip_serving:
        serving = bench_serving(args)
        print_serving_table(serving, args)
    print(f"\ntotal {time.perf_counter() - t0:.0f}s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"args": vars(args), "transfer": transfer, "device_pages": device, "serving": serving},
                f,
                indent=2,
                default=str,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
