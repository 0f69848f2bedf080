"""Turn Hugging Face-named tensors (from safetensors or GGUF) into the decoder's stacked parameter tree."""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
import numpy as np

from tpuserve.tpu_platform.models.arch import ModelArch, ModelConfigError


def _group_qkv(q: np.ndarray, k: np.ndarray, v: np.ndarray, hkv: int, d: int) -> np.ndarray:
    """Regroup Q, K, V projections (or biases) by KV head: [..., Hq*D], [..., Hkv*D] x2 -> [..., Hkv, G+2, D].

    Slot [kv, g] (g < G) is query head kv*G + g (HF's GQA order: query head h reads KV head h // G),
    slot G is that KV head's K and slot G+1 its V. One KV head's whole attention input is then one
    contiguous slice, so tensor parallelism splits the Hkv axis and nothing else.
    """
    lead = q.shape[:-1]
    return np.concatenate([q.reshape(*lead, hkv, -1, d), k.reshape(*lead, hkv, 1, d),
                           v.reshape(*lead, hkv, 1, d)], axis=-2)


def build_params(arch: ModelArch, get: Callable[[str], np.ndarray | None], dtype) -> dict:
    """``get(name)`` returns the HF tensor (any float dtype, HF [out, in] layout) or None if absent.

    Returns the tree documented in ``tpu_platform/models/decoder.py`` (layers stacked on a leading
    [L] axis), arrays in ``dtype``. ``tpu_platform/models/sharding.py`` gives its PartitionSpecs.
    """
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
    per_layer: dict[str, list[np.ndarray]] = {}

    def add(key: str, t: np.ndarray):
        per_layer.setdefault(key, []).append(t)

    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        q = check(p + "self_attn.q_proj.weight", need(p + "self_attn.q_proj.weight"), (hq * d, hid))
        k = check(p + "self_attn.k_proj.weight", need(p + "self_attn.k_proj.weight"), (hkv * d, hid))
        v = check(p + "self_attn.v_proj.weight", need(p + "self_attn.v_proj.weight"), (hkv * d, hid))
        add("qkv", _group_qkv(q.T, k.T, v.T, hkv, d))
        if arch.qkv_bias:
            qb, kb, vb = (check(p + f"self_attn.{n}_proj.bias", need(p + f"self_attn.{n}_proj.bias"),
                                (rows,)) for n, rows in (("q", hq * d), ("k", hkv * d), ("v", hkv * d)))
            add("qkv_bias", _group_qkv(qb, kb, vb, hkv, d))
        if arch.qk_norm:
            add("q_norm", check(p + "self_attn.q_norm.weight", need(p + "self_attn.q_norm.weight"), (d,)))
            add("k_norm", check(p + "self_attn.k_norm.weight", need(p + "self_attn.k_norm.weight"), (d,)))
        add("o", check(p + "self_attn.o_proj.weight", need(p + "self_attn.o_proj.weight"), (hid, hq * d)).T)
        if arch.o_bias:
            add("o_bias", need(p + "self_attn.o_proj.bias"))
        gate = check(p + "mlp.gate_proj.weight", need(p + "mlp.gate_proj.weight"), (f, hid))
        up = check(p + "mlp.up_proj.weight", need(p + "mlp.up_proj.weight"), (f, hid))
        add("gate_up", np.stack([gate.T, up.T], axis=1))  # [H, 2, F]
        add("down", check(p + "mlp.down_proj.weight", need(p + "mlp.down_proj.weight"), (hid, f)).T)
        if arch.mlp_bias:
            add("gate_up_bias", np.stack([need(p + "mlp.gate_proj.bias"), need(p + "mlp.up_proj.bias")]))
            add("down_bias", need(p + "mlp.down_proj.bias"))
        add("input_norm", check(p + "input_layernorm.weight", need(p + "input_layernorm.weight"), (hid,)))
        add("post_norm", check(p + "post_attention_layernorm.weight",
                               need(p + "post_attention_layernorm.weight"), (hid,)))

    embed = check("model.embed_tokens.weight", need("model.embed_tokens.weight"), (arch.vocab_size, hid))
    params = {
        "embed": jnp.asarray(embed, dtype),
        "final_norm": jnp.asarray(need("model.norm.weight"), dtype),
        "layers": {k: jnp.asarray(np.stack(v), dtype) for k, v in per_layer.items()},
    }
    if not arch.tie_word_embeddings:
        head = get("lm_head.weight")
        if head is None:
            raise ModelConfigError("checkpoint has no lm_head.weight and tie_word_embeddings is false")
        params["lm_head"] = jnp.asarray(check("lm_head.weight", np.asarray(head, np.float32),
                                              (arch.vocab_size, hid)).T, dtype)
    return params


def unstack_layers(params: dict) -> dict:
    """The same tree with ``layers`` as a list of per-layer dicts (each array its own buffer).

    For ``layer_loop="unroll"``: a dot can then read its weight in place, where a slice of the
    stacked array would be copied first. The stacked arrays are released as each key is split.
    """
    stacked = dict(params["layers"])
    num_layers = len(next(iter(stacked.values())))
    layers: list[dict] = [{} for _ in range(num_layers)]
    for key in list(stacked):
        arr = stacked.pop(key)
        for i in range(num_layers):
            layers[i][key] = jnp.array(arr[i], copy=True)
        del arr
    return {**params, "layers": layers}
