"""gpt-oss's published MXFP4 experts (``quantization_config.quant_method: mxfp4``), decoded at load.

The published checkpoints keep only the expert projections in MXFP4, as
``mlp.experts.{gate_up,down}_proj_blocks`` u8 ``[E, out, in/32, 16]`` (two e2m1 codes a byte, the
even element in the low nibble: the HF packing, not GGUF's split halves) and ``..._scales`` u8 e8m0
``[E, out, in/32]``; everything else is bf16. This step dequantizes the experts to dense
``[E, in, out]`` arrays under the dense checkpoint's names (``mlp.experts.gate_up_proj``, ...), so the
model reads one layout for both; the expert weights then take the model dtype's bytes (keeping them
packed through the grouped matmul is a later step).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from tpuserve.quant import fp4

_EXPERT_TENSORS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def is_gpt_oss_mxfp4(cfg: dict) -> bool:
    qc = cfg.get("quantization_config") or {}
    return "GptOssForCausalLM" in (cfg.get("architectures") or []) and (
        str(qc.get("quant_method", "")).lower() == "mxfp4"
    )


def decode_expert(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks u8 [E, out, in/32, 16], scales u8 [E, out, in/32] -> f32 [E, in, out]."""
    e, out, nblk, width = blocks.shape
    rec = fp4.mxfp4_from_checkpoint(np.asarray(blocks).reshape(e, out, nblk * width), np.asarray(scales))
    return np.asarray(fp4.dequantize_mxfp4(rec))


def with_dequantized_experts(
    get: Callable[[str], np.ndarray | None], raw: Callable[[str], np.ndarray | None]
) -> Callable[[str], np.ndarray | None]:
    """``get`` (f32 tensors by name) that also answers the expert names from their blocks/scales."""

    def read(name: str) -> np.ndarray | None:
        t = get(name)
        if t is not None or not name.endswith(_EXPERT_TENSORS):
            return t
        blocks, scales = raw(name + "_blocks"), raw(name + "_scales")
        if blocks is None or scales is None:
            return None
        return decode_expert(blocks, scales)

    return read
