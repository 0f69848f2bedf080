"""The sparse expert MLP of a mixture-of-experts layer (Qwen3-MoE, gpt-oss), over all T token slots at once.

Each token picks its top-k experts from a softmax router; its MLP output is the routing-weighted sum
of those experts' SiLU-gated MLPs. Rather than running every expert on every token (E times the
work), the T*k (token, expert) assignments are sorted by expert so that each expert's rows are one
contiguous block, and one grouped matmul multiplies block g by expert g's weight. Every shape is
static: there are always exactly T*k assignment rows, only how they split among experts varies.

Per-layer weights (E experts, H hidden, F expert ffn; [in, out] like every weight here):
    router [H, E]; experts_gate_up [E, H, 2F] (gate columns, then up); experts_down [E, F, H]
    gpt-oss adds router_bias [E], experts_gate_up_bias [E, 2F] (gate, then up), experts_down_bias
    [E, H] (the loader de-interleaves gpt-oss's alternating gate/up columns into this layout).
    The two expert weights may instead be ``Mxfp4Weight`` records of the same [E, in, out]
    (packed [E, in/2, out] u8, scale [E, in/32, out]: gpt-oss's published experts, kept packed):
    the TPU kernel decodes them tile by tile in VMEM; elsewhere they are dequantized in the step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tpuserve.moe import grouped_matmul as moe_kernels
from tpuserve.quant.fp4 import Mxfp4Weight, dequantize_mxfp4
from tpuserve.tpu_platform.mesh import MODEL_AXIS, model_axis_size
from tpuserve.tpu_platform.models.arch import MoeArch


def experts_stacked(weight: jax.Array | Mxfp4Weight) -> bool:
    """Whether an expert weight holds every layer's experts ([L, E, ...], a layer scan's) rather
    than one layer's ([E, ...]); a record answers by its packed bytes."""
    return (weight.packed if isinstance(weight, Mxfp4Weight) else weight).ndim == 4


def grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array | Mxfp4Weight,
    group_sizes: jax.Array,
    impl: str = "auto",
    layer: jax.Array | None = None,
) -> jax.Array:
    """lhs [M, K] (rows sorted by group), rhs [G, K, N], group_sizes [G] i32 summing to M -> [M, N].

    Rows group_sizes[:g].sum() .. group_sizes[:g+1].sum() - 1 are multiplied by rhs[g]. The one
    place experts are multiplied. impl: "auto" decides at trace time, as the quantized linears do:
    the Pallas kernel (moe/pallas_tpu_gmm.py) on a TPU, XLA's ``ragged_dot`` elsewhere; or
    "ragged_dot", "pallas_tpu", "pallas_tpu_interpret" (the kernel interpreted on CPU: tests).
    layer: a scalar int32 when rhs is every layer's experts stacked, [L, G, K, N] (a layer scan
    leaves them out of its slices, see decoder.py): the kernel reads layer ``layer``'s in place.
    rhs may be an ``Mxfp4Weight`` (module docstring): the kernel reads its bytes; ``ragged_dot``
    takes it dequantized to lhs's dtype inside the step (exact: an e2m1 value times a power of
    two), which costs a dense copy of the layer's experts per step, acceptable off the TPU.
    """
    if impl == "auto":
        impl = "pallas_tpu" if jax.default_backend() == "tpu" else "ragged_dot"
    if impl == "ragged_dot":
        if layer is not None:
            rhs = jax.tree_util.tree_map(lambda a: a[layer], rhs)  # an array or the record's arrays
        if isinstance(rhs, Mxfp4Weight):
            rhs = dequantize_mxfp4(rhs, lhs.dtype)
        return jax.lax.ragged_dot(lhs, rhs, group_sizes)
    if impl in ("pallas_tpu", "pallas_tpu_interpret"):
        return moe_kernels.grouped_matmul(lhs, rhs, group_sizes, layer=layer, impl=impl)
    raise ValueError(
        f"grouped_matmul: impl {impl!r} is not one of auto, ragged_dot, pallas_tpu, pallas_tpu_interpret"
    )


