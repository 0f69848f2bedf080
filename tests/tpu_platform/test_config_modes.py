"""Typed modes (string-valued enums parsed from flag text), "auto" resolved once per platform, and
the plugins' one mapping each from their framework's settings to ``EngineConfig`` (tested here,
without vLLM or SGLang installed)."""

from __future__ import annotations

from dataclasses import fields
from types import SimpleNamespace

import pytest

from tpuserve.attention.names import AttentionImpl
from tpuserve.tpu_platform.config import (
    ConfigError,
    EngineConfig,
    KVLoadFailurePolicy,
    KVRole,
    LayerLoop,
    QuantCalibration,
    SpecMethod,
)


def test_flag_text_parses_to_members_that_still_equal_the_text():
    cfg = EngineConfig.from_kwargs(
        attention_impl="reference",
        layer_loop="scan",
        quantization_calibration="rtn",
        speculative_config='{"method": "ngram", "num_speculative_tokens": 2}',
        kv_transfer_config={"kv_role": "kv_consumer", "kv_load_failure_policy": "recompute"},
    )
    c = cfg.compilation
    assert c.attention_impl is AttentionImpl.REFERENCE and c.attention_impl == "reference"
    assert c.layer_loop is LayerLoop.SCAN
    assert cfg.quantization.calibration is QuantCalibration.RTN
    assert cfg.speculative.method is SpecMethod.NGRAM
    kv = cfg.kv_transfer
    assert kv.kv_role is KVRole.CONSUMER and kv.kv_role.receives and not kv.kv_role.sends
    assert kv.kv_load_failure_policy is KVLoadFailurePolicy.RECOMPUTE


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        ({"layer_loop": "loop"}, "layer_loop"),
        ({"attention_impl": "flash"}, "attention_impl"),
        ({"quantization_calibration": "awq"}, "quantization_calibration"),
        ({"speculative_config": {"method": "medusa"}}, "speculative_config.method"),
        ({"kv_transfer_config": {"kv_role": "kv_peer"}}, "kv_transfer_config.kv_role"),
        (
            {"kv_transfer_config": {"kv_role": "kv_both", "kv_load_failure_policy": "retry"}},
            "kv_transfer_config.kv_load_failure_policy",
        ),
    ],
)
def test_a_bad_mode_names_its_flag_and_the_choices(kwargs, flag):
    with pytest.raises(ConfigError, match=rf"^{flag}: must be one of \(.*\) \(got '"):
        EngineConfig.from_kwargs(**kwargs)


@pytest.mark.parametrize(
    "backend, kv_cache_dtype, impl, loop",
    [
        ("cpu", "auto", AttentionImpl.BLOCKED, LayerLoop.UNROLL),
        ("tpu", "auto", AttentionImpl.PALLAS_TPU, LayerLoop.SCAN),
        ("gpu", "auto", AttentionImpl.PALLAS_GPU, LayerLoop.SCAN),
    ],
)
def test_auto_is_resolved_once_for_the_backend(backend, kv_cache_dtype, impl, loop, caplog):
    cfg = EngineConfig.from_kwargs(kv_cache_dtype=kv_cache_dtype)
    with caplog.at_level("INFO", logger="tpuserve.tpu_platform.config"):
        on = cfg.with_modes_resolved(backend)
    assert (on.compilation.attention_impl, on.compilation.layer_loop) == (impl, loop)
    assert f"attention_impl auto -> {impl.value}" in caplog.text
    assert on.with_modes_resolved(backend) is on  # nothing left to resolve
    assert cfg.compilation.attention_impl is AttentionImpl.AUTO  # the original is not changed


def test_every_front_end_gets_concrete_modes_from_its_worker():
    # The engine, the vLLM worker and the SGLang executor all build a Worker from a config that
    # may still say "auto"; the Worker resolves it, once, and its parts read the concrete modes.
    from tpuserve.tpu_platform.worker import Worker

    worker = Worker(EngineConfig.from_kwargs(model="unused", attention_impl="auto", layer_loop="auto"))
    assert worker.config.compilation.attention_impl is AttentionImpl.BLOCKED  # the CPU backend
    assert worker.config.compilation.layer_loop is LayerLoop.UNROLL


def test_the_attention_layer_refuses_an_unresolved_mode():
    import jax.numpy as jnp

    from tpuserve.attention.dispatch import AttentionParams, ragged_paged_attention

    with pytest.raises(ValueError, match="resolve 'auto'"):
        ragged_paged_attention(
            jnp.zeros((1, 2, 8)),
            jnp.zeros((1, 1, 8)),
            jnp.zeros((1, 1, 8)),
            jnp.zeros((1, 1, 4, 2, 8)),
            jnp.int32(0),
            None,  # never read: the mode is checked first
            AttentionParams(sm_scale=1.0),
            "auto",
        )


