"""Where a stretch of engine steps spends the device's time: a JAX profiler trace, summarized.

``traced(dir)`` records a profiler trace (with its Perfetto JSON) around a block; ``summarize(dir)``
reads that JSON and reports, for the accelerator's timeline, the programs that ran (count, total
and median time), the busiest ops, how much of the traced wall span the device was busy, and the
idle gaps between consecutive programs. A device that idles between steps is waiting for the host;
one that is busy throughout sets the step time itself.

    python benchmarks/device_trace.py DIR          # summarize a trace written earlier
"""

from __future__ import annotations

import contextlib
import glob
import gzip
import json
import os
import statistics
import sys

import jax


@contextlib.contextmanager
def traced(out_dir: str):
    """Profile the block into ``out_dir`` (TensorBoard files plus perfetto_trace.json.gz)."""
    os.makedirs(out_dir, exist_ok=True)
    with jax.profiler.trace(out_dir, create_perfetto_trace=True):
        yield


def _load(out_dir: str) -> list[dict]:
    files = sorted(glob.glob(os.path.join(out_dir, "**", "perfetto_trace.json.gz"), recursive=True))
    if not files:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {out_dir}")
    with gzip.open(files[-1], "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def _names(events: list[dict]) -> tuple[dict, dict]:
    procs, threads = {}, {}
    for e in events:
        if e.get("ph") != "M":
            continue
        if e.get("name") == "process_name":
            procs[e["pid"]] = e["args"]["name"]
        elif e.get("name") == "thread_name":
            threads[(e["pid"], e["tid"])] = e["args"]["name"]
    return procs, threads


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def summarize(out_dir: str, top: int = 15) -> dict:
    """The device timeline of the trace under ``out_dir`` (the first accelerator's, else every
    process's threads listed so a reader can see what was recorded)."""
    events = _load(out_dir)
    procs, threads = _names(events)
    dev_pids = [p for p, n in procs.items() if "/device:" in n and "CPU" not in n]
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    if not dev_pids:
        counts: dict[str, int] = {}
        for e in spans:
            key = f"{procs.get(e['pid'], e['pid'])} / {threads.get((e['pid'], e['tid']), e['tid'])}"
            counts[key] = counts.get(key, 0) + 1
        return dict(device=None, threads=counts)
    pid = min(dev_pids)
    mine = [e for e in spans if e["pid"] == pid]
    by_thread: dict[str, list[dict]] = {}
    for e in mine:
        by_thread.setdefault(threads.get((pid, e["tid"]), str(e["tid"])), []).append(e)
    modules = next((v for k, v in by_thread.items() if "Module" in k), [])
    ops = next((v for k, v in by_thread.items() if k.endswith("Ops")), [])
    main = modules or ops
    iv = sorted((e["ts"], e["ts"] + e["dur"]) for e in main)
    res: dict = dict(device=procs[pid], threads={k: len(v) for k, v in by_thread.items()})
    if not iv:
        return res
    span = iv[-1][1] - iv[0][0]
    busy = _union_us(iv)
    gaps = [b[0] - a[1] for a, b in zip(iv, iv[1:]) if b[0] > a[1]]
    res.update(
        span_ms=span / 1e3,
        busy_ms=busy / 1e3,
        busy_fraction=busy / span if span else 0.0,
        gaps=len(gaps),
        gap_median_us=statistics.median(gaps) if gaps else 0.0,
        gap_total_ms=sum(gaps) / 1e3,
    )

    def table(evs: list[dict]) -> list[dict]:
        acc: dict[str, list[float]] = {}
        for e in evs:
            acc.setdefault(e["name"], []).append(e["dur"])
        rows = [
            dict(name=n[:120], count=len(d), total_ms=sum(d) / 1e3, median_us=statistics.median(d))
            for n, d in acc.items()
        ]
        return sorted(rows, key=lambda r: -r["total_ms"])[:top]

    res["programs"] = table(modules)
    res["ops"] = table(ops)
    return res


def report(s: dict) -> str:
    if s.get("device") is None:
        return "no accelerator timeline in the trace; threads recorded: " + json.dumps(s.get("threads"))
    lines = [f"{s['device']}: threads {s['threads']}"]
    if "span_ms" in s:
        lines.append(
            f"  span {s['span_ms']:.1f} ms, device busy {s['busy_ms']:.1f} ms ({s['busy_fraction']:.0%}); "
            f"{s['gaps']} idle gaps, median {s['gap_median_us']:.0f} us, total {s['gap_total_ms']:.1f} ms"
        )
        for title in ("programs", "ops"):
            lines.append(f"  {title} by device time:")
            for r in s[title]:
                lines.append(
                    f"    {r['total_ms']:9.2f} ms  x{r['count']:<5d} median {r['median_us']:8.1f} us  {r['name']}"
                )
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(summarize(sys.argv[1])))
