"""Write a GGUF checkpoint out as a Hugging Face directory (config.json, safetensors, tokenizer).

Peers that only read Hugging Face directories (transformers, vLLM, SGLang) can then run the very same
weights and tokenizer as we do, which is what parity tests and benchmarks need.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np


def export_hf_dir(gguf_path: str, out_dir: str, dtype: str = "float32") -> str:
    """Dequantize ``gguf_path`` into ``out_dir`` (created); returns out_dir. Skips work if present."""
    # on use: gguf_loader loads the gguf library, and this module is imported without a GGUF to read
    from safetensors.numpy import save_file

    from tpuserve.tpu_platform.loader.gguf_loader import load_gguf

    source = os.path.abspath(gguf_path)
    if _exported_from(out_dir) == source:
        return out_dir
    ckpt = load_gguf(gguf_path)
    # Written aside and published by one rename: processes that export at once (test workers, the
    # plugin suites side by side) then see either no directory or a whole one, never a half-written
    # safetensors file.
    tmp = f"{out_dir}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    config = dict(ckpt.config)
    config["torch_dtype"] = dtype
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    tensors = {k: np.ascontiguousarray(v, dtype=np.dtype(dtype)) for k, v in ckpt.tensors.items()}
    save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    ckpt.tokenizer.save_pretrained(tmp)
    with open(os.path.join(tmp, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id")}, f)
    with open(os.path.join(tmp, _MARKER), "w") as f:
        f.write(source)
    if _exported_from(out_dir) == source:  # another process published it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
        return out_dir
    shutil.rmtree(out_dir, ignore_errors=True)  # another source's export, or a partial one
    try:
        os.rename(tmp, out_dir)
    except OSError:  # another process published between the check and the rename
        shutil.rmtree(tmp, ignore_errors=True)
        if _exported_from(out_dir) != source:
            raise
    return out_dir


_MARKER = ".exported-from"


def _exported_from(out_dir: str) -> str | None:
    """The GGUF path a complete export in ``out_dir`` was made from, or None if there is none."""
    try:
        with open(os.path.join(out_dir, _MARKER)) as f:
            return f.read()
    except OSError:
        return None


def default_model_hf_dir() -> str:
    """The default model exported once under ~/.cache/tpuserve/models/."""
    from tpuserve.tpu_platform.loader.gguf_loader import default_model_path  # on use, as above

    out = os.path.join(os.path.expanduser("~"), ".cache", "tpuserve", "models", "SmolLM2-135M-Instruct")
    return export_hf_dir(default_model_path(), out)