def test_explicit_modes_are_kept_and_a_bad_pair_is_refused_when_resolving():
    cfg = EngineConfig.from_kwargs(attention_impl="reference", layer_loop="scan")
    assert cfg.with_modes_resolved("cpu") is cfg
    # the TPU kernel reads an FP8 cache: "auto" takes it, and asking for it by name is kept; the
    # reference asked for by name still runs
    for impl in ("auto", "pallas_tpu"):
        fp8 = EngineConfig.from_kwargs(attention_impl=impl, kv_cache_dtype="fp8").with_modes_resolved("tpu")
        assert fp8.compilation.attention_impl is AttentionImpl.PALLAS_TPU
    ref = EngineConfig.from_kwargs(attention_impl="reference", kv_cache_dtype="fp8").with_modes_resolved(
        "tpu"
    )
    assert ref.compilation.attention_impl is AttentionImpl.REFERENCE


def _vllm_settings(**model):
    model_config = SimpleNamespace(
        **{
            "model": "/m",
            "dtype": "torch.bfloat16",
            "max_model_len": 512,
            "seed": None,
            "max_logprobs": 5000,
            "quantization": None,
            **model,
        }
    )
    sched = SimpleNamespace(max_num_seqs=7, max_num_batched_tokens=96, enable_chunked_prefill=True)
    cache = SimpleNamespace(
        block_size=32, cache_dtype="fp8_e4m3", gpu_memory_utilization=0.7, kv_cache_memory_bytes=None
    )
    parallel = SimpleNamespace(tensor_parallel_size=1, enable_expert_parallel=True)
    options = SimpleNamespace(attention_impl="auto", layer_loop="scan", compilation_cache_dir="/xla")
    return model_config, sched, cache, parallel, options


def test_vllm_settings_map_to_the_engine_config():
    from tpuserve.tpu_platform.vllm_plugin.engine_config import engine_config_from_vllm

    spec = {"method": "ngram", "num_speculative_tokens": 3}
    cfg = engine_config_from_vllm(*_vllm_settings(), spec)
    want = EngineConfig.from_kwargs(
        model="/m",
        dtype="bfloat16",
        max_model_len=512,
        max_num_seqs=7,
        max_num_batched_tokens=96,
        block_size=32,
        seed=0,
        gpu_memory_utilization=0.7,
        kv_cache_memory_bytes=None,
        attention_impl="auto",
        layer_loop="scan",
        enable_chunked_prefill=True,
        compilation_cache_dir="/xla",
        max_logprobs=1024,  # vLLM's value clamped to our bound
        async_scheduling=False,
        quantization=None,
        kv_cache_dtype="fp8_e4m3",
        tensor_parallel_size=1,
        enable_expert_parallel=True,
        speculative_config=spec,
    )
    assert cfg == want
    with pytest.raises(ConfigError, match="dtype torch.float64: the tpuserve platform runs"):
        engine_config_from_vllm(*_vllm_settings(dtype="torch.float64"), None)


def test_sglang_settings_left_unset_take_the_engine_config_defaults():
    from tpuserve.tpu_platform.sglang_plugin.executor import ExecutorConfig

    cfg = ExecutorConfig(model_path="/m", page_size=32, max_model_len=256).engine_config()
    defaults = EngineConfig()
    assert cfg.scheduler.async_scheduling is False  # SGLang's scheduler waits for each batch
    for section in ("model", "cache", "scheduler", "compilation", "quantization"):
        got, default = getattr(cfg, section), getattr(defaults, section)
        for f in fields(got):
            if (section, f.name) in {
                ("model", "model"),
                ("model", "max_model_len"),
                ("cache", "block_size"),
                ("scheduler", "async_scheduling"),
            }:
                continue
            assert getattr(got, f.name) == getattr(default, f.name), (section, f.name)
    assert (cfg.model.model, cfg.model.max_model_len, cfg.cache.block_size) == ("/m", 256, 32)
    given = ExecutorConfig(
        model_path="/m",
        page_size=16,
        max_model_len=256,
        max_total_tokens=160,
        max_num_seqs=3,
        max_num_batched_tokens=48,
        layer_loop="scan",
        kv_cache_dtype="fp8_e4m3",
    ).engine_config()
    assert given.cache.num_gpu_blocks == 160 // 16 + 1  # page 0 reserved on both sides
    assert (given.scheduler.max_num_seqs, given.scheduler.max_num_batched_tokens) == (3, 48)
    assert given.compilation.layer_loop is LayerLoop.SCAN and given.cache.kv_cache_dtype == "fp8_e4m3"
