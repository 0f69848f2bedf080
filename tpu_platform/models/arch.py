"""Model architecture description parsed from a Hugging Face ``config.json`` dict, validated once."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# Architectures the decoder implements, with the features each turns on.
SUPPORTED = {
    "LlamaForCausalLM": dict(qk_norm=False, default_qkv_bias=False),
    "MistralForCausalLM": dict(qk_norm=False, default_qkv_bias=False),
    "Qwen2ForCausalLM": dict(qk_norm=False, default_qkv_bias=True),
    "Qwen3ForCausalLM": dict(qk_norm=True, default_qkv_bias=False),
    "Qwen3MoeForCausalLM": dict(qk_norm=True, default_qkv_bias=False),
    "GptOssForCausalLM": dict(qk_norm=False, default_qkv_bias=True),
}

# Mixture-of-experts architectures we recognise but do not serve, with the feature that is missing.
# Named so that such a checkpoint fails with the reason, not as an unknown architecture.
UNSUPPORTED_MOE = {
    "Qwen2MoeForCausalLM": "shared experts with a sigmoid gate",
    "MixtralForCausalLM": "Mixtral's block_sparse_moe tensor names and router",
    "DeepseekV2ForCausalLM": "multi-head latent attention and grouped expert routing",
    "DeepseekV3ForCausalLM": "multi-head latent attention and grouped expert routing",
    "Qwen3NextForCausalLM": "linear-attention layers and shared experts",
    "OlmoeForCausalLM": "OLMoE's expert layout",
    "PhimoeForCausalLM": "sparse-mixer routing",
}


class ModelConfigError(ValueError):
    """The checkpoint's config is unsupported or inconsistent."""


def _expert_sizes(cfg: dict, family: str, expert_keys: tuple[str, str], ffn_key: str) -> tuple[int, int, int]:
    """(experts, top_k, expert ffn size) of an MoE config.json, the first of ``expert_keys`` that
    is set naming the expert count; a ModelConfigError naming the missing or bad field."""
    experts = cfg.get(expert_keys[0], cfg.get(expert_keys[1]))
    top_k, ffn = cfg.get("num_experts_per_tok"), cfg.get(ffn_key)
    if not experts or not top_k or not ffn:
        raise ModelConfigError(
            f"a {family} config.json needs {expert_keys[0]}, num_experts_per_tok and {ffn_key}"
        )
    experts, top_k = int(experts), int(top_k)
    if not 0 < top_k <= experts:
        raise ModelConfigError(f"num_experts_per_tok={top_k} must be in 1..{expert_keys[0]}={experts}")
    return experts, top_k, int(ffn)


@dataclass(frozen=True)
class MoeArch:
    """The sparse expert block of a mixture-of-experts model (Qwen3-MoE, gpt-oss).

    moe_layers: the layer indices whose MLP is the expert block; the others have the dense MLP of
    ``ModelArch.intermediate_size`` (Qwen3-MoE's ``mlp_only_layers`` / ``decoder_sparse_step``).
    gpt-oss differs in four ways, each a field: the router has a bias (``router_bias``), the softmax
    runs over the k chosen logits only (``softmax_after_topk``), the experts' projections have
    biases (``expert_bias``), and the activation is the clamped SwiGLU (``swiglu_limit`` not None:
    gate clamped above, up both sides, ``(up + 1) * gate * sigmoid(swiglu_alpha * gate)``).
    """

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    norm_topk_prob: bool
    moe_layers: tuple[int, ...]
    router_bias: bool = False
    softmax_after_topk: bool = False
    expert_bias: bool = False
    swiglu_alpha: float = 1.0
    swiglu_limit: float | None = None  # None: SiLU(gate) * up (Qwen3-MoE)

    @classmethod
    def from_gpt_oss_config(cls, cfg: dict, num_layers: int) -> MoeArch:
        experts, top_k, ffn = _expert_sizes(
            cfg, "gpt-oss", ("num_local_experts", "num_experts"), "intermediate_size"
        )
        return cls(
            num_experts=experts,
            top_k=top_k,
            expert_intermediate_size=ffn,
            norm_topk_prob=False,  # the softmax over the chosen k already sums to 1
            moe_layers=tuple(range(num_layers)),
            router_bias=True,
            softmax_after_topk=True,
            expert_bias=True,
            swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
        )

    @classmethod
    def from_qwen3_moe_config(cls, cfg: dict, num_layers: int) -> MoeArch:
        # transformers 5 writes the expert count as num_local_experts; published configs say num_experts
        experts, top_k, ffn = _expert_sizes(
            cfg, "Qwen3-MoE", ("num_experts", "num_local_experts"), "moe_intermediate_size"
        )
        step = int(cfg.get("decoder_sparse_step", 1) or 1)
        dense_only = {int(i) for i in cfg.get("mlp_only_layers") or ()}
        # transformers' rule: a layer is sparse unless listed, and only every step-th layer (1-based)
        moe_layers = tuple(i for i in range(num_layers) if i not in dense_only and (i + 1) % step == 0)
        return cls(
            num_experts=experts,
            top_k=top_k,
            expert_intermediate_size=ffn,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            moe_layers=moe_layers,
        )


