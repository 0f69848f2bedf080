"""Is the KV cache updated in place on the device, and what does a step's program need besides it?

For each model shape (random weights built in memory: shapes only matter) and KV cache size, builds
the ModelRunner as the engine does and reports, for the compiled step program of a few token
buckets: the cache's device layout, ``memory_analysis()`` (temporaries, aliased bytes) next to the
cache's size, every instruction of the optimized HLO that produces a cache-sized array other than
in place (copies, transposes, fusions), and the time of one step with no sequences, which should
not depend on the cache's size. A kernel-only probe does the same for the attention kernel alone.

    python benchmarks/tpu_memory.py --out /tmp/tpu_memory.json             # on the TPU machine
    python benchmarks/tpu_memory.py --smoke                                # CPU, tiny shapes

Runs on CPU too (the TPU kernel then runs interpreted), where the numbers only check the script.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

# Model shapes (HF config keys); vocabulary and the rest follow SmolLM2's config.
SHAPES = {
    "smollm2-135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        rope_theta=100000.0,
    ),
    "llama-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        rope_theta=500000.0,
    ),
    "smollm2-1.7b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=24,
        num_attention_heads=32,
        num_key_value_heads=32,
        head_dim=64,
        rope_theta=130000.0,
    ),
    "llama-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rope_theta=500000.0,
    ),
    "tiny": dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        rope_theta=10000.0,
        vocab_size=512,
    ),
}


def hf_config(name: str) -> dict:
    cfg = dict(
        architectures=["LlamaForCausalLM"],
        vocab_size=49152,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
    )
    cfg.update(SHAPES[name])
    return cfg


def random_params(arch, dtype):
    """The decoder's parameter tree for ``arch`` filled with small constants (values do not matter
    for memory or time)."""
    from tpuserve.tpu_platform.models.weights import build_params

    hq, hkv, d, h, f = (
        arch.num_heads,
        arch.num_kv_heads,
        arch.head_dim,
        arch.hidden_size,
        arch.intermediate_size,
    )
    shapes = {
        "q_proj": (hq * d, h),
        "k_proj": (hkv * d, h),
        "v_proj": (hkv * d, h),
        "o_proj": (h, hq * d),
        "gate_proj": (f, h),
        "up_proj": (f, h),
        "down_proj": (h, f),
    }

    def get(name):
        if name == "model.embed_tokens.weight":
            shape = (arch.vocab_size, h)
        elif name.endswith("norm.weight"):
            shape = (d,) if ("q_norm" in name or "k_norm" in name) else (h,)
        elif name.endswith(".weight") and name.split(".")[-2] in shapes:
            shape = shapes[name.split(".")[-2]]
        else:
            return None
        return np.broadcast_to(np.float32(0.01), shape)

    return build_params(arch, get, dtype)


def cache_lines(hlo: str, cache_elems: int) -> list[str]:
    """Instructions of an optimized HLO module whose result holds as many elements as the whole
    cache, excluding parameters, bitcasts, tuples and the in-place custom call itself."""
    out = []
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?[\w.\-]+ = (\w+)\[([\d,]*)\]\{[^}]*\} (\S+?)\(", line)
        if not m:
            continue
        dims = [int(x) for x in m.group(2).split(",") if x]
        if not dims or int(np.prod(dims)) != cache_elems:
            continue
        op = m.group(3)
        if op in ("parameter", "bitcast", "get-tuple-element", "tuple"):
            continue
        out.append(line.strip()[:400])
    return out


def memory_stats(compiled) -> dict:
    ma = compiled.memory_analysis()
    if ma is None:
        return {}
    return {
        k: int(getattr(ma, k))
        for k in (
            "argument_size_in_bytes",
            "output_size_in_bytes",
            "alias_size_in_bytes",
            "temp_size_in_bytes",
            "generated_code_size_in_bytes",
        )
    }


def median_ms(fn, iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def auto_layout_step(runner, args) -> dict:
    """The same step compiled with the cache's layout left to the compiler (Layout.AUTO)."""
    import functools

    from jax.experimental.layout import Format, Layout

    try:
        fn = jax.jit(
            functools.partial(runner._traced_step, inv_freq=jnp.asarray(runner.arch.inv_freq())),
            donate_argnums=(1,),
            static_argnums=(4,),
            in_shardings=(None, Format(Layout.AUTO)) + (None,) * (len(args) - 3),
            out_shardings=(None, None, None, None, Format(Layout.AUTO)),
        )
        abstract = jax.ShapeDtypeStruct(args[1].shape, args[1].dtype)
        c = fn.lower(args[0], abstract, *args[2:]).compile()
        return dict(
            memory=memory_stats(c),
            cache_in_format=str(c.input_formats[0][1]),
            cache_copies=cache_lines(c.as_text(), int(np.prod(abstract.shape))),
        )
    except Exception as e:
        return dict(error=repr(e)[:2000])


