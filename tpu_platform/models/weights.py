"""Turn Hugging Face-named tensors (from safetensors or GGUF) into the decoder's stacked parameter tree."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from tpuserve.quant import fuse
from tpuserve.tpu_platform.device import HostSource
from tpuserve.tpu_platform.models.arch import ModelArch, ModelConfigError
from tpuserve.tpu_platform.startup_timing import StartupTimings


def _as_read(t, dtype) -> np.ndarray:
    """A checkpoint tensor as the transforms below read it: as stored when that is float32 or the
    target ``dtype``, else upcast to float32. The transforms only move values (transpose, concat,
    stack), so either way the tree ends up with the values an all-f32 pipeline gives: a tensor
    stored in the target dtype needs no cast at all, one stored in f32 reaches the same f32 ->
    target cast (``_to_device``), and every other dtype goes through f32 as it always did. Keeping
    the stored dtype skips a full f32 copy of the checkpoint (the memory-mapped view is read once,
    by the copy that stacks it) and, for a bf16 checkpoint served in bf16, half the bytes moved."""
    t = np.asarray(t)
    if t.dtype == np.float32 or t.dtype == jnp.dtype(dtype):
        return t
    return t.astype(np.float32)


def _to_device(host: np.ndarray, dtype) -> jax.Array:
    """A host array on the default device in ``dtype``. Already in ``dtype``: transferred as it is
    (``jnp.asarray`` would copy it on the host first). Otherwise ``jnp.asarray(host, dtype)``, the
    cast loading always made: it is not one operation for every dtype (f32 -> f16 rounds NaN
    payloads differently from a cast on the device), and the weights must not change."""
    if host.dtype == jnp.dtype(dtype):
        return jax.device_put(host)
    return jnp.asarray(host, dtype)


def _group_qkv(q: np.ndarray, k: np.ndarray, v: np.ndarray, hkv: int, d: int) -> np.ndarray:
    """Regroup Q, K, V projections (or biases) by KV head: [..., Hq*D], [..., Hkv*D] x2 -> [..., Hkv, G+2, D].

    Slot [kv, g] (g < G) is query head kv*G + g (HF's GQA order: query head h reads KV head h // G),
    slot G is that KV head's K and slot G+1 its V. One KV head's whole attention input is then one
    contiguous slice, so tensor parallelism splits the Hkv axis and nothing else.
    """
    lead = q.shape[:-1]
    return np.concatenate(
        [q.reshape(*lead, hkv, -1, d), k.reshape(*lead, hkv, 1, d), v.reshape(*lead, hkv, 1, d)], axis=-2
    )


# Rows of a transposed source copied per tile (_copy_into): 64 rows of a [F, H] weight are a few
# hundred KiB, read once while the destination is written row after row.
_TILE = 64


def _copy_into(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src`` for equal shapes, in tiles along the axis ``src`` is contiguous in when it
    is a transposed view: numpy's plain assignment walks ``dst`` in order and reads ``src`` a whole
    row apart each element (a 8192 x 2048 f32 transpose: 0.6-1.6 s on this 2-core host, 0.1-0.2 s
    in tiles). Same values either way: only the order of the copies changes."""
    if dst.shape != src.shape:  # assignment would broadcast; stacking must not
        raise ValueError(f"cannot copy a {src.shape} tensor into {dst.shape}")
    if src.ndim < 2 or src.flags.c_contiguous:
        dst[...] = src
        return
    axis = int(np.argmin([abs(st) for st in src.strides]))
    for a in range(0, src.shape[axis], _TILE):
        index = (slice(None),) * axis + (slice(a, a + _TILE),)
        dst[index] = src[index]


@dataclass(frozen=True)
class _Assembled:
    """A per-layer tensor made of (views of) checkpoint tensors, assembled only when it is copied
    into its slot of the stacked [L, ...] array: the transposing copy out of the memory-mapped file
    is then the only copy, and it runs on the stacking threads (``_stack``) instead of serially.
    ``pieces``: (index into the tensor, the values that go there); together they cover it."""

    shape: tuple[int, ...]
    pieces: tuple[tuple[tuple, np.ndarray], ...]

    @property
    def dtype(self) -> np.dtype:
        return np.result_type(*(a for _, a in self.pieces))  # np.concatenate's promotion

    def write(self, out: np.ndarray) -> None:
        for index, values in self.pieces:
            _copy_into(out[index], values)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = np.empty(self.shape, self.dtype if dtype is None else dtype)
        self.write(out)
        return out


@dataclasses.dataclass(frozen=True)
class _Columns:
    """``values[..., columns]`` left unread: a slice picks its columns out of ``values`` and copies
    nothing else (gpt-oss's gate / up reorder, for its dense experts and its packed records). Over
    a transposed view of a stored tensor (a packed record's leaves, ``[E, K, N]`` views of
    ``[E, N, K]`` bytes) a column pick reads only those stored rows."""

    values: np.ndarray
    columns: np.ndarray

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.values.shape[:-1], len(self.columns))

    @property
    def dtype(self) -> np.dtype:
        return self.values.dtype

    def __getitem__(self, index: tuple) -> np.ndarray:
        index = tuple(index) + (slice(None),) * (len(self.shape) - len(index))
        return self.values[(*index[:-1], self.columns[index[-1]])]


