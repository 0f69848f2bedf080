"""On-device token sampling in pure JAX: masks, penalties, greedy / temperature / top-k / top-p / min-p, logprobs.

The logits never leave the device: only the sampled ids (and the requested logprobs) come back to the
host. Shapes: S = sequence rows, V = vocabulary size.

Processing order (vLLM v1's, with top-k -> top-p -> min-p for the random filters):
  1. banned ids and the structured-output bitmask set disallowed tokens to -inf;
  2. penalties: repetition (on tokens seen in the prompt or the output: positive logits are divided
     by the penalty, the others multiplied), then frequency (``-= freq * count``) and presence
     (``-= pres * (count > 0)``);
  3. greedy rows (temperature < 1e-5) take the argmax of the processed logits;
  4. random rows: divide by the temperature, keep the top-k, then the top-p nucleus, then drop tokens
     whose probability is below ``min_p * max_prob``, and draw from the softmax of what is left.

Randomness contract: the PRNG key of row i is ``fold_in(key(seeds[i]), steps[i])`` and the draw is
vmapped over rows, so a row's token depends only on its (seed, step) and its own logits: never on the
other rows, its position in the batch, the batch size, or which compiled variant ran.

Compilation: host-side flags derived from the batch (any random row? any top-k/top-p? penalties in use?
banned ids? bitmask? how many logprobs?) pick a static variant, each jitted once and cached in
``_VARIANTS``; ``jax.jit`` keys its own cache on the shapes. An all-greedy batch without penalties or
masks compiles to an argmax only. ``compile_count()`` counts actual traces.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from tpuserve.tpu_platform.step_batch import Logprobs, SamplerOutput, SamplingBatch

# Rows whose temperature is below this are greedy (float32 so host and device agree on the boundary).
GREEDY_EPS = np.float32(1e-5)


@dataclass(frozen=True)
class _Variant:
    """Static flags selecting which stages a compiled sampler contains."""

    any_random: bool  # some row samples (temperature >= GREEDY_EPS)
    top_k_top_p: bool  # some random row has an active top-k or top-p (bisection passes over V)
    counts: bool  # output_counts used (repetition/frequency/presence penalties)
    prompt_mask: bool  # prompt_mask used (repetition penalty)
    banned: bool  # banned_ids has at least one real id
    bitmask: bool  # token_bitmask forbids at least one token
    num_logprobs: int | None  # None = no logprobs, else top-k size (already clamped to V)


# Jitted sampler per variant; jax.jit caches the compiled executable per input shape.
_VARIANTS: dict[_Variant, Callable[..., Any]] = {}
_trace_count = 0


def compile_count() -> int:
    """How many times a jitted function of this module was traced (sample variants and
    compute_logprobs, one per distinct static variant and input shapes)."""
    return _trace_count


def _note_trace() -> None:
    # Called from inside traced bodies: Python runs it once per trace, never on cached calls.
    global _trace_count
    _trace_count += 1


# ---------------------------------------------------------------------------------------------
# Device-side stages. All take and return [S, V] float32 logits unless stated otherwise.
# ---------------------------------------------------------------------------------------------


def _apply_banned(x: jax.Array, banned_ids: jax.Array) -> jax.Array:
    """x [S, V], banned_ids [S, K] i32 with -1 padding -> x with banned tokens at -inf."""
    num_rows, vocab = x.shape
    # -1 would wrap to V-1 under numpy-style indexing; map it out of range and drop it instead.
    ids = jnp.where(banned_ids < 0, vocab, banned_ids)
    rows = jnp.broadcast_to(jnp.arange(num_rows)[:, None], ids.shape)
    return x.at[rows, ids].set(-jnp.inf, mode="drop")


def _apply_bitmask(x: jax.Array, bitmask: jax.Array) -> jax.Array:
    """x [S, V], bitmask [S, ceil(V/32)] i32 (bit j of word w allows token 32w+j) -> masked x."""
    vocab = x.shape[1]
    token = jnp.arange(vocab)
    words = bitmask[:, token // 32]  # [S, V]
    # An arithmetic shift smears the sign bit of word bit 31, but `& 1` keeps only the wanted bit.
    allowed = ((words >> (token % 32)) & 1) == 1
    return jnp.where(allowed, x, -jnp.inf)


def _apply_penalties(
    x: jax.Array,
    repetition: jax.Array,
    output_counts: jax.Array | None = None,
    prompt_mask: jax.Array | None = None,
    presence: jax.Array | None = None,
    frequency: jax.Array | None = None,
) -> jax.Array:
    """x [S, V]; repetition/presence/frequency [S] f32; output_counts [S, V] i32; prompt_mask [S, V] bool.

    Neutral rows (1/0/0) come out bit-identical, so they sample as if no penalty stage ran.
    """
    seen = jnp.zeros(x.shape, dtype=bool)
    if prompt_mask is not None:
        seen = seen | prompt_mask
    if output_counts is not None:
        seen = seen | (output_counts > 0)
    rp = repetition[:, None]
    x = jnp.where(seen, jnp.where(x > 0, x / rp, x * rp), x)
    if output_counts is not None:
        assert presence is not None and frequency is not None
        counts = output_counts.astype(jnp.float32)
        x = x - frequency[:, None] * counts
        x = x - presence[:, None] * (output_counts > 0).astype(jnp.float32)
    return x


def _sortable_key(x: jax.Array) -> jax.Array:
    """float32 -> uint32 with the same order (for non-NaN values): flip negatives, set the sign of positives."""
    u = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where((u >> 31) == 1, ~u, u | jnp.uint32(0x80000000))


def _largest_key_where(holds: Callable[[jax.Array], jax.Array], num_rows: int) -> jax.Array:
    """Per row, the largest uint32 t with holds(t) true; holds(t [S]) -> [S] bool must be true at 0
    and stay false once false as t grows. 32 bisection steps over the whole uint32 range."""

    def step(_, bounds):
        lo, hi = bounds
        span = hi - lo
        mid = lo + (span >> 1) + (span & 1)  # upper midpoint, without overflowing uint32
        ok = holds(mid)
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

    lo = jnp.zeros((num_rows,), jnp.uint32)
    hi = jnp.full((num_rows,), 0xFFFFFFFF, jnp.uint32)
    return jax.lax.fori_loop(0, 32, step, (lo, hi))[0]


def _apply_top_k_top_p(x: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """x [S, V] (already divided by temperature); top_k [S] i32 (<=0 or >=V: off); top_p [S] f32 (>=1: off).

    Keeps the k largest logits, then the smallest set of those (by probability, renormalised over the
    top-k set) whose mass reaches top_p; the top token is always kept. Tokens tied with either cutoff
    are kept too.

    No sort: XLA:CPU sorts a [32, 49152] row block in ~0.5 s. Both cutoffs are found by bisection
    on the order-preserving integer keys of the logits instead (32 counting passes each):
      * the top-k cutoff is the k-th largest key: the largest t with #{key >= t} >= k;
      * the nucleus keeps value v exactly when the mass strictly above v is below top_p (what the
        sorted cumulative sum decides), so its cutoff is one past the largest t whose mass above t
        still reaches top_p.
    """
    num_rows, vocab = x.shape
    keys = _sortable_key(x)
    k = jnp.where((top_k <= 0) | (top_k > vocab), vocab, top_k)
    k_cut = _largest_key_where(lambda t: jnp.sum(keys >= t[:, None], axis=-1) >= k, num_rows)
    in_top_k = keys >= k_cut[:, None]
    probs = jax.nn.softmax(jnp.where(in_top_k, x, -jnp.inf), axis=-1)
    p = top_p[:, None]

    def mass_above_reaches_p(t):
        return jnp.sum(jnp.where(keys > t[:, None], probs, 0.0), axis=-1) >= top_p

    # Capped at the top key: the top token stays even for top_p = 0, where every t "reaches" it.
    top_key = jnp.max(keys, axis=-1)
    p_cut = jnp.minimum(_largest_key_where(mass_above_reaches_p, num_rows), top_key - 1) + 1
    # p >= 1 keeps everything explicitly, since rounding can make the mass above a token reach 1.
    in_nucleus = (keys >= p_cut[:, None]) | (p >= 1.0)
    return jnp.where(in_top_k & in_nucleus, x, -jnp.inf)


def _apply_min_p(x: jax.Array, min_p: jax.Array) -> jax.Array:
    """x [S, V]; min_p [S] f32 (0: off). Drops tokens with prob < min_p * max_prob.

    prob_i / max_prob = exp(x_i - max_x), so the test runs on logits and needs no softmax;
    log(0) = -inf keeps every token of rows with min_p = 0.
    """
    max_x = jnp.max(x, axis=-1, keepdims=True)
    threshold = max_x + jnp.log(min_p)[:, None]
    return jnp.where(x >= threshold, x, -jnp.inf)


def _row_key(seed: jax.Array, step: jax.Array) -> jax.Array:
    """Key of one row from its (seed, step) alone; vmapped so rows never share or split a key."""
    return jax.random.fold_in(jax.random.key(seed), step)


def _draw_random(x: jax.Array, greedy_ids: jax.Array, a: dict[str, jax.Array], top_k_top_p: bool) -> jax.Array:
    """x [S, V] processed logits, greedy_ids [S] -> [S] i32: greedy rows keep greedy_ids, others sample."""
    temperature = a["temperature"]
    is_greedy = temperature < GREEDY_EPS
    # Greedy rows divide by 1 only to keep their (discarded) draw finite.
    y = x / jnp.where(is_greedy, 1.0, temperature)[:, None]
    # min-p before top-k/top-p, as vLLM v1 orders them (it only matters when top-p is also set).
    y = _apply_min_p(y, a["min_p"])
    if top_k_top_p:
        y = _apply_top_k_top_p(y, a["top_k"], a["top_p"])
    keys = jax.vmap(_row_key)(a["seeds"], a["steps"])
    drawn = jax.vmap(jax.random.categorical)(keys, y).astype(jnp.int32)
    return jnp.where(is_greedy, greedy_ids, drawn)


def _logprobs(raw: jax.Array, targets: jax.Array, num_top: int) -> tuple[jax.Array, ...]:
    """raw [R, V] f32, targets [R] i32 -> (logprob [R], rank [R] i32, top_ids [R, k] i32, top_lp [R, k])."""
    lp = jax.nn.log_softmax(raw, axis=-1)
    target_lp = jnp.take_along_axis(lp, targets[:, None], axis=-1)[:, 0]
    # Rank 1 = best; ties share the better rank because only strictly larger logprobs count.
    ranks = (1 + jnp.sum(lp > target_lp[:, None], axis=-1)).astype(jnp.int32)
    if num_top > 0:
        top_lp, top_ids = jax.lax.top_k(lp, num_top)
    else:
        top_lp = jnp.zeros((raw.shape[0], 0), jnp.float32)
        top_ids = jnp.zeros((raw.shape[0], 0), jnp.int32)
    return target_lp, ranks, top_ids.astype(jnp.int32), top_lp


def _sample_impl(v: _Variant, logits: jax.Array, a: dict[str, jax.Array]) -> tuple[Any, ...]:
    """Traced body of one variant: logits [S, V], a = the batch arrays this variant needs."""
    _note_trace()
    raw = logits.astype(jnp.float32)
    x = raw
    if v.banned:
        x = _apply_banned(x, a["banned_ids"])
    if v.bitmask:
        x = _apply_bitmask(x, a["token_bitmask"])
    if v.counts or v.prompt_mask:
        x = _apply_penalties(
            x,
            a["repetition_penalty"],
            output_counts=a.get("output_counts"),
            prompt_mask=a.get("prompt_mask"),
            presence=a.get("presence_penalty"),
            frequency=a.get("frequency_penalty"),
        )
    token_ids = jnp.argmax(x, axis=-1).astype(jnp.int32)
    if v.any_random:
        token_ids = _draw_random(x, token_ids, a, v.top_k_top_p)
    if v.num_logprobs is None:
        return (token_ids,)
    return (token_ids, *_logprobs(raw, token_ids, v.num_logprobs))


# ---------------------------------------------------------------------------------------------
# Host side: pick the variant, ship only the arrays it needs, bring back numpy.
# ---------------------------------------------------------------------------------------------


def _check_rows(batch: SamplingBatch, num_rows: int, vocab: int) -> None:
    """Raise ValueError when a batch array does not match the logits' [S, V]."""
    for name in (
        "temperature", "top_k", "top_p", "min_p", "seeds", "steps",
        "repetition_penalty", "presence_penalty", "frequency_penalty",
    ):
        shape = np.shape(getattr(batch, name))
        if shape != (num_rows,):
            raise ValueError(f"SamplingBatch.{name} has shape {shape}, expected ({num_rows},)")
    for name, cols in (
        ("output_counts", vocab),
        ("prompt_mask", vocab),
        ("token_bitmask", (vocab + 31) // 32),
    ):
        arr = getattr(batch, name)
        if arr is not None and np.shape(arr) != (num_rows, cols):
            raise ValueError(f"SamplingBatch.{name} has shape {np.shape(arr)}, expected ({num_rows}, {cols})")
    if batch.banned_ids is not None and (np.ndim(batch.banned_ids) != 2 or len(batch.banned_ids) != num_rows):
        raise ValueError(f"SamplingBatch.banned_ids has shape {np.shape(batch.banned_ids)}, expected ({num_rows}, K)")
    if batch.num_logprobs is not None and batch.num_logprobs < 0:
        raise ValueError(f"num_logprobs must be None or >= 0, got {batch.num_logprobs}")


def _prepare(batch: SamplingBatch, num_rows: int, vocab: int) -> tuple[_Variant, dict[str, np.ndarray]]:
    """Static flags of the batch and the (typed numpy) arrays the chosen variant reads."""
    _check_rows(batch, num_rows, vocab)
    a: dict[str, np.ndarray] = {}

    temperature = np.asarray(batch.temperature, np.float32)
    random_rows = temperature >= GREEDY_EPS
    any_random = bool(random_rows.any())
    top_k_top_p = False
    if any_random:
        top_k = np.asarray(batch.top_k, np.int32)
        top_p = np.asarray(batch.top_p, np.float32)
        active = ((top_k > 0) & (top_k < vocab)) | (top_p < 1.0)
        top_k_top_p = bool((active & random_rows).any())
        a.update(
            temperature=temperature,
            min_p=np.asarray(batch.min_p, np.float32),
            seeds=np.asarray(batch.seeds, np.uint32),
            steps=np.asarray(batch.steps, np.int32),
        )
        if top_k_top_p:
            a.update(top_k=top_k, top_p=top_p)

    # Penalty arrays are [S, V]: skip shipping them when every row's penalties are neutral.
    rep = np.asarray(batch.repetition_penalty, np.float32)
    pres = np.asarray(batch.presence_penalty, np.float32)
    freq = np.asarray(batch.frequency_penalty, np.float32)
    any_rep = bool((rep != 1.0).any())
    use_counts = batch.output_counts is not None and (any_rep or bool((pres != 0).any() or (freq != 0).any()))
    use_prompt = batch.prompt_mask is not None and any_rep
    if use_counts or use_prompt:
        a["repetition_penalty"] = rep
    if use_counts:
        a.update(
            output_counts=np.asarray(batch.output_counts, np.int32),
            presence_penalty=pres,
            frequency_penalty=freq,
        )
    if use_prompt:
        a["prompt_mask"] = np.asarray(batch.prompt_mask, bool)

    banned = batch.banned_ids is not None and bool((np.asarray(batch.banned_ids) >= 0).any())
    if banned:
        a["banned_ids"] = np.asarray(batch.banned_ids, np.int32)
    # All-ones (-1) words allow everything; any other word may forbid something.
    bitmask = batch.token_bitmask is not None and not bool((np.asarray(batch.token_bitmask) == -1).all())
    if bitmask:
        a["token_bitmask"] = np.asarray(batch.token_bitmask, np.int32)

    num_logprobs = None if batch.num_logprobs is None else min(int(batch.num_logprobs), vocab)
    variant = _Variant(any_random, top_k_top_p, use_counts, use_prompt, banned, bitmask, num_logprobs)
    return variant, a


def _jitted(variant: _Variant) -> Callable[..., Any]:
    fn = _VARIANTS.get(variant)
    if fn is None:

        def sample_variant(logits: jax.Array, arrays: dict[str, jax.Array]) -> tuple[Any, ...]:
            return _sample_impl(variant, logits, arrays)

        fn = jax.jit(sample_variant)
        _VARIANTS[variant] = fn
    return fn


def _to_logprobs(parts: tuple[Any, ...]) -> Logprobs:
    lp, ranks, top_ids, top_lp = (np.asarray(p) for p in parts)
    return Logprobs(token_logprobs=lp, token_ranks=ranks, top_ids=top_ids, top_logprobs=top_lp)


def sample(logits: jax.Array, batch: SamplingBatch) -> SamplerOutput:
    """Sample one token per row.

    logits [S, V] float (raw model output, ideally already on device); batch has S rows.
    Returns numpy token_ids [S] i32, plus logprobs of the raw distribution when batch.num_logprobs
    is set (top entries: k = min(num_logprobs, V) columns).
    """
    logits = jnp.asarray(logits)
    if logits.ndim != 2:
        raise ValueError(f"logits must be [S, V], got shape {logits.shape}")
    num_rows, vocab = logits.shape
    variant, arrays = _prepare(batch, num_rows, vocab)
    out = _jitted(variant)(logits, arrays)
    token_ids = np.asarray(out[0])
    logprobs = _to_logprobs(out[1:]) if variant.num_logprobs is not None else None
    return SamplerOutput(token_ids=token_ids, logprobs=logprobs)


def _lower(logits: jax.Array, batch: SamplingBatch) -> Any:
    """The jax ``Lowered`` of the variant ``sample`` would run (for tests inspecting the program)."""
    logits = jnp.asarray(logits)
    variant, arrays = _prepare(batch, *logits.shape)
    return _jitted(variant).lower(logits, arrays)


def _compute_logprobs_impl(logits: jax.Array, targets: jax.Array, num_top: int) -> tuple[jax.Array, ...]:
    _note_trace()
    return _logprobs(logits.astype(jnp.float32), targets, num_top)


_compute_logprobs_jit = jax.jit(_compute_logprobs_impl, static_argnames=("num_top",))


def compute_logprobs(logits: jax.Array, target_ids: Any, num_top: int) -> Logprobs:
    """Logprobs of given targets under log_softmax(logits) (prompt logprobs).

    logits [R, V] float, target_ids [R] int, num_top >= 0 -> Logprobs with numpy token_logprobs [R],
    token_ranks [R] i32, top_ids / top_logprobs [R, min(num_top, V)].
    """
    logits = jnp.asarray(logits)
    if logits.ndim != 2:
        raise ValueError(f"logits must be [R, V], got shape {logits.shape}")
    if num_top < 0:
        raise ValueError(f"num_top must be >= 0, got {num_top}")
    targets = np.asarray(target_ids, np.int32)
    if targets.shape != (logits.shape[0],):
        raise ValueError(f"target_ids has shape {targets.shape}, expected ({logits.shape[0]},)")
    return _to_logprobs(_compute_logprobs_jit(logits, targets, num_top=min(int(num_top), logits.shape[1])))