def runner_case(
    name: str,
    num_pages: int,
    loop: str,
    impl: str,
    token_buckets,
    iters: int,
    dump_dir: str | None,
    max_num_seqs: int,
    auto_layout: bool = False,
    abstract_pages=(),
    movers: int = 0,
) -> dict:
    from tpuserve.tpu_platform.config import EngineConfig
    from tpuserve.tpu_platform.device import discover, resolve_dtype
    from tpuserve.tpu_platform.model_runner import ModelRunner
    from tpuserve.tpu_platform.models.arch import ModelArch

    device = discover()
    dtype = resolve_dtype("auto", device)
    arch = ModelArch.from_hf_config(hf_config(name))
    max_len = 2048 if name != "tiny" else 256
    cfg = EngineConfig.from_kwargs(
        attention_impl=impl,
        layer_loop=loop,
        max_num_seqs=max_num_seqs,
        max_model_len=max_len,
        max_num_batched_tokens=max(token_buckets),
    )
    t0 = time.perf_counter()
    runner = ModelRunner(cfg, arch, random_params(arch, dtype), device, dtype, None, max_len)
    plan = None
    if num_pages == 0:  # the largest cache the memory plan allows at 0.9 of the device
        from tpuserve.tpu_platform.worker import plan_memory

        weights = sum(x.nbytes for x in jax.tree_util.tree_leaves(runner.params))
        plan = plan_memory(
            EngineConfig.from_kwargs(
                gpu_memory_utilization=0.9,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max(token_buckets),
            ),
            memory_bytes=device.memory_bytes,
            weight_bytes=weights,
            step_bytes=runner.step_memory(),
            vocab_size=arch.vocab_size,
        )
        num_pages = plan.kv_cache // runner._cache_spec(1).page_bytes(runner.attn_impl)
        print("plan:", plan.describe(), "->", num_pages, "pages", flush=True)
    runner.allocate_kv_cache(num_pages)
    kv = runner.kv_cache
    res = dict(
        model=name,
        num_pages=num_pages,
        layer_loop=runner.layer_loop,
        impl=runner.attn_impl,
        cache_shape=list(kv.shape),
        cache_dtype=str(kv.dtype),
        cache_bytes=int(kv.nbytes),
        cache_format=str(getattr(kv, "format", None)),
        build_s=time.perf_counter() - t0,
        plan=None if plan is None else plan.describe(),
        steps=[],
    )
    for t in token_buckets:
        b = runner._empty_batch(t, runner.page_buckets[0])
        args = runner.step_args(b)
        t1 = time.perf_counter()
        compiled = runner._step.lower(*args).compile()
        step = dict(
            tokens=t,
            pages_per_seq=runner.page_buckets[0],
            compile_s=time.perf_counter() - t1,
            memory=memory_stats(compiled),
        )
        try:
            step["cache_in_format"] = str(compiled.input_formats[0][1])
            step["cache_out_format"] = str(jax.tree.leaves(compiled.output_formats)[-1])
        except Exception as e:
            step["formats_error"] = repr(e)
        hlo = compiled.as_text()
        step["cache_copies"] = cache_lines(hlo, int(np.prod(kv.shape)))
        if dump_dir and t == token_buckets[0]:
            fn = os.path.join(dump_dir, f"{name}_p{num_pages}_{runner.layer_loop}_t{t}.hlo.gz")
            with gzip.open(fn, "wt") as f:
                f.write(hlo)

        def empty_step(runner=runner, b=b):
            runner.forward(b)
            jax.block_until_ready(runner.kv_cache)

        step["empty_step_ms"] = median_ms(empty_step, iters)
        if auto_layout:
            step["auto_layout"] = auto_layout_step(runner, args)
        for n in abstract_pages:  # memory of the same program over a bigger cache, not allocated
            big = jax.ShapeDtypeStruct((kv.shape[0], n) + kv.shape[2:], kv.dtype)
            c = runner._step.lower(args[0], big, *args[2:]).compile()
            step.setdefault("abstract", []).append(
                dict(
                    num_pages=n,
                    cache_bytes=int(np.prod(big.shape)) * kv.dtype.itemsize,
                    memory=memory_stats(c),
                )
            )
        res["steps"].append(step)
        print(json.dumps({k: v for k, v in step.items() if k != "cache_copies"}), flush=True)
        for line in step["cache_copies"][:6]:
            print("   cache-sized:", line[:240], flush=True)
    if movers:
        res["movers"] = mover_case(runner, movers, iters)
        print(json.dumps(res["movers"]), flush=True)
    del runner
    return res


