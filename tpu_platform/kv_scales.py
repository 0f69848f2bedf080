"""The two static scales of an FP8 KV cache (``--kv-cache-dtype fp8``); no jax import.

The cache holds ``clip(K / k_scale)`` and ``clip(V / v_scale)`` in ``float8_e4m3fn`` (clipped to
+-448, attention/dispatch.py ``quantize_kv``); attention multiplies the scores by ``k_scale`` and
the output by ``v_scale``. The kernels take the scales as static floats, so there is one pair per
model, not per layer.

Where they come from, first match wins:

1. The checkpoint: compressed-tensors and ModelOpt FP8-KV checkpoints store a per-layer scalar
   ``model.layers.{i}.self_attn.k_scale`` / ``v_scale`` (ModelOpt's older exports:
   ``self_attn.k_proj.k_scale`` / ``self_attn.v_proj.v_scale``; older compressed-tensors:
   ``self_attn.k_proj.output_scale``). All layers must carry them (else loading with an FP8 KV
   cache fails, naming the missing layers; a model-dtype cache ignores them); the
   model's scale is the max over layers (a layer's values then never exceed the range it was
   calibrated for).
2. Calibration at load: one prefill of ``CALIBRATION_TEXT`` (a few hundred tokens of plain prose,
   tokenized with the model's tokenizer) in the model dtype; the amax of K (after RoPE, as written
   to the cache) and of V over every layer and head gives ``scale = amax / 448 * MARGIN``.
   ``MARGIN`` = 1.25 leaves a quarter of headroom above what the calibration text reached, so
   unseen inputs rarely saturate; values beyond it saturate at +-448 (never NaN). A larger margin
   costs resolution near zero (e4m3 has 3 mantissa bits whatever the scale, and subnormals start
   at 2^-6 * scale).
"""

from __future__ import annotations

import logging

import numpy as np

log = logging.getLogger(__name__)

FP8_E4M3_MAX = 448.0
MARGIN = 1.25
# Below this amax a scale would divide by ~0; such a K or V is all zeros anyway.
_MIN_AMAX = 1e-6

CALIBRATION_TEXT = (
    "The river starts high in the hills, where snow melts slowly through the spring and feeds a "
    "hundred small streams. By the time it reaches the first town it is wide enough for boats, and "
    "the people who live along its banks have used it for centuries: for fishing, for carrying "
    "grain and timber to the coast, and for turning the wheels of mills that ground flour for the "
    "whole valley. In the summer, children swim in the shallow bends while their parents work in "
    "the fields nearby. In the autumn, heavy rain can raise the water by several meters in a single "
    "night, and the old stone bridge has been rebuilt three times after floods carried parts of it "
    "away. A small museum near the market square keeps maps, photographs and letters that describe "
    "how the town grew around the river, how trade changed when the railway arrived, and how the "
    "factories that once lined the water closed one after another. Today most visitors come for "
    "the quiet walking paths, the birds that nest in the reeds, and the long evenings when the light "
    "turns gold over the water. Teachers bring their classes to measure the temperature of the "
    "water, count insects under the stones and learn why clean rivers matter for farms, forests and "
    "cities far downstream. Questions are welcome: how deep is the river, where does it end, and "
    "what would happen to the valley if it ran dry? The answers, like the river itself, keep moving. "
    "Numbers help too: 12 bridges, 3 mills, 47 kilometers of banks, and about 8,500 people in 2024."
)


def scales_from_amax(k_amax: float, v_amax: float, margin: float = MARGIN) -> tuple[float, float]:
    """(k_scale, v_scale) that map ``amax * margin`` to the e4m3 maximum (448)."""
    k_scale, v_scale = (float(max(float(a), _MIN_AMAX) * margin / FP8_E4M3_MAX) for a in (k_amax, v_amax))
    return k_scale, v_scale


def _layer_scale(get, layer: int, kind: str) -> float | None:
    for name in (
        f"model.layers.{layer}.self_attn.{kind}_scale",
        f"model.layers.{layer}.self_attn.attn.{kind}_scale",
        f"model.layers.{layer}.self_attn.{kind}_proj.{kind}_scale",
        f"model.layers.{layer}.self_attn.{kind}_proj.output_scale",
    ):
        t = get(name)
        if t is not None:
            return float(np.max(np.asarray(t, np.float32)))
    return None


def scales_from_checkpoint(get, num_layers: int) -> tuple[float, float] | None:
    """(max over layers of k_scale, of v_scale) from a checkpoint's tensors (``get(name)`` -> array
    or None), or None when it carries none. Raises ValueError when only some layers carry them
    or a scale is not a positive finite number."""
    found = {kind: [_layer_scale(get, i, kind) for i in range(num_layers)] for kind in "kv"}
    present = [x is not None for kind in "kv" for x in found[kind]]
    if not any(present):
        return None
    if not all(present):
        missing = [f"layer {i} {kind}_scale" for kind in "kv" for i, x in enumerate(found[kind]) if x is None]
        raise ValueError(
            f"the checkpoint carries KV cache scales for some layers only (missing: "
            f"{', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''})"
        )
    # every layer has both (checked above)
    k_scales, v_scales = ([x for x in found[kind] if x is not None] for kind in "kv")
    out = (max(k_scales), max(v_scales))
    if not all(np.isfinite(s) and s > 0 for s in out):
        raise ValueError(f"the checkpoint's KV cache scales must be positive and finite, got {out}")
    return out


def calibration_token_ids(tokenizer, vocab_size: int) -> np.ndarray:
    """``CALIBRATION_TEXT`` as token ids of the model's tokenizer (ids past the model's vocab,
    possible with a mismatched tokenizer, are dropped)."""
    ids = np.asarray(tokenizer(CALIBRATION_TEXT, add_special_tokens=True)["input_ids"], np.int32)
    ids = ids[(ids >= 0) & (ids < vocab_size)]
    if len(ids) == 0:
        raise ValueError("the calibration text tokenized to no ids inside the model's vocabulary")
    return ids
