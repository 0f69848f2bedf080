"""What a checkpoint directory is, read without importing the loader (and with it JAX): for the
plugins' config-time checks, which run in vLLM's / SGLang's front-end processes."""

from __future__ import annotations

import json
import os


def checkpoint_quant(model_path: str | None):
    """What our loader reads off the checkpoint at ``model_path``: a ``CheckpointQuant``, or None
    for a dense one (or a GGUF file / a path without config.json). Raises ModelConfigError for a
    format the loader does not read. Only a local config.json is consulted (the loader reads local
    paths only); the loader is imported only when the checkpoint declares a quantization."""
    if not model_path:
        return None
    path = os.path.expanduser(str(model_path))
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        return None
    with open(cfg_path) as f:
        config = json.load(f)
    if config.get("quantization_config") is None and not os.path.isfile(
        os.path.join(path, "hf_quant_config.json")
    ):
        return None
    # only now: the loader package imports JAX, which these processes must not load for a dense model
    from tpuserve.tpu_platform.loader.quantized import detect

    return detect(config, path)
