"""compressed-tensors as an oracle: its own scale math and compressors write the checkpoint tensors.

``compress(w, preset)`` does what llm-compressor does for a Linear's weight ``[out, in]``: min/max
per the preset's strategy -> ``calculate_qparams`` (and ``generate_gparam`` for NVFP4) -> the
registered compressor's ``compress``. ``decompress`` is that compressor's own inverse. Nothing here
touches tpuserve.
"""

from __future__ import annotations

import math

import torch
from compressed_tensors.compressors.base import BaseCompressor
from compressed_tensors.quantization import QuantizationStrategy as S
from compressed_tensors.quantization import preset_name_to_scheme
from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

# preset -> compression format the compressor is registered under
FORMATS = {
    "FP8": "float-quantized",
    "FP8_DYNAMIC": "float-quantized",
    "FP8_BLOCK": "float-quantized",
    "NVFP4": "nvfp4-pack-quantized",
    "MXFP4": "mxfp4-pack-quantized",
}


def scheme(preset: str):
    return preset_name_to_scheme(preset, ["Linear"])


def _minmax(w: torch.Tensor, args):
    out, k = w.shape
    st = args.strategy
    if st == S.TENSOR:
        return torch.aminmax(w)
    if st == S.CHANNEL:
        return w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
    if st == S.BLOCK:
        bo, bi = args.block_structure
        po, pi = math.ceil(out / bo) * bo, math.ceil(k / bi) * bi
        # zero padding never widens a range: calculate_qparams folds 0 into min/max anyway
        p = torch.nn.functional.pad(w, (0, pi - k, 0, po - out))
        p = p.reshape(po // bo, bo, pi // bi, bi)
        return p.amin(dim=(1, 3)), p.amax(dim=(1, 3))
    if st in (S.GROUP, S.TENSOR_GROUP):
        g = w.reshape(out, k // args.group_size, args.group_size)
        return g.amin(dim=-1), g.amax(dim=-1)
    raise ValueError(st)


def compress(w: torch.Tensor, preset: str) -> dict[str, torch.Tensor]:
    """f32 ``[out, in]`` -> the checkpoint tensors compressed-tensors writes for this module."""
    sc = scheme(preset)
    args = sc.weights
    sd = {"weight": w}
    gs = None
    if args.strategy == S.TENSOR_GROUP:
        gs = generate_gparam(w.min(), w.max())
        sd["weight_global_scale"] = gs
    mn, mx = _minmax(w, args)
    scale, _ = calculate_qparams(mn, mx, args, global_scale=gs)
    sd["weight_scale"] = scale
    comp = BaseCompressor.get_value_from_registry(FORMATS[preset])
    return comp.compress(sd, sc)


def decompress(sd: dict[str, torch.Tensor], preset: str) -> torch.Tensor:
    comp = BaseCompressor.get_value_from_registry(FORMATS[preset])
    return comp.decompress(dict(sd), scheme(preset))["weight"]
