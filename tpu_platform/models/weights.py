"""Turn Hugging Face-named tensors (from safetensors or GGUF) into the decoder's stacked parameter tree."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from tpuserve.quant import fuse
from tpuserve.tpu_platform.models.arch import ModelArch, ModelConfigError


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


def _expert_weights(arch: ModelArch, p: str, need, check, dtype) -> dict[str, np.ndarray]:
    """One MoE layer's router and experts (prefix ``p`` = "model.layers.N."), in moe.py's layout:
    router [H, E], experts_gate_up [E, H, 2F] (gate columns then up), experts_down [E, F, H].

    The expert arrays are filled in ``dtype`` one expert at a time: they are most of a MoE model's
    bytes, and an f32 copy of every layer's experts would double the host memory loading needs."""
    moe = arch.moe
    assert moe is not None
    hid, f, e = arch.hidden_size, moe.expert_intermediate_size, moe.num_experts
    router = check(p + "mlp.gate.weight", need(p + "mlp.gate.weight"), (e, hid))
    np_dtype = jnp.dtype(dtype)
    gate_up = np.empty((e, hid, 2 * f), np_dtype)
    down = np.empty((e, f, hid), np_dtype)
    for j in range(e):
        x = f"{p}mlp.experts.{j}."
        gate_up[j, :, :f] = check(x + "gate_proj.weight", need(x + "gate_proj.weight"), (f, hid)).T
        gate_up[j, :, f:] = check(x + "up_proj.weight", need(x + "up_proj.weight"), (f, hid)).T
        down[j] = check(x + "down_proj.weight", need(x + "down_proj.weight"), (hid, f)).T
    return {"router": router.T, "experts_gate_up": gate_up, "experts_down": down}


def _gpt_oss_expert_weights(arch: ModelArch, p: str, need, check, dtype, linear_rec) -> dict:
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
        # fancy indexing copies: the one host copy of gate_up (down stays a view until placed)
        out["experts_gate_up"] = dataclasses.replace(
            gu, packed=gu.packed[..., gate_then_up], scale=gu.scale[..., gate_then_up]
        )
        out["experts_down"] = down
        return out
    if any(r is not None for r in recs):
        raise ModelConfigError(f"{x}: gate_up_proj and down_proj must be both quantized or both dense")
    gu = check(x + "gate_up_proj", need(x + "gate_up_proj"), (e, hid, 2 * f))
    np_dtype = jnp.dtype(dtype)
    out["experts_gate_up"] = gu[..., gate_then_up].astype(np_dtype)
    out["experts_down"] = check(x + "down_proj", need(x + "down_proj"), (e, f, hid)).astype(np_dtype)
    return out


def _stack_layers(layer_tensors: list[dict], dtype, keep_f32: frozenset = frozenset(), as_list: bool = False):
    """Per-layer {key: tensor} -> one dict of [L, ...] arrays when every layer has the same keys
    (the decoder scans over it), else a list of per-layer dicts (run unrolled): a model mixing dense
    and expert MLP layers (Qwen3-MoE's ``mlp_only_layers``) has no single layer body to scan, nor
    one whose layers attend differently (``as_list``: gpt-oss's sliding and full layers).
    keep_f32: keys kept in float32 whatever ``dtype`` (attention sinks: a logit, added in f32)."""

    def dense(k, t):
        if isinstance(t, np.ndarray):
            return jnp.asarray(t, jnp.float32 if k in keep_f32 else dtype)
        return _placed(t)

    keys = {frozenset(layer) for layer in layer_tensors}
    if len(keys) > 1 or as_list:
        return [{k: dense(k, v) for k, v in layer.items()} for layer in layer_tensors]
    out = {}
    for k in layer_tensors[0]:
        v = [layer[k] for layer in layer_tensors]
        out[k] = dense(k, np.stack(v)) if isinstance(v[0], np.ndarray) else _stack_records(k, v)
    return out


def _placed(rec):
    """A quantized record with its numpy leaves (host views, e.g. the gpt-oss experts') made jax
    arrays, kept in their stored dtype; a record of jax arrays is returned as it is."""
    return jax.tree_util.tree_map(lambda a: jnp.asarray(a) if isinstance(a, np.ndarray) else a, rec)


