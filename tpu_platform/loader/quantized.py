"""Pre-quantized Hugging Face checkpoints: detect the format, read each Linear as a quant/ record.

Formats (facts file, section 1; every scale multiplies whatever its name says):

* HF ``fp8`` (DeepSeek-V3 style): ``X.weight`` e4m3 ``[out, in]``, ``X.weight_scale_inv`` f32 (or
  e8m0) ``[ceil(out/bo), ceil(in/bi)]`` with ``weight_block_size [bo, bi]``; without a block size,
  ``X.weight_scale`` per tensor.
* compressed-tensors (``quant_method: compressed-tensors``):
  ``float-quantized`` FP8: ``X.weight`` e4m3 + ``X.weight_scale`` per tensor ``[1]``, per channel
  ``[out, 1]`` or per block (``block_structure`` of the group);
  ``nvfp4-pack-quantized``: ``X.weight_packed`` u8 ``[out, in/2]``, ``X.weight_scale`` e4m3
  ``[out, in/16]``, ``X.weight_global_scale`` f32 ``[1]`` that *divides* (2688/amax);
  ``mxfp4-pack-quantized``: ``X.weight_packed`` + ``X.weight_scale`` u8 e8m0 ``[out, in/32]``.
* ModelOpt (``quant_method: modelopt`` or ``hf_quant_config.json``), NVFP4: ``X.weight`` u8
  packed, ``X.weight_scale`` e4m3, ``X.weight_scale_2`` f32 that *multiplies* (amax/2688);
  FP8: ``X.weight`` e4m3 + ``X.weight_scale`` per tensor.
* gpt-oss's own ``quant_method: mxfp4`` (experts only, ``*_blocks`` / ``*_scales``): ``detect``
  names it for the plugins' config-time checks; the loader reads it with gpt_oss_mxfp4.py.

Which Linears are quantized is read off the tensors themselves (a module left dense by the
checkpoint's ``ignore`` / ``exclude_modules`` simply has a float ``X.weight``), so the ignore
patterns need no interpreting. Activation schemes (``input_scale``, dynamic per-token or
``input_global_scale``) are not applied: every format runs weight-only (W8A16 / W4A16), which is
what the checkpoint's own dequantized weights give.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from tpuserve.quant.fp4 import Mxfp4Weight, Nvfp4Weight, mxfp4_from_checkpoint, nvfp4_from_checkpoint
from tpuserve.quant.fp8 import Fp8Weight, fp8_from_checkpoint
from tpuserve.tpu_platform.loader.gpt_oss_mxfp4 import is_gpt_oss_mxfp4
from tpuserve.tpu_platform.models.arch import ModelConfigError

PRODUCERS = ("fp8", "compressed-tensors", "modelopt")
# CheckpointQuant.producer of gpt-oss's own MXFP4 experts (quant_method "mxfp4").
GPT_OSS_PRODUCER = "gpt-oss"
_CT_FORMATS = {
    "float-quantized": "fp8",
    "naive-quantized": "fp8",
    "nvfp4-pack-quantized": "nvfp4",
    "mxfp4-pack-quantized": "mxfp4",
}


@dataclass(frozen=True)
class CheckpointQuant:
    """What a checkpoint's ``quantization_config`` says.

    method: the weight format family, as ``--quantization`` names it ("fp8", "mxfp4", "nvfp4").
    producer: "fp8" (HF / DeepSeek), "compressed-tensors", "modelopt" or "gpt-oss" (its MXFP4
      experts, which the loader reads through gpt_oss_mxfp4.py, not ``read_linear``).
    block_size: FP8 2-D scale block ``(out, in)`` (HF ``weight_block_size``, compressed-tensors
      ``block_structure``), None for per-tensor / per-channel scales.
    """

    method: str
    producer: str
    block_size: tuple[int, int] | None = None


def _block_size(value: Sequence[int]) -> tuple[int, int]:
    """A config's FP8 scale block ``[out, in]`` as CheckpointQuant keeps it."""
    if len(value) != 2:
        raise ModelConfigError(f"FP8 scale block {value!r}: expected [out, in]")
    return int(value[0]), int(value[1])