def mover_case(runner, n: int, iters: int) -> dict:
    """The page movers on the runner's own cache: the host-tier load and the P/D import of ``n`` pages.

    Each is a donated scatter into the whole cache; on the chip it must stay in place (temporaries
    far below the cache, the cache's format unchanged), like the step.
    """
    from tpuserve.kv_cache.host_tier import HostPagePool
    from tpuserve.kv_cache.layout import stage_for
    from tpuserve.kv_cache.transfer.device_pages import DevicePageMover

    kv = runner.kv_cache
    before = str(getattr(kv, "format", None))
    L = kv.shape[0]
    pages = list(range(1, n + 1))
    idx = jnp.asarray(np.asarray(pages, np.int32))
    res = dict(pages=n, cache_bytes=int(kv.nbytes))
    pool = HostPagePool(n, (L, *kv.shape[2:]), kv.dtype)
    pool.save(kv, list(range(n)), pages)
    pool.wait()
    staged = stage_for(kv, np.zeros((n, L, *kv.shape[2:]), np.dtype(kv.dtype)))
    res["host_load_memory"] = memory_stats(pool._scatter_for(kv).lower(kv, staged, idx).compile())

    def host_load():
        runner.kv_cache = pool.load(runner.kv_cache, list(range(n)), pages)
        jax.block_until_ready(runner.kv_cache)

    res["host_load_ms"] = median_ms(host_load, iters)
    res["format_after_host_load"] = str(getattr(runner.kv_cache, "format", None))
    mover = DevicePageMover()
    host = mover.gather(runner.kv_cache, pages).numpy()

    def import_pages():
        runner.kv_cache = mover.scatter(runner.kv_cache, host, pages)
        jax.block_until_ready(runner.kv_cache)

    res["pd_import_ms"] = median_ms(import_pages, iters)
    staged = stage_for(runner.kv_cache, np.zeros_like(host))
    res["pd_import_memory"] = memory_stats(mover._scatter.lower(runner.kv_cache, staged, idx).compile())
    res["format_after_pd_import"] = str(getattr(runner.kv_cache, "format", None))
    res["format_kept"] = res["format_after_host_load"] == before == res["format_after_pd_import"]
    return res


def kernel_case(
    num_layers: int,
    num_pages: int,
    page_size: int,
    combined: int,
    head_dim: int,
    dtype,
    iters: int,
    interpret,
    auto: bool = False,
) -> dict:
    """The attention kernel alone on a donated stacked cache: an empty step (no sequences)."""
    from tpuserve.attention.pallas_tpu import ragged_paged_attention_tpu_stacked

    hkv = combined // 2
    t, s, pps = 8, 8, 4
    q = jnp.zeros((t, 4 * hkv, head_dim), dtype)
    new_kv = jnp.zeros((t, 2 * hkv, head_dim), dtype)
    z = jnp.zeros((s,), jnp.int32)
    md = (z, jnp.zeros((s, pps), jnp.int32), jnp.zeros((s + 1,), jnp.int32), jnp.zeros((1,), jnp.int32))

    def run(cache, q, new_kv, layer, *md):
        return ragged_paged_attention_tpu_stacked(
            q, new_kv, cache, layer, *md, sm_scale=0.1, interpret=interpret
        )

    kw = {}
    if auto:
        from jax.experimental.layout import Format, Layout

        kw = dict(
            in_shardings=(Format(Layout.AUTO),) + (None,) * 7, out_shardings=(None, Format(Layout.AUTO))
        )
    fn = jax.jit(run, donate_argnums=(0,), **kw)
    shape = (num_layers, num_pages, page_size, combined, head_dim)
    compiled = fn.lower(jax.ShapeDtypeStruct(shape, dtype), q, new_kv, jnp.int32(1), *md).compile()
    cache = jnp.zeros(shape, dtype)
    if auto:
        cache = jax.device_put(cache, compiled.input_formats[0][0])
    res = dict(
        cache_shape=list(cache.shape),
        dtype=str(jnp.dtype(dtype)),
        cache_bytes=int(cache.nbytes),
        cache_format=str(getattr(cache, "format", None)),
        auto_layout=auto,
        compiled_in_format=str(compiled.input_formats[0][0]),
    )
    res["memory"] = memory_stats(compiled)
    res["cache_copies"] = cache_lines(compiled.as_text(), int(np.prod(cache.shape)))
    state = [cache]

    def once():
        out, state[0] = compiled(state[0], q, new_kv, jnp.int32(1), *md)
        jax.block_until_ready(state[0])

    res["ms"] = median_ms(once, iters)
    res["cache_format_after"] = str(state[0].format)
    print(json.dumps({k: v for k, v in res.items() if k != "cache_copies"}), flush=True)
    for line in res["cache_copies"][:4]:
        print("   cache-sized:", line[:240], flush=True)
    return res