@dataclass(frozen=True)
class ModelArch:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    rope_scaling: tuple | None = None  # frozen (key, value) pairs of the HF rope_scaling dict
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    moe: MoeArch | None = None  # None: every layer has the dense MLP
    # Per-layer sliding windows when layers differ (gpt-oss's ``layer_types``: sliding and full
    # layers alternate); None: every layer uses ``sliding_window``. ``layer_window`` reads either.
    layer_sliding_windows: tuple[int | None, ...] | None = None
    attention_sinks: bool = False  # a learned per-head logit in each softmax denominator (gpt-oss)

    @classmethod
    def from_hf_config(cls, cfg: dict, generation_config: dict | None = None) -> ModelArch:
        """``generation_config``: the checkpoint's generation_config.json, whose eos_token_id
        list ends generation too (as in vLLM): gpt-oss stops on <|call|> as well as <|return|>,
        Llama 3 instructs on <|eot_id|>."""
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED), None)
        moe_arch = next((a for a in archs if a in UNSUPPORTED_MOE), None)
        if arch is None and moe_arch is not None:
            raise ModelConfigError(
                f"mixture-of-experts architecture {moe_arch} is not supported "
                f"(needs {UNSUPPORTED_MOE[moe_arch]}); the supported MoE architectures are Qwen3MoeForCausalLM and GptOssForCausalLM"
            )
        if arch is None:
            raise ModelConfigError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED)}"
            )

        def need(key):
            if cfg.get(key) is None:
                raise ModelConfigError(f"config.json is missing {key!r}")
            return cfg[key]

        hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or 0) or hidden // heads
        if heads % kv_heads:
            raise ModelConfigError(
                f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
            )
        if not cfg.get("head_dim") and hidden % heads:
            raise ModelConfigError(f"hidden_size={hidden} is not divisible by num_attention_heads={heads}")
        rope_scaling = cfg.get("rope_scaling") or None
        rope_theta = cfg.get("rope_theta")
        params = cfg.get("rope_parameters")  # transformers 5 folds theta/scaling into this dict
        if isinstance(params, dict):
            rope_theta = params.get("rope_theta", rope_theta)
            if params.get("rope_type", "default") != "default":
                rope_scaling = params
        if rope_scaling is not None:
            kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
            if kind not in ("default", "llama3", "linear", "yarn"):
                raise ModelConfigError(
                    f"unsupported rope_scaling type {kind!r} (supported: llama3, linear, yarn)"
                )
            if kind == "default":
                rope_scaling = None
        eos_ids: tuple[int, ...] = ()
        for source in (cfg, generation_config or {}):
            eos = source.get("eos_token_id")
            for e in eos if isinstance(eos, (list, tuple)) else ([eos] if eos is not None else []):
                if int(e) not in eos_ids:
                    eos_ids += (int(e),)
        sliding = (
            cfg.get("sliding_window") if cfg.get("use_sliding_window", arch == "MistralForCausalLM") else None
        )
        feats = SUPPORTED[arch]
        qkv_bias = bool(cfg.get("attention_bias", feats["default_qkv_bias"]))
        num_layers = int(need("num_hidden_layers"))
        moe = MoeArch.from_qwen3_moe_config(cfg, num_layers) if arch == "Qwen3MoeForCausalLM" else None
        gpt_oss = arch == "GptOssForCausalLM"
        layer_windows = None
        if gpt_oss:
            moe = MoeArch.from_gpt_oss_config(cfg, num_layers)
            sliding = None  # per layer instead, from layer_types (transformers' default: odd layers full)
            types = cfg.get("layer_types") or [
                "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)
            ]
            if len(types) != num_layers or set(types) - {"sliding_attention", "full_attention"}:
                raise ModelConfigError(
                    f"layer_types must name sliding_attention or full_attention for each of the "
                    f"{num_layers} layers, got {types!r}"
                )
            window = cfg.get("sliding_window")
            layer_windows = tuple(int(window) if t == "sliding_attention" and window else None for t in types)
        return cls(
            architecture=arch,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=qkv_bias and arch in ("LlamaForCausalLM", "MistralForCausalLM", "GptOssForCausalLM"),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=feats["qk_norm"],
            rope_scaling=tuple(
                sorted((k, v) for k, v in rope_scaling.items() if isinstance(v, (int, float, str)))
            )
            if rope_scaling
            else None,
            sliding_window=int(sliding) if sliding else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            moe=moe,
            layer_sliding_windows=layer_windows,
            attention_sinks=gpt_oss,
        )

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer ``layer`` (None: full attention)."""
        if self.layer_sliding_windows is not None:
            return self.layer_sliding_windows[layer]
        return self.sliding_window

    def rope_attention_factor(self) -> float:
        """What YaRN multiplies cos and sin by (so every q.k logit by its square); 1 otherwise.

        The paper's temperature: 0.1 ln(factor) + 1 for factor > 1, unless the config names
        ``attention_factor`` (or DeepSeek's ``mscale`` / ``mscale_all_dim`` ratio)."""
        rs = dict(self.rope_scaling or ())
        if rs.get("rope_type", rs.get("type")) != "yarn":
            return 1.0
        if rs.get("attention_factor") is not None:
            return float(rs["attention_factor"])
        factor = float(rs.get("factor", 1.0))

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if rs.get("mscale") and rs.get("mscale_all_dim"):
            return mscale(factor, float(rs["mscale"])) / mscale(factor, float(rs["mscale_all_dim"]))
        return mscale(factor)

    def inv_freq(self) -> np.ndarray:
        """Rotary inverse frequencies [head_dim // 2], with Llama 3 / linear scaling applied."""
        d = self.head_dim
        inv = 1.0 / (self.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
        if not self.rope_scaling:
            return inv.astype(np.float32)
        rs = dict(self.rope_scaling)
        kind = rs.get("rope_type", rs.get("type"))
        factor = float(rs.get("factor", 1.0))
        if kind == "linear":
            return (inv / factor).astype(np.float32)
        if kind == "yarn":
            return self._yarn_inv_freq(factor, rs)
        # Llama 3: long wavelengths are slowed by `factor`, short ones kept, a smooth blend between.
        low = float(rs.get("low_freq_factor", 1.0))
        high = float(rs.get("high_freq_factor", 4.0))
        old_ctx = float(rs.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv
        smooth = (old_ctx / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv / factor + smooth * inv
        out = np.where(wavelen > old_ctx / low, inv / factor, inv)
        mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        return np.where(mid, blended, out).astype(np.float32)

    def _yarn_inv_freq(self, factor: float, rs: dict) -> np.ndarray:
        """YaRN (arXiv 2309.00071): dimensions that turn fewer than ``beta_slow`` times over the
        original context are interpolated (divided by ``factor``), those that turn more than
        ``beta_fast`` times are kept, with a linear ramp over the dimension index between."""
        d = self.head_dim
        base = self.rope_theta
        old_ctx = float(rs.get("original_max_position_embeddings", self.max_position_embeddings))
        beta_fast = float(rs.get("beta_fast") or 32.0)
        beta_slow = float(rs.get("beta_slow") or 1.0)

        def dim_of(rotations: float) -> float:
            # the (fractional) dimension pair index whose wavelength fits `rotations` times in old_ctx
            return d * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = dim_of(beta_fast), dim_of(beta_slow)
        if rs.get("truncate", True):  # the published gpt-oss config says false
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
        if low == high:
            high += 0.001  # a zero-width ramp would divide by zero
        # f32 like the reference implementations: the ramp is where YaRN's rounding shows
        ramp = np.clip((np.arange(d // 2, dtype=np.float32) - low) / (high - low), 0, 1)
        keep = (1 - ramp).astype(np.float32)  # 1: extrapolate (original frequency), 0: interpolate
        pos = (base ** (np.arange(0, d, 2, dtype=np.float32) / d)).astype(np.float32)
        out = (1.0 / (factor * pos)) * (1 - keep) + (1.0 / pos) * keep
        return out.astype(np.float32)