def route(
    x: jax.Array, router: jax.Array, moe: MoeArch, bias: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """x [T, H], router [H, E], bias [E] or None -> (weights [T, k] f32, experts [T, k] i32),
    best expert first.

    Logits and softmax in f32 whatever the activation dtype: a rounding there can change which
    experts a token gets, a discrete jump no later precision recovers.
    """
    logits = jnp.dot(x.astype(jnp.float32), router.astype(jnp.float32))
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    if moe.softmax_after_topk:  # gpt-oss: the softmax sees only the k chosen logits
        top, experts = jax.lax.top_k(logits, moe.top_k)
        return jax.nn.softmax(top, axis=-1), experts.astype(jnp.int32)
    probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(probs, moe.top_k)
    if moe.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def expert_activation(gate: jax.Array, up: jax.Array, moe: MoeArch) -> jax.Array:
    """SiLU(gate) * up, or gpt-oss's clamped SwiGLU when ``moe.swiglu_limit`` is set: the gate
    clamped above at the limit, up to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate).
    The clamps bound what an outlier token can push through an expert."""
    if moe.swiglu_limit is None:
        return jax.nn.silu(gate) * up
    limit = moe.swiglu_limit
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(moe.swiglu_alpha * gate))


def moe_mlp(
    x: jax.Array,
    w: dict,
    moe: MoeArch,
    impl: str = "auto",
    layer: jax.Array | None = None,
    mesh=None,
) -> jax.Array:
    """The expert block: x [T, H] (after the post-attention norm) -> [T, H] in x's dtype.

    w holds one layer's ``router``, ``experts_gate_up`` and ``experts_down``, and gpt-oss's biases
    when present (module docstring); or with ``layer`` (a scalar int32) every layer's expert
    weights stacked ([L, E, ...]) next to this layer's router and biases.
    Padding slots of a ragged batch route like any token (their rows are finite, so are their
    outputs) and their results are discarded by the caller. impl: ``grouped_matmul``'s.
    mesh: None, or a mesh whose "model" axis the expert weights (and their biases) are split over
    on E (expert parallelism, ``sharding.param_partition_specs(expert_parallel=True)``): each
    device then runs its own experts (``expert_parallel_mlp``).
    """
    if mesh is not None and model_axis_size(mesh) > 1:
        return expert_parallel_mlp(x, w, moe, mesh, impl, layer)
    weights, experts = route(x, w["router"], moe, w.get("router_bias"))
    return local_experts(x, weights, experts, w, moe, 0, moe.num_experts, impl, layer).astype(x.dtype)


def local_experts(
    x: jax.Array,
    weights: jax.Array,
    experts: jax.Array,
    w: dict,
    moe: MoeArch,
    first: jax.Array | int,
    count: int,
    impl: str = "auto",
    layer: jax.Array | None = None,
) -> jax.Array:
    """The contributions of experts ``first .. first + count - 1`` to every token: x [T, H], the
    routing (weights [T, k] f32, experts [T, k] i32) -> [T, H] f32.

    w's expert arrays hold just those ``count`` experts (all E on one device; a device's E/ep
    under expert parallelism, where ``first`` is traced). Assignments to other experts sort after
    the local ones and stay out of the groups: the grouped matmul leaves rows past the groups' sum
    zero (the TPU kernel only writes zeros to their tiles, no matmul), and their outputs are
    masked out before the weighted sum, so they add exactly nothing.
    """
    t, k = x.shape[0], moe.top_k
    local = experts.reshape(t * k) - first
    mine = (local >= 0) & (local < count)
    key = jnp.where(mine, local, count)  # every other device's assignment: one bucket, last
    # Assignment a = token * k + slot; sorting by expert makes each expert's rows contiguous.
    order = jnp.argsort(key, stable=True)
    token_of = order // k
    group_sizes = jnp.bincount(key, length=count + 1)[:count].astype(jnp.int32)
    rows = x[token_of]  # [T*k, H]
    gate_up = grouped_matmul(rows, w["experts_gate_up"], group_sizes, impl, layer)  # [T*k, 2F]
    row_expert = jnp.minimum(key[order], count - 1)  # each sorted row's expert, for its biases
    if "experts_gate_up_bias" in w:
        gate_up = gate_up + w["experts_gate_up_bias"][row_expert].astype(gate_up.dtype)
    f = gate_up.shape[-1] // 2
    act = expert_activation(gate_up[:, :f], gate_up[:, f:], moe)
    out = grouped_matmul(act, w["experts_down"], group_sizes, impl, layer)  # [T*k, H]
    if "experts_down_bias" in w:
        out = out + w["experts_down_bias"][row_expert].astype(out.dtype)
    # Weight and sum in f32: a token's k expert outputs add up in one place. A `where`, not a
    # zero weight: a row outside the groups is whatever the bias made of zeros, never counted.
    scaled = out.astype(jnp.float32) * weights.reshape(t * k)[order][:, None]
    scaled = jnp.where(mine[order][:, None], scaled, 0.0)
    return jnp.zeros((t, x.shape[1]), jnp.float32).at[token_of].add(scaled)