def build_params(
    arch: ModelArch,
    get: Callable[[str], np.ndarray | None],
    dtype,
    get_linear: Callable[[str], object | None] | None = None,
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
    """

    def linear_rec(module: str, k: int, n: int, lead: tuple[int, ...] = ()):
        rec = get_linear(module) if get_linear is not None else None
        return None if rec is None else _check_record(module, rec, k, n, lead)

    def need(name: str) -> np.ndarray:
        t = get(name)
        if t is None:
            raise ModelConfigError(f"checkpoint is missing tensor {name!r}")
        return np.asarray(t, dtype=np.float32)

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
            add("qkv", fuse.take_out(fuse.concat_out(recs), _qkv_index(hq, hkv, d), (hkv, hq // hkv + 2, d)))
        elif any(r is not None for r in recs):
            raise ModelConfigError(f"{p}self_attn: q/k/v must be all quantized or all dense")
        else:
            q = check(p + "self_attn.q_proj.weight", need(p + "self_attn.q_proj.weight"), (hq * d, hid))
            k = check(p + "self_attn.k_proj.weight", need(p + "self_attn.k_proj.weight"), (hkv * d, hid))
            v = check(p + "self_attn.v_proj.weight", need(p + "self_attn.v_proj.weight"), (hkv * d, hid))
            add("qkv", _group_qkv(q.T, k.T, v.T, hkv, d))
        if arch.qkv_bias:
            qb, kb, vb = (
                check(p + f"self_attn.{n}_proj.bias", need(p + f"self_attn.{n}_proj.bias"), (rows,))
                for n, rows in (("q", hq * d), ("k", hkv * d), ("v", hkv * d))
            )
            add("qkv_bias", _group_qkv(qb, kb, vb, hkv, d))
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
            for key, t in _gpt_oss_expert_weights(arch, p, need, check, dtype, linear_rec).items():
                add(key, t)
        elif arch.moe is not None and i in arch.moe.moe_layers:
            for key, t in _expert_weights(arch, p, need, check, dtype).items():
                add(key, t)
        else:
            recs = [linear_rec(p + f"mlp.{n}_proj", hid, f) for n in ("gate", "up")]
            if all(r is not None for r in recs):
                add("gate_up", fuse.concat_out(recs, (2, f)))  # [gate | up] columns = [2, F]
            elif any(r is not None for r in recs):
                raise ModelConfigError(f"{p}mlp: gate/up must be all quantized or all dense")
            else:
                gate = check(p + "mlp.gate_proj.weight", need(p + "mlp.gate_proj.weight"), (f, hid))
                up = check(p + "mlp.up_proj.weight", need(p + "mlp.up_proj.weight"), (f, hid))
                # [2, H, F]: the gate and up [H, F] one after the other. As [H, 2, F], XLA:TPU copied
                # each layer's weight into another layout before every dot of 2+ rows (on a v5e:
                # 318 us per Llama-1B MLP layer at 8 rows against 141; benchmarks/tpu_step_parts.py).
                add("gate_up", np.stack([gate.T, up.T], axis=0))
            down = linear_rec(p + "mlp.down_proj", f, hid)
            add(
                "down",
                down
                if down is not None
                else check(p + "mlp.down_proj.weight", need(p + "mlp.down_proj.weight"), (hid, f)).T,
            )
            if arch.mlp_bias:
                add("gate_up_bias", np.stack([need(p + "mlp.gate_proj.bias"), need(p + "mlp.up_proj.bias")]))
                add("down_bias", need(p + "mlp.down_proj.bias"))
        add("input_norm", check(p + "input_layernorm.weight", need(p + "input_layernorm.weight"), (hid,)))
        add(
            "post_norm",
            check(p + "post_attention_layernorm.weight", need(p + "post_attention_layernorm.weight"), (hid,)),
        )

    embed = check("model.embed_tokens.weight", need("model.embed_tokens.weight"), (arch.vocab_size, hid))
    params = {
        "embed": jnp.asarray(embed, dtype),
        "final_norm": jnp.asarray(need("model.norm.weight"), dtype),
        "layers": _stack_layers(
            layer_tensors,
            dtype,
            keep_f32=frozenset({"sinks"}),
            as_list=len({arch.layer_window(i) for i in range(arch.num_layers)}) > 1,
        ),
    }
    head_rec = None if arch.tie_word_embeddings else linear_rec("lm_head", hid, arch.vocab_size)
    if head_rec is not None:
        params["lm_head"] = head_rec
    elif not arch.tie_word_embeddings:
        head = get("lm_head.weight")
        if head is None:
            raise ModelConfigError("checkpoint has no lm_head.weight and tie_word_embeddings is false")
        params["lm_head"] = jnp.asarray(
            check("lm_head.weight", np.asarray(head, np.float32), (arch.vocab_size, hid)).T, dtype
        )
    return params


def unstack_layers(params: dict) -> dict:
    """The same tree with ``layers`` as a list of per-layer dicts (each array its own buffer).

    For ``layer_loop="unroll"``: a dot can then read its weight in place, where a slice of the
    stacked array would be copied first. The stacked arrays are released as each key is split.
    A value may also be a pytree of arrays that all lead with [L] (a quantized weight record of
    ``quant/``: data and scales); each leaf is split the same way, the record type kept.
    A tree whose layers are already a list (``_stack_layers``) is returned as it is.
    """
    if isinstance(params["layers"], (list, tuple)):
        return params
    stacked = dict(params["layers"])
    num_layers = int(jax.tree_util.tree_leaves(next(iter(stacked.values())))[0].shape[0])
    layers: list[dict] = [{} for _ in range(num_layers)]
    for key in list(stacked):
        value = stacked.pop(key)
        for i in range(num_layers):
            layers[i][key] = jax.tree_util.tree_map(lambda a, i=i: jnp.array(a[i], copy=True), value)
        del value
    return {**params, "layers": layers}
