"""Where a draft head's weights come from (the heads themselves: models/draft_head.py).

EAGLE-3: a checkpoint directory in the published layout (``fc``, ``midlayer.*``, ``norm``,
``lm_head``, ``d2t``; vLLM's ``LlamaForCausalLMEagle3``). MTP: the layer a target checkpoint carries
past its decoder layers, in DeepSeek-V3's naming (``model.layers.{L}.{enorm, hnorm, eh_proj,
shared_head.norm, shared_head.head}`` plus a full decoder block under the same prefix). Both give
``(DraftHead, params)`` in the tree ``models/draft_head.py`` describes; a head without its own
embedding (or, for MTP, LM head) shares the target's.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from tpuserve.tpu_platform.loader.safetensors_raw import SafetensorsFiles
from tpuserve.tpu_platform.models.arch import ModelArch, ModelConfigError
from tpuserve.tpu_platform.models.draft_head import DraftHead
from tpuserve.tpu_platform.models.weights import _group_qkv, build_params, unstack_layers


def _safetensors_getter(path: str):
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ModelConfigError(f"{path!r} has no *.safetensors weight files")
    return SafetensorsFiles(files)


def _read_config(path: str) -> dict:
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise ModelConfigError(f"draft model {path!r} has no config.json")
    with open(cfg_file) as f:
        return json.load(f)


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's default feature layers for a target of ``num_layers``: (2, L//2, L-3)."""
    return (2, num_layers // 2, num_layers - 3)


def load_eagle3(path: str, target: ModelArch, target_params: dict, dtype) -> tuple[DraftHead, dict]:
    """An EAGLE-3 checkpoint directory (config.json + safetensors) -> (DraftHead, params).

    Tensor names as published (``midlayer.*``, ``fc``, ``norm``, ``lm_head``, ``d2t``; an optional
    ``model.`` prefix and ``layers.0.`` for ``midlayer.`` are accepted too). The embedding is the
    target's unless the checkpoint has ``embed_tokens``.
    """
    cfg = _read_config(path)
    if int(cfg.get("num_hidden_layers", 1)) != 1:
        raise ModelConfigError(
            f"EAGLE-3 draft {path!r}: num_hidden_layers="
            f"{cfg.get('num_hidden_layers')}; only one-layer heads exist"
        )
    arch = ModelArch.from_hf_config({**cfg, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1})
    target_h = int(cfg.get("target_hidden_size") or arch.hidden_size)
    if target_h != target.hidden_size:
        raise ModelConfigError(
            f"EAGLE-3 draft {path!r} expects a target of hidden size {target_h}, "
            f"the target has {target.hidden_size}"
        )
    if arch.vocab_size != target.vocab_size:
        raise ModelConfigError(
            f"EAGLE-3 draft {path!r} has vocab_size {arch.vocab_size}, the target {target.vocab_size}"
        )
    eagle = cfg.get("eagle_config") or {}
    aux = tuple(
        int(i)
        for i in (eagle.get("eagle_aux_hidden_state_layer_ids") or default_aux_layer_ids(target.num_layers))
    )
    if not all(0 <= i < target.num_layers for i in aux):
        raise ModelConfigError(
            f"EAGLE-3 aux layer ids {aux} out of range for a {target.num_layers}-layer target"
        )
    vd = int(cfg.get("draft_vocab_size") or arch.vocab_size)
    files = _safetensors_getter(path)
    by_name = {}
    for name in files.keys():
        short = name[len("model.") :] if name.startswith("model.") else name
        short = "layers.0." + short[len("midlayer.") :] if short.startswith("midlayer.") else short
        by_name[short] = name

    def need(name: str, shape: tuple, dt=np.float32) -> np.ndarray:
        if name not in by_name:
            raise ModelConfigError(f"EAGLE-3 draft {path!r} is missing tensor {name!r}")
        t = files.get(by_name[name])
        if tuple(t.shape) != shape:
            raise ModelConfigError(
                f"EAGLE-3 draft tensor {name!r} has shape {tuple(t.shape)}, config implies {shape}"
            )
        return np.asarray(t, dt)

    h, hq, hkv, d, f = (
        arch.hidden_size,
        arch.num_heads,
        arch.num_kv_heads,
        arch.head_dim,
        arch.intermediate_size,
    )
    p = "layers.0."
    q = need(p + "self_attn.q_proj.weight", (hq * d, 2 * h))
    k = need(p + "self_attn.k_proj.weight", (hkv * d, 2 * h))
    v = need(p + "self_attn.v_proj.weight", (hkv * d, 2 * h))
    gate = need(p + "mlp.gate_proj.weight", (f, h))
    up = need(p + "mlp.up_proj.weight", (f, h))
    layer = {
        "qkv": _group_qkv(q.T, k.T, v.T, hkv, d),
        "o": need(p + "self_attn.o_proj.weight", (h, hq * d)).T,
        "gate_up": np.stack([gate.T, up.T], axis=0),  # [2, H, F] as the target's (weights.py)
        "down": need(p + "mlp.down_proj.weight", (h, f)).T,
        "input_norm": need(p + "input_layernorm.weight", (h,)),
        "post_norm": need(p + "post_attention_layernorm.weight", (h,)),
    }
    params = {
        "layer": {key: jnp.asarray(val, dtype) for key, val in layer.items()},
        "fc": jnp.asarray(need("fc.weight", (h, 3 * target_h)).T, dtype),
        "hidden_norm": jnp.asarray(need(p + "hidden_norm.weight", (h,)), dtype),
        "final_norm": jnp.asarray(need("norm.weight", (h,)), dtype),
        "lm_head": jnp.asarray(need("lm_head.weight", (vd, h)).T, dtype),
    }
    if "d2t" in by_name:
        d2t = need("d2t", (vd,), np.int64)
        ids = np.arange(vd) + d2t
        if ids.min() < 0 or ids.max() >= target.vocab_size:
            raise ModelConfigError(
                f"EAGLE-3 draft {path!r}: d2t maps draft ids outside the target "
                f"vocabulary [0, {target.vocab_size})"
            )
        params["d2t"] = jnp.asarray(d2t, jnp.int32)
    elif vd != target.vocab_size:
        raise ModelConfigError(
            f"EAGLE-3 draft {path!r} has draft_vocab_size {vd} < vocab_size "
            f"{target.vocab_size} but no d2t mapping"
        )
    if "embed_tokens.weight" in by_name:
        params["embed"] = jnp.asarray(need("embed_tokens.weight", (target.vocab_size, h)), dtype)
    elif h == target.hidden_size:
        params["embed"] = _dense_embed(target_params)
    else:
        raise ModelConfigError(
            f"EAGLE-3 draft {path!r} has no embed_tokens and its hidden size "
            f"{h} differs from the target's {target.hidden_size}"
        )
    head = DraftHead(
        "eagle3",
        arch,
        feature_width=len(aux) * target.hidden_size,
        draft_vocab_size=vd,
        aux_layer_ids=aux,
        norm_before_residual=bool(cfg.get("norm_before_residual", False)),
    )
    return head, params


def load_mtp(path: str, target: ModelArch, target_params: dict, dtype) -> tuple[DraftHead, dict]:
    """The MTP layer of a target checkpoint directory whose config has ``num_nextn_predict_layers``:
    tensors ``model.layers.{num_hidden_layers}.*`` (DeepSeek-V3's naming) -> (DraftHead, params).
    The embedding and LM head fall back to the target's when the layer carries none."""
    cfg = _read_config(path)
    n = int(cfg.get("num_nextn_predict_layers") or 0)
    if n < 1:
        raise ModelConfigError(
            f"speculative method 'mtp': {path!r} has no MTP layers "
            f"(config.json num_nextn_predict_layers is {n})"
        )
    if n > 1:
        raise ModelConfigError(
            f"speculative method 'mtp': {path!r} has {n} MTP layers; only one "
            f"(reused for every draft position) is supported"
        )
    files = _safetensors_getter(path)
    prefix = f"model.layers.{target.num_layers}."
    arch = dataclasses.replace(target, num_layers=1)

    def get(name: str):
        if name.startswith("model.layers.0."):
            name = prefix + name[len("model.layers.0.") :]
        elif name == "model.norm.weight":
            name = prefix + "shared_head.norm.weight"
        elif name == "lm_head.weight":
            name = prefix + "shared_head.head.weight"
        t = files.get(name)
        return None if t is None else np.asarray(t, np.float32)

    h = target.hidden_size

    def need(name: str, shape: tuple) -> np.ndarray:
        t = get(name)
        if t is None:
            raise ModelConfigError(f"MTP layer in {path!r} is missing tensor {name!r}")
        if tuple(t.shape) != shape:
            raise ModelConfigError(f"MTP tensor {name!r} has shape {tuple(t.shape)}, config implies {shape}")
        return t

    # The block through the target's own builder: a one-row stand-in embedding (the real one is
    # shared below) and a tied head keep it from copying the vocabulary-sized tensors.
    stand_in = np.zeros((1, h), np.float32)
    block = build_params(
        dataclasses.replace(arch, vocab_size=1, tie_word_embeddings=True),
        lambda name: stand_in if name == "model.embed_tokens.weight" else get(name),
        dtype,
    )
    params = {
        "layer": unstack_layers(block)["layers"][0],
        "final_norm": block["final_norm"],
        "enorm": jnp.asarray(need(prefix + "enorm.weight", (h,)), dtype),
        "hnorm": jnp.asarray(need(prefix + "hnorm.weight", (h,)), dtype),
        "eh_proj": jnp.asarray(need(prefix + "eh_proj.weight", (h, 2 * h)).T, dtype),
    }
    embed = get(prefix + "embed_tokens.weight")
    params["embed"] = (
        jnp.asarray(need(prefix + "embed_tokens.weight", (target.vocab_size, h)), dtype)
        if embed is not None
        else _dense_embed(target_params)
    )
    head_w = get(prefix + "shared_head.head.weight")
    params["lm_head"] = (
        jnp.asarray(need(prefix + "shared_head.head.weight", (target.vocab_size, h)).T, dtype)
        if head_w is not None
        else _target_head(target_params)
    )
    head = DraftHead("mtp", arch, feature_width=h, draft_vocab_size=target.vocab_size)
    return head, params


def _dense_embed(target_params: dict):
    embed = target_params["embed"]
    if not isinstance(embed, jax.Array):
        raise ModelConfigError("the draft head shares the target's embedding, which must be dense")
    return embed


def _target_head(target_params: dict):
    head = target_params["lm_head"] if "lm_head" in target_params else target_params["embed"].T
    if not isinstance(head, jax.Array):
        raise ModelConfigError("the MTP layer shares the target's LM head, which must be dense")
    return head


def load_draft(
    method: str, model: str | None, target_source: str, target: ModelArch, target_params: dict, dtype
) -> tuple[DraftHead, dict]:
    """The draft head ``--speculative-config`` names: EAGLE-3 from ``model``; MTP from ``model``
    or, when unset, the target's own checkpoint directory."""
    if method == "eagle3":
        if not model:
            raise ModelConfigError(
                "speculative method 'eagle3' needs speculative_config.model: the EAGLE-3 checkpoint directory"
            )
        return load_eagle3(os.path.expanduser(model), target, target_params, dtype)
    if method == "mtp":
        path = os.path.expanduser(model) if model else target_source
        if not os.path.isdir(path):
            raise ModelConfigError(
                f"speculative method 'mtp' reads the MTP layer from a Hugging Face "
                f"directory; {path!r} is not one"
            )
        return load_mtp(path, target, target_params, dtype)
    raise ModelConfigError(f"no draft model for speculative method {method!r}")
