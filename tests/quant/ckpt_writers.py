"""Pre-quantized checkpoints written by the formats' own libraries (nothing here touches tpuserve).

* ``write_compressed_tensors(src, dst, preset)``: compressed-tensors' own lifecycle, as
  llm-compressor drives it: ``apply_quantization_config`` attaches the scheme and scale parameters
  to every Linear but the LM head, the scales come from its ``calculate_qparams`` (and
  ``generate_gparam`` for NVFP4's global scale), then ``ModelCompressor`` compresses the model and
  writes ``quantization_config`` into config.json.
* ``write_hf_fp8(src, dst, scale_fmt)``: transformers' own FP8 quantizer op (``Fp8Quantize``, the
  one its ``FineGrainedFP8`` quantizer serializes with): e4m3 weights and ``weight_scale_inv`` per
  128x128 block (f32, or UE8M0 powers of two), config ``quant_method: fp8``.
"""

from __future__ import annotations

import json
import os
import shutil

import ct_oracle as ct  # tests/quant/ct_oracle.py
import torch

_AUX_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def _copy_aux(src: str, dst: str) -> None:
    for f in _AUX_FILES:
        if os.path.exists(os.path.join(src, f)):
            shutil.copy(os.path.join(src, f), dst)


@torch.no_grad()
def write_compressed_tensors(src: str, dst: str, preset: str) -> str:
    import transformers
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    qc = QuantizationConfig(config_groups={"group_0": ct.scheme(preset)}, ignore=["lm_head"])
    apply_quantization_config(model, qc)
    for _, m in model.named_modules():
        sch = getattr(m, "quantization_scheme", None)
        if sch is None:
            continue
        w = m.weight.detach()
        gs = None
        if hasattr(m, "weight_global_scale"):
            gs = generate_gparam(w.min(), w.max())
            m.weight_global_scale.data.copy_(gs.reshape(m.weight_global_scale.shape))
        mn, mx = ct._minmax(w, sch.weights)
        scale, _ = calculate_qparams(mn, mx, sch.weights, global_scale=gs)
        m.weight_scale.data = scale.to(m.weight_scale.dtype).reshape(m.weight_scale.shape)
    comp = ModelCompressor.from_pretrained_model(model, quantization_format=ct.FORMATS[preset])
    comp.compress_model(model)
    model.save_pretrained(dst)
    comp.update_config(dst)
    _copy_aux(src, dst)
    return dst


@torch.no_grad()
def write_hf_fp8(src: str, dst: str, scale_fmt: str | None = None) -> str:
    """Every projection weight -> e4m3 + ``weight_scale_inv`` per 128x128 block (dims must divide)."""
    import transformers
    from safetensors.torch import save_file
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    kw = {"scale_fmt": scale_fmt} if scale_fmt else {}
    cfg = FineGrainedFP8Config(weight_block_size=[128, 128], **kw)

    class _Quantizer:  # the only attribute Fp8Quantize reads from its hf_quantizer
        quantization_config = cfg

    op = Fp8Quantize(_Quantizer())
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    sd = {}
    for k, v in model.state_dict().items():
        if k.endswith("_proj.weight"):
            sd.update(op.convert({k: v}))
        else:
            sd[k] = v.contiguous()
    os.makedirs(dst, exist_ok=True)
    save_file(sd, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": [128, 128],
        **kw,
    }
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    _copy_aux(src, dst)
    return dst