@dataclasses.dataclass(frozen=True)
class _Concat:
    """``np.concatenate(parts, axis=-1)`` left unread: an index (slices, the last axis a slice or
    an int array of columns) reads from each part only its columns that are asked for. A
    pre-quantized checkpoint's fused q|k|v and gate|up records are these (``_fused_lazy``)."""

    parts: tuple

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.parts[0].shape[:-1], sum(p.shape[-1] for p in self.parts))

    @property
    def dtype(self) -> np.dtype:
        return np.result_type(*(p.dtype for p in self.parts))

    def __getitem__(self, index: tuple) -> np.ndarray:
        index = tuple(index) + (slice(None),) * (len(self.shape) - len(index))
        lead, cols = index[:-1], np.arange(self.shape[-1])[index[-1]]
        lead_shape = np.broadcast_to(np.empty((), np.int8), self.shape[:-1])[lead].shape  # no copy
        out = np.empty((*lead_shape, len(cols)), self.dtype)
        start = 0
        for part in self.parts:
            stop = start + part.shape[-1]
            mine = (cols >= start) & (cols < stop)
            if mine.any():
                out[..., mine] = part[(*lead, cols[mine] - start)]
            start = stop
        return out


# fuse.concat_out / take_out building lazy arrays: nothing is read until a slice is asked for
_LAZY_FUSE = fuse.ArrayOps(concat=lambda xs: _Concat(tuple(xs)), take=lambda a, index: _Columns(a, index))


def _fused_lazy(recs: list, columns: np.ndarray | None, out_shape: tuple[int, ...]):
    """``fuse.take_out(fuse.concat_out(recs), columns, out_shape)`` (``columns`` None: only the
    concatenation, with output axes ``out_shape``) over records of unread views
    (``read_linear(lazy=True)``): each data leaf becomes a ``_Columns`` pick out of a ``_Concat``,
    so a column slice of the fused weight reads only the stored rows it needs. An FP8 block scale
    widened per column (``fuse.columnwise``) is computed here, whole: it is small."""

    def host(rec):
        return jax.tree_util.tree_map(lambda a: np.asarray(a) if isinstance(a, jax.Array) else a, rec)

    recs = [host(fuse.columnwise(w)) for w in recs]
    if columns is None:
        return fuse.concat_out(recs, out_shape, ops=_LAZY_FUSE)
    return fuse.take_out(fuse.concat_out(recs, ops=_LAZY_FUSE), columns, out_shape, ops=_LAZY_FUSE)


def _qkv_parts(q: np.ndarray, k: np.ndarray, v: np.ndarray, hkv: int, d: int) -> _Assembled:
    """``_group_qkv(q, k, v, hkv, d)`` for [H, *] weights, deferred (``_Assembled``)."""
    lead, g = q.shape[:-1], q.shape[-1] // (hkv * d)
    at = (slice(None),) * (len(lead) + 1)  # every leading axis and the KV-head axis
    return _Assembled(
        (*lead, hkv, g + 2, d),
        (
            ((*at, slice(0, g)), q.reshape(*lead, hkv, g, d)),
            ((*at, slice(g, g + 1)), k.reshape(*lead, hkv, 1, d)),
            ((*at, slice(g + 1, g + 2)), v.reshape(*lead, hkv, 1, d)),
        ),
    )


def _qkv_index(hq: int, hkv: int, d: int) -> np.ndarray:
    """Columns of [q | k | v] (``[Hq*D + 2*Hkv*D]``) in ``_group_qkv``'s [Hkv, G+2, D] order."""
    g = hq // hkv
    q = np.arange(hq * d).reshape(hkv, g, d)
    k = hq * d + np.arange(hkv * d).reshape(hkv, 1, d)
    v = hq * d + hkv * d + np.arange(hkv * d).reshape(hkv, 1, d)
    return np.concatenate([q, k, v], axis=1).reshape(-1)


def _check_record(name: str, rec, k: int, n: int, lead: tuple[int, ...] = ()):
    """``rec`` when it is ``[*lead, k, n]`` (lead: the experts axis of a stacked expert tensor)."""
    got_lead = tuple(jax.tree_util.tree_leaves(rec)[0].shape[:-2])
    if (rec.in_features, rec.out_features) != (k, n) or got_lead != lead:
        raise ModelConfigError(
            f"quantized tensor {name!r} is {list(got_lead)} x [out={rec.out_features}, "
            f"in={rec.in_features}], config implies {list(lead)} x [{n}, {k}]"
        )
    return rec


