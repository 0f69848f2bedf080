"""Write a GGUF checkpoint out as a Hugging Face directory (config.json, safetensors, tokenizer).

Peers that only read Hugging Face directories (transformers, vLLM, SGLang) can then run the very same
weights and tokenizer as we do, which is what parity tests and benchmarks need.
"""

from __future__ import annotations

import json
import os

import numpy as np


def export_hf_dir(gguf_path: str, out_dir: str, dtype: str = "float32") -> str:
    """Dequantize ``gguf_path`` into ``out_dir`` (created); returns out_dir. Skips work if present."""
    # on use: gguf_loader loads the gguf library, and this module is imported without a GGUF to read
    from safetensors.numpy import save_file

    from tpuserve.tpu_platform.loader.gguf_loader import load_gguf

    marker = os.path.join(out_dir, ".exported-from")
    if os.path.exists(marker):
        with open(marker) as f:
            if f.read() == os.path.abspath(gguf_path):
                return out_dir
    ckpt = load_gguf(gguf_path)
    os.makedirs(out_dir, exist_ok=True)
    config = dict(ckpt.config)
    config["torch_dtype"] = dtype
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    tensors = {k: np.ascontiguousarray(v, dtype=np.dtype(dtype)) for k, v in ckpt.tensors.items()}
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    ckpt.tokenizer.save_pretrained(out_dir)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id")}, f)
    with open(marker, "w") as f:
        f.write(os.path.abspath(gguf_path))
    return out_dir


def default_model_hf_dir() -> str:
    """The default model exported once under ~/.cache/tpuserve/models/."""
    from tpuserve.tpu_platform.loader.gguf_loader import default_model_path  # on use, as above

    out = os.path.join(os.path.expanduser("~"), ".cache", "tpuserve", "models", "SmolLM2-135M-Instruct")
    return export_hf_dir(default_model_path(), out)
