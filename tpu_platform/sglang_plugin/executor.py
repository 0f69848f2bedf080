"""Our side of the SGLang worker: weights, KV cache and model steps in JAX, no SGLang, no torch.

The SGLang worker (worker.py) turns each scheduled batch into ``ScheduledSeq`` items whose page
tables are SGLang's own page ids (slots.py) and calls ``JaxExecutor.run``. SGLang's scheduler does
not know our compile buckets, so ``plan_steps`` cuts any batch it sends into runner-sized steps:
at most ``max_num_batched_tokens`` tokens and ``max_num_seqs`` sequences each, a long prefill
chunk spread over consecutive steps. Sequences are independent and their KV lives in pages SGLang
already assigned, so splitting changes nothing but the number of model calls.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, replace

import numpy as np

from tpuserve.tpu_platform.config import LAYER_LOOPS, EngineConfig
from tpuserve.tpu_platform.step_batch import ScheduledSeq

log = logging.getLogger(__name__)


# Our loader's settings SGLang has no flag for, from ``--model-loader-extra-config '{"...": ...}'``
# (SGLang hands that JSON to the loader of the chosen load format; ours is the platform's).
LOADER_OPTIONS = ("layer_loop",)


def loader_options(raw) -> dict:
    """``--model-loader-extra-config`` (a JSON string or a dict) as our options; unknown keys and
    bad values raise ValueError naming them (checked at start-up by platform.py, read again by the
    scheduler process's worker)."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw or "{}")
        except json.JSONDecodeError as e:
            raise ValueError(f"--model-loader-extra-config is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError("--model-loader-extra-config must be a JSON object")
    unknown = sorted(set(raw) - set(LOADER_OPTIONS))
    if unknown:
        raise ValueError(
            f"--model-loader-extra-config: unknown key(s) {', '.join(unknown)} "
            f"for the tpuserve platform; known: {', '.join(LOADER_OPTIONS)}"
        )
    if raw.get("layer_loop", "auto") not in LAYER_LOOPS:
        raise ValueError(
            f"--model-loader-extra-config layer_loop={raw['layer_loop']!r}: must be one of {LAYER_LOOPS}"
        )
    return raw


@dataclass(frozen=True)
class ExecutorConfig:
    """SGLang's settings for our executor. Engine settings SGLang leaves unset are None and take
    ``EngineConfig``'s defaults (``engine_config`` is the one mapping): none of their own here."""

    model_path: str
    page_size: int  # SGLang's page_size; our block_size
    max_model_len: int
    dtype: str | None = None  # our names: auto / float32 / bfloat16 / float16
    max_total_tokens: int | None = None  # SGLang's --max-total-tokens; None: sized from memory
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    gpu_memory_utilization: float | None = None
    attention_impl: str | None = None
    layer_loop: str | None = None  # config.LayerLoop: "scan" (fast compiles) / "unroll" (CPU default)
    # Weight quantization: None (the checkpoint as it is), "fp8" / "mxfp4" / "nvfp4" (quantize at
    # load, or a pre-quantized checkpoint's own method: sglang_plugin/quantization.py resolves it).
    quantization: str | None = None
    kv_cache_dtype: str | None = None  # "auto" (model dtype) or "fp8_e4m3"
    warmup: bool | None = None  # None: compile every bucket up front on accelerators only
    # Drafts a sequence verifies per step under SGLang's NGRAM speculation (its
    # --speculative-num-draft-tokens minus the root); None: no speculation. The runner sizes and
    # warms its draft slots by it.
    num_speculative_tokens: int | None = None

    def engine_config(self) -> EngineConfig:
        """Our engine's configuration: the values SGLang set, EngineConfig's defaults for the rest."""
        given = dict(
            model=self.model_path,
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            block_size=self.page_size,
            attention_impl=self.attention_impl,
            layer_loop=self.layer_loop,
            quantization=self.quantization,
            kv_cache_dtype=self.kv_cache_dtype,
            gpu_memory_utilization=self.gpu_memory_utilization,
            speculative_config=(
                {"method": "ngram", "num_speculative_tokens": self.num_speculative_tokens}
                if self.num_speculative_tokens
                else None
            ),
            # +1: page 0 is reserved by both SGLang (padding) and us; SGLang's pages are 1..usable.
            num_gpu_blocks=(
                max(1, self.max_total_tokens // self.page_size) + 1
                if self.max_total_tokens is not None
                else None
            ),
        )
        return EngineConfig.from_kwargs(
            **{k: v for k, v in given.items() if v is not None},
            # SGLang's scheduler waits for each batch's ids before building the next.
            async_scheduling=False,
        )


@dataclass
class _Piece:
    """One sequence's share of one runner step: ``seq`` (a chunk of it) for caller index ``index``."""

    index: int
    seq: ScheduledSeq
    last: bool  # the chunk that ends the caller's item: its sample is the answer


def plan_steps(
    seqs: list[ScheduledSeq], page_size: int, max_tokens: int, max_seqs: int
) -> list[list[_Piece]]:
    """Cut a batch into steps within the runner's limits; each sequence at most once per step.

    Chunks of one sequence land in consecutive steps in order, so each chunk finds the K/V of the
    previous one already written. A chunk's page table covers only the tokens it reaches. A
    sequence with drafts to verify is never cut: its token and drafts go into one step whole.
    """
    pending = [(i, 0) for i in range(len(seqs))]  # (caller index, tokens of it done)
    steps: list[list[_Piece]] = []
    while pending:
        step: list[_Piece] = []
        budget = max_tokens
        later = []
        for i, done in pending:
            s = seqs[i]
            left = len(s.token_ids) - done
            if s.draft_token_ids:
                whole = left + len(s.draft_token_ids)
                if whole > max_tokens:
                    raise ValueError(
                        f"a sequence verifying {len(s.draft_token_ids)} drafts needs {whole} "
                        f"tokens in one step, more than the step's {max_tokens}"
                    )
                if whole > budget or len(step) == max_seqs:
                    later.append((i, done))
                    continue
                step.append(_Piece(i, s, last=True))
                budget -= whole
                continue
            if budget == 0 or len(step) == max_seqs:
                later.append((i, done))
                continue
            take = min(left, budget)
            start = s.num_computed + done
            pages = -(-(start + take) // page_size)
            piece = replace(
                s, token_ids=s.token_ids[done : done + take], num_computed=start, page_ids=s.page_ids[:pages]
            )
            step.append(_Piece(i, piece, last=(take == left)))
            budget -= take
            if take < left:
                later.append((i, done + take))
        steps.append(step)
        pending = later
    return steps


class JaxExecutor:
    """Owns the model (weights + KV cache in JAX arrays) and runs steps indexed by SGLang's pages."""

    def __init__(self, cfg: ExecutorConfig):
        # JAX loads with the executor, not when platform.py checks loader_options at start-up
        from tpuserve.tpu_platform.worker import Worker

        t0 = time.perf_counter()
        self.cfg = cfg
        self.config = cfg.engine_config()
        self.worker = Worker(self.config)
        self.worker.load(clamp_max_model_len=True)
        self.device, self.dtype, self.arch = self.worker.device, self.worker.dtype, self.worker.arch
        self.quantization = self.worker.quantization  # the weights' format (None: dense)
        self.max_model_len = self.worker.max_model_len
        self.num_pages = self.worker.num_pages(need_full_sequence=False)
        self.usable_pages = self.num_pages - 1
        self.runner = self.worker.init_kv_cache(self.num_pages)
        self.steps = 0
        self.model_calls = 0
        warm = cfg.warmup if cfg.warmup is not None else self.device.is_accelerator
        if warm:
            self.worker.warmup()
        self.compiles_after_init = self.runner.compile_count
        scales = self.kv_scales
        log.info(
            "tpuserve JAX executor ready in %.1fs: backend=%s dtype=%s, weights=%s, KV cache "
            "%s in JAX (%d pages x %d tokens, %.1f MiB, %s%s), decoder layers: %s, %d programs compiled",
            time.perf_counter() - t0,
            self.device.backend,
            np.dtype(self.dtype).name,
            self.quantization or "dense",
            tuple(self.runner.kv_cache.shape),
            self.usable_pages,
            cfg.page_size,
            self.kv_cache_bytes / 2**20,
            self.kv_cache_dtype.name,
            "" if scales is None else f", k_scale {scales[0]:.6g}, v_scale {scales[1]:.6g}",
            self.runner.layer_loop,
            self.compiles_after_init,
        )

    @property
    def capacity_tokens(self) -> int:
        """Tokens SGLang may place: its pool size (pages 1..usable_pages)."""
        return self.usable_pages * self.cfg.page_size

    @property
    def kv_cache_dtype(self) -> np.dtype:
        """The cached values' dtype (an FP8 cache's array holds their bytes as uint8 on CPU)."""
        return np.dtype(self.runner.kv_cache_dtype)

    @property
    def kv_scales(self) -> tuple[float, float] | None:
        """(k_scale, v_scale) of an FP8 KV cache (checkpoint's or calibrated); None otherwise."""
        return self.runner.kv_scales

    @property
    def kv_cache_bytes(self) -> int:
        return int(self.runner.kv_cache.nbytes)

    @property
    def recompiles(self) -> int:
        """Programs compiled after start-up (non-zero while serving after a warm-up is a bug)."""
        return self.runner.compile_count - self.compiles_after_init

    def run(self, seqs: list[ScheduledSeq]) -> np.ndarray:
        """Compute every sequence's scheduled tokens; return one sampled id per sequence (int32)."""
        return self.verify(seqs)[0][:, 0]

    def verify(self, seqs: list[ScheduledSeq]) -> tuple[np.ndarray, np.ndarray]:
        """Compute every sequence's tokens and verify its drafts (``draft_token_ids``, may be empty).

        Returns (token_ids [S, 1 + K] int32, num_accepted [S] int32), K the most drafts of any
        sequence: sequence i's new tokens are ``token_ids[i, : num_accepted[i] + 1]`` (its accepted
        drafts, then the token sampled after them); -1 pads. K/V of every verified draft is written
        (StepOutput says why rejected ones are harmless).
        """
        width = 1 + max((len(s.draft_token_ids) for s in seqs), default=0)
        tokens = np.full((len(seqs), width), -1, np.int32)
        accepted = np.zeros(len(seqs), np.int32)
        if not seqs:
            return tokens, accepted
        sched = self.config.scheduler
        for step in plan_steps(seqs, self.cfg.page_size, sched.max_num_batched_tokens, sched.max_num_seqs):
            out = self.runner.execute(self.runner.build_batch([p.seq for p in step]))
            self.model_calls += 1
            for row, p in enumerate(step):
                if p.last:
                    n = min(width, out.token_ids.shape[1])
                    tokens[p.index, :n] = out.token_ids[row, :n]
                    accepted[p.index] = out.num_accepted[row]
        self.steps += 1
        return tokens, accepted
