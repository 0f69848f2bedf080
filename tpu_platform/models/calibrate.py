"""Calibrated FP4 quantization of a decoder's parameter tree: GPTQ, one layer at a time.

For each decoder layer in order: run the layer on the calibration tokens with its dense weights,
recording every matmul's input statistics ``H = X^T X`` (qkv, o, gate_up, down); replace the four
weights by GPTQ records (``quant/gptq.py``); run the layer again with the records to get the next
layer's input. Later layers are thus calibrated on the inputs the quantized model will really feed
them, so their corrections absorb part of the earlier layers' error.

Weights placed over a mesh (a tensor-parallel load, one host or several) stay there: the layer
passes run sharded, the Hessians come back replicated, and each device's block of a weight's
columns is quantized by the host that holds the device (GPTQ quantizes every column on its own
given ``H``; NVFP4's global scale is taken over the whole weight first), so no host reads or
holds a whole weight and the records equal a whole-weight GPTQ's.

The calibration text ships with the package (``quant/data/calibration.txt``: a mix of prose,
dialogue, a recipe, a letter, a little code), and is not the text the quality tests measure.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tpuserve import quant
from tpuserve.attention.dispatch import AttentionParams
from tpuserve.attention.metadata import AttentionMetadata
from tpuserve.quant.fp4 import MXFP4_BLOCK, Mxfp4Weight, Nvfp4Weight, hadamard32, pack_codes
from tpuserve.quant.fuse import gate_up_in_out
from tpuserve.quant.gptq import gptq_fp4
from tpuserve.tpu_platform.device import place
from tpuserve.tpu_platform.linear import linear, quant_linear_impls
from tpuserve.tpu_platform.mesh import MODEL_AXIS
from tpuserve.tpu_platform.models.decoder import block_from_normed, embed_tokens, rms_norm
from tpuserve.tpu_platform.models.weights import join_gate_up

# Package data of quant/ (setup.py), where the quantization formats live.
CALIBRATION_TEXT = os.path.join(os.path.dirname(quant.__file__), "data", "calibration.txt")
GPTQ_METHODS = ("mxfp4", "nvfp4")
MATMUL_KEYS = ("qkv", "o", "gate_up", "down")
# Per format, what measured best on the default model (benchmarks/RESULTS.md, "Quantized weights"):
# MXFP4's power-of-two scales gain from rotated blocks and from rounding the most-used inputs
# first; NVFP4's finer e4m3 scales do best chosen block by block as GPTQ goes (no act order).
ROTATE_DEFAULT = {"mxfp4": True, "nvfp4": False}
ACT_ORDER = {"mxfp4": True, "nvfp4": False}
DAMP = {"mxfp4": 0.05, "nvfp4": 0.2}  # x mean(diag H), added to H
_SEQ_LEN = 512  # calibration tokens are cut into sequences of at most this many
_PAGE = 16


def calibration_token_ids(tokenizer, path: str = CALIBRATION_TEXT) -> np.ndarray:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    # longer than some models' context, which is fine (it is cut into sequences): no warning
    ids = tokenizer.encode(text, verbose=False)
    if len(ids) < 64:
        raise ValueError(f"calibration text {path} has only {len(ids)} tokens")
    return np.asarray(ids, np.int32)


class _Probe:
    """A dense weight that, used through ``linear`` inside a trace, records its input's
    ``X^T X`` (f32) in a dict the traced function returns."""

    def __init__(self, w, sink: dict, key: str):
        self.w, self.sink, self.key = w, sink, key


def _probe_linear(x, probe: _Probe, bias, out_dtype):
    xf = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    probe.sink[probe.key] = jnp.dot(xf.T, xf, precision=jax.lax.Precision.HIGHEST)
    return linear(x, probe.w, bias, out_dtype=out_dtype)


@dataclasses.dataclass
class _Batch:
    """The calibration tokens as one ragged prefill step over sequences of <= _SEQ_LEN tokens."""

    token_ids: jax.Array
    cos: jax.Array
    sin: jax.Array
    md: object

    @classmethod
    def build(cls, token_ids: np.ndarray, arch):
        lens = [min(_SEQ_LEN, len(token_ids) - s) for s in range(0, len(token_ids), _SEQ_LEN)]
        pages_per_seq = -(-_SEQ_LEN // _PAGE)
        positions = np.concatenate([np.arange(n) for n in lens]).astype(np.float32)
        freqs = positions[:, None] * arch.inv_freq()[None, :]
        pages = 1 + np.arange(len(lens) * pages_per_seq, dtype=np.int32).reshape(len(lens), -1)
        md = AttentionMetadata(
            kv_lens=jnp.asarray(lens, jnp.int32),
            page_indices=jnp.asarray(pages),
            cu_q_lens=jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32),
            num_seqs=jnp.asarray([len(lens)], jnp.int32),
        )
        scale = arch.rope_attention_factor()  # YaRN's, as decoder.forward applies it; else 1
        return cls(
            jnp.asarray(token_ids), jnp.asarray(np.cos(freqs) * scale), jnp.asarray(np.sin(freqs) * scale), md
        )


def _run_layer(arch, md, cos, sin, h, w):
    """One decoder layer over the calibration batch (its own one-layer KV cache) -> h out."""
    num_pages = 1 + md.page_indices.size
    cache = jnp.zeros((1, num_pages, _PAGE, 2 * arch.num_kv_heads, arch.head_dim), h.dtype)
    params = AttentionParams(sm_scale=arch.head_dim**-0.5, sliding_window=arch.sliding_window)
    x = rms_norm(h, w["input_norm"], arch.rms_norm_eps)
    # "blocked": the same function as "reference" in jnp, but the reference gathers every token's
    # whole 512-key row (~8 GB over ~9.5k calibration tokens): ~4x slower a layer, most of a GPTQ load.
    h, _ = block_from_normed(arch, params, "blocked", md, cos, sin, x, h, cache, w, jnp.int32(0))
    return h


def _in_out(key: str, w):
    """A layer's weight as ``[in, *out]`` (only the dense gate_up is stored otherwise)."""
    return gate_up_in_out(w, False) if key == "gate_up" else w