def llm_case(
    model: str,
    util: float,
    max_num_seqs: int,
    warmup: bool,
    batches,
    prompt_len: int,
    new_tokens: int,
    kv_cache_dtype: str = "auto",
) -> dict:
    """The public API as a user runs it: LLM(model, bf16, gpu_memory_utilization=util,
    max_num_seqs, kv_cache_dtype) warmed up, then batches of prompt_len random prompt tokens x
    new_tokens greedy tokens (ignore_eos); device memory in use and at peak; an empty step at this
    cache, and that step program's temporaries and whole-cache copies (an FP8 cache's path too)."""
    from tpuserve import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(
        model,
        dtype="bfloat16",
        gpu_memory_utilization=util,
        max_num_seqs=max_num_seqs,
        warmup=warmup,
        kv_cache_dtype=kv_cache_dtype,
    )
    ready = time.perf_counter() - t0
    engine = llm.engine
    runner, worker = engine.runner, engine.worker
    res = dict(
        model=model,
        util=util,
        max_num_seqs=max_num_seqs,
        kv_cache_dtype=kv_cache_dtype,
        attention_impl=str(runner.attn_impl),
        ready_s=ready,
        plan=None if worker._plan is None else worker._plan.describe(),
        num_pages=runner.kv_spec.num_pages,
        cache_bytes=int(runner.kv_cache.nbytes),
        cache_format=str(runner.kv_cache.format),
        compiled=runner.compile_count,
        memory_after_ready=jax.devices()[0].memory_stats(),
        runs=[],
    )
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for b in batches:
        prompts = [{"prompt_token_ids": rng.integers(100, 30000, prompt_len).tolist()} for _ in range(b)]
        t1 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t1
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        res["runs"].append(
            dict(
                batch=b,
                wall_s=wall,
                tokens=n,
                tok_s=n / wall,
                errors=sum(1 for o in outs if getattr(o, "error", None)),
            )
        )
        print(json.dumps(res["runs"][-1]), flush=True)
    b = runner._empty_batch(1, runner.page_buckets[0])

    def empty_step():
        runner.forward(b)
        jax.block_until_ready(runner.kv_cache)

    res["empty_step_ms"] = median_ms(empty_step, 20)
    res["compiled_after"] = runner.compile_count
    # The step program over this cache: its temporaries against the cache, and any whole-cache copy.
    compiled = runner._step.lower(*runner.step_args(b)).compile()
    res["step_memory"] = memory_stats(compiled)
    res["step_cache_copies"] = cache_lines(compiled.as_text(), int(np.prod(runner.kv_cache.shape)))
    res["memory_end"] = jax.devices()[0].memory_stats()
    stats = res["memory_end"] or {}
    brief = ("runs", "memory_after_ready", "step_cache_copies")
    print(json.dumps({k: v for k, v in res.items() if k not in brief}), flush=True)
    ops = [re.search(r"\} (\S+?)\(", line) for line in res["step_cache_copies"]]
    print(
        f"step over the cache ({res['cache_bytes'] / 2**30:.2f} GiB): temporaries "
        f"{res['step_memory'].get('temp_size_in_bytes', 0) / 2**20:.1f} MiB, whole-cache ops by kind "
        f"{dict(collections.Counter(m.group(1) if m else '?' for m in ops))}",
        flush=True,
    )
    if stats:
        print(
            f"peak HBM {stats.get('peak_bytes_in_use', 0) / 2**30:.2f} GiB of "
            f"{stats.get('bytes_limit', 0) / 2**30:.2f} GiB",
            flush=True,
        )
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--dump-hlo", default=None, help="folder for the optimized HLO of each step")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--models", default="llama-1b")
    p.add_argument(
        "--pages",
        default="256,0",
        help="KV pages per case; 0: the largest the memory plan allows at gpu_memory_utilization 0.9",
    )
    p.add_argument("--loops", default="scan,unroll")
    p.add_argument("--tokens", default="1,128")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--kernel-probe", action="store_true")
    p.add_argument(
        "--movers", type=int, default=0, help="also time the host-tier load and P/D import of this many pages"
    )
    p.add_argument(
        "--auto-layout",
        action="store_true",
        help="also compile each step with the cache layout left to the compiler",
    )
    p.add_argument(
        "--abstract-pages",
        default="",
        help="also compile each step over caches of these page counts (not allocated)",
    )
    p.add_argument("--llm", default=None, help="model directory: run the LLM acceptance instead")
    p.add_argument("--util", type=float, default=0.9)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--batches", default="1,128")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--kv-cache-dtype", default="auto", help="with --llm: auto or fp8")
    args = p.parse_args(argv)
    if args.llm:
        res = llm_case(
            args.llm,
            args.util,
            args.max_num_seqs,
            not args.no_warmup,
            [int(x) for x in args.batches.split(",")],
            args.prompt_len,
            args.new_tokens,
            args.kv_cache_dtype,
        )
        if args.out:
            with open(args.out, "w") as f:
                json.dump(
                    dict(device=jax.devices()[0].device_kind, jax=jax.__version__, command=sys.argv, llm=res),
                    f,
                    indent=1,
                )
        return 0
    backend = jax.default_backend()
    interpret = None
    impl = "pallas_tpu"
    if backend != "tpu":
        from tpuserve.attention.dispatch import TPU_INTERPRET_PARAMS

        interpret, impl = TPU_INTERPRET_PARAMS, "pallas_tpu_interpret"
    if args.smoke:
        args.models, args.pages, args.tokens, args.iters = "tiny", "16,64", "1,8", 2
    if args.dump_hlo:
        os.makedirs(args.dump_hlo, exist_ok=True)
    out = dict(
        device=jax.devices()[0].device_kind, jax=jax.__version__, command=sys.argv, cases=[], kernel=[]
    )
    tokens = [int(x) for x in args.tokens.split(",")]
    for name in args.models.split(","):
        for loop in args.loops.split(","):
            for pages in (int(x) for x in args.pages.split(",")):
                out["cases"].append(
                    runner_case(
                        name,
                        pages,
                        loop,
                        impl,
                        tokens,
                        args.iters,
                        args.dump_hlo,
                        max_num_seqs=128,
                        auto_layout=args.auto_layout,
                        movers=args.movers,
                        abstract_pages=[int(x) for x in args.abstract_pages.split(",") if x],
                    )
                )
    # The ratio that says whether a step's cost follows the cache size: largest / smallest cache.
    by_key: dict = {}
    for case in out["cases"]:
        for step in case["steps"]:
            key = (case["model"], case["layer_loop"], step["tokens"])
            by_key.setdefault(key, []).append(
                (case["num_pages"], step["empty_step_ms"], step["memory"].get("temp_size_in_bytes", 0))
            )
    for (model, loop, t), rows in by_key.items():
        rows.sort()
        cells = ", ".join(f"{p} pages {ms:.2f} ms (temp {tmp / 2**20:.1f} MiB)" for p, ms, tmp in rows)
        ratio = f"; largest / smallest cache {rows[-1][1] / rows[0][1]:.2f}x" if len(rows) > 1 else ""
        print(f"{model} {loop} t={t}: {cells}{ratio}", flush=True)
    if args.kernel_probe:
        bf16 = jnp.bfloat16 if backend == "tpu" else jnp.float32
        small = 64 if args.smoke else None
        probes = [  # (layers, pages, page_size, C, D, dtype)
            (16, small or 4097, 16, 16, 64, bf16),  # the Llama-1B cache
            (16, small or 256, 16, 16, 64, bf16),
            (16, small or 4097, 1, 256, 64, bf16),  # same bytes, page view already 2-D
            (16, small or 2048, 16, 16, 128, bf16),  # head_dim 128, same bytes
            (16, small or 2048, 16, 16, 64, jnp.float32),
        ]
        probes = [(p, False) for p in probes] + [(probes[0], True), (probes[2], True)]
        for probe, auto in probes:
            try:
                out["kernel"].append(kernel_case(*probe, iters=args.iters, interpret=interpret, auto=auto))
            except Exception as e:
                print("probe", probe, "failed:", repr(e)[:400], flush=True)
                out["kernel"].append(dict(probe=str(probe), error=repr(e)[:2000]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
