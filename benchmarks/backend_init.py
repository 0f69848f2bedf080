"""Where the first device query's seconds go (the engine's "devices" start-up phase: 8.6 s on a
TPU v5e, 2026-12-06), and whether other start-up work can run beside it.

Each variant runs in a fresh process: ``import jax``, then ``jax.devices()`` (which starts the
backend), timed apart; variants change the environment (e.g. ``JAX_PLATFORMS=tpu``: no search for
other backends). ``overlap``: a thread imports transformers (the tokenizer's 4 s import) while the
main thread starts the backend; if the backend start holds the GIL, the two add up instead of
overlapping.

    python benchmarks/backend_init.py                      # every variant, 2 runs each
    python benchmarks/backend_init.py --variants default,platforms --runs 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys, threading, time
t0 = time.perf_counter()
import jax
t1 = time.perf_counter()
side = {}
if sys.argv[1] == "overlap":
    def imp():
        s = time.perf_counter()
        import transformers  # noqa: F401
        side["import_transformers_s"] = time.perf_counter() - s
        side["import_done_at_s"] = time.perf_counter() - t1
    th = threading.Thread(target=imp)
    th.start()
devices = jax.devices()
t2 = time.perf_counter()
if sys.argv[1] == "overlap":
    th.join()
t3 = time.perf_counter()
if sys.argv[1].startswith("xfer"):
    # host -> device copies of 1 GiB of bf16 weights: whole, then in 16 pieces of 64 MiB (a layer
    # of the 1B shape's gate_up), each timed to completion, twice (the first also maps pages)
    import numpy as np
    import jax.numpy as jnp
    host = np.ones(1 << 29, jnp.bfloat16)
    for rep in (0, 1):
        s = time.perf_counter()
        jax.device_put(host).block_until_ready()
        side[f"whole_{rep}_s"] = time.perf_counter() - s
        s = time.perf_counter()
        jax.block_until_ready([jax.device_put(p) for p in np.split(host, 16)])
        side[f"pieces_{rep}_s"] = time.perf_counter() - s
print(json.dumps({"import_jax_s": t1 - t0, "devices_s": t2 - t1, "both_done_s": t3 - t1,
                  "backend": jax.default_backend(), "n": len(devices), **side}))
"""

VARIANTS = {
    "default": {},
    "platforms": {"JAX_PLATFORMS": "tpu"},
    "skip-mds": {"TPU_SKIP_MDS_QUERY": "1"},
    "overlap": {},
    # the host buffer libtpu pins at start (4 GiB by default; its set-up took 5.2 of the 5.5 s)
    "premap-256m": {"TPU_PREMAPPED_BUFFER_SIZE": str(256 << 20)},
    "premap-1g": {"TPU_PREMAPPED_BUFFER_SIZE": str(1 << 30)},
    # then 1 GiB host -> device, whole and in 64 MiB pieces, under each premapped buffer size
    "xfer-default": {},
    "xfer-256m": {"TPU_PREMAPPED_BUFFER_SIZE": str(256 << 20)},
    "xfer-512m": {"TPU_PREMAPPED_BUFFER_SIZE": str(512 << 20)},
    "xfer-1g": {"TPU_PREMAPPED_BUFFER_SIZE": str(1 << 30)},
    # libtpu's own log (its stderr, written to --log-dir): where inside the start the time goes
    "verbose": {
        "TPU_STDERR_LOG_LEVEL": "0",
        "TPU_MIN_LOG_LEVEL": "0",
        "TPU_VMODULE": "tpu_configuration_ops_impl=3",
    },
}


def run(variant: str, log_dir: str | None, i: int) -> dict:
    env = {**os.environ, **VARIANTS[variant]}
    out = subprocess.run([sys.executable, "-c", CHILD, variant], env=env, capture_output=True, text=True)
    if log_dir:
        with open(os.path.join(log_dir, f"backend_init_{variant}_{i}.stderr"), "w") as f:
            f.write(out.stderr)
    if out.returncode != 0:  # e.g. JAX_PLATFORMS=tpu on a machine without one
        return {"error": (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--json", default=None)
    p.add_argument("--log-dir", default=None, help="keep each run's stderr here")
    args = p.parse_args(argv)
    results: dict[str, list[dict]] = {}
    for v in args.variants.split(","):
        results[v] = [run(v, args.log_dir, i) for i in range(args.runs)]
        ok = [r for r in results[v] if "error" not in r]
        if not ok:
            print(f"{v:10s} failed: {results[v][0]['error']}", flush=True)
            continue
        keys = [k for k in ok[0] if k.endswith("_s")]
        med = {k: statistics.median(r[k] for r in ok) for k in keys}
        print(f"{v:10s} " + "  ".join(f"{k} {x:6.2f}" for k, x in med.items()), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
