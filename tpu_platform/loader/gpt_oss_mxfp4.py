"""gpt-oss's published MXFP4 experts (``quantization_config.quant_method: mxfp4``).

The published checkpoints keep only the expert projections in MXFP4, as
``mlp.experts.{gate_up,down}_proj_blocks`` u8 ``[E, out, in/32, 16]`` (two e2m1 codes a byte, the
even element in the low nibble: the HF packing, not GGUF's split halves) and ``..._scales`` u8 e8m0
``[E, out, in/32]``; everything else is bf16.

Two ways to read them, both kept:

* packed (the default, ``expert_records``): each expert tensor becomes an ``Mxfp4Weight`` whose
  ``packed`` is ``[E, in/2, out]`` and ``scale`` ``[E, in/32, out]``, the layout the grouped matmul
  decodes in VMEM (moe/pallas_tpu_gmm.py). The nibble pairing is already the record's (even k low),
  so only the two trailing axes swap: no byte is re-packed and nothing is dequantized. The
  experts keep their ~4.25 bits a weight on the device, which is what lets gpt-oss-20b fit a 16 GB
  chip.
* dequantized (``with_dequantized_experts``): the experts decode to dense ``[E, in, out]`` under the
  dense checkpoint's names (``mlp.experts.gate_up_proj``, ...), so they take the model dtype's
  bytes. It is the reference the packed path is tested against (bit-exact with transformers'
  ``convert_moe_packed_tensors``) and the form for anything that needs dense experts.
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


def packed_expert(blocks: np.ndarray, scales: np.ndarray) -> fp4.Mxfp4Weight:
    """blocks u8 [E, out, in/32, 16], scales u8 [E, out, in/32] -> an ``Mxfp4Weight`` of
    ``[E, in, out]`` with numpy leaves ``packed [E, in/2, out]``, ``scale [E, in/32, out]``.

    The leaves are transposed views (of a memory-mapped file, when the inputs are): whoever
    places them on the device makes the one copy, so loading holds no second host copy."""
    if blocks.ndim != 4 or blocks.shape[-1] * 2 != fp4.MXFP4_BLOCK or blocks.dtype != np.uint8:
        raise ValueError(
            f"gpt-oss MXFP4 blocks must be u8 [E, out, in/32, 16], got {blocks.dtype} {blocks.shape}"
        )
    e, out, nblk, width = blocks.shape
    if scales.shape != (e, out, nblk) or scales.dtype != np.uint8:
        raise ValueError(
            f"gpt-oss MXFP4 scales {scales.dtype} {scales.shape} do not fit blocks {blocks.shape}"
        )
    packed = np.swapaxes(blocks.reshape(e, out, nblk * width), -1, -2)
    # numpy leaves on purpose: they are stacked on the host, then placed (models/weights.py _placed)
    return fp4.Mxfp4Weight(packed, np.swapaxes(scales, -1, -2), (out,))  # type: ignore[arg-type]


def expert_records(raw: Callable[[str], np.ndarray | None]) -> Callable[[str], fp4.Mxfp4Weight | None]:
    """``get_linear`` for ``weights.build_params``: the packed record of an expert module
    (``model.layers.N.mlp.experts.gate_up_proj`` / ``down_proj``) from its blocks and scales in
    ``raw`` (tensors as stored); None for every other module, which the checkpoint keeps dense."""

    def read(module: str) -> fp4.Mxfp4Weight | None:
        if not module.endswith(_EXPERT_TENSORS):
            return None
        blocks, scales = raw(module + "_blocks"), raw(module + "_scales")
        if blocks is None or scales is None:
            return None
        return packed_expert(blocks, scales)

    return read


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
