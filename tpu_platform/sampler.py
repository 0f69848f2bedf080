"""On-device token sampling in pure JAX: masks, penalties, greedy / temperature / top-k / top-p / min-p, logprobs.

The logits never leave the device: only the sampled ids (and the requested logprobs) come back to the
host. Shapes: S = sequence rows, V = vocabulary size.

Processing order (vLLM v1's):
  1. banned ids and the structured-output bitmask set disallowed tokens to -inf (the host folds the
     banned ids into the bitmask, so both are one mask on device);
  2. penalties: repetition (on tokens seen in the prompt or the output: positive logits are divided
     by the penalty, the others multiplied), then frequency (``-= freq * count``) and presence
     (``-= pres * (count > 0)``);
  3. greedy rows (temperature < 1e-5) take the argmax of the processed logits;
  4. random rows: divide by the temperature, drop tokens whose probability is below
     ``min_p * max_prob`` (min-p runs first, as vLLM v1 applies it before its top-k/top-p sampler),
     keep the top-k, then the top-p nucleus of what is left, and draw from the softmax of the rest.

Randomness contract: the PRNG key of row i is ``fold_in(key(seeds[i]), steps[i])`` and the draw is
vmapped over rows, so a row's token depends only on its (seed, step) and its own logits: never on the
other rows, its position in the batch, the batch size, or which compiled variant ran.

Compilation: a batch is one of 8 kinds, {greedy, random} x {plain, extras} x {no logprobs, logprobs},
run as a chain of at most three small jitted stages, each compiled once per row count (5 programs per
row count in all, the last shared with compute_logprobs); every per-request choice is a runtime value,
so nothing compiles after ``warmup``:
  * argmax: a plain all-greedy batch compiles to an argmax only;
  * extras: the allowed-token bitmask (banned ids are folded into it on the host, so the ban list's
    width shapes nothing) and the penalties (dense output_counts and prompt_mask [S, V]); a batch
    needing only some of them gets neutral arrays for the rest, kept on device and not re-sent. It
    ends in the argmax (greedy batches) or hands the processed logits on (random ones);
  * random: temperature sampling and min-p (one cheap fused pass); top-k/top-p sit behind a
    ``lax.cond`` on a flag the host computes, so plain temperature sampling skips their bisection;
  * logprobs: always the top ``max_logprobs`` (the engine's limit, clamped to V); the host slices the
    columns down to what was asked for.
Stages rather than one fused program per kind: the PRNG (threefry) dominates compile time on CPU,
and this way one program per row count holds it instead of four. Prompt logprobs
(``compute_logprobs``) pad their rows to power-of-two buckets.

State is per engine: a ``Sampler`` holds its own compiled stages, trace count (``compile_count()``)
and neutral arrays, placed where its engine's logits live; two engines in one process share none.

Draft verification (rejection_sampler.py) draws its own tokens from the same distribution:
it reuses the extras stage (``Sampler.prepare_verification``), the random processing
(``target_logits``), the row keys (``row_keys``) and the logprobs program
(``Sampler.token_logprobs_async``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tpuserve.tpu_platform.device import place
from tpuserve.tpu_platform.executable_cache import CachedJit, ExecutableCache
from tpuserve.tpu_platform.step_batch import Logprobs, SamplerOutput, SamplingBatch

# Rows whose temperature is below this are greedy (float32 so host and device agree on the boundary).
GREEDY_EPS = np.float32(1e-5)
# vLLM's --max-logprobs default: how many top entries the logprobs variants compute.
DEFAULT_MAX_LOGPROBS = 20
# Smallest row bucket of compute_logprobs: below it, padding costs less than one more program.
MIN_LOGPROB_ROWS = 8


@dataclass(frozen=True)
class _Variant:
    """Which stages a batch runs (8 kinds)."""

    random: bool  # some row samples (temperature >= GREEDY_EPS)
    extras: bool  # penalties and/or an allowed-token mask (banned ids, structured output)
    num_top: int | None  # None = no logprobs, else the top-k size (max_logprobs clamped to V)


def logprob_rows_bucket(num_rows: int) -> int:
    """Row count compute_logprobs pads ``num_rows`` to: the next power of two, at least MIN_LOGPROB_ROWS."""
    return max(MIN_LOGPROB_ROWS, 1 << max(0, int(num_rows) - 1).bit_length())


# ---------------------------------------------------------------------------------------------
# Device-side stages. All take and return [S, V] float32 logits unless stated otherwise.
# ---------------------------------------------------------------------------------------------


def _apply_bitmask(x: jax.Array, bitmask: jax.Array) -> jax.Array:
    """x [S, V], bitmask [S, ceil(V/32)] i32 (bit j of word w allows token 32w+j) -> masked x."""
    num_rows, vocab = x.shape
    # Expand every word to its 32 bits in place (no gather): [S, W, 32] -> [S, 32W] -> first V.
    # An arithmetic shift smears the sign bit of word bit 31, but `& 1` keeps only the wanted bit.
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    allowed = bits.reshape(num_rows, -1)[:, :vocab] == 1
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


def _top_k_top_p_keep(x: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """x [S, V] (already divided by temperature); top_k [S] i32 (<=0 or >=V: off); top_p [S] f32 (>=1: off)
    -> keep [S, V] bool, the tokens the filters let through.

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
    return in_top_k & in_nucleus


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