def _ct_method(qc: dict) -> tuple[str, tuple[int, int] | None]:
    groups = qc.get("config_groups") or {}
    formats = {g.get("format") or qc.get("format") for g in groups.values()} or {qc.get("format")}
    methods = {_CT_FORMATS.get(f) if isinstance(f, str) else None for f in formats}
    method = methods.pop() if len(methods) == 1 else None
    if method is None:
        raise ModelConfigError(
            f"compressed-tensors format(s) {sorted(map(str, formats))} are not "
            f"supported; supported: {sorted(_CT_FORMATS)}"
        )
    blocks = {
        _block_size(g["weights"]["block_structure"])
        for g in groups.values()
        if (g.get("weights") or {}).get("block_structure")
    }
    if len(blocks) > 1:
        raise ModelConfigError(f"compressed-tensors groups use different FP8 blocks {sorted(blocks)}")
    if method == "fp8":
        bits = {(g.get("weights") or {}).get("num_bits") for g in groups.values()}
        kinds = {(g.get("weights") or {}).get("type") for g in groups.values()}
        if bits != {8} or kinds != {"float"}:
            raise ModelConfigError(
                f"compressed-tensors weights of {bits} bits / type {kinds} are "
                f"not supported (only 8-bit float, 4-bit nvfp4/mxfp4)"
            )
    return method, (blocks.pop() if blocks else None)


def detect(config: dict, path: str) -> CheckpointQuant | None:
    """The checkpoint's quantization (config.json ``quantization_config`` or ModelOpt's
    ``hf_quant_config.json``); None when it is a dense checkpoint."""
    qc = config.get("quantization_config")
    if qc is None:
        side = os.path.join(path, "hf_quant_config.json")
        if not os.path.isfile(side):
            return None
        with open(side) as f:
            qc = {"quant_method": "modelopt", **json.load(f).get("quantization", {})}
    kind = str(qc.get("quant_method", "")).lower()
    if kind == "fp8":
        if qc.get("fmt", "e4m3") != "e4m3":
            raise ModelConfigError(f"fp8 checkpoint format {qc.get('fmt')!r} is not supported (only e4m3)")
        block = qc.get("weight_block_size")
        return CheckpointQuant("fp8", "fp8", _block_size(block) if block else None)
    if kind == "compressed-tensors":
        method, block = _ct_method(qc)
        return CheckpointQuant(method, "compressed-tensors", block)
    if kind in ("modelopt", "modelopt_fp4"):
        algo = str(qc.get("quant_algo", "")).upper()
        if algo in ("NVFP4", "FP8"):
            return CheckpointQuant(algo.lower(), "modelopt")
        raise ModelConfigError(f"ModelOpt quant_algo {algo!r} is not supported (NVFP4, FP8)")
    if kind == "mxfp4":
        # gpt-oss's published format: only its experts, as *_blocks / *_scales (gpt_oss_mxfp4.py,
        # which the loader reads itself). The method names no layout of its own beyond that model.
        if is_gpt_oss_mxfp4(config):
            return CheckpointQuant("mxfp4", GPT_OSS_PRODUCER)
        archs = config.get("architectures") or []
        raise ModelConfigError(
            f"checkpoint quant_method 'mxfp4' is gpt-oss's format (its experts as *_blocks / "
            f"*_scales) and is read for GptOssForCausalLM only, not for {archs or 'an unnamed architecture'}"
        )
    raise ModelConfigError(
        f"checkpoint quant_method {kind!r} is not supported; supported: {PRODUCERS} and 'mxfp4' (gpt-oss)"
    )


