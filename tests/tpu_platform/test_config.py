"""The one typed, sectioned engine config: vLLM's flag names, validated once, no jax at import."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys

import pytest

from tpuserve.tpu_platform.config import _SECTIONS, CacheConfig, ConfigError, EngineConfig, SchedulerConfig


def test_importing_the_config_imports_no_jax():
    code = (
        "import sys; import tpuserve.tpu_platform.config as c; c.EngineConfig.from_kwargs(max_num_seqs=2); "
        "bad = [m for m in sys.modules if m == 'jax' or m.startswith('jax.')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_flat_flags_route_to_their_sections():
    c = EngineConfig.from_kwargs(
        model="/m",
        max_num_seqs=3,
        block_size=32,
        gpu_memory_utilization=0.7,
        attention_impl="reference",
        async_scheduling=False,
        max_logprobs=5,
    )
    assert c.model.model == "/m" and c.model.max_logprobs == 5
    assert c.scheduler == SchedulerConfig(max_num_seqs=3, async_scheduling=False)
    assert c.cache == CacheConfig(block_size=32, gpu_memory_utilization=0.7)
    assert c.compilation.attention_impl == "reference"
    assert c.speculative is None and c.kv_transfer is None and c.quantization.method is None
    assert c.token_buckets[-1] == c.scheduler.max_num_batched_tokens


def test_token_buckets_double_then_grow_by_the_factor():
    """Doubling up to 32 rows (weight-bound matmuls: padding is nearly free), then x1.5 rounded up
    to multiples of 16, then the budget; factor 2 keeps the plain powers of two."""
    buckets = EngineConfig.from_kwargs(max_num_batched_tokens=512).token_buckets
    assert buckets == (1, 2, 4, 8, 16, 32, 48, 80, 128, 192, 288, 432, 512)
    assert all(b / a <= 2 for a, b in zip(buckets[5:], buckets[6:]))
    assert EngineConfig.from_kwargs(max_num_batched_tokens=512, token_bucket_factor=2).token_buckets == (
        1,
        2,
        4,
        8,
        16,
        32,
        64,
        128,
        256,
        512,
    )
    assert EngineConfig.from_kwargs(max_num_batched_tokens=100, min_token_bucket=16).token_buckets == (
        16,
        32,
        48,
        80,
        100,
    )


def test_every_section_field_is_a_cli_flag_once():
    from tpuserve.server.engine_args import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    names = {f.name for cls in _SECTIONS.values() for f in dataclasses.fields(cls)}
    names = (names - {"method", "model", "calibration"}) | {
        "quantization",
        "quantization_calibration",
        "speculative_config",
        "kv_transfer_config",
    }
    flags = set(EngineConfig.flag_fields())
    assert names <= flags
    args = parser.parse_args(
        [
            "--max-num-seqs",
            "7",
            "--no-enable-chunked-prefill",
            "--gpu-memory-utilization",
            "0.3",
            "--max-logprobs",
            "4",
        ]
    )
    c = EngineConfig.from_kwargs(**engine_kwargs(args))
    assert (c.scheduler.max_num_seqs, c.scheduler.enable_chunked_prefill) == (7, False)
    assert (c.cache.gpu_memory_utilization, c.model.max_logprobs) == (0.3, 4)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_num_seq=3), "unknown engine argument"),
        (dict(block_size=12), "block_size"),
        (dict(dtype="int8"), "dtype"),
        (dict(gpu_memory_utilization=0), "gpu_memory_utilization"),
        (dict(kv_cache_dtype="fp8_e5m2"), r"kv_cache_dtype: .*fp8_e5m2 .*not supported"),
        (dict(kv_cache_dtype="int8"), "kv_cache_dtype"),
        (
            dict(kv_cache_dtype="fp8_e4m3", kv_transfer_config='{"kv_role": "kv_producer"}'),
            "kv_transfer_config: .*kv_cache_dtype",
        ),
        (dict(tensor_parallel_size=2, kv_offloading_size=1.0), "kv_offloading_size"),
        (dict(data_parallel_size=0), "data_parallel_size"),
        (dict(quantization="int4"), r"quantization: must be one of \('fp8', 'mxfp4', 'nvfp4'\)"),
        (
            dict(quantization="mxfp4", quantization_calibration="awq"),
            r"quantization_calibration: must be one of \('gptq', 'rtn'\)",
        ),
        (dict(speculative_config='{"method": "eagle3", "num_speculative_tokens": 3}'), "eagle3"),
        (
            dict(speculative_config='{"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}'),
            "prompt_lookup_min",
        ),
        (dict(speculative_config='{"method": "medusa"}'), "method"),
        (dict(speculative_config="{oops"), "not valid JSON"),
        (dict(speculative_config='{"methd": "ngram"}'), "unknown key"),
        (
            dict(kv_transfer_config='{"kv_role": "kv_producer", "kv_load_failure_policy": "retry"}'),
            "kv_load_failure_policy",
        ),
        (dict(kv_transfer_config='{"kv_role": "kv_both", "kv_connector": "NixlConnector"}'), "kv_connector"),
        (dict(attention_impl="flash"), "attention_impl"),
        (dict(token_bucket_factor=1.1), r"token_bucket_factor: .*>= 1.25"),
        (
            dict(enable_chunked_prefill=False, max_model_len=512, max_num_batched_tokens=256),
            "max_num_batched_tokens",
        ),
    ],
)
def test_bad_values_name_the_flag(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        EngineConfig.from_kwargs(**kwargs)


def test_no_field_is_dead():
    """Every config field is read somewhere outside config.py's validation (grep the package)."""
    import inspect
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2]
    sources = "\n".join(
        p.read_text()
        for folder in ("server", "tpu_platform", "tpuserve", "attention")
        for p in (root / folder).rglob("*.py")
        if p.name != "config.py"
    )
    sources += inspect.getsource(EngineConfig.token_buckets.fget)  # derives the token buckets
    for section, cls in _SECTIONS.items():
        for f in dataclasses.fields(cls):
            # Validated-and-refused features are read by their validate(); the rest by the runtime.
            if section in ("parallel", "quantization"):
                continue
            assert f".{f.name}" in sources or f"{f.name}=" in sources, f"{section}.{f.name} is never read"


