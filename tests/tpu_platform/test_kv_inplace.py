"""The KV cache stays in one device format and is updated in place; the memory plan is measured.

On a TPU v5e the compiled kernel needs the cache row-major, while XLA, left to itself, laid a
head_dim-64 cache out with the page axis minor-most: every step copied the whole cache into the
kernel's layout and back (benchmarks/RESULTS.md, "KV cache in place on a TPU v5e"). The chip is
where that shows; these tests guard the mechanism on CPU:

* the step program lowered for TPU takes the cache donated and pinned row-major, and returns it
  pinned the same way (``mhlo.layout_mode`` on the argument and the result);
* programs that return an updated cache (host-tier and P/D page movers) keep the format the cache
  came in. A CPU cache can be placed in a non-default layout, which an unpinned program does not
  keep - the TPU failure in miniature;
* the memory plan subtracts what the compiled step programs need, and refuses clearly.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.layout import Format, Layout
from tiny_models import tiny_model

from tpuserve.kv_cache.host_tier import HostPagePool
from tpuserve.kv_cache.layout import cache_out_format, gathered_table_format, kv_cache_format
from tpuserve.kv_cache.transfer.device_pages import DevicePageMover, moves_bits, page_gather, page_scatter
from tpuserve.tpu_platform import model_runner
from tpuserve.tpu_platform.config import ConfigError, EngineConfig
from tpuserve.tpu_platform.device import DeviceInfo
from tpuserve.tpu_platform.model_runner import ModelRunner
from tpuserve.tpu_platform.worker import plan_memory

pytestmark = pytest.mark.timeout(300)

TPU = DeviceInfo("tpu", 1, "TPU v5 lite", 16 << 30)
GIB = 1 << 30


def _runner(impl: str, loop: str = "scan", device=TPU, num_pages=None, kv_scales=None, quantize=None, **kw):
    arch, _, params = tiny_model(
        "llama", layers=2, hidden=128, heads=4, kv_heads=2, head_dim=64, ffn=256, vocab=512
    )
    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    if quantize is not None:  # the layers' matmuls as quantized records
        from tpuserve.tpu_platform.models.quantize import quantize_params

        params, _ = quantize_params(params, quantize)
    cfg = EngineConfig.from_kwargs(
        attention_impl=impl,
        layer_loop=loop,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=256,
        **kw,
    )
    kv_dtype = jnp.float8_e4m3fn if kw.get("kv_cache_dtype") == "fp8" else None
    return ModelRunner(
        cfg, arch, params, device, jnp.bfloat16, num_pages, 256, kv_cache_dtype=kv_dtype, kv_scales=kv_scales
    )


def test_kv_cache_format_is_row_major_for_the_compiled_tpu_kernel_only():
    cpu = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    fmt = kv_cache_format("pallas_tpu", jnp.bfloat16, cpu)
    assert fmt.layout.major_to_minor == (0, 1, 2, 3, 4)
    assert fmt.layout.tiling == ((8, 128), (2, 1))  # as a v5e reports a bf16 array's format
    assert kv_cache_format("pallas_tpu", jnp.float32, cpu).layout.tiling == ((8, 128),)
    for impl in ("reference", "blocked", "pallas_gpu", "pallas_tpu_interpret"):
        assert kv_cache_format(impl, jnp.bfloat16, cpu) is None


def test_gathered_table_is_placed_row_major_for_the_compiled_tpu_kernel_only():
    """XLA:TPU laid gpt-oss's [201088, 2880] embedding out V-minor (2880 is no lane multiple) and
    every step copied it whole before the row gather; with the TPU kernel it is re-placed
    row-major. A quantized record or another impl: left alone. (A table already row-major in
    TPU tiles, also left alone, cannot be made on a CPU device.)"""
    table = jnp.zeros((512, 72), jnp.bfloat16)
    fmt = gathered_table_format("pallas_tpu", table)
    assert fmt.layout.major_to_minor == (0, 1) and fmt.layout.tiling == ((8, 128), (2, 1))
    assert fmt.sharding == table.sharding
    for impl in ("reference", "blocked", "pallas_gpu", "pallas_tpu_interpret"):
        assert gathered_table_format(impl, table) is None
    assert gathered_table_format("pallas_tpu", {"packed": table}) is None
    placed = jax.device_put(table, Format(Layout(major_to_minor=(1, 0)), table.sharding))
    assert gathered_table_format("pallas_tpu", placed).layout == fmt.layout


def test_runner_re_places_the_embedding_once_for_both_layer_trees(monkeypatch):
    """The runner hands the re-placed table to the unrolled layers and to the quick tier's stacked
    tree alike (one array, not two copies). The format here is a CPU column-major one standing in
    for the TPU row-major format, which a CPU device cannot hold."""
    col_major = []

    def fake(impl, table):
        col_major.append(impl)
        return Format(Layout(major_to_minor=(1, 0)), table.sharding)

    monkeypatch.setattr(model_runner, "gathered_table_format", fake)
    r = _runner("blocked", "unroll")
    assert col_major == ["blocked"]
    embed = r.params["embed"]
    assert embed.format.layout.major_to_minor == (1, 0)
    assert r._quick is not None and r._quick[0]["embed"] is embed


def test_step_memory_compiles_against_a_two_page_cache(monkeypatch):
    """The profile forward's cache is a two-page stand-in whatever max_model_len is: at p + 1
    pages gpt-oss-20b's 131k-token cache (12 GiB) went into the compile beside its 12.8 GiB of
    weights, and XLA:TPU refused it as over HBM."""
    r = _runner("blocked", "unroll", device=DeviceInfo("cpu", 1, "cpu", None))
    assert r.page_buckets[-1] > 2
    seen = {}
    real = r._compiled

    def spy(name, jitted, args):
        seen[name] = args
        return real(name, jitted, args)

    monkeypatch.setattr(r, "_compiled", spy)
    assert r.step_memory()["forward"] > 0
    cache = seen["forward"][1]
    assert cache.shape == r._cache_spec(2).shape_for("blocked") and cache.shape[1] == 2


@pytest.mark.parametrize("loop", ["scan", "unroll"])
def test_tpu_step_takes_and_returns_the_cache_row_major_and_donated(loop):
    r = _runner("pallas_tpu", loop)  # no cache allocated: a TPU-format array cannot live on CPU
    assert r.kv_cache is None and r.kv_format is not None
    b = r._empty_batch(8, r.page_buckets[0])
    shape = r._cache_spec(64).shape_for(r.attn_impl)
    cache = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    args = r.step_args(b, kv_cache=cache)
    text = r._step.trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    main = next(line for line in text.splitlines() if "func.func public @main" in line)
    cache_type = "tensor<" + "x".join(map(str, shape)) + "xbf16>"
    row_major = 'mhlo.layout_mode = "{4,3,2,1,0:T(8,128)(2,1)}"'
    args, results = main.split("->", 1)
    # The cache argument's attributes run to the next argument.
    arg = re.search(re.escape(cache_type) + r" \{(.*?)(?:, %arg\d+:|\)$)", args)
    assert arg and row_major in arg.group(1) and "tf.aliasing_output" in arg.group(1), args
    assert re.search(re.escape(cache_type) + r" \{[^{]*" + re.escape(row_major), results), results
    assert "tpu_custom_call" in text  # the kernel is what updates it


def _moved_format_case(mover: str):
    """A committed CPU cache in a non-default layout through one load / import."""
    shape = (2, 16, 4, 4, 8)
    fmt = Format(Layout(major_to_minor=(1, 0, 2, 3, 4)), jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    kv = jax.jit(lambda: jnp.zeros(shape, jnp.float32), out_shardings=fmt)()
    assert kv.committed and cache_out_format(kv) == kv.format
    pages = np.arange(2 * 2 * 4 * 4 * 8, dtype=np.float32).reshape(2, 2, 4, 4, 8)
    if mover == "host_tier":
        pool = HostPagePool(4, (2, 4, 4, 8), kv.dtype)
        pool.save(jnp.zeros(shape, jnp.float32).at[:, 3:5].set(pages), [0, 1], [3, 4])
        pool.wait()
        out = pool.load(kv, [0, 1], [5, 6])
    else:
        out = DevicePageMover().scatter(kv, pages, [5, 6])
    return kv, out, fmt, pages


@pytest.mark.parametrize("mover", ["host_tier", "device_pages"])
def test_page_movers_keep_the_caches_format_and_update_it_in_place(mover):
    kv, out, fmt, pages = _moved_format_case(mover)
    assert kv.is_deleted()  # donated
    # An unpinned scatter would return it row-major here.
    assert out.format.layout.major_to_minor == fmt.layout.major_to_minor and out.committed
    np.testing.assert_array_equal(np.asarray(out)[:, 5:7], pages)


def _tpu_text(fn, *shapes) -> str:
    exported = jax.export.export(jax.jit(fn), platforms=["tpu"])(*shapes)
    return exported.mlir_module()


def test_pd_page_movers_do_not_bitcast_the_cache_on_tpu():
    """A bitcast of the whole bf16 cache to uint16 changed its tiled layout on a v5e: the P/D
    gather needed 23.5 GB of temporaries for an 11.7 GB cache. Bits move on XLA:CPU only."""
    assert moves_bits(jnp.bfloat16, "cpu") and not moves_bits(jnp.bfloat16, "tpu")
    assert not moves_bits(jnp.float32, "cpu")
    cache = jax.ShapeDtypeStruct((2, 64, 16, 4, 128), jnp.bfloat16)
    pages = jax.ShapeDtypeStruct((2, 4, 16, 4, 128), jnp.bfloat16)
    idx = jax.ShapeDtypeStruct((4,), jnp.int32)
    for as_bits, want in ((moves_bits(jnp.bfloat16, "tpu"), 0), (True, 1)):  # True: the test can fail
        g = _tpu_text(lambda kv, i: page_gather(kv, i, as_bits), cache, idx)
        s = _tpu_text(lambda kv, p, i: page_scatter(kv, p, i, as_bits), cache, pages, idx)
        assert min(1, g.count("bitcast_convert")) == want and min(1, s.count("bitcast_convert")) == want


def step_cache_analysis(r, num_pages: int):
    """XLA's memory analysis of the runner's step compiled over an abstract ``num_pages`` cache,
    and that cache's bytes."""
    t, p = r.token_buckets[0], r.page_buckets[0]
    batch = r._empty_batch(t, p)
    spec = r._cache_spec(num_pages)
    cache = jax.ShapeDtypeStruct(spec.shape_for(r.attn_impl), spec.dtype, sharding=r._kv_sharding)
    args = r.step_args(batch, kv_cache=cache)
    compiled = r._step.lower(*args).compile()
    return compiled.memory_analysis(), int(np.prod(cache.shape)) * jnp.dtype(cache.dtype).itemsize


