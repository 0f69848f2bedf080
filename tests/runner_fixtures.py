"""A ModelRunner over a loaded checkpoint, as the model tests build one (f32, asked to scan)."""

from __future__ import annotations


def scan_runner(path: str, loaded):
    """The runner for ``loaded`` (``load_model(path, jnp.float32)``) with layer_loop "scan": models
    whose layers differ in structure run unrolled instead, which the tests check."""
    import jax.numpy as jnp

    from tpuserve.tpu_platform.config import EngineConfig
    from tpuserve.tpu_platform.device import discover
    from tpuserve.tpu_platform.model_runner import ModelRunner

    return ModelRunner(
        EngineConfig.from_kwargs(model=path, max_num_batched_tokens=64, layer_loop="scan"),
        loaded.arch,
        loaded.params,
        discover(),
        jnp.float32,
        num_pages=32,
        max_model_len=256,
    )