@pytest.mark.parametrize("name", ["auto", "fp8", "fp8_e4m3"])
def test_kv_cache_dtypes_are_accepted(name):
    """vLLM's two names of an e4m3 KV cache both mean float8_e4m3fn; with TP it just works."""
    import jax.numpy as jnp

    from tpuserve.tpu_platform.worker import resolve_kv_cache_dtype

    c = EngineConfig.from_kwargs(kv_cache_dtype=name, tensor_parallel_size=2)
    assert c.cache.kv_cache_dtype == name
    want = jnp.bfloat16 if name == "auto" else jnp.float8_e4m3fn
    assert resolve_kv_cache_dtype(name, jnp.bfloat16) == jnp.dtype(want)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["fp8", "mxfp4", "nvfp4"])
def test_online_quantization_methods_are_accepted(method):
    assert EngineConfig.from_kwargs(quantization=method).quantization.method == method


def test_a_tpu_gets_wider_scheduler_defaults_unless_the_user_set_them():
    from tpuserve.tpu_platform.config import TPU_SCHEDULER_DEFAULTS

    cfg = EngineConfig.from_kwargs()
    assert cfg.for_backend("cpu") is cfg and cfg.for_backend("gpu") is cfg
    tpu = cfg.for_backend("tpu").scheduler
    assert (tpu.max_num_batched_tokens, tpu.max_num_seqs) == (
        TPU_SCHEDULER_DEFAULTS["max_num_batched_tokens"],
        TPU_SCHEDULER_DEFAULTS["max_num_seqs"],
    )
    assert tpu.max_num_batched_tokens > cfg.scheduler.max_num_batched_tokens
    assert max(cfg.for_backend("tpu").token_buckets) == tpu.max_num_batched_tokens
    # A value the user gave stays, even when it equals the CPU default.
    mine = EngineConfig.from_kwargs(max_num_batched_tokens=256, max_num_seqs=32).for_backend("tpu")
    assert (mine.scheduler.max_num_batched_tokens, mine.scheduler.max_num_seqs) == (256, 32)
    half = EngineConfig.from_kwargs(max_num_seqs=8).for_backend("tpu").scheduler
    assert (half.max_num_batched_tokens, half.max_num_seqs) == (
        TPU_SCHEDULER_DEFAULTS["max_num_batched_tokens"],
        8,
    )