@pytest.mark.parametrize("impl", ["reference", "blocked"])
def test_fp8_cache_is_read_and_written_in_place_on_cpu(impl):
    """XLA:CPU widens an fp8 gather's or scatter's whole operand: reading a layer's pages cost a
    2-byte copy of the entire cache every layer, and the write (a uint8 scatter between two
    bitcasts of the cache) a 1-byte one. Stored as uint8 on CPU (kv_storage_dtype), the cache is
    read and written in place: the step's temporaries do not grow with it, as for an f32 cache.

    Measured (temporaries' growth / the cache's, 64 -> 1,024 pages): 0.0 for both impls; fp8
    storage gave 1.0 (reference) and 2.0 (blocked), before the uint8 reads 2.0 and 3.0."""
    cpu = DeviceInfo("cpu", 1, "cpu", None)
    arch, _, params = tiny_model(
        "llama", layers=2, hidden=128, heads=4, kv_heads=2, head_dim=64, ffn=256, vocab=512
    )
    cfg = EngineConfig.from_kwargs(
        attention_impl=impl, layer_loop="scan", max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256
    )
    r = ModelRunner(
        cfg,
        arch,
        params,
        cpu,
        jnp.float32,
        None,
        256,
        kv_cache_dtype=jnp.float8_e4m3fn,
        kv_scales=(0.05, 0.05),
    )
    assert r.kv_cache_dtype == jnp.float8_e4m3fn and r.kv_storage_dtype == jnp.uint8
    small, small_bytes = step_cache_analysis(r, 64)
    big, big_bytes = step_cache_analysis(r, 1024)
    assert big.alias_size_in_bytes >= big_bytes and small.alias_size_in_bytes >= small_bytes
    grown = big.temp_size_in_bytes - small.temp_size_in_bytes
    assert grown <= 0.1 * (big_bytes - small_bytes), (grown, big_bytes - small_bytes)