# The per-expert arrays of a layer (split on E under expert parallelism), and those of them a layer
# scan hands over whole, [L, E, ...] (decoder._UNSLICED); the biases are the scan's slices, [E, ...].
EXPERT_ARRAYS = ("experts_gate_up", "experts_down", "experts_gate_up_bias", "experts_down_bias")
_STACKED_EXPERTS = ("experts_gate_up", "experts_down")


# Expert parallelism. The activations entering the expert block are replicated (tensor
# parallelism's all-reduce after ``o`` leaves every token on every device), so the simplest correct
# layout needs no dispatch: every device routes every token with the same replicated router (the
# same f32 logits, so the same choices everywhere), runs its own E/ep experts over the assignments
# routed to them, and one psum over the axis adds the devices' partial sums. Cost per layer: the
# grouped matmul multiplies about T*k/ep rows a device (its experts' share; the TPU kernel only
# zero-fills the tiles past them, while the row buffers stay [T*k, ...]: shapes are static), the
# router and sort are repeated on every device (T x E, small), and the psum moves one [T, H] f32
# (twice a bf16 all-reduce's bytes: a token's k partial outputs add in f32, as on one device).
# An all-to-all layout would instead send each assignment's row only to the device owning its
# expert and back: it needs tokens split over the devices to begin with (sequence/data-parallel
# activations, not TP's replicated ones), a static per-device capacity (or padding to T*k rows)
# for the exchanged buffers, two all_to_alls per layer of [T*k/ep, H] each, and a combine that
# restores token order; it pays off when T*k*H per layer is large (big prefill batches over many
# devices), not at decode. Not built.
def expert_parallel_mlp(
    x: jax.Array, w: dict, moe: MoeArch, mesh, impl: str = "auto", layer: jax.Array | None = None
) -> jax.Array:
    """``moe_mlp`` with w's experts split over ``mesh``'s "model" axis on E (the layout above)."""
    from jax.sharding import PartitionSpec as P

    ep = model_axis_size(mesh)
    count = moe.num_experts // ep
    if count * ep != moe.num_experts:
        raise ValueError(f"{moe.num_experts} experts do not split over {ep} devices")
    stacked = experts_stacked(w["experts_gate_up"])
    names = [n for n in EXPERT_ARRAYS if n in w]
    expert_w = {n: w[n] for n in names}
    # E is axis 0 of a layer's arrays, axis 1 of the [L, E, ...] stacks a layer scan passes whole;
    # a record (Mxfp4Weight) gets the spec on each of its arrays (they all lead with [L,] E).
    specs = {}
    for n in names:
        spec = P(None, MODEL_AXIS) if stacked and n in _STACKED_EXPERTS else P(MODEL_AXIS)
        specs[n] = jax.tree_util.tree_map(lambda _, spec=spec: spec, w[n])
    shared = {n: w[n] for n in ("router", "router_bias") if n in w}
    lyr = jnp.int32(0) if layer is None else layer

    def block(x, shared, expert_w, lyr):
        weights, experts = route(x, shared["router"], moe, shared.get("router_bias"))
        first = jax.lax.axis_index(MODEL_AXIS) * count
        y = local_experts(
            x, weights, experts, expert_w, moe, first, count, impl, None if layer is None else lyr
        )
        return jax.lax.psum(y, MODEL_AXIS)

    y = jax.shard_map(
        block,
        mesh=mesh,
        in_specs=(P(), jax.tree_util.tree_map(lambda _: P(), shared), specs, P()),
        out_specs=P(),
        check_vma=False,
    )(x, shared, expert_w, lyr)
    return y.astype(x.dtype)