def _stack_records(key: str, recs: list):
    """Per-layer records -> one record with a leading [L] axis (same type and static layout).
    Numpy leaves stack on the host, so the device holds only the stacked copy."""

    def stack(*xs):
        return jnp.asarray(np.stack(xs)) if isinstance(xs[0], np.ndarray) else jnp.stack(xs)

    try:
        return jax.tree_util.tree_map(stack, *recs)
    except ValueError as e:  # differing static metadata (block, out_shape, convention)
        raise ModelConfigError(
            f"quantized {key!r} weights differ in format between layers; "
            f"mixed per-layer formats are not supported ({e})"
        ) from e


def _expert_weights(arch: ModelArch, p: str, need, check, dtype, lazy: bool = False) -> dict:
    """One MoE layer's router and experts (prefix ``p`` = "model.layers.N."), in moe.py's layout:
    router [H, E], experts_gate_up [E, H, 2F] (gate columns then up), experts_down [E, F, H].

    The expert arrays are filled in ``dtype`` one expert at a time: they are most of a MoE model's
    bytes, and an f32 copy of every layer's experts would double the host memory loading needs.
    ``lazy`` (sharded reads): ``_Assembled`` views of the per-expert tensors instead, so a host
    copies only the experts (and columns) its devices hold."""
    moe = arch.moe
    assert moe is not None
    hid, f, e = arch.hidden_size, moe.expert_intermediate_size, moe.num_experts
    router = check(p + "mlp.gate.weight", need(p + "mlp.gate.weight"), (e, hid))

    def expert(j: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Expert j's gate and up [H, F] and down [F, H] (transposed views of what ``need`` gave)."""
        x = f"{p}mlp.experts.{j}."
        gate = check(x + "gate_proj.weight", need(x + "gate_proj.weight"), (f, hid))
        up = check(x + "up_proj.weight", need(x + "up_proj.weight"), (f, hid))
        down = check(x + "down_proj.weight", need(x + "down_proj.weight"), (hid, f))
        return gate.T, up.T, down.T

    if lazy:
        gu_pieces, down_pieces = [], []
        for j in range(e):
            gate, up, down = expert(j)
            gu_pieces += [((j, slice(None), slice(0, f)), gate), ((j, slice(None), slice(f, 2 * f)), up)]
            down_pieces.append(((j,), down))
        return {
            "router": router.T,
            "experts_gate_up": _Assembled((e, hid, 2 * f), tuple(gu_pieces)),
            "experts_down": _Assembled((e, f, hid), tuple(down_pieces)),
        }
    np_dtype = jnp.dtype(dtype)
    gate_up = np.empty((e, hid, 2 * f), np_dtype)
    down_all = np.empty((e, f, hid), np_dtype)
    for j in range(e):
        gate_up[j, :, :f], gate_up[j, :, f:], down_all[j] = expert(j)
    return {"router": router.T, "experts_gate_up": gate_up, "experts_down": down_all}


def _gpt_oss_expert_weights(
    arch: ModelArch, p: str, need, check, dtype, linear_rec, lazy: bool = False
) -> dict:
    """One gpt-oss layer's router and experts in moe.py's layout, with their biases.

    gpt-oss stores the experts already [in, out] and fused: ``mlp.experts.gate_up_proj`` [E, H, 2F]
    with gate and up in alternating columns (gate = [..., 0::2], up = [..., 1::2]), its bias
    [E, 2F] alike, ``down_proj`` [E, F, H] and bias [E, H]; the router is ``mlp.router`` with a
    bias. The columns are de-interleaved here into [gate | up], so the expert block slices halves.
    A published MXFP4 checkpoint's experts come from ``linear_rec`` as records (packed
    [E, in/2, out] u8, numpy leaves: loader/gpt_oss_mxfp4.py), whose columns are reordered the
    same way (an MXFP4 scale is per column, so a column permutation is exact); or, dequantized,
    under the dense names."""
    moe = arch.moe
    assert moe is not None
    hid, f, e = arch.hidden_size, moe.expert_intermediate_size, moe.num_experts
    x = p + "mlp.experts."
    gu_bias = check(x + "gate_up_proj_bias", need(x + "gate_up_proj_bias"), (e, 2 * f))
    gate_then_up = np.concatenate([np.arange(0, 2 * f, 2), np.arange(1, 2 * f, 2)])
    out = {
        "router": check(p + "mlp.router.weight", need(p + "mlp.router.weight"), (e, hid)).T,
        "router_bias": check(p + "mlp.router.bias", need(p + "mlp.router.bias"), (e,)),
        "experts_gate_up_bias": gu_bias[..., gate_then_up],
        "experts_down_bias": check(x + "down_proj_bias", need(x + "down_proj_bias"), (e, hid)),
    }
    recs = [linear_rec(x + "gate_up_proj", hid, 2 * f, (e,)), linear_rec(x + "down_proj", f, hid, (e,))]
    if all(r is not None for r in recs):
        gu, down = recs
        if lazy:  # the column order as a pick at read time: a slice reads only its columns
            out["experts_gate_up"] = dataclasses.replace(
                gu, packed=_Columns(gu.packed, gate_then_up), scale=_Columns(gu.scale, gate_then_up)
            )
            out["experts_down"] = down
            return out
        # fancy indexing copies: the one host copy of gate_up (down stays a view until placed)
        out["experts_gate_up"] = dataclasses.replace(
            gu, packed=gu.packed[..., gate_then_up], scale=gu.scale[..., gate_then_up]
        )
        out["experts_down"] = down
        return out
    if any(r is not None for r in recs):
        raise ModelConfigError(f"{x}: gate_up_proj and down_proj must be both quantized or both dense")
    gu = check(x + "gate_up_proj", need(x + "gate_up_proj"), (e, hid, 2 * f))
    if lazy:  # the column order as a pick at read time, as for the packed records above
        out["experts_gate_up"] = _Columns(gu, gate_then_up)
        out["experts_down"] = check(x + "down_proj", need(x + "down_proj"), (e, f, hid))
        return out
    np_dtype = jnp.dtype(dtype)
    out["experts_gate_up"] = gu[..., gate_then_up].astype(np_dtype)
    out["experts_down"] = check(x + "down_proj", need(x + "down_proj"), (e, f, hid)).astype(np_dtype)
    return out


def _stack(arrays: list[np.ndarray | _Assembled], pool: ThreadPoolExecutor) -> np.ndarray:
    """``np.stack(arrays)``, one layer per task: numpy's copies release the GIL, and these copies
    (which read the memory-mapped checkpoint and transpose it) are most of loading's host time."""
    if len({a.shape for a in arrays}) > 1:  # assignment would broadcast where np.stack refuses
        raise ValueError(f"cannot stack layers of shapes {sorted({a.shape for a in arrays})}")
    out = np.empty((len(arrays), *arrays[0].shape), np.result_type(*(a.dtype for a in arrays)))

    def fill(i: int) -> None:
        a = arrays[i]
        if isinstance(a, _Assembled):
            a.write(out[i])
        else:
            _copy_into(out[i], np.asarray(a))

    list(pool.map(fill, range(len(arrays))))  # list(): re-raises a task's error here
    return out


def _copy_threads() -> int:
    """Threads for the host copies: the cores this process may use, at most 8 (past that the
    copies are bound by memory bandwidth)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(8, cores))


def _stack_layers(
    layer_tensors: list[dict],
    dtype,
    keep_f32: frozenset = frozenset(),
    as_list: bool = False,
    timings: StartupTimings | None = None,
):
    """Per-layer {key: tensor} -> one dict of [L, ...] arrays when every layer has the same keys
    (the decoder scans over it), else a list of per-layer dicts (run unrolled): a model mixing dense
    and expert MLP layers (Qwen3-MoE's ``mlp_only_layers``) has no single layer body to scan, nor
    one whose layers attend differently (``as_list``: gpt-oss's sliding and full layers).
    keep_f32: keys kept in float32 whatever ``dtype`` (attention sinks: a logit, added in f32).
    timings: charged "stack layers" (host copies, which read the memory-mapped checkpoint) and
    "to device" (transfers and casts; each key's transfer overlaps the next key's stacking)."""
    timings = StartupTimings() if timings is None else timings

    def dense(k, t):
        if isinstance(t, _Assembled):  # a layer on its own (not stacked): assemble it here
            with timings.phase("stack layers"):
                t = np.asarray(t)
        if not isinstance(t, np.ndarray):
            return _placed(t)
        with timings.phase("to device"):
            return _to_device(t, jnp.float32 if k in keep_f32 else dtype)

    keys = {frozenset(layer) for layer in layer_tensors}
    if len(keys) > 1 or as_list:
        return [{k: dense(k, v) for k, v in layer.items()} for layer in layer_tensors]
    out = {}
    with ThreadPoolExecutor(_copy_threads(), thread_name_prefix="tpuserve-stack") as pool:
        for k in layer_tensors[0]:
            v = [layer[k] for layer in layer_tensors]
            if isinstance(v[0], (np.ndarray, _Assembled)):
                with timings.phase("stack layers"):
                    stacked = _stack(v, pool)
                out[k] = dense(k, stacked)
            else:
                out[k] = _stack_records(k, v)
    return out


def _placed(rec):
    """A quantized record with its numpy leaves (host views, e.g. the gpt-oss experts') made jax
    arrays, kept in their stored dtype; a record of jax arrays is returned as it is."""
    return jax.tree_util.tree_map(lambda a: jnp.asarray(a) if isinstance(a, np.ndarray) else a, rec)


# ---- sharded reads: each parameter a HostSource that reads any slice from the files ----


def _read_dtype(stored, dtype) -> np.dtype:
    """The dtype ``_as_read`` gives a tensor stored in ``stored``."""
    stored = np.dtype(stored)
    return stored if stored == np.float32 or stored == jnp.dtype(dtype) else np.dtype(np.float32)


def _part_dtype(part, dtype) -> np.dtype:
    if dtype is None:  # a quantized record's leaf: its bytes as stored
        return np.dtype(part.dtype)
    if isinstance(part, _Assembled):
        return np.result_type(*(_read_dtype(v.dtype, dtype) for _, v in part.pieces))
    return _read_dtype(part.dtype, dtype)


def _normalized(index: tuple, shape: tuple[int, ...]) -> tuple[slice, ...]:
    """``index`` (slices, None bounds allowed, as ``jax.make_array_from_callback`` gives them) as
    one ``slice(start, stop)`` per axis."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    out = []
    for s, n in zip(index, shape, strict=True):
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"a parameter slice must be contiguous, got {s}")
        out.append(slice(start, max(start, stop)))
    return tuple(out)


def _overlap(index: tuple[slice, ...], piece: tuple, shape: tuple[int, ...]):
    """Where the piece of an ``_Assembled`` at ``piece`` (its index into the whole, ints allowed)
    meets the request ``index``: (into the request's output, into the piece's values), or None."""
    dst, src = [], []
    for axis, n in enumerate(shape):
        want = index[axis]
        p = piece[axis] if axis < len(piece) else slice(None)
        if isinstance(p, slice):
            p0, p1, _ = p.indices(n)
            dropped = False
        else:
            p0, p1, dropped = int(p), int(p) + 1, True
        lo, hi = max(want.start, p0), min(want.stop, p1)
        if lo >= hi:
            return None
        dst.append(slice(lo - want.start, hi - want.start))
        if not dropped:
            src.append(slice(lo - p0, hi - p0))
    return tuple(dst), tuple(src)


def _fill(out: np.ndarray, part, index: tuple[slice, ...], on_read: Callable[[int], None]) -> None:
    """``out[...] = part[index]`` for a checkpoint view or an ``_Assembled`` of views, copying (and
    so reading from the memory-mapped file) only the elements inside ``index``; ``on_read`` is
    told the stored bytes each copy reads."""
    if not isinstance(part, _Assembled):
        view = part[index]
        on_read(view.nbytes)
        _copy_into(out, view)
        return
    for piece, values in part.pieces:
        hit = _overlap(index, piece, part.shape)
        if hit is None:
            continue
        dst, src = hit
        target = out[dst]
        view = values[src]
        on_read(view.nbytes)
        _copy_into(target, view.reshape(target.shape))  # an int-indexed piece: its axis back


def _source(parts: list, dtype, stacked: bool, on_read: Callable[[int], None]) -> HostSource:
    """One parameter as a HostSource: ``parts`` stacked on a new [L] axis (``stacked``) or the one
    part as it is, read slice by slice with the values the whole-tensor load gives (the same
    ``_as_read`` dtypes, the same final cast as ``_to_device``); ``dtype`` None: as stored (a
    quantized record's leaves)."""
    shapes = {p.shape for p in parts}
    if len(shapes) > 1:
        raise ValueError(f"cannot stack layers of shapes {sorted(shapes)}")
    inner = tuple(parts[0].shape)
    shape = (len(parts), *inner) if stacked else inner
    host_dtype = np.result_type(*(_part_dtype(p, dtype) for p in parts))

    def read(index):
        index = _normalized(index, shape)
        out = np.empty(tuple(s.stop - s.start for s in index), host_dtype)
        if stacked:
            layers = range(index[0].start, index[0].stop)

            def layer(j: int) -> None:
                _fill(out[j], parts[layers[j]], index[1:], on_read)

            with ThreadPoolExecutor(_copy_threads(), thread_name_prefix="tpuserve-shard") as pool:
                list(pool.map(layer, range(len(layers))))  # list(): re-raises a task's error here
        else:
            _fill(out, parts[0], index, on_read)
        return out if dtype is None or out.dtype == jnp.dtype(dtype) else jnp.asarray(out, dtype)

    return HostSource(shape, host_dtype if dtype is None else jnp.dtype(dtype), read)


def _layer_sources(
    layer_tensors: list[dict], dtype, keep_f32: frozenset, as_list: bool, on_read: Callable[[int], None]
):
    """``_stack_layers``'s tree, of HostSources."""

    def final(k):
        return jnp.float32 if k in keep_f32 else dtype

    def source(k, parts, stacked):
        if isinstance(parts[0], (np.ndarray, _Assembled, _Columns)):
            return _source(parts, final(k), stacked, on_read)
        # a quantized record (gpt-oss's packed experts): a source per leaf, bytes as stored
        return jax.tree_util.tree_map(lambda *leaves: _source(list(leaves), None, stacked, on_read), *parts)

    keys = {frozenset(layer) for layer in layer_tensors}
    if len(keys) > 1 or as_list:
        return [{k: source(k, [v], False) for k, v in layer.items()} for layer in layer_tensors]
    return {k: source(k, [layer[k] for layer in layer_tensors], True) for k in layer_tensors[0]}


def build_params(
    arch: ModelArch,
    get: Callable[[str], np.ndarray | None],
    dtype,
    get_linear: Callable[[str], object | None] | None = None,
    timings: StartupTimings | None = None,
    sharded_reads: Callable[[int], None] | None = None,
) -> dict:
    """``get(name)`` returns the HF tensor (any float dtype, HF [out, in] layout) or None if absent.

    get_linear: for a pre-quantized checkpoint, ``get_linear(module)`` (e.g.
    ``"model.layers.0.mlp.down_proj"``) returns that Linear's quantized record (quant/, 2-D
    ``[in, out]``), or None when the module is dense. Fused weights (qkv, gate_up) are then fused
    records (quant/fuse.py); their parts must be all quantized or all dense. gpt-oss's fused
    expert modules (``"model.layers.0.mlp.experts.gate_up_proj"``) answer with a 3-D record
    ``[E, in, out]`` (loader/gpt_oss_mxfp4.py).

    Returns the tree documented in ``tpu_platform/models/decoder.py`` (layers stacked on a leading
    [L] axis, or a list of per-layer dicts when layers differ in structure: ``_stack_layers``),
    dense arrays in ``dtype``, records as they were read.
    ``tpu_platform/models/sharding.py`` gives its PartitionSpecs.
    timings: the start-up record the phases go to ("layer transforms", "stack layers", "to
    device"; startup_timing.py); the arrays are on the device when this returns.

    sharded_reads: for a mesh over several processes: ``get`` returns memory-mapped views, and
    every parameter comes back a ``HostSource`` (device.py) that copies out of them only the
    slice asked for, charging the bytes it reads to ``sharded_reads``: ``device.place`` then
    reads on each host only its devices' shards. Float checkpoints, mixture-of-experts ones
    included, gpt-oss's published MXFP4 experts (``get_linear`` its ``expert_records`` over the
    same views: each record leaf a source, bytes as stored) and pre-quantized dense checkpoints
    (``get_linear`` gives records of unread views, ``read_linear(lazy=True)``; fused q|k|v and
    gate|up through ``_fused_lazy``).
    """
    timings = StartupTimings() if timings is None else timings
    lazy = sharded_reads is not None
    t_layers = time.perf_counter()

    def linear_rec(module: str, k: int, n: int, lead: tuple[int, ...] = ()):
        rec = get_linear(module) if get_linear is not None else None
        return None if rec is None else _check_record(module, rec, k, n, lead)

    def need(name: str) -> np.ndarray:
        t = get(name)
        if t is None:
            raise ModelConfigError(f"checkpoint is missing tensor {name!r}")
        return t if lazy else _as_read(t, dtype)  # lazy: the view, read slice by slice

    def check(name: str, t: np.ndarray, shape: tuple) -> np.ndarray:
        if t.shape != shape:
            raise ModelConfigError(f"tensor {name!r} has shape {t.shape}, config implies {shape}")
        return t

    hq, hkv, d, hid = arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.hidden_size
    f = arch.intermediate_size
    layer_tensors: list[dict] = []

    def add(key: str, t):
        layer_tensors[-1][key] = t

    for i in range(arch.num_layers):
        layer_tensors.append({})
        p = f"model.layers.{i}."
        recs = [
            linear_rec(p + f"self_attn.{n}_proj", hid, rows)
            for n, rows in (("q", hq * d), ("k", hkv * d), ("v", hkv * d))
        ]
        if all(r is not None for r in recs):
            columns, grouped = _qkv_index(hq, hkv, d), (hkv, hq // hkv + 2, d)
            if lazy:
                add("qkv", _fused_lazy(recs, columns, grouped))
            else:
                add("qkv", fuse.take_out(fuse.concat_out(recs), columns, grouped))
        elif any(r is not None for r in recs):
            raise ModelConfigError(f"{p}self_attn: q/k/v must be all quantized or all dense")
        else:
            q = check(p + "self_attn.q_proj.weight", need(p + "self_attn.q_proj.weight"), (hq * d, hid))
            k = check(p + "self_attn.k_proj.weight", need(p + "self_attn.k_proj.weight"), (hkv * d, hid))
            v = check(p + "self_attn.v_proj.weight", need(p + "self_attn.v_proj.weight"), (hkv * d, hid))
            add("qkv", _qkv_parts(q.T, k.T, v.T, hkv, d))
        if arch.qkv_bias:
            qb, kb, vb = (
                check(p + f"self_attn.{n}_proj.bias", need(p + f"self_attn.{n}_proj.bias"), (rows,))
                for n, rows in (("q", hq * d), ("k", hkv * d), ("v", hkv * d))
            )
            add("qkv_bias", _qkv_parts(qb, kb, vb, hkv, d) if lazy else _group_qkv(qb, kb, vb, hkv, d))
        if arch.qk_norm:
            add("q_norm", check(p + "self_attn.q_norm.weight", need(p + "self_attn.q_norm.weight"), (d,)))
            add("k_norm", check(p + "self_attn.k_norm.weight", need(p + "self_attn.k_norm.weight"), (d,)))
        o = linear_rec(p + "self_attn.o_proj", hq * d, hid)
        add(
            "o",
            o
            if o is not None
            else check(p + "self_attn.o_proj.weight", need(p + "self_attn.o_proj.weight"), (hid, hq * d)).T,
        )
        if arch.o_bias:
            add("o_bias", need(p + "self_attn.o_proj.bias"))
        if arch.attention_sinks:
            add("sinks", check(p + "self_attn.sinks", need(p + "self_attn.sinks"), (hq,)))
        if arch.architecture == "GptOssForCausalLM":
            for key, t in _gpt_oss_expert_weights(arch, p, need, check, dtype, linear_rec, lazy).items():
                add(key, t)
        elif arch.moe is not None and i in arch.moe.moe_layers:
            for key, t in _expert_weights(arch, p, need, check, dtype, lazy).items():
                add(key, t)
        else:
            recs = [linear_rec(p + f"mlp.{n}_proj", hid, f) for n in ("gate", "up")]
            if all(r is not None for r in recs):
                # [gate | up] columns = [2, F]
                add("gate_up", _fused_lazy(recs, None, (2, f)) if lazy else fuse.concat_out(recs, (2, f)))
            elif any(r is not None for r in recs):
                raise ModelConfigError(f"{p}mlp: gate/up must be all quantized or all dense")
            else:
                gate = check(p + "mlp.gate_proj.weight", need(p + "mlp.gate_proj.weight"), (f, hid))
                up = check(p + "mlp.up_proj.weight", need(p + "mlp.up_proj.weight"), (f, hid))
                # [2, H, F]: the gate and up [H, F] one after the other. As [H, 2, F], XLA:TPU copied
                # each layer's weight into another layout before every dot of 2+ rows (on a v5e:
                # 318 us per Llama-1B MLP layer at 8 rows against 141; benchmarks/tpu_step_parts.py).
                add("gate_up", _Assembled((2, hid, f), (((0,), gate.T), ((1,), up.T))))
            down = linear_rec(p + "mlp.down_proj", f, hid)
            add(
                "down",
                down
                if down is not None
                else check(p + "mlp.down_proj.weight", need(p + "mlp.down_proj.weight"), (hid, f)).T,
            )
            if arch.mlp_bias:
                gb, ub = need(p + "mlp.gate_proj.bias"), need(p + "mlp.up_proj.bias")
                add(
                    "gate_up_bias",
                    _Assembled((2, f), (((0,), gb), ((1,), ub))) if lazy else np.stack([gb, ub]),
                )
                add("down_bias", need(p + "mlp.down_proj.bias"))
        add("input_norm", check(p + "input_layernorm.weight", need(p + "input_layernorm.weight"), (hid,)))
        add(
            "post_norm",
            check(p + "post_attention_layernorm.weight", need(p + "post_attention_layernorm.weight"), (hid,)),
        )

    embed = check("model.embed_tokens.weight", need("model.embed_tokens.weight"), (arch.vocab_size, hid))
    final_norm = need("model.norm.weight")
    timings.add("layer transforms", time.perf_counter() - t_layers)
    as_list = len({arch.layer_window(i) for i in range(arch.num_layers)}) > 1
    if sharded_reads is not None:
        return _sources(arch, get, embed, final_norm, layer_tensors, dtype, as_list, sharded_reads)
    with timings.phase("to device"):
        params = {"embed": _to_device(embed, dtype), "final_norm": _to_device(final_norm, dtype)}
    params["layers"] = _stack_layers(
        layer_tensors,
        dtype,
        keep_f32=frozenset({"sinks"}),
        as_list=as_list,
        timings=timings,
    )
    head_rec = None if arch.tie_word_embeddings else linear_rec("lm_head", hid, arch.vocab_size)
    if head_rec is not None:
        params["lm_head"] = head_rec
    elif not arch.tie_word_embeddings:
        head = get("lm_head.weight")
        if head is None:
            raise ModelConfigError("checkpoint has no lm_head.weight and tie_word_embeddings is false")
        head = check("lm_head.weight", _as_read(head, dtype), (arch.vocab_size, hid)).T
        with timings.phase("to device"):
            params["lm_head"] = _to_device(head, dtype)
    with timings.phase("to device"):
        # Wait for the transfers here, so that their time is charged to this phase, not to
        # whichever later phase first touches the weights.
        jax.block_until_ready(params)
    return params


def _sources(arch: ModelArch, get, embed, final_norm, layer_tensors, dtype, as_list, on_read) -> dict:
    """``build_params``'s tree, of HostSources (its ``sharded_reads``)."""
    params = {
        "embed": _source([embed], dtype, False, on_read),
        "final_norm": _source([final_norm], dtype, False, on_read),
        "layers": _layer_sources(layer_tensors, dtype, frozenset({"sinks"}), as_list, on_read),
    }
    if not arch.tie_word_embeddings:
        head = get("lm_head.weight")
        if head is None:
            raise ModelConfigError("checkpoint has no lm_head.weight and tie_word_embeddings is false")
        if head.shape != (arch.vocab_size, arch.hidden_size):
            raise ModelConfigError(
                f"tensor 'lm_head.weight' has shape {head.shape}, config implies "
                f"{(arch.vocab_size, arch.hidden_size)}"
            )
        params["lm_head"] = _source([head.T], dtype, False, on_read)
    return params


def unstack_layers(params: dict) -> dict:
    """The same tree with ``layers`` as a list of per-layer dicts (each array its own buffer).

    For ``layer_loop="unroll"``: a dot can then read its weight in place, where a slice of the
    stacked array would be copied first. For the same reason a dense ``gate_up`` [2, H, F] becomes
    ``gate`` and ``up`` [H, F] (and its bias ``gate_bias`` / ``up_bias`` [F]): XLA:CPU copies
    ``gate_up[0]`` before its dot (SmolLM2-135M's 30 MLPs at 32 rows: 86 ms as slices, 27 ms as
    two arrays). The stacked arrays are released as each key is split.
    A value may also be a pytree of arrays that all lead with [L] (a quantized weight record of
    ``quant/``: data and scales); each leaf is split the same way, the record type kept.
    A tree whose layers are already a list (``_stack_layers``) keeps its arrays; only gate_up splits.
    """
    if isinstance(params["layers"], (list, tuple)):
        return {**params, "layers": [_split_gate_up(w) for w in params["layers"]]}
    stacked = dict(params["layers"])
    num_layers = int(jax.tree_util.tree_leaves(next(iter(stacked.values())))[0].shape[0])
    layers: list[dict] = [{} for _ in range(num_layers)]
    for key in list(stacked):
        value = stacked.pop(key)
        for i in range(num_layers):
            layers[i][key] = jax.tree_util.tree_map(
                lambda a, i=i: a.layer(i) if isinstance(a, HostSource) else jnp.array(a[i], copy=True), value
            )
        del value
    return {**params, "layers": [_split_gate_up(w) for w in layers]}


def join_gate_up(layer: dict) -> dict:
    """``_split_gate_up`` undone: gate and up [H, F] back into one gate_up [2, H, F] (biases
    likewise), for code that quantizes the fused weight (models/quantize.py, calibrate.py)."""
    if "gate" not in layer:
        return layer
    out = {k: v for k, v in layer.items() if k not in ("gate", "up", "gate_bias", "up_bias")}
    out["gate_up"] = jnp.stack([layer["gate"], layer["up"]])
    if "gate_bias" in layer:
        out["gate_up_bias"] = jnp.stack([layer["gate_bias"], layer["up_bias"]])
    return out


def _split_gate_up(layer: dict) -> dict:
    """A per-layer dict with a dense gate_up [2, H, F] as ``gate`` and ``up`` [H, F] (its bias
    [2, F] as ``gate_bias`` / ``up_bias``); anything else (a quantized record, a gate_up grouped
    by device, a mixture-of-experts layer) unchanged."""
    wgu = layer.get("gate_up")
    if not isinstance(wgu, (jax.Array, np.ndarray, HostSource)) or wgu.ndim != 3 or wgu.shape[0] != 2:
        return layer

    def half(a, j: int):
        return a.layer(j) if isinstance(a, HostSource) else jnp.array(a[j], copy=True)

    out = {k: v for k, v in layer.items() if k not in ("gate_up", "gate_up_bias")}
    out["gate"], out["up"] = half(wgu, 0), half(wgu, 1)
    bias = layer.get("gate_up_bias")
    if bias is not None:
        out["gate_bias"], out["up_bias"] = half(bias, 0), half(bias, 1)
    return out