def _layer_hessians(arch, keys, md, cos, sin, h, w) -> dict:
    """{key: X^T X [K, K] f32} of the layer's matmuls ``keys``, with its dense weights."""
    sink: dict = {}
    # gate_up probed as [H, 2, F]: the decoder then runs it through ``linear`` in one piece
    probes = {k: (_Probe(_in_out(k, v), sink, k) if k in keys else v) for k, v in w.items()}
    _run_layer(arch, md, cos, sin, h, probes)
    return sink


def _rotate_rows(a: np.ndarray) -> np.ndarray:
    """``R a`` in float64 for ``a [K, N]``: each run of 32 rows times the orthonormal Hadamard
    matrix (``fp4.hadamard_blocks(a, axis=-2)``, kept in float64 for the Hessian's sake)."""
    k, n = a.shape
    return np.einsum("ij,bjn->bin", hadamard32(), a.reshape(k // MXFP4_BLOCK, MXFP4_BLOCK, n)).reshape(k, n)


def _rotated_hessian(hessian: np.ndarray) -> np.ndarray:
    return _rotate_rows(_rotate_rows(np.asarray(hessian, np.float64)).T).T  # R H R


def gptq_record(w, hessian: np.ndarray, method: str, *, rotate: bool = False):
    """One 2-D-contracted weight ``[K, *out]`` -> an FP4 record, by GPTQ over ``hessian [K, K]``.

    rotate (MXFP4 only): quantize ``R W`` against ``R H R`` (the inputs ``x R`` the rotated record
    will meet; ``Mxfp4Weight.rotated``). A weight on a mesh of several devices is quantized by
    device column blocks (``_gptq_by_device``)."""
    if rotate and method != "mxfp4":
        raise ValueError(f"rotation is for MXFP4 records, not {method!r}")
    if rotate:
        hessian = _rotated_hessian(hessian)
    if _mesh_of(w) is not None:
        return _gptq_by_device(w, hessian, method, rotate)
    w = np.asarray(w, np.float32)
    out = tuple(w.shape[1:])
    codes, scales, g = _gptq_columns(w.reshape(w.shape[0], -1), hessian, method, rotate)
    g_arr = None if g is None else jnp.full((1, 1), g, jnp.float32)
    return _record(method, pack_codes(jnp.asarray(codes)), jnp.asarray(scales), g_arr, out, rotate)


def _gptq_columns(w2, hessian: np.ndarray, method: str, rotate: bool, amax: float | None = None):
    """GPTQ of columns ``w2 [K, n]`` (all of a weight's, or a block of them with the whole
    weight's ``amax``) -> (codes, scales, global scale); ``hessian`` is rotated already."""
    if rotate:
        w2 = _rotate_rows(np.asarray(w2, np.float64))
    return gptq_fp4(w2, hessian, method, damp=DAMP[method], act_order=ACT_ORDER[method], amax=amax)


def _record(method: str, packed, scales, g, out: tuple, rotate: bool):
    if method == "mxfp4":
        return Mxfp4Weight(packed, scales, out, rotate)
    return Nvfp4Weight(packed, scales, g, out, False)


def _mesh_of(x):
    """The mesh ``x`` is placed over when it spans several devices on the model axis, else None."""
    sharding = getattr(x, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or MODEL_AXIS not in mesh.shape or mesh.shape[MODEL_AXIS] < 2:
        return None
    return mesh


def _gptq_by_device(w: jax.Array, hessian: np.ndarray, method: str, rotate: bool):
    """``gptq_record`` of a weight placed over a mesh (``hessian`` rotated already): resharded to
    blocks of its ``[K, N]`` columns along the model axis, each block quantized by the host holding
    its device, the codes and scales assembled as arrays of the same column sharding (the runner
    reshards them to its own layout when it places the records)."""
    mesh = _mesh_of(w)
    k, out = w.shape[0], tuple(w.shape[1:])
    n = math.prod(out)
    if n % mesh.shape[MODEL_AXIS]:
        raise ValueError(f"GPTQ by device: {n} columns do not split over {mesh.shape[MODEL_AXIS]} devices")
    by_columns = NamedSharding(mesh, P(None, MODEL_AXIS))
    replicated = NamedSharding(mesh, P())
    w2 = jax.jit(lambda a: a.reshape(k, n).astype(jnp.float32), out_shardings=by_columns)(w)
    amax = None
    if method == "nvfp4":  # the global scale is the whole weight's
        amax = float(jax.jit(lambda a: jnp.max(jnp.abs(a)), out_shardings=replicated)(w2))
    codes, scales, g = [], [], None
    for shard in w2.addressable_shards:
        c, s, g = _gptq_columns(np.asarray(shard.data, np.float32), hessian, method, rotate, amax)
        codes.append(jax.device_put(c, shard.device))
        scales.append(jax.device_put(np.asarray(s), shard.device))
    codes_all = jax.make_array_from_single_device_arrays((k, n), by_columns, codes)
    scales_all = jax.make_array_from_single_device_arrays((scales[0].shape[0], n), by_columns, scales)
    packed = jax.jit(pack_codes, out_shardings=by_columns)(codes_all)  # pairs along K: no exchange
    g_all = None if g is None else place(np.full((1, 1), g, np.float32), replicated)
    return _record(method, packed, scales_all, g_all, out, rotate)


def quantize_layers_gptq(
    params: dict, arch, token_ids: np.ndarray, method: str, *, keys=MATMUL_KEYS, rotate: bool | None = None
) -> dict:
    """Return ``params`` with each layer's ``keys`` replaced by GPTQ ``method`` records.

    ``layers`` may be stacked ([L, ...] arrays) or a list of per-layer dicts; the result keeps the
    form (records stacked along L again for the stacked form). Its passes route ``linear`` through
    their own table: the quantized records and the probes.
    """
    if method not in GPTQ_METHODS:
        raise ValueError(f"GPTQ quantizes {GPTQ_METHODS}, got {method!r}")
    if rotate is None:
        rotate = ROTATE_DEFAULT[method]
    token_ids = np.asarray(token_ids, np.int32)
    if token_ids.size == 0 or token_ids.min() < 0 or token_ids.max() >= arch.vocab_size:
        raise ValueError(
            f"calibration token ids must be non-empty and in [0, {arch.vocab_size}) "
            f"(the model's vocabulary); does the tokenizer belong to the model?"
        )
    stacked = isinstance(params["layers"], dict)
    num_layers = arch.num_layers
    layers = (
        [{k: v[i] for k, v in params["layers"].items()} for i in range(num_layers)]
        if stacked
        else [join_gate_up(w) for w in params["layers"]]
    )
    batch = _Batch.build(token_ids, arch)
    mesh = next((m for m in map(_mesh_of, jax.tree_util.tree_leaves(layers[0])) if m is not None), None)
    hessians = jax.jit(functools.partial(_layer_hessians, arch, tuple(keys)))
    if mesh is not None:
        # Weights over a mesh (perhaps of several hosts): the batch joins them there, and the
        # Hessians come back whole on every host, for each to quantize its devices' columns.
        replicated = NamedSharding(mesh, P())

        def put(x):
            return place(np.asarray(x), replicated)

        md = jax.tree_util.tree_map(put, batch.md)
        batch = _Batch(put(batch.token_ids), put(batch.cos), put(batch.sin), md)
        hessians = jax.jit(functools.partial(_layer_hessians, arch, tuple(keys)), out_shardings=replicated)
    data = (batch.md, batch.cos, batch.sin)
    run = jax.jit(functools.partial(_run_layer, arch))
    h = embed_tokens(params["embed"], batch.token_ids).astype(jnp.float32)
    done = []
    with quant_linear_impls().register(_Probe, _probe_linear).active():
        for w in layers:
            stats = hessians(*data, h, w)
            q = dict(w)
            for k in keys:
                q[k] = gptq_record(_in_out(k, w[k]), np.asarray(stats[k], np.float64), method, rotate=rotate)
            h = run(*data, h, q)
            done.append(q)
    out_layers: dict | list[dict]
    if stacked:
        out_layers = {
            k: jax.tree_util.tree_map(lambda *a: jnp.stack(a), *[d[k] for d in done]) for k in done[0]
        }
    else:
        out_layers = done
    return {**params, "layers": out_layers}