@pytest.mark.parametrize("loop", ["scan", "unroll"])
def test_tpu_step_runs_an_fp8_cache_in_the_kernel_in_place(loop):
    """On a TPU an FP8 cache is stored as its uint8 bytes (kv_storage_dtype) and "auto" runs it on
    the compiled kernel, which decodes the codes in VMEM: the step lowered for TPU takes the uint8
    cache donated and pinned row-major in the 8-bit tiling, returns it pinned the same way, and the
    kernel is what updates it (the same in-place mechanism as bf16's)."""
    r = _runner("auto", loop, kv_cache_dtype="fp8", kv_scales=(0.05, 0.05))
    assert r.attn_impl == "pallas_tpu" and r.kv_storage_dtype == jnp.uint8
    assert r.kv_cache_dtype == jnp.float8_e4m3fn
    b = r._empty_batch(8, r.page_buckets[0])
    spec = r._cache_spec(64)
    shape = spec.shape_for(r.attn_impl)
    assert shape[3:] == (8, 128)  # head_dim 64: lane-packed, 2 KV heads' [K | V] rows padded to 8
    cache = jax.ShapeDtypeStruct(shape, spec.dtype)
    text = r._step.trace(*r.step_args(b, kv_cache=cache)).lower(lowering_platforms=("tpu",)).as_text()
    main = next(line for line in text.splitlines() if "func.func public @main" in line)
    cache_type = "tensor<" + "x".join(map(str, shape)) + "xui8>"
    row_major = 'mhlo.layout_mode = "{4,3,2,1,0:T(8,128)(4,1)}"'
    args, results = main.split("->", 1)
    arg = re.search(re.escape(cache_type) + r" \{(.*?)(?:, %arg\d+:|\)$)", args)
    assert arg and row_major in arg.group(1) and "tf.aliasing_output" in arg.group(1), args
    assert re.search(re.escape(cache_type) + r" \{[^{]*" + re.escape(row_major), results), results
    assert "tpu_custom_call" in text