def _as_e4m3(a: np.ndarray) -> np.ndarray:
    import ml_dtypes

    if a.dtype == ml_dtypes.float8_e4m3fn:
        return a
    if a.dtype == np.uint8:  # some writers store fp8 bytes as U8
        return a.view(ml_dtypes.float8_e4m3fn)
    raise ModelConfigError(f"expected float8_e4m3fn data, got {a.dtype}")


def _is_float8(a: np.ndarray) -> bool:
    import ml_dtypes

    return a.dtype in (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2)


def _required(raw: Callable[[str], np.ndarray | None], name: str) -> np.ndarray:
    a = raw(name)
    if a is None:
        raise ModelConfigError(f"quantized checkpoint: tensor {name} is missing")
    return a


def _quantized_weight(q: CheckpointQuant, module: str, probe: Callable[[str], np.ndarray | None]) -> bool:
    """Whether ``module`` is stored quantized: FP4 ``weight_packed``, or a ``.weight`` of fp8 codes,
    of u8 in an FP8 checkpoint (e4m3 stored as bytes), or of u8 with ModelOpt's ``weight_scale_2``
    (NVFP4's packed pairs). Anything else is a dense module (the checkpoint's ignore list)."""
    if probe(module + ".weight_packed") is not None:
        return True
    weight = probe(module + ".weight")
    if weight is None:
        return False
    if weight.dtype == np.uint8:
        return q.method == "fp8" or probe(module + ".weight_scale_2") is not None
    return _is_float8(weight)


def read_linear(
    q: CheckpointQuant,
    module: str,
    raw: Callable[[str], np.ndarray | None],
    lazy: bool = False,
    probe: Callable[[str], np.ndarray | None] | None = None,
) -> Fp8Weight | Mxfp4Weight | Nvfp4Weight | None:
    """The quantized record for Linear ``module`` (e.g. ``model.layers.0.mlp.down_proj``), or None
    when the checkpoint keeps that module dense. ``raw(name)`` returns a tensor in its stored dtype
    (fp8 as ml_dtypes) or None. Records are 2-D ``[in, out]`` (quant/ layout), output axes flat.
    lazy: the record's arrays are numpy, the data transposed views of the stored tensors, unread
    (per-slice reads on several hosts: weights.build_params's ``sharded_reads``).
    probe: like ``raw`` but not counted as a read (``SafetensorsFiles.view``): what looks at a
    tensor's dtype to tell a dense module (e.g. an unquantized LM head) from a quantized one."""
    xp = np if lazy else jnp
    probe = raw if probe is None else probe
    if not _quantized_weight(q, module, probe):
        return None
    packed = raw(module + ".weight_packed")
    if packed is not None:  # compressed-tensors FP4
        fp4_scale = _required(raw, module + ".weight_scale")
        gs = raw(module + ".weight_global_scale")
        if gs is not None:
            return nvfp4_from_checkpoint(packed, _as_e4m3(fp4_scale), gs, global_divides=True, xp=xp)
        return mxfp4_from_checkpoint(packed, fp4_scale, xp=xp)
    weight = _required(raw, module + ".weight")
    scale_2 = raw(module + ".weight_scale_2") if weight.dtype == np.uint8 else None
    if scale_2 is not None:  # ModelOpt NVFP4
        return nvfp4_from_checkpoint(
            weight, _as_e4m3(_required(raw, module + ".weight_scale")), scale_2, global_divides=False, xp=xp
        )
    scale = raw(module + ".weight_scale_inv")
    if scale is None:
        scale = raw(module + ".weight_scale")
    if scale is None:
        raise ModelConfigError(f"fp8 tensor {module}.weight has no weight_scale(_inv)")
    scale = np.asarray(scale).astype(np.float32)  # e8m0 (UE8M0 scale_inv) decodes exactly
    n, k = weight.shape
    per_block = q.block_size is not None and scale.size > 1 and scale.shape != (n, 1)
    return fp8_from_checkpoint(_as_e4m3(weight), scale, block_size=q.block_size if per_block else None, xp=xp)
