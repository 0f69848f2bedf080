"""Decoder-only transformer (Llama / Mistral / Qwen2 / Qwen3 / Qwen3-MoE / gpt-oss) in JAX over a ragged batch and paged KV.

``forward`` runs the layers and returns hidden states (``DecoderOutput``); ``compute_logits`` is the
LM head, applied by the caller to just the rows it samples from. One ``forward`` serves all four
architectures: the differences are flags on ``ModelArch`` (QKV bias, Q/K RMSNorm, rope scaling,
tied embeddings). Layers are stacked along a leading axis and run with
``lax.scan``: one compiled layer body instead of L copies keeps compile time flat in depth. When
``layers`` is instead a list of per-layer dicts (``weights.unstack_layers``), the layers are
unrolled: XLA:CPU copies a scanned layer's weights out of the stack each step, which costs more than
the compile time saved (EngineConfig.layer_loop).

Parameter tree (L layers, H hidden, F ffn, Hq/Hkv heads of D, G = Hq/Hkv, V vocab); weights are
[in, *out] and every matmul goes through ``linear.linear``:
    embed [V, H]; final_norm [H]; lm_head [H, V] (absent when tied)
    layers: input_norm [L, H], qkv [L, H, Hkv, G+2, D], qkv_bias [L, Hkv, G+2, D]?,
            q_norm / k_norm [L, D]?, o [L, Hq*D, H], o_bias [L, H]?, post_norm [L, H],
            gate_up [L, 2, H, F] (gate, up), gate_up_bias [L, 2, F]?, down [L, F, H], down_bias [L, H]?
            (a quantized gate_up is a record of [H, 2, F], or of [H, TP, 2, F/TP] under TP)
            or, in a mixture-of-experts layer, router / experts_gate_up / experts_down (moe.py)
            in place of gate_up and down; a model mixing both kinds is a list of layers;
            sinks [L, Hq]? f32 (gpt-oss's attention sinks; its layers are a list too, since
            sliding-window and full-attention layers alternate: ModelArch.layer_window)
qkv groups by KV head: [.., kv, g] for g < G is query head kv*G + g, [.., kv, G] is K, [.., kv, G+1] V
(weights.build_params). Tensor parallelism is then one PartitionSpec per array (sharding.py): qkv
splits on Hkv, gate_up on F, o and down on their input rows; the experts are replicated, or split
on E with ``expert_parallel`` (moe.expert_parallel_mlp). With ``unstack_layers`` the leading [L]
axis becomes a list of per-layer dicts, and a dense gate_up there is gate [H, F] and up [H, F]
(gate_bias, up_bias [F]?).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from tpuserve.attention.dispatch import AttentionParams, ragged_paged_attention
from tpuserve.attention.metadata import AttentionMetadata
from tpuserve.tpu_platform.linear import LayerOfStack, keeps_stack_whole, linear
from tpuserve.tpu_platform.mesh import MODEL_AXIS, model_axis_size
from tpuserve.tpu_platform.models.arch import ModelArch
from tpuserve.tpu_platform.models.moe import experts_stacked, moe_mlp


def rms_norm(x, weight, eps: float):
    """Normalise in f32 (as transformers does), scale in the activation dtype."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def apply_rope(x, cos, sin):
    """Rotate-half rotary embedding. x [T, heads, D]; cos, sin [T, D/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :].astype(x.dtype), sin[:, None, :].astype(x.dtype)
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


@jax.tree_util.register_dataclass
@dataclass
class DecoderOutput:
    """What ``forward`` returns (a pytree, so it crosses ``jax.jit`` boundaries).

    hidden      [T, H] activation dtype: the last layer's output after the final RMSNorm.
    aux_hidden  tuple of [T, H], one per requested ``aux_layer_ids`` entry, in that order: the
                residual stream entering that layer (embeddings plus all earlier layers' outputs,
                before the layer's input norm). Empty when none were asked for.
    kv_cache    [L, P, page_size, 2*Hkv, D], this step's K/V written.
    """

    hidden: jax.Array
    aux_hidden: tuple[jax.Array, ...]
    kv_cache: jax.Array


def embed_tokens(table, token_ids, mesh=None):
    """table [V, H], token_ids [T] -> [T, H]. Under a tensor-parallel mesh the table is split by
    vocabulary: each device looks up the ids in its own range (zeros elsewhere) and one all-reduce
    sums the rows, instead of gathering the whole table."""
    if model_axis_size(mesh) == 1:
        return table[token_ids]

    def local(tab, ids):
        v_local = tab.shape[0]
        rel = ids - jax.lax.axis_index(MODEL_AXIS) * v_local
        mine = (rel >= 0) & (rel < v_local)
        rows = tab[jnp.where(mine, rel, 0)]
        return jax.lax.psum(jnp.where(mine[:, None], rows, jnp.zeros_like(rows)), MODEL_AXIS)

    return jax.shard_map(
        local, mesh=mesh, in_specs=(P(MODEL_AXIS, None), P()), out_specs=P(), check_vma=False
    )(table, token_ids)


# Stacked layer weights a layer scan passes whole instead of sliced (forward says why).
_UNSLICED = ("experts_gate_up", "experts_down")


def _layer(
    arch: ModelArch,
    attn_params: AttentionParams,
    attn_impl: str,
    md: AttentionMetadata,
    cos,
    sin,
    h,
    kv_cache,
    w,
    layer_idx,
    mesh=None,
    expert_parallel: bool = False,
):
    """One transformer block. h [T, H] residual stream in; returns (h [T, H] out, kv_cache)."""
    x = rms_norm(h, w["input_norm"], arch.rms_norm_eps)
    return block_from_normed(
        arch, attn_params, attn_impl, md, cos, sin, x, h, kv_cache, w, layer_idx, mesh, expert_parallel
    )


def block_from_normed(
    arch: ModelArch,
    attn_params: AttentionParams,
    attn_impl: str,
    md: AttentionMetadata,
    cos,
    sin,
    x,
    h,
    kv_cache,
    w,
    layer_idx,
    mesh=None,
    expert_parallel: bool = False,
):
    """A transformer block past its input norm: x [T, Hin] is the attention input (Hin = H, or
    2H for an EAGLE-3 draft layer, whose qkv reads [embedding, hidden]), h [T, H] the residual
    stream. Returns (h [T, H] out, kv_cache). expert_parallel: ``forward``'s."""
    t = h.shape[0]
    hq, hkv, d = arch.num_heads, arch.num_kv_heads, arch.head_dim
    g = hq // hkv

    qkv = linear(x, w["qkv"], w.get("qkv_bias"))  # [T, Hkv, G+2, D]
    q = qkv[:, :, :g].reshape(t, hq, d)  # query head kv*G + g: the GQA order attention expects
    k, v = qkv[:, :, g], qkv[:, :, g + 1]  # [T, Hkv, D] each
    if arch.qk_norm:
        q = rms_norm(q, w["q_norm"], arch.rms_norm_eps)
        k = rms_norm(k, w["k_norm"], arch.rms_norm_eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    attn, kv_cache = ragged_paged_attention(
        q,
        k,
        v,
        kv_cache,
        layer_idx,
        md,
        attn_params,
        attn_impl,
        mesh=mesh,
        heads_axis=MODEL_AXIS,
        sinks=w.get("sinks"),  # gpt-oss: f32 [Hq], one learned logit per query head
    )
    h = h + linear(attn.reshape(t, hq * d), w["o"], w.get("o_bias"))

    x = rms_norm(h, w["post_norm"], arch.rms_norm_eps)
    if "router" in w:  # an expert layer of a mixture-of-experts model (models/moe.py)
        assert arch.moe is not None
        # Experts stacked over layers ([L, E, ...], a layer scan's): the kernel indexes the layer.
        stacked = experts_stacked(w["experts_gate_up"])
        layer = layer_idx if stacked else None
        return h + moe_mlp(x, w, arch.moe, layer=layer, mesh=mesh if expert_parallel else None), kv_cache
    if "gate" in w:  # unrolled dense layers (weights.unstack_layers): two arrays, two dots
        gate = linear(x, w["gate"], w.get("gate_bias"))
        up = linear(x, w["up"], w.get("up_bias"))
        return h + linear(jax.nn.silu(gate) * up, w["down"], w.get("down_bias")), kv_cache
    wgu, bgu = w["gate_up"], w.get("gate_up_bias")
    if getattr(wgu, "ndim", 0) == 3:  # dense [2, H, F]: one dot batched over the pair
        # Two dots on wgu[0] and wgu[1] (one slice of the layer scan, two consumers) made XLA's TPU
        # compiler copy the layer's whole 67 MB [2, H, F] slice every step before the up half's dot
        # (89.5 us of the 1B's ~216 us layer at batch 1, 2026-12-06 trace); one consumer reads in place.
        gate, up = jax.lax.dot_general(
            jnp.broadcast_to(x, (2, *x.shape)), wgu, (((x.ndim,), (1,)), ((0,), (0,)))
        )
        if bgu is not None:
            gate, up = gate + bgu[0].astype(gate.dtype), up + bgu[1].astype(up.dtype)
    else:
        gu = linear(x, wgu, bgu)  # a record of [H, 2, F], or grouped by device: [T, 2, F]
        if gu.ndim == 4:  # grouped by device for tensor parallelism (sharding.group_gate_up_by_device)
            gu = gu.swapaxes(1, 2).reshape(t, 2, -1)
        gate, up = gu[:, 0], gu[:, 1]
    y = linear(jax.nn.silu(gate) * up, w["down"], w.get("down_bias"))
    return h + y, kv_cache


def forward(
    params,
    kv_cache,
    token_ids,
    positions,
    md: AttentionMetadata,
    *,
    arch: ModelArch,
    attn_impl: str,
    inv_freq,
    aux_layer_ids: tuple[int, ...] = (),
    mesh=None,
    kv_scales: tuple[float, float] | None = None,
    kv_dtype=None,
    expert_parallel: bool = False,
) -> DecoderOutput:
    """One ragged step over all T token slots; returns hidden states, not logits.

    params: the tree in this module's docstring, layers stacked ([L, ...] arrays, run with
        ``lax.scan``) or a list of per-layer dicts (unrolled).
    kv_cache [L, P, page_size, 2*Hkv, D]; token_ids, positions [T] i32; inv_freq [D/2] f32.
    aux_layer_ids: static layer indices in [0, L] whose incoming residual stream to return (L: the
        last layer's output before the final norm). Empty: no extra work is traced.
    mesh: a ("data", "model") mesh the params and cache are sharded over (``models/sharding.py``),
        or None. The matmuls follow their weights' shardings (XLA adds the all-reduces after o and
        down); attention and the embedding lookup run per device under ``shard_map``.
    kv_scales: (k_scale, v_scale), static floats of an FP8 KV cache (the cache holds K/k_scale and
        V/v_scale, attention/dispatch.py); None: the cache holds K and V as they are.
    kv_dtype: the dtype of the cached values, when the cache stores them as uint8 bytes (an FP8
        cache on XLA:CPU, ``kv_cache_shape.kv_storage_dtype``); None: the cache's own dtype.
    expert_parallel: the expert weights are split over the mesh's "model" axis on E
        (``sharding.param_partition_specs(expert_parallel=True)``): each device runs its own
        experts and a psum adds them up (``moe.expert_parallel_mlp``). False: replicated experts.
    Returns DecoderOutput(hidden [T, H], aux_hidden (len(aux_layer_ids) x [T, H]), kv_cache).
    """
    num_layers = arch.num_layers
    aux_layer_ids = tuple(int(i) for i in aux_layer_ids)
    bad = [i for i in aux_layer_ids if not 0 <= i <= num_layers]
    if bad:
        raise ValueError(f"aux_layer_ids {bad} out of range for {num_layers} layers (0..{num_layers})")
    h = embed_tokens(params["embed"], token_ids, mesh)
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    cos, sin = jnp.cos(freqs), jnp.sin(freqs)
    rope_factor = arch.rope_attention_factor()
    if rope_factor != 1.0:  # YaRN scales cos and sin, so every q.k logit by rope_factor**2
        cos, sin = cos * rope_factor, sin * rope_factor
    k_scale, v_scale = (None, None) if kv_scales is None else (float(x) for x in kv_scales)
    attn_params = AttentionParams(
        sm_scale=arch.head_dim**-0.5,
        sliding_window=arch.layer_window(0),  # the scanned body's; unrolled layers take their own
        k_scale=k_scale,
        v_scale=v_scale,
        kv_dtype=None if kv_dtype is None else jnp.dtype(kv_dtype).name,
    )

    layers, whole, records = params["layers"], {}, {}
    if not isinstance(layers, (list, tuple)):
        # A scan hands each layer a slice of every stacked weight; a slice that feeds a Pallas
        # call is materialized, so the expert stacks would be copied whole (every expert, every
        # layer, every step: 1.2 GB a layer for Qwen3-30B-A3B's 128 experts). They stay out of
        # the slices, whole, and the grouped matmul fetches the layer's active experts itself.
        whole = {key: layers[key] for key in _UNSLICED if key in layers}
        # Quantized matmul records likewise: their kernels read the scan's layer in place.
        records = {k: v for k, v in layers.items() if k not in whole and keeps_stack_whole(v)}
        layers = {key: value for key, value in layers.items() if key not in whole and key not in records}
    # Static per layer: gpt-oss alternates sliding-window and full-attention layers. Layers that
    # differ cannot share a scanned body, so their weights come as a list (weights._stack_layers).
    windows = [arch.layer_window(i) for i in range(num_layers)]
    layer_params = [replace(attn_params, sliding_window=wnd) for wnd in windows]

    def block(h, kv_cache, w, layer_idx, params_i=attn_params):
        w = {**w, **whole, **{key: LayerOfStack(rec, layer_idx) for key, rec in records.items()}}
        return _layer(
            arch, params_i, attn_impl, md, cos, sin, h, kv_cache, w, layer_idx, mesh, expert_parallel
        )

    captured: dict[int, jax.Array] = {}
    if isinstance(layers, (list, tuple)):  # unrolled: layer i is a constant
        for i, w in enumerate(layers):
            if i in aux_layer_ids:
                captured[i] = h
            h, kv_cache = block(h, kv_cache, w, jnp.int32(i), layer_params[i])
    elif len(set(windows)) > 1:
        raise ValueError("layers with different sliding windows cannot be scanned; unstack them first")
    elif not aux_layer_ids:

        def body(carry, xs):
            return block(*carry, *xs), None

        (h, kv_cache), _ = jax.lax.scan(
            body, (h, kv_cache), (layers, jnp.arange(num_layers, dtype=jnp.int32))
        )
    else:
        # Each wanted layer gets a slot of a [S+1, T, H] buffer carried through the scan; every layer
        # writes its input h to its slot, the unwanted ones to the spare last slot (one T x H write a
        # layer, in place, instead of stacking all L inputs as scan outputs).
        wanted = sorted({i for i in aux_layer_ids if i < num_layers})
        slot_of = np.full(num_layers, len(wanted), np.int32)
        slot_of[wanted] = np.arange(len(wanted), dtype=np.int32)
        buf = jnp.zeros((len(wanted) + 1, *h.shape), h.dtype)

        def body(carry, xs):
            h, kv_cache, buf = carry
            w, layer_idx, slot = xs
            buf = jax.lax.dynamic_update_index_in_dim(buf, h, slot, axis=0)
            return (*block(h, kv_cache, w, layer_idx), buf), None

        (h, kv_cache, buf), _ = jax.lax.scan(
            body,
            (h, kv_cache, buf),
            (layers, jnp.arange(num_layers, dtype=jnp.int32), jnp.asarray(slot_of)),
        )
        captured = {i: buf[s] for s, i in enumerate(wanted)}
    if num_layers in aux_layer_ids:
        captured[num_layers] = h
    hidden = rms_norm(h, params["final_norm"], arch.rms_norm_eps)
    return DecoderOutput(
        hidden=hidden, aux_hidden=tuple(captured[i] for i in aux_layer_ids), kv_cache=kv_cache
    )


def compute_logits(params, hidden_rows, *, arch: ModelArch):
    """LM head: hidden_rows [R, H] (already final-normed, e.g. ``DecoderOutput.hidden[rows]``) ->
    logits [R, V] f32. Uses ``lm_head`` [H, V], or the embedding [V, H] transposed when tied."""
    del arch  # the tree says whether the head is tied; kept for a uniform model interface
    head = params["lm_head"] if "lm_head" in params else params["embed"].T
    return linear(hidden_rows, head, out_dtype=jnp.float32).astype(jnp.float32)