def row_keys(seeds: jax.Array, steps: jax.Array) -> jax.Array:
    """seeds [S] u32, steps [S] i32 -> [S] typed PRNG keys, each from its row's (seed, step) alone."""
    return jax.vmap(_row_key)(seeds, steps)


def target_logits(x: jax.Array, a: dict[str, jax.Array]) -> jax.Array:
    """x [S, V] processed logits (after the extras stage) -> [S, V] f32 logits whose softmax is the
    distribution a random row draws from: divided by the temperature, min-p, then top-k/top-p, with
    dropped tokens at -inf. Greedy rows divide by 1. Draft verification (spec_decode) reuses it, so
    its target distribution is exactly the one plain sampling draws from.

    ``a`` holds the random stage's arguments (temperature, min_p, top_k, top_p [S], use_top_k_top_p).
    """
    temperature = a["temperature"]
    is_greedy = temperature < GREEDY_EPS
    # Greedy rows divide by 1 only to keep their (discarded) draw finite.
    y = x / jnp.where(is_greedy, 1.0, temperature)[:, None]
    y = _apply_min_p(y, a["min_p"])  # one fused max + compare: cheap enough to always run
    # The bisection passes run only when some random row has top-k/top-p on (a host-computed flag),
    # so one program serves every mix while plain temperature sampling skips them. The cond yields a
    # mask, not the logits: its skip branch is then a constant the select fuses away, where passing
    # [S, V] logits through the cond costs a copy. Inactive rows' masks keep everything either way.
    keep = jax.lax.cond(
        a["use_top_k_top_p"],
        lambda z: _top_k_top_p_keep(z, a["top_k"], a["top_p"]),
        lambda z: jnp.ones(z.shape, bool),
        y,
    )
    return jnp.where(keep, y, -jnp.inf)


def _draw_random(x: jax.Array, greedy_ids: jax.Array, a: dict[str, jax.Array]) -> jax.Array:
    """x [S, V] processed logits, greedy_ids [S] -> [S] i32: greedy rows keep greedy_ids, others sample."""
    y = target_logits(x, a)
    keys = row_keys(a["seeds"], a["steps"])
    drawn = jax.vmap(jax.random.categorical)(keys, y).astype(jnp.int32)
    return jnp.where(a["temperature"] < GREEDY_EPS, greedy_ids, drawn)


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


# Stage bodies. A Sampler jits each (and counts its traces); jax.jit caches one executable per
# static flag and shapes.


def _argmax_impl(logits: jax.Array) -> jax.Array:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def _extras_impl(logits: jax.Array, a: dict[str, jax.Array], keep_logits: bool) -> jax.Array:
    """Mask, then penalties; returns the processed f32 logits (keep_logits) or their argmax."""
    x = _apply_bitmask(logits.astype(jnp.float32), a["token_bitmask"])
    x = _apply_penalties(
        x,
        a["repetition_penalty"],
        output_counts=a["output_counts"],
        prompt_mask=a["prompt_mask"],
        presence=a["presence_penalty"],
        frequency=a["frequency_penalty"],
    )
    return x if keep_logits else jnp.argmax(x, axis=-1).astype(jnp.int32)


def _random_impl(logits: jax.Array, a: dict[str, jax.Array]) -> jax.Array:
    x = logits.astype(jnp.float32)
    return _draw_random(x, jnp.argmax(x, axis=-1).astype(jnp.int32), a)


