"""Oracle models for quantized serving: transformers running weights fake-quantized by torchao or
compressed-tensors, and the helpers that turn an engine's prompt logprobs into numbers to compare.

``fake_quantize_hf(model, method)`` replaces every decoder-layer projection weight of a transformers
model by what the oracle library's own quantize -> dequantize gives. It mirrors how the engine
quantizes online (``tpu_platform/models/quantize.py``): per output channel for FP8, per 32 / 16 K
elements for FP4, and NVFP4's per-tensor global scale taken over the fused tensor the engine
quantizes as one (q|k|v together, gate|up together). Nothing here touches tpuserve.
"""

from __future__ import annotations

import numpy as np
import torch

PROJ_GROUPS = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn.o_proj",),
    ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp.down_proj",),
)


def _fp8_channel(w: torch.Tensor) -> torch.Tensor:
    import ct_oracle as ct
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    sd = ct.compress(w, "FP8_DYNAMIC")
    return dequantize(
        sd["weight"].to(torch.float32),
        sd["weight_scale"],
        args=ct.scheme("FP8_DYNAMIC").weights,
        dtype=torch.float32,
    )


def _mxfp4(w: torch.Tensor) -> torch.Tensor:
    from torchao.prototype.mx_formats.mx_tensor import MXTensor

    return MXTensor.to_mx(w, torch.float4_e2m1fn_x2, block_size=32).dequantize(torch.float32)


def _nvfp4(w: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

    t = NVFP4Tensor.to_nvfp4(w, per_tensor_scale=per_tensor_amax_to_scale(amax))
    return t.dequantize(torch.float32)


def fake_quantize_weights(ws: list[torch.Tensor], method: str) -> list[torch.Tensor]:
    """f32 ``[out, in]`` weights of one fused group -> their quantize-dequantize, per the oracle."""
    if method == "fp8":
        return [_fp8_channel(w) for w in ws]
    if method == "mxfp4":
        return [_mxfp4(w) for w in ws]
    if method == "nvfp4":
        amax = torch.stack([w.abs().max() for w in ws]).max()
        return [_nvfp4(w, amax) for w in ws]
    raise ValueError(method)


@torch.no_grad()
def fake_quantize_hf(model, method: str):
    """In place: every layer's projections of a transformers CausalLM -> oracle fake-quantized."""
    for layer in model.model.layers:
        for group in PROJ_GROUPS:
            mods = [layer.get_submodule(name) for name in group]
            new = fake_quantize_weights([m.weight.detach().float() for m in mods], method)
            for m, w in zip(mods, new):
                m.weight.copy_(w.to(m.weight.dtype))
    return model


@torch.no_grad()
def hf_logprobs(model, token_ids: list[int]) -> np.ndarray:
    """log_softmax of the model's logits over ``token_ids``: ``[T, V]`` f32."""
    return torch.log_softmax(model(torch.tensor([token_ids])).logits[0].float(), -1).numpy()


def engine_prompt_logprobs(out) -> np.ndarray:
    """A RequestOutput with ``prompt_logprobs=0`` -> logprob of each prompt token after the first."""
    return np.array(
        [out.prompt_logprobs[j + 1][tok].logprob for j, tok in enumerate(out.prompt_token_ids[1:])]
    )


def oracle_target_logprobs(lp: np.ndarray, token_ids: list[int]) -> np.ndarray:
    """``[T, V]`` log-probs -> the logprob each next prompt token got (what the engine reports)."""
    return np.array([lp[j, tok] for j, tok in enumerate(token_ids[1:])])


@torch.no_grad()
def load_engine_weights_into_hf(model, layers: list[dict], dequant, num_heads: int, num_kv_heads: int):
    """In place: each HF projection weight <- the engine's record for it, dequantized by ``dequant``
    and ungrouped (qkv ``[H, Hkv, G+2, D]`` -> q/k/v, gate_up ``[H, 2, F]`` -> gate/up)."""
    g = num_heads // num_kv_heads
    for hf_layer, w in zip(model.model.layers, layers):
        qkv = np.asarray(dequant(w["qkv"]), np.float32)
        h = qkv.shape[0]
        parts = {
            "self_attn.q_proj": qkv[:, :, :g].reshape(h, -1),
            "self_attn.k_proj": qkv[:, :, g].reshape(h, -1),
            "self_attn.v_proj": qkv[:, :, g + 1].reshape(h, -1),
            "self_attn.o_proj": np.asarray(dequant(w["o"]), np.float32),
        }
        gu = np.asarray(dequant(w["gate_up"]), np.float32)
        parts.update(
            {
                "mlp.gate_proj": gu[:, 0],
                "mlp.up_proj": gu[:, 1],
                "mlp.down_proj": np.asarray(dequant(w["down"]), np.float32),
            }
        )
        for name, arr in parts.items():
            hf_layer.get_submodule(name).weight.copy_(torch.from_numpy(np.ascontiguousarray(arr.T)))
    return model
