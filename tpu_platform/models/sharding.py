"""Tensor-parallel PartitionSpecs for the decoder's parameter tree (layout in ``decoder.py``).

The weight layout is chosen so that each array needs exactly one PartitionSpec over one mesh axis:
attention splits by KV head (qkv's Hkv axis carries each KV head's G query heads, its K and its V;
o's rows are the query heads in the same kv-major order), the MLP splits by F (gate_up's last axis,
down's rows), the embedding by vocabulary (an LM head [H, V] by its columns). Everything else (norms,
output biases) is replicated. XLA's partitioner inserts the all-reduces after o and down.
The split is even when the axis size divides Hkv, F and V.

A mixture-of-experts layer's experts are replicated by default (each device holds all E and runs
the whole expert block on the replicated activations). With ``expert_parallel`` they split on E
instead, over the same "model" axis (EP size = TP size): every per-expert array, dense or a
quantized record's arrays (gpt-oss's packed MXFP4 experts) and the experts' biases alike, so a
device holds E/TP whole experts. The router stays replicated (moe.expert_parallel_mlp says why).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from tpuserve.quant import fuse
from tpuserve.quant.fuse import gate_up_in_out
from tpuserve.tpu_platform.device import HostSource, read_whole
from tpuserve.tpu_platform.models.moe import EXPERT_ARRAYS

# Per-layer weight -> (rank without the [L] axis, spec factory of the mesh axis name).
_LAYER_SPECS = {
    "qkv": (4, lambda a: P(None, a, None, None)),  # [H, Hkv, G+2, D]
    "qkv_bias": (3, lambda a: P(a, None, None)),  # [Hkv, G+2, D]
    "o": (2, lambda a: P(a, None)),  # [Hq*D, H]: rows are heads
    "gate_up": (3, lambda a: P(None, None, a)),  # [2, H, F]
    "gate_up_bias": (2, lambda a: P(None, a)),  # [2, F]
    # unrolled dense layers split gate_up (weights.unstack_layers): [H, F] each, biases [F]
    "gate": (2, lambda a: P(None, a)),
    "up": (2, lambda a: P(None, a)),
    "gate_bias": (1, lambda a: P(a)),
    "up_bias": (1, lambda a: P(a)),
    # grouped by device (group_gate_up_by_device): [H, TP, 2, F/TP] and [TP, 2, F/TP]
    "gate_up_grouped": (4, lambda a: P(None, a, None, None)),
    "gate_up_bias_grouped": (3, lambda a: P(a, None, None)),
    "down": (2, lambda a: P(a, None)),  # [F, H]
}
_TOP_SPECS = {
    "embed": (2, lambda a: P(a, None)),  # [V, H]: vocab-parallel
    "lm_head": (2, lambda a: P(None, a)),  # [H, V]
}


# Quantized weight records (quant/) keep a weight [in, *out] as 2-D data [rows, N] with N =
# prod(out) flattened and rows derived from `in` (K, K/2 packed nibbles), plus scales [rows', N'].
# How each record's arrays split: "out" splits the last axis (qkv: Hkv is N's outermost factor, so
# an even split of N is a split by KV head), "in" the rows (o, down: the contracted axis, as dense).
# gate_up's N is [2, F] flattened with the 2 outermost, so no single-axis split of N is a split by F:
# such records stay replicated (correct, just not memory-sharded). Quantized after
# ``group_gate_up_by_device`` (or, pre-quantized, reordered by ``group_gate_up_records_by_device``)
# its N is [TP, 2, F/TP]: an even split of N is then a split by F.
_RECORD_SPLIT = {"qkv": "out", "o": "in", "down": "in", "lm_head": "out", "gate_up": "out"}


def _record_spec(name: str, rec, axis: str, stacked: bool):
    """The record with each data array replaced by its PartitionSpec (a spec tree of its type).

    A scale with one row or one column (per-tensor / per-channel) is not split along that axis.
    """
    import dataclasses

    split = _RECORD_SPLIT.get(name)
    if name == "gate_up" and len(rec.out_shape) != 3:
        split = None  # [2, F]: see _RECORD_SPLIT
    lead = (None,) if stacked else ()
    specs = {}
    for f in dataclasses.fields(rec):
        arr = getattr(rec, f.name)
        if not hasattr(arr, "ndim"):
            continue  # static metadata (block, out_shape, ...)
        rows, cols = arr.shape[-2], arr.shape[-1]
        if split == "out" and cols > 1:
            specs[f.name] = P(*lead, None, axis)
        elif split == "in" and rows > 1:
            specs[f.name] = P(*lead, axis, None)
        else:
            specs[f.name] = P()
    return dataclasses.replace(rec, **specs)


def _spec(name: str, arr, table: dict, axis: str, stacked: bool, expert_parallel: bool = False):
    if expert_parallel and name in EXPERT_ARRAYS:
        # E leads a layer's array ([E, ...]); a stacked [L, E, ...] has L first
        # a spec for E on every array (a record's too), whatever its rank
        spec = P(None, axis) if stacked else P(axis)
        return jax.tree_util.tree_map(lambda _: spec, arr)
    if not hasattr(arr, "ndim"):  # a quantized weight record (a pytree of arrays)
        # a spec per array, so the spec tree has the params' structure; a record with no split
        # (gpt-oss's packed experts without expert_parallel, replicated like dense experts) gets
        # P() for each
        return _record_spec(name, arr, axis, stacked)
    if name not in table:  # norms, o_bias, down_bias, q_norm, k_norm, router, experts: replicated
        return P()
    rank, make = table[name]
    ndim = getattr(arr, "ndim", None)
    if name in ("gate_up", "gate_up_bias") and ndim == rank + 1 + stacked:
        rank, make = table[name + "_grouped"]
    if ndim != rank + stacked:
        raise ValueError(
            f"parameter {name!r} has rank {ndim}, expected {rank + stacked} "
            f"({'stacked [L, ...]' if stacked else 'per-layer'} layout of decoder.py)"
        )
    spec = make(axis)
    return P(None, *spec) if stacked else spec


def param_partition_specs(params: dict, axis: str = "model", expert_parallel: bool = False) -> dict:
    """The params tree with each array replaced by its ``PartitionSpec`` over mesh axis ``axis``.

    Works for stacked layers (``layers`` a dict of [L, ...] arrays: the L axis is never split) and
    for ``weights.unstack_layers`` trees (a list of per-layer dicts). A quantized weight record
    gets a record of the same type holding one spec per array (``_RECORD_SPLIT``). Use as
    ``jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), params, specs)``.
    expert_parallel: split a MoE layer's experts on E over ``axis`` (module docstring);
    ``check_expert_parallel`` first.
    """
    out: dict[str, Any] = {
        k: _spec(k, v, _TOP_SPECS, axis, False) for k, v in params.items() if k != "layers"
    }
    layers = params["layers"]
    if isinstance(layers, (list, tuple)):
        out["layers"] = type(layers)(
            {k: _spec(k, v, _LAYER_SPECS, axis, False, expert_parallel) for k, v in w.items()} for w in layers
        )
    else:
        out["layers"] = {k: _spec(k, v, _LAYER_SPECS, axis, True, expert_parallel) for k, v in layers.items()}
    return out


def kv_cache_partition_spec(axis: str = "model") -> P:
    """The paged KV cache [L, P, page_size, C, D] split by KV head, like qkv.

    K and V of a head are adjacent (``kv_cache.layout.interleave_kv``), so with C = 2*Hkv an even
    split of the C axis gives each device both halves of its own KV heads. Layouts that pad C (the
    TPU kernel's) need the padding per device instead; that is not handled here yet.
    """
    return P(None, None, None, axis, None)


def kv_head_replicas(num_heads: int, num_kv_heads: int, tp: int) -> int:
    """How many copies of each KV head tensor parallelism over ``tp`` devices needs (1: none).

    Raises ValueError naming the flag when the model's heads cannot split over ``tp`` devices.
    """
    problems = []
    if num_heads % tp:
        problems.append(f"{num_heads} attention heads")
    if num_kv_heads % tp and tp % num_kv_heads:
        problems.append(f"{num_kv_heads} KV heads (need a multiple or a divisor of the TP size)")
    if problems:
        raise ValueError(
            f"tensor_parallel_size={tp}: the model's "
            + " and ".join(problems)
            + f" do not split over {tp} devices"
        )
    return max(1, tp // num_kv_heads)


def check_tensor_parallel(arch, tp: int) -> int:
    """Validate that ``arch`` splits over ``tp`` devices; returns kv_head_replicas (see there)."""
    r = kv_head_replicas(arch.num_heads, arch.num_kv_heads, tp)
    sizes = [("vocab_size", arch.vocab_size)]
    if arch.moe is None or len(arch.moe.moe_layers) < arch.num_layers:  # some layer has a dense MLP
        sizes.insert(0, ("intermediate_size", arch.intermediate_size))
    for what, n in sizes:
        if n % tp:
            raise ValueError(
                f"tensor_parallel_size={tp}: the model's {what}={n} does not split evenly over {tp} devices"
            )
    return r


def check_expert_parallel(arch, ep: int) -> None:
    """Validate expert parallelism over ``ep`` devices for ``arch``: it needs experts, and E / ep
    whole experts a device. Raises ValueError naming the flag."""
    if arch.moe is None:
        raise ValueError(
            f"enable_expert_parallel: {arch.architecture} is a dense model (no experts to shard); "
            f"drop --enable-expert-parallel"
        )
    e = arch.moe.num_experts
    if e % ep:
        raise ValueError(
            f"enable_expert_parallel: the model's {e} experts do not split evenly over "
            f"tensor_parallel_size={ep} devices (expert parallelism shards the experts over the "
            f"tensor-parallel devices); use a tensor_parallel_size that divides {e}"
        )


def group_gate_up_by_device(params: dict, tp: int) -> dict:
    """gate_up [.., 2, H, F] -> [.., H, TP, 2, F/TP] (its bias [.., 2, F] -> [.., TP, 2, F/TP]).

    A quantized record flattens a weight's output axes into one N; with gate and up as the two
    outermost blocks of N, no even split of N gives each device both halves of its F slice. Grouped
    by device first, N's outermost factor is the device, so the record splits by F like the dense
    weight. The decoder turns the grouped output back into [T, 2, F] (a relabelling: F keeps its
    order). Apply before quantizing; dense weights do not need it.
    """

    stacked = not isinstance(params["layers"], (list, tuple))

    def group(x):
        if x.ndim == 3 + stacked:  # the weight, not its bias
            x = gate_up_in_out(x, stacked)
        *lead, two, f = x.shape
        if f % tp:
            raise ValueError(f"intermediate_size={f} does not split over {tp} devices")
        return x.reshape(*lead, two, tp, f // tp).swapaxes(-3, -2)

    return _map_weight_and_bias(params, "gate_up", group)


def group_gate_up_records_by_device(params: dict, tp: int) -> dict:
    """A pre-quantized checkpoint's gate_up records (N = [2, F] flattened, ``_RECORD_SPLIT``)
    with their columns reordered to [TP, 2, F/TP], as ``group_gate_up_by_device`` gives an
    online-quantized one: the record then splits by F over the TP devices instead of being held
    whole on each. Only a permutation of columns (each scale is per column after fusing), so the
    values are the checkpoint's; a sharded load's leaves stay unread (``HostSource.columns``).
    Its bias, if any, is grouped the same way; a dense gate_up is left as it is."""
    import dataclasses

    import jax.numpy as jnp

    def take(a, columns):
        if isinstance(a, HostSource):
            return a.columns(columns)
        return jnp.take(a, jnp.asarray(columns, jnp.int32), axis=-1)

    ops = fuse.ArrayOps(concat=lambda xs: None, take=take)  # take_out never concatenates

    def layer(w):
        rec = w.get("gate_up")
        if not dataclasses.is_dataclass(rec) or len(rec.out_shape) != 2:
            return w
        f = rec.out_shape[1]
        if f % tp:
            raise ValueError(f"intermediate_size={f} does not split over {tp} devices")
        # new column (t, g, j) is old column g*F + t*F/TP + j
        columns = np.arange(2 * f).reshape(2, tp, f // tp).transpose(1, 0, 2).reshape(-1)
        w = dict(w, gate_up=fuse.take_out(rec, columns, (tp, 2, f // tp), ops=ops))
        bias = w.get("gate_up_bias")
        if bias is not None:  # [.., 2, F], small: read whole
            bias = read_whole(bias)
            w["gate_up_bias"] = bias.reshape(*bias.shape[:-2], 2, tp, f // tp).swapaxes(-3, -2)
        return w

    layers = params["layers"]
    layers = type(layers)(layer(w) for w in layers) if isinstance(layers, (list, tuple)) else layer(layers)
    return dict(params, layers=layers)


def replicate_kv_heads(params: dict, arch, tp: int):
    """(params, arch) with each KV head copied so that ``tp`` devices hold one KV head each.

    When Hkv < TP a split by KV head is impossible, so (as tpu-inference does) each KV head is
    replicated r = TP / Hkv times and its G query heads are divided among the copies: copy s of KV
    head h serves query heads h*G + s*G/r ... h*G + (s+1)*G/r - 1. The query heads keep their order,
    so ``o`` is unchanged; only qkv (and its bias) grow on the Hkv axis, and the KV cache holds TP
    heads. The model computes exactly what it did. Dense weights only: quantize afterwards.
    """
    import dataclasses

    import jax.numpy as jnp

    r = kv_head_replicas(arch.num_heads, arch.num_kv_heads, tp)
    if r == 1:
        return params, arch
    g = arch.num_heads // arch.num_kv_heads

    def grow(x):  # [..., Hkv, G+2, D] -> [..., Hkv*r, G/r+2, D]
        if not hasattr(x, "ndim"):
            raise ValueError(
                "replicating KV heads needs dense qkv weights; this checkpoint's are "
                "pre-quantized (use a tensor_parallel_size the KV heads divide)"
            )
        if isinstance(x, HostSource):
            return _grown_source(x, grow, r, g)
        *lead, hkv, _, d = x.shape
        q = x[..., :g, :].reshape(*lead, hkv * r, g // r, d)
        kv = jnp.repeat(x[..., g:, :], r, axis=-3)
        return jnp.concatenate([q, kv], axis=-2)

    return (
        _map_weight_and_bias(params, "qkv", grow),
        dataclasses.replace(arch, num_kv_heads=arch.num_kv_heads * r),
    )


def _grown_source(x: HostSource, grow, r: int, g: int) -> HostSource:
    """``grow(x)`` of a sharded load's source, still read slice by slice: a slice of the grown
    heads reads the KV heads they copy, grows those and keeps the slice. The last read is kept
    (only it, so that nothing stays held once placed): the copies of one KV head, on adjacent
    devices, share one read."""
    *lead, hkv, _, d = x.shape
    shape = (*lead, hkv * r, g // r + 2, d)
    last: list = [None, None]  # [key, grown values]

    def read(index):
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        j0, j1, _ = index[-3].indices(hkv * r)
        kv0, kv1 = j0 // r, -(-j1 // r)
        key = tuple(s.indices(n) for s, n in zip(index[:-3], lead, strict=True)) + ((kv0, kv1),)
        if last[0] != key:
            last[:] = [key, grow(x.read((*index[:-3], slice(kv0, kv1), slice(None), slice(None))))]
        return last[1][..., j0 - kv0 * r : j1 - kv0 * r, :, :][(Ellipsis, *index[-2:])]

    return HostSource(shape, x.dtype, read)


def _map_weight_and_bias(params: dict, name: str, fn) -> dict:
    """params with every layer's ``name`` and ``name + "_bias"`` (when present) replaced by
    ``fn(array)``; stacked ([L, ...] dict) and unrolled (list of dicts) layers alike."""

    def layer(w):
        w = dict(w, **{name: fn(w[name])})
        if w.get(name + "_bias") is not None:
            w[name + "_bias"] = fn(w[name + "_bias"])
        return w

    layers = params["layers"]
    layers = type(layers)(layer(w) for w in layers) if isinstance(layers, (list, tuple)) else layer(layers)
    return dict(params, layers=layers)