def test_tpu_reference_step_reads_the_fp8_bytes_and_lowers():
    """The jnp reference asked for by name on a TPU reads the same uint8 storage (gathering bytes,
    bitcasting only the gathered pages) and its step still lowers with the cache donated."""
    r = _runner("reference", kv_cache_dtype="fp8", kv_scales=(0.05, 0.05))
    assert r.attn_impl == "reference" and r.kv_storage_dtype == jnp.uint8
    b = r._empty_batch(8, r.page_buckets[0])
    spec = r._cache_spec(64)
    cache = jax.ShapeDtypeStruct(spec.shape_for(r.attn_impl), spec.dtype)
    text = r._step.trace(*r.step_args(b, kv_cache=cache)).lower(lowering_platforms=("tpu",)).as_text()
    main = next(line for line in text.splitlines() if "func.func public @main" in line)
    cache_type = "tensor<" + "x".join(map(str, spec.shape_for(r.attn_impl))) + "xui8>"
    arg = re.search(re.escape(cache_type) + r" \{(.*?)(?:, %arg\d+:|\)$)", main.split("->", 1)[0])
    assert arg and "tf.aliasing_output" in arg.group(1), main


def test_uncommitted_cache_keeps_the_compilers_choice():
    kv = jnp.zeros((2, 16, 4, 4, 8))
    assert not kv.committed and cache_out_format(kv) is None


def test_step_memory_is_measured_without_a_cache_then_allocated_once():
    r = _runner("blocked", "unroll", device=DeviceInfo("cpu", 1, "cpu", None))
    step = r.step_memory()
    assert step["forward"] > 0 and step["prompt_logits"] > 0
    # The LM head over the widest step holds its [T, V] f32 logits at least.
    assert step["prompt_logits"] >= 64 * 512 * 4
    r.allocate_kv_cache(16)
    assert r.kv_cache.shape == r.kv_spec.shape_for("blocked") and r.kv_spec.num_pages == 16
    with pytest.raises(RuntimeError, match="already allocated"):
        r.allocate_kv_cache(16)


def _cfg(**kw):
    return EngineConfig.from_kwargs(max_num_seqs=128, **kw)