def _logprobs_impl(logits: jax.Array, targets: jax.Array, num_top: int) -> tuple[jax.Array, ...]:
    return _logprobs(logits.astype(jnp.float32), targets, num_top)


# ---------------------------------------------------------------------------------------------
# Host side: pick the variant, ship only the arrays it needs, bring back numpy.
# ---------------------------------------------------------------------------------------------


def _check_rows(batch: SamplingBatch, num_rows: int, vocab: int) -> None:
    """Raise ValueError when a batch array does not match the logits' [S, V]."""
    for name in (
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "seeds",
        "steps",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
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
        raise ValueError(
            f"SamplingBatch.banned_ids has shape {np.shape(batch.banned_ids)}, expected ({num_rows}, K)"
        )
    if batch.num_logprobs is not None and batch.num_logprobs < 0:
        raise ValueError(f"num_logprobs must be None or >= 0, got {batch.num_logprobs}")


def _neutral_host(name: str, num_rows: int, vocab: int) -> np.ndarray:
    """The host value of an extras input that changes nothing."""
    if name == "output_counts":
        return np.zeros((num_rows, vocab), np.int32)
    if name == "prompt_mask":
        return np.zeros((num_rows, vocab), bool)
    if name == "token_bitmask":
        return np.full((num_rows, (vocab + 31) // 32), -1, np.int32)
    raise KeyError(name)


def _allowed_words(batch: SamplingBatch, num_rows: int, vocab: int) -> np.ndarray | None:
    """The batch's bitmask with its banned ids cleared, [S, ceil(V/32)] i32; None when it allows everything.

    Folding the ban list in here keeps its width (how many ids a row bans) out of the program shapes.
    """
    words = None
    if batch.token_bitmask is not None:
        given = np.asarray(batch.token_bitmask, np.int32)
        # All-ones (-1) words allow everything; any other word may forbid something.
        if not bool((given == -1).all()):
            words = given.view(np.uint32).copy()  # a copy: the caller's array is not ours to edit
    if batch.banned_ids is not None:
        ids = np.asarray(batch.banned_ids, np.int64)
        # -1 pads; ids outside the vocabulary ban nothing.
        rows, cols = np.nonzero((ids >= 0) & (ids < vocab))
        if rows.size:
            if words is None:
                words = np.full((num_rows, (vocab + 31) // 32), 0xFFFFFFFF, np.uint32)
            tokens = ids[rows, cols]
            clear = ~(np.uint32(1) << (tokens % 32).astype(np.uint32))
            np.bitwise_and.at(words, (rows, tokens // 32), clear)
    return None if words is None else words.view(np.int32)


def _num_top(max_logprobs: int, vocab: int) -> int:
    if max_logprobs < 0:
        raise ValueError(f"max_logprobs must be >= 0, got {max_logprobs}")
    return min(int(max_logprobs), vocab)


def _prepare(
    batch: SamplingBatch,
    num_rows: int,
    vocab: int,
    max_logprobs: int,
    neutral: Callable[[str, int, int], Any],
) -> tuple[_Variant, dict[str, Any], dict[str, Any], int]:
    """The batch's variant, the arguments of its random and extras stages (numpy, or the neutral
    arrays ``neutral(name, S, V)`` gives; empty when the stage does not run), and how many
    top-logprob columns the caller gets back."""
    _check_rows(batch, num_rows, vocab)
    random_args: dict[str, Any] = {}
    extras_args: dict[str, Any] = {}

    temperature = np.asarray(batch.temperature, np.float32)
    random_rows = temperature >= GREEDY_EPS
    any_random = bool(random_rows.any())
    if any_random:
        top_k = np.asarray(batch.top_k, np.int32)
        top_p = np.asarray(batch.top_p, np.float32)
        min_p = np.asarray(batch.min_p, np.float32)
        top_k_top_p = ((top_k > 0) & (top_k < vocab)) | (top_p < 1.0)
        random_args.update(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            seeds=np.asarray(batch.seeds, np.uint32),
            steps=np.asarray(batch.steps, np.int32),
            use_top_k_top_p=np.asarray(bool((top_k_top_p & random_rows).any())),
        )

    # Penalty arrays are [S, V]: skip shipping them when every row's penalties are neutral.
    rep = np.asarray(batch.repetition_penalty, np.float32)
    pres = np.asarray(batch.presence_penalty, np.float32)
    freq = np.asarray(batch.frequency_penalty, np.float32)
    any_rep = bool((rep != 1.0).any())
    use_counts = batch.output_counts is not None and (any_rep or bool((pres != 0).any() or (freq != 0).any()))
    use_prompt = batch.prompt_mask is not None and any_rep
    words = _allowed_words(batch, num_rows, vocab)
    extras = use_counts or use_prompt or words is not None
    if extras:
        extras_args.update(
            repetition_penalty=rep,
            presence_penalty=pres,
            frequency_penalty=freq,
            output_counts=(
                np.asarray(batch.output_counts, np.int32)
                if use_counts
                else neutral("output_counts", num_rows, vocab)
            ),
            prompt_mask=(
                np.asarray(batch.prompt_mask, bool) if use_prompt else neutral("prompt_mask", num_rows, vocab)
            ),
            token_bitmask=words if words is not None else neutral("token_bitmask", num_rows, vocab),
        )

    num_top = None
    columns = 0
    if batch.num_logprobs is not None:
        num_top = _num_top(max_logprobs, vocab)
        columns = min(int(batch.num_logprobs), vocab)
        if columns > num_top:
            raise ValueError(f"num_logprobs {batch.num_logprobs} exceeds max_logprobs {max_logprobs}")
    return _Variant(any_random, extras, num_top), random_args, extras_args, columns


def _to_logprobs(parts: tuple[Any, ...], num_rows: int, columns: int) -> Logprobs:
    """Device results -> numpy, cut to the real rows and to the top columns the caller asked for."""
    lp, ranks, top_ids, top_lp = (np.asarray(p) for p in parts)
    return Logprobs(
        token_logprobs=lp[:num_rows],
        token_ranks=ranks[:num_rows],
        top_ids=top_ids[:num_rows, :columns],
        top_logprobs=top_lp[:num_rows, :columns],
    )


def _check_logprob_inputs(logits: Any, target_ids: Any) -> tuple[Any, np.ndarray]:
    if not isinstance(logits, jax.Array):
        logits = np.asarray(logits)
    if logits.ndim != 2:
        raise ValueError(f"logits must be [R, V], got shape {logits.shape}")
    targets = np.asarray(target_ids, np.int32)
    if targets.ndim != 1 or targets.shape[0] > logits.shape[0]:
        raise ValueError(f"target_ids has shape {targets.shape}, expected (R,) with R <= {logits.shape[0]}")
    return logits, targets


class Sampler:
    """One engine's sampler: its own compiled stage programs, their trace count, and the neutral
    extras inputs, placed where the engine's logits live (``sharding``: a mesh runner's replicated
    sharding; None: the default device). Engines in one process never share one."""

    def __init__(self, sharding: Any = None, disk: ExecutableCache | None = None):
        """disk: where the stage programs are kept across restarts (executable_cache.py); None:
        plain ``jax.jit`` (traced and lowered on every start)."""
        self.sharding = sharding
        self._traces = 0
        # Neutral extras inputs per (name, S, V), kept on device so batches that lack them send nothing.
        self._neutral_arrays: dict[tuple[str, int, int], jax.Array] = {}
        # Jitted per instance (bound methods): a trace, and so a compile count, is this sampler's own.
        self._argmax_jit = CachedJit("sampler-argmax", jax.jit(self._argmax), disk)
        self._extras_jit = CachedJit(
            "sampler-extras", jax.jit(self._extras, static_argnames=("keep_logits",)), disk
        )
        self._random_jit = CachedJit("sampler-random", jax.jit(self._random), disk)
        # Sampled-token logprobs and prompt logprobs share it, so a row count both use compiles once.
        self._logprobs_jit = CachedJit(
            "sampler-logprobs", jax.jit(self._logprobs, static_argnames=("num_top",)), disk
        )

    def compile_count(self) -> int:
        """How many times a stage program of this sampler was traced: each once per static flag and
        input shapes (sample's stages and the logprobs program compute_logprobs shares)."""
        return self._traces

    # The traced bodies: Python runs them once per trace, never on cached calls.

    def _argmax(self, logits: jax.Array) -> jax.Array:
        self._traces += 1
        return _argmax_impl(logits)

    def _extras(self, logits: jax.Array, a: dict[str, jax.Array], keep_logits: bool) -> jax.Array:
        self._traces += 1
        return _extras_impl(logits, a, keep_logits)

    def _random(self, logits: jax.Array, a: dict[str, jax.Array]) -> jax.Array:
        self._traces += 1
        return _random_impl(logits, a)

    def _logprobs(self, logits: jax.Array, targets: jax.Array, num_top: int) -> tuple[jax.Array, ...]:
        self._traces += 1
        return _logprobs_impl(logits, targets, num_top)

    def _neutral(self, name: str, num_rows: int, vocab: int) -> jax.Array:
        """A device-resident extras input that changes nothing, made once per shape.

        device_put of a host array compiles nothing, unlike jnp.zeros, so a first use after warm-up is free.
        """
        key = (name, num_rows, vocab)
        arr = self._neutral_arrays.get(key)
        if arr is None:
            arr = self._neutral_arrays[key] = place(_neutral_host(name, num_rows, vocab), self.sharding)
        return arr

    def _prepare(
        self, batch: SamplingBatch, num_rows: int, vocab: int, max_logprobs: int
    ) -> tuple[_Variant, dict[str, Any], dict[str, Any], int]:
        """``_prepare`` with this sampler's neutral arrays. The host extras go to the same
        placement as the neutral ones: a program's cache key includes where its inputs sit, so a
        batch mixing them differently from warm-up's would compile again (on a mesh under
        ``jax.jit``; with an executable cache, on one device too: executable_cache.CachedJit)."""
        variant, random_args, extras_args, columns = _prepare(
            batch, num_rows, vocab, max_logprobs, self._neutral
        )
        extras_args = {
            k: place(v, self.sharding) if isinstance(v, np.ndarray) else v for k, v in extras_args.items()
        }
        return variant, random_args, extras_args, columns

    def sample_async(
        self,
        logits: jax.Array,
        batch: SamplingBatch,
        max_logprobs: int = DEFAULT_MAX_LOGPROBS,
        greedy: jax.Array | None = None,
    ) -> tuple[jax.Array, tuple[jax.Array, ...] | None]:
        """Dispatch sampling without waiting for the device (for a runner that overlaps steps).

        Returns token_ids [S] i32 on device, and when batch.num_logprobs is set the device logprob parts
        (token_logprobs [S], token_ranks [S] i32, top_ids [S, K] i32, top_logprobs [S, K]) with
        K = min(max_logprobs, V) whatever was asked: consumers slice the columns they want on the host
        (``sample`` does). Raises ValueError when num_logprobs > max_logprobs.
        greedy [S] i32: the logits' argmax when the caller already has it on device (the runner's
        forward computes it): a batch that only takes argmaxes then dispatches nothing here.
        """
        logits = jnp.asarray(logits)
        if logits.ndim != 2:
            raise ValueError(f"logits must be [S, V], got shape {logits.shape}")
        num_rows, vocab = logits.shape
        variant, random_args, extras_args, _ = self._prepare(batch, num_rows, vocab, max_logprobs)
        if greedy is not None and not (variant.random or variant.extras):
            token_ids = greedy
        else:
            token_ids = self._run_stages(variant, logits, random_args, extras_args)
        parts = None
        if variant.num_top is not None:
            parts = tuple(self._logprobs_jit(logits, token_ids, num_top=variant.num_top))
        return token_ids, parts

    def sample(
        self, logits: jax.Array, batch: SamplingBatch, max_logprobs: int = DEFAULT_MAX_LOGPROBS
    ) -> SamplerOutput:
        """Sample one token per row.

        logits [S, V] float (raw model output, ideally already on device); batch has S rows.
        max_logprobs: the engine's limit on num_logprobs (vLLM's --max-logprobs); the device always
        computes that many top entries, so the requested count never changes the program. Keep it fixed
        for a server's life and pass the same value to ``warmup``.
        Returns numpy token_ids [S] i32, plus logprobs of the raw distribution when batch.num_logprobs
        is set: token_logprobs / token_ranks [S], top_ids / top_logprobs [S, k] with
        k = min(batch.num_logprobs, V), the batch's largest request; a row that asked for fewer takes the
        first columns of its row (sorted best first). Raises ValueError when num_logprobs > max_logprobs.
        """
        token_ids, parts = self.sample_async(logits, batch, max_logprobs)
        logprobs = None
        if parts is not None:
            assert batch.num_logprobs is not None  # parts come only when logprobs are asked for
            logprobs = _to_logprobs(
                parts, len(batch.temperature), min(int(batch.num_logprobs), parts[2].shape[1])
            )
        return SamplerOutput(token_ids=np.asarray(token_ids), logprobs=logprobs)

    def prepare_verification(
        self, logits: jax.Array, batch: SamplingBatch, max_logprobs: int = DEFAULT_MAX_LOGPROBS
    ) -> tuple[jax.Array, dict[str, Any], int | None]:
        """For draft verification (rejection_sampler.py), which draws its own tokens.

        logits [R, V] (device), batch with R rows -> (x [R, V]: the logits after the extras stage (mask,
        penalties; dispatched, not awaited) or the logits themselves when the batch needs none; the random
        stage's arguments, empty when every row is greedy; the logprob columns the device computes,
        None when the batch wants no logprobs). Feed x and the arguments to ``target_logits``.
        """
        num_rows, vocab = logits.shape
        variant, random_args, extras_args, _ = self._prepare(batch, num_rows, vocab, max_logprobs)
        x = self._extras_jit(logits, extras_args, keep_logits=True) if variant.extras else logits
        return x, random_args, variant.num_top

    def token_logprobs_async(
        self, logits: jax.Array, targets: jax.Array, num_top: int
    ) -> tuple[jax.Array, ...]:
        """logits [R, V], targets [R] i32 -> device (logprob [R], rank [R], top_ids [R, k], top_lp [R, k]),
        the program ``sample_async`` runs for its logprobs (so a warmed row count compiles nothing)."""
        return tuple(self._logprobs_jit(logits, targets, num_top=num_top))

    def _run_stages(
        self, variant: _Variant, logits: jax.Array, random_args: dict, extras_args: dict
    ) -> jax.Array:
        """Token ids [S] (on device) through the stages the variant needs."""
        if variant.extras:
            x = self._extras_jit(logits, extras_args, keep_logits=variant.random)
            return self._random_jit(x, random_args) if variant.random else x
        if variant.random:
            return self._random_jit(logits, random_args)
        return self._argmax_jit(logits)

    def _lowered_text(
        self, logits: jax.Array, batch: SamplingBatch, max_logprobs: int = DEFAULT_MAX_LOGPROBS
    ) -> str:
        """The StableHLO text of every stage ``sample`` would run for this batch (tests inspect it)."""
        logits = jnp.asarray(logits)
        num_rows, vocab = logits.shape
        variant, random_args, extras_args, _ = self._prepare(batch, num_rows, vocab, max_logprobs)
        texts = []
        x: jax.Array | jax.ShapeDtypeStruct = logits
        if variant.extras:
            texts.append(self._extras_jit.lower(logits, extras_args, keep_logits=variant.random).as_text())
            x = jax.ShapeDtypeStruct(logits.shape, jnp.float32)
        if variant.random:
            texts.append(self._random_jit.lower(x, random_args).as_text())
        elif not variant.extras:
            texts.append(self._argmax_jit.lower(logits).as_text())
        if variant.num_top is not None:
            ids = jax.ShapeDtypeStruct((num_rows,), jnp.int32)
            texts.append(self._logprobs_jit.lower(logits, ids, num_top=variant.num_top).as_text())
        return "\n".join(texts)

    def compute_logprobs_async(
        self, logits: Any, target_ids: Any, max_logprobs: int = DEFAULT_MAX_LOGPROBS
    ) -> tuple[jax.Array, ...]:
        """Dispatch prompt logprobs without waiting: the device parts of ``compute_logprobs``, padded.

        logits [N, V], target_ids [R] with R <= N (see compute_logprobs). Returns (token_logprobs [B],
        token_ranks [B] i32, top_ids [B, K] i32, top_logprobs [B, K]) with B = logprob_rows_bucket(N) and
        K = min(max_logprobs, V): the host keeps the first R rows and the columns it wants.
        """
        logits, targets = _check_logprob_inputs(logits, target_ids)
        num_logits_rows, vocab = logits.shape
        bucket = logprob_rows_bucket(num_logits_rows)
        if bucket > num_logits_rows:
            pad = ((0, bucket - num_logits_rows), (0, 0))
            logits = jnp.pad(logits, pad) if isinstance(logits, jax.Array) else np.pad(logits, pad)
        padded_targets = np.zeros(bucket, np.int32)
        padded_targets[: targets.shape[0]] = targets
        return tuple(self._logprobs_jit(logits, padded_targets, num_top=_num_top(max_logprobs, vocab)))

    def compute_logprobs(
        self, logits: Any, target_ids: Any, num_top: int, max_logprobs: int = DEFAULT_MAX_LOGPROBS
    ) -> Logprobs:
        """Logprobs of given targets under log_softmax(logits) (prompt logprobs).

        logits [N, V] float, target_ids [R] int with R <= N: row i of the result scores target_ids[i]
        under logits row i; logits rows past R are padding and ignored. The rows are padded to
        ``logprob_rows_bucket(N)`` (power-of-two buckets, all compiled by ``warmup``), so the number of
        prompt positions never compiles a new program. Padding a host (numpy) array is free; padding a
        device array of a non-bucket N runs a small pad op compiled per N, which callers avoid by
        gathering their logits rows with indices already padded to ``logprob_rows_bucket(R)``.
        The device computes the top min(max_logprobs, V) entries; 0 <= num_top <= max_logprobs.
        Returns numpy token_logprobs [R], token_ranks [R] i32, top_ids / top_logprobs [R, min(num_top, V)].
        """
        if num_top < 0:
            raise ValueError(f"num_top must be >= 0, got {num_top}")
        logits, targets = _check_logprob_inputs(logits, target_ids)
        columns = min(int(num_top), logits.shape[1])
        if columns > _num_top(max_logprobs, logits.shape[1]):
            raise ValueError(f"num_top {num_top} exceeds max_logprobs {max_logprobs}")
        parts = self.compute_logprobs_async(logits, targets, max_logprobs)
        return _to_logprobs(parts, targets.shape[0], columns)

    def warmup(
        self,
        row_counts: Iterable[int],
        vocab_size: int,
        max_logprobs: int = DEFAULT_MAX_LOGPROBS,
        prompt_logprob_rows: int = 0,
        dtype: Any = jnp.float32,
        argmax: bool = True,
    ) -> int:
        """Compile every sampler variant for every row count in ``row_counts`` (logits [S, vocab_size] of
        ``dtype``), and compute_logprobs for every row bucket up to ``prompt_logprob_rows`` (0: none).

        Afterwards no batch of those row counts compiles anything, whatever its sampling parameters,
        as long as ``max_logprobs`` matches what ``sample`` / ``compute_logprobs`` are called with.
        The warm-up logits live where the real ones do (the sampler's ``sharding``).
        Costs 5 programs per row count (argmax, extras x 2, random, logprobs) plus one per prompt
        bucket not among them. ``argmax=False`` leaves out the argmax-only program, for a caller
        that always passes ``sample_async`` the argmax it has (the runner's forward computes it):
        4 programs per row count. Returns the number of programs compiled (0 when everything was warm).
        """
        before = self.compile_count()
        for num_rows in sorted(set(int(n) for n in row_counts)):
            logits = place(np.zeros((num_rows, vocab_size), dtype), self.sharding)
            for name in ("output_counts", "prompt_mask", "token_bitmask"):
                self._neutral(name, num_rows, vocab_size)
            for random in (False, True):
                for extras in (False, True):
                    for logprobs in (False, True):
                        if not (argmax or random or extras):
                            continue  # the argmax-only kinds (the logprobs program comes with the others)
                        batch = SamplingBatch.greedy(num_rows)
                        if random:
                            batch.temperature[0] = 1.0
                        if extras:
                            batch.repetition_penalty[0] = 1.1
                            batch.output_counts = np.zeros((num_rows, vocab_size), np.int32)
                        if logprobs:
                            batch.num_logprobs = 0
                        self.sample(logits, batch, max_logprobs)
        if prompt_logprob_rows > 0:
            rows = MIN_LOGPROB_ROWS
            while rows <= logprob_rows_bucket(prompt_logprob_rows):
                logits = place(np.zeros((rows, vocab_size), dtype), self.sharding)
                self.compute_logprobs(logits, np.zeros(rows, np.int32), 0, max_logprobs)
                rows *= 2
        return self.compile_count() - before
