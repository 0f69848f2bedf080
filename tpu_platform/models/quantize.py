"""Online quantization of a loaded dense parameter tree (``--quantization fp8|mxfp4|nvfp4``).

The tree is the decoder's (``tpu_platform/models/weights.py::build_params``): ``layers`` holds the
matmul weights ``qkv [L, H, Hkv, G+2, D]``, ``o [L, Hq*D, H]``, ``gate_up [L, 2, H, F]``,
``down [L, F, H]`` (stacked, for ``layer_loop="scan"``) or is a list of per-layer dicts (unrolled,
after ``unstack_layers``). Those four become records; norms, biases and the embedding stay dense
(the embedding is a gather, and a tied LM head reads it). An untied ``lm_head [H, V]`` is quantized
only on request: it is where low-bit error shows most.

Recipes: "fp8" per output channel (compressed-tensors' FP8_DYNAMIC weights, bit for bit), W8A16;
"mxfp4" / "nvfp4" W4A16, either GPTQ over calibration tokens (``models/calibrate.py``) or
round-to-nearest with a per-block scale search (``quant/search.py``).

It lives with the models, not in quant/: GPTQ runs the decoder's layers, and a tree of records
needs the model's ``linear`` routed to them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax

from tpuserve.quant.fp8 import quantize_fp8
from tpuserve.quant.fuse import gate_up_in_out
from tpuserve.quant.search import quantize_mxfp4_search, quantize_nvfp4_search
from tpuserve.tpu_platform.models.calibrate import GPTQ_METHODS, quantize_layers_gptq
from tpuserve.tpu_platform.models.weights import join_gate_up

METHODS = ("fp8", "fp8_w8a8", "fp8_block", "mxfp4", "nvfp4")
MATMUL_KEYS = ("qkv", "o", "gate_up", "down")


@dataclasses.dataclass(frozen=True)
class QuantReport:
    """Weight memory before and after, in bytes.

    ``dense_bytes``: the replaced arrays as they were stored (f32 on CPU, bf16 on accelerators);
    ``bf16_bytes``: the same elements at 2 bytes (the yardstick of the acceptance ratios);
    ``quant_bytes``: the records that replaced them (data + scales);
    ``total_before`` / ``total_after``: the whole tree.
    """

    method: str
    dense_bytes: int
    bf16_bytes: int
    quant_bytes: int
    total_before: int
    total_after: int

    @property
    def ratio_vs_bf16(self) -> float:
        return self.quant_bytes / self.bf16_bytes if self.bf16_bytes else 1.0

    def summary(self) -> str:
        mib = 1 / 2**20
        return (
            f"{self.method}: matmul weights {self.dense_bytes * mib:.1f} MiB -> "
            f"{self.quant_bytes * mib:.1f} MiB ({self.ratio_vs_bf16:.3f}x of bf16); "
            f"all params {self.total_before * mib:.1f} -> {self.total_after * mib:.1f} MiB"
        )


def _quantizer(method: str, num_lead: int):
    if method == "fp8":
        return functools.partial(quantize_fp8, granularity="channel", num_lead=num_lead)
    if method == "fp8_w8a8":
        return functools.partial(quantize_fp8, granularity="channel", num_lead=num_lead, act_quant=True)
    if method == "fp8_block":
        return functools.partial(quantize_fp8, granularity="block", block_size=128, num_lead=num_lead)
    # FP4: each block's scale is searched for the least squared error (quant/search.py); the
    # amax-only rule of the reference quantizers loses far more quality on small models.
    if method == "mxfp4":
        return functools.partial(quantize_mxfp4_search, num_lead=num_lead)
    if method == "nvfp4":
        return functools.partial(quantize_nvfp4_search, num_lead=num_lead)
    raise ValueError(f"quantization method must be one of {METHODS}, got {method!r}")


def tree_nbytes(tree) -> int:
    return sum(int(a.size) * a.dtype.itemsize for a in jax.tree_util.tree_leaves(tree))


def quantize_params(
    params: dict,
    method: str,
    *,
    keys=MATMUL_KEYS,
    lm_head: bool = False,
    calibration=None,
) -> tuple[dict, QuantReport]:
    """Replace the matmul weights of ``params`` by ``method`` records; returns (tree, report).

    The records multiply through a runner's ``LinearImpls`` (``linear.quant_linear_impls()``).
    calibration: ``(arch, token_ids)`` to quantize the layers' FP4 weights by GPTQ over those
    tokens (``models/calibrate.py``) instead of round-to-nearest; None: round-to-nearest.
    """
    _quantizer(method, 0)  # validate early
    dense = bf16 = quant = 0
    calibrated = None  # the GPTQ layers, in the form of params["layers"]
    if calibration is not None:
        if method not in GPTQ_METHODS:
            raise ValueError(f"calibrated quantization is for {GPTQ_METHODS}, not {method!r}")
        arch, token_ids = calibration
        calibrated = quantize_layers_gptq(params, arch, token_ids, method, keys=keys)["layers"]

    def convert(arr, num_lead, rec=None):
        nonlocal dense, bf16, quant
        if rec is None:
            rec = jax.jit(_quantizer(method, num_lead))(arr)
        dense += int(arr.size) * arr.dtype.itemsize
        bf16 += int(arr.size) * 2
        quant += rec.nbytes
        return rec

    def convert_layer(layer: dict, num_lead: int, done: dict | None) -> dict:
        def weight(k, v):  # gate_up is quantized as [in, *out] = [H, 2, F]
            return gate_up_in_out(v, num_lead == 1) if k == "gate_up" else v

        return {
            k: (convert(weight(k, v), num_lead, done and done[k]) if k in keys else v)
            for k, v in layer.items()
        }

    out = dict(params)
    layers = params["layers"]
    if isinstance(layers, dict):  # stacked [L, ...]
        out["layers"] = convert_layer(layers, 1, calibrated)
    else:  # unrolled: a list of per-layer dicts (gate_up fused again: its record is one weight)
        out["layers"] = [
            convert_layer(join_gate_up(layer), 0, calibrated and calibrated[i])
            for i, layer in enumerate(layers)
        ]
    if lm_head and "lm_head" in params:
        out["lm_head"] = convert(params["lm_head"], 0)
    report = QuantReport(method, dense, bf16, quant, tree_nbytes(params), tree_nbytes(out))
    return out, report