def test_memory_plan_subtracts_measured_step_needs():
    plan = plan_memory(
        _cfg(gpu_memory_utilization=0.9),
        memory_bytes=16 * GIB,
        weight_bytes=2 * GIB,
        step_bytes={"forward": GIB, "prompt_logits": GIB // 2},
        vocab_size=49152,
    )
    sampler = 128 * 49152 * 4 * 4
    assert plan.usable == int(0.9 * 16 * GIB)
    assert plan.activations == GIB + sampler + int(0.02 * 16 * GIB)
    assert plan.kv_cache == plan.usable - 2 * GIB - plan.activations
    assert "KV cache" in plan.describe() and "weights 2.00" in plan.describe()


def test_memory_plan_refuses_weights_that_do_not_fit_naming_numbers_and_flags():
    with pytest.raises(
        ConfigError,
        match=r"weights alone take 15\.00 GiB.*0\.5 x 16\.00 GiB"
        r".*--gpu-memory-utilization.*--quantization",
    ):
        plan_memory(
            _cfg(gpu_memory_utilization=0.5),
            memory_bytes=16 * GIB,
            weight_bytes=15 * GIB,
            step_bytes={},
            vocab_size=1000,
        )
    with pytest.raises(ConfigError, match=r"no device memory left.*--max-num-batched-tokens"):
        plan_memory(
            _cfg(gpu_memory_utilization=0.5),
            memory_bytes=16 * GIB,
            weight_bytes=7 * GIB,
            step_bytes={"forward": 2 * GIB},
            vocab_size=1000,
        )


def test_worker_sizes_the_cache_from_the_measured_plan(random_checkpoints, monkeypatch):
    from tpuserve.tpu_platform import worker as worker_mod

    monkeypatch.setattr(worker_mod, "_MARGIN_FRACTION", 0.0)  # activations then fixed in bytes
    cfg = EngineConfig.from_kwargs(
        model=random_checkpoints["llama"],
        attention_impl="blocked",
        gpu_memory_utilization=0.9,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        max_model_len=256,
    )
    w = worker_mod.Worker(cfg)
    w.load()
    w.device = DeviceInfo("tpu", 1, "fake", 64 * GIB)  # an accelerator: the plan decides
    first = w.memory_plan()
    assert first.weights == w.weight_bytes and first.forward > 0 and first.lm_head > 0
    runner = w.runner
    assert runner is not None and runner.kv_cache is None  # measured before any cache exists
    # A device whose 0.9 leaves room for exactly 40 pages after weights and measured activations.
    want = 40
    w.device = DeviceInfo(
        "tpu", 1, "fake", int((first.weights + first.activations + want * w.page_bytes()) / 0.9) + 2
    )
    w._plan = None
    assert w.num_pages(need_full_sequence=False) == want
    assert w.init_kv_cache(want) is runner and runner.kv_spec.num_pages == want  # built once


def test_page_size_keeps_the_kernels_page_table_within_smem():
    """The Pallas TPU kernel prefetches the whole page table (max_num_seqs x pages a sequence)
    into SMEM: on a v5e a 512 KiB table compiled and a 2.5 MiB one (a 40,960-token model, 16-token
    pages, 256 sequences) failed. Pages grow with the context there; other impls keep theirs."""
    from tpuserve.attention.kv_cache_shape import PAGE_TABLE_SMEM_BYTES, min_page_size

    assert min_page_size("pallas_tpu", 8192, 256) == 16  # the 1B shape that compiled on the chip
    assert min_page_size("pallas_tpu", 40960, 256) == 128  # the one that did not, at 16
    assert min_page_size("pallas_tpu", 131072, 256) == 256
    assert min_page_size("pallas_tpu_interpret", 131072, 1) == 1
    for impl in ("blocked", "reference", "pallas_gpu"):
        assert min_page_size(impl, 131072, 1024) == 1
    for length in (1000, 8192, 40960, 131072):
        for seqs in (1, 64, 256, 1024):
            page = min_page_size("pallas_tpu", length, seqs)
            assert seqs * -(-length // page) * 4 <= PAGE_TABLE_SMEM_BYTES
            assert page == 1 or seqs * -(-length // (page // 2)) * 4 > PAGE_TABLE_SMEM_BYTES


def test_worker_raises_the_page_size_a_long_context_needs_and_refuses_a_set_one(random_checkpoints):
    from tpuserve.attention.kv_cache_shape import PAGE_TABLE_SMEM_BYTES
    from tpuserve.tpu_platform.worker import Worker

    common = dict(
        model=random_checkpoints["llama"],
        attention_impl="pallas_tpu_interpret",
        max_model_len=256,
        max_num_seqs=16384,  # 16384 x 16 pages of 16 tokens = 1 MiB of page table: too much
        max_num_batched_tokens=256,
    )
    w = Worker(EngineConfig.from_kwargs(**common))
    w.load()
    page = w.config.cache.block_size
    assert page == 32 and 16384 * (256 // page) * 4 <= PAGE_TABLE_SMEM_BYTES
    with pytest.raises(ConfigError, match=r"block_size=16: .*page table.*block_size >= 32"):
        Worker(EngineConfig.from_kwargs(block_size=16, **common)).load()
    # The jnp paths keep no table in SMEM: the page size stays as configured.
    blocked = Worker(EngineConfig.from_kwargs(**{**common, "attention_impl": "blocked"}))
    blocked.load()
    assert blocked.config.cache.block_size == 16


def test_tpu_runner_holds_nvfp4_scales_as_bytes():
    """On a TPU the runner converts NVFP4 scales to their bytes once, in both layer trees (the
    kernels read bytes; a per-step bitcast was a copy on XLA:TPU); elsewhere they stay float8."""
    from tpuserve.quant import fp4

    def scales(tree):
        recs = jax.tree.leaves(tree, is_leaf=lambda a: isinstance(a, fp4.Nvfp4Weight))
        return {r.scale.dtype for r in recs if isinstance(r, fp4.Nvfp4Weight)}

    tpu = _runner("blocked", "unroll", quantize="nvfp4")
    assert scales(tpu.params) == {jnp.dtype(jnp.uint8)}
    assert tpu._quick is not None and scales(tpu._quick[0]) == {jnp.dtype(jnp.uint8)}
    cpu = _runner("blocked", "unroll", device=DeviceInfo("cpu", 1, "cpu", None), quantize="nvfp4")
    assert scales(cpu.params) == {jnp.dtype(jnp.float8_e4m3fn)}


@pytest.mark.parametrize("method", ["mxfp4", "nvfp4"])
def test_tpu_runner_can_hold_fp4_codes_in_the_kernels_k_order(monkeypatch, method):
    """With ``TILE_RECORDS_FOR_KERNEL`` a TPU runner re-orders its dense FP4 records' codes once
    (both layer trees, stacks one layer at a time) and they dequantize to the plain records'
    weights (the kernel on such records: tests/quant/test_pallas_tpu_matmul.py). Elsewhere, or
    with the switch off, records stay as loaded. (The tiny model's K tiles of 128 / 256 stand in
    for the compiled kernel's 512.)"""
    import functools

    from tpuserve.quant import fp4, pallas_tpu_matmul

    is_rec = lambda a: isinstance(a, (fp4.Mxfp4Weight, fp4.Nvfp4Weight))  # noqa: E731
    dequant = fp4.dequantize_mxfp4 if method == "mxfp4" else fp4.dequantize_nvfp4

    def records(tree):
        return [r for r in jax.tree.leaves(tree, is_leaf=is_rec) if is_rec(r)]

    plain = _runner("blocked", "unroll", quantize=method)
    assert {r.k_tile for r in records(plain.params)} == {0}
    monkeypatch.setattr(pallas_tpu_matmul, "TILE_RECORDS_FOR_KERNEL", (fp4.Mxfp4Weight, fp4.Nvfp4Weight))
    tile_all = functools.partial(pallas_tpu_matmul.tile_records_for_kernel, lane_quantum=128)
    monkeypatch.setattr(pallas_tpu_matmul, "tile_records_for_kernel", tile_all)
    tiled = _runner("blocked", "unroll", quantize=method)
    assert {r.k_tile for r in records(tiled.params)} == {128, 256}  # K 128 (qkv, o, gate_up), 256 (down)
    assert tiled._quick is not None and plain._quick is not None
    for ours, theirs in ((tiled.params, plain.params), (tiled._quick[0], plain._quick[0])):
        for a, b in zip(records(ours), records(theirs), strict=True):
            assert a.k_tile and not b.k_tile and a.packed.shape == b.packed.shape
            np.testing.assert_array_equal(np.asarray(dequant(a)), np.asarray(dequant(b)))
    cpu = _runner("blocked", "unroll", device=DeviceInfo("cpu", 1, "cpu", None), quantize=method)
    assert {r.k_tile for r in records(cpu.params)} == {0}
