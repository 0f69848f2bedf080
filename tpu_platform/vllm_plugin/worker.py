"""``TpuserveWorker``: vLLM's worker interface implemented over our shared ``Worker``.

vLLM calls, in order: ``init_device`` (our Worker: JAX backend, compilation cache, dtype, and with
``--tensor-parallel-size N`` a mesh over the first N local devices; its EngineConfig built from
vLLM's), ``load_model`` (weights to device), ``get_kv_cache_spec`` (one full-attention spec per
layer: our page size, KV heads, head_dim, and the cache's dtype: the model's, or float8_e4m3fn under
``--kv-cache-dtype fp8``),
``determine_available_memory`` (the Worker's one KV budget formula), ``initialize_from_config``
(vLLM's num_blocks become our KV pages, one for one, page 0 being vLLM's null block),
``compile_or_warm_up_model`` (every shape bucket, on accelerators), then each step
``execute_model`` and ``sample_tokens``.

Tensor parallelism: vLLM's uni executor builds this one worker whatever ``world_size`` says
(platform.py keeps ``--tensor-parallel-size N`` in vLLM's config and forces ``uni``); the worker
runs every step as one SPMD program over its N-device mesh, with weights and KV heads sharded.
What it reports to vLLM is global: the spec's ``num_kv_heads`` is the engine's total (the model's,
or N when the worker replicates fewer KV heads than devices), a page's bytes are its slices on every
device together, and the memory budget is for the whole mesh, so vLLM's block count is the number
of pages, each of which every device holds its heads' slice of.

Overlap: ``execute_model`` dispatches the forward pass and returns at once (JAX runs it
asynchronously); vLLM's engine core then builds the structured-output bitmask on the host while
the device computes, and ``sample_tokens`` samples under that bitmask.

KV connector (only ours: ``offload_connector.TpuserveHostOffloadConnector``, which
``--kv-offloading-size`` selects, or ``pd_connector.TpuservePDConnector`` for prefill/decode
disaggregation): created before the KV cache is allocated, handed the runner after; each step binds
the scheduler's metadata, starts the loads before the forward, dispatches the stores / exports
after sampling, and returns a ``KVConnectorOutput`` (also from steps that schedule no tokens:
``with_kv_conn_output_only``). Any other connector is refused here too.

Speculative decoding (``--speculative-config`` with method ngram; spec_decode.py): ``sample_tokens``
proposes the next step's drafts on the host for the requests it just sampled, vLLM's engine core
collects them through ``take_draft_token_ids`` and schedules them; the next step verifies them in
the same ragged batch (our runner's rejection sampler) and returns accepted drafts + one token each.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np
import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheSpec
from vllm.v1.outputs import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    DraftTokenIds,
    KVConnectorOutput,
    LogprobsLists,
    LogprobsTensors,
    ModelRunnerOutput,
)
from vllm.v1.worker.worker_base import CompilationTimes, WorkerBase

from tpuserve.kv_cache.host_tier import warmup_pages
from tpuserve.tpu_platform.step_batch import pack_sampling_rows
from tpuserve.tpu_platform.vllm_plugin.engine_config import engine_config_from_vllm
from tpuserve.tpu_platform.vllm_plugin.offload_connector import TpuserveHostOffloadConnector
from tpuserve.tpu_platform.vllm_plugin.options import PluginOptions
from tpuserve.tpu_platform.vllm_plugin.pd_connector import TpuservePDConnector
from tpuserve.tpu_platform.vllm_plugin.quantization import (
    register_quant_configs,
    spec_dtype_and_mode,
)
from tpuserve.tpu_platform.vllm_plugin.request_state import RequestTable, StepPlan, StepResult
from tpuserve.tpu_platform.vllm_plugin.spec_decode import DraftPlanner, NgramSettings

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest

    from tpuserve.tpu_platform.config import EngineConfig
    from tpuserve.tpu_platform.model_runner import ForwardState, ModelRunner
    from tpuserve.tpu_platform.models.arch import ModelArch
    from tpuserve.tpu_platform.step_batch import StepBatch
    from tpuserve.tpu_platform.worker import Worker

log = logging.getLogger("vllm.tpuserve.worker")


class TpuserveWorker(WorkerBase):
    def __init__(
        self,
        vllm_config: VllmConfig,
        local_rank: int,
        rank: int,
        distributed_init_method: str,
        is_driver_worker: bool = False,
    ):
        super().__init__(vllm_config, local_rank, rank, distributed_init_method, is_driver_worker)
        register_quant_configs()  # this process may build configs naming "nvfp4" too (idempotent)
        self.options = PluginOptions.from_vllm(vllm_config)
        # Set by init_device, load_model and initialize_from_config; read through _device_worker,
        # _loaded_arch, _built_runner and _request_table, which name the step that has not run.
        self.worker: Worker | None = None
        self.arch: ModelArch | None = None
        self.runner: ModelRunner | None = None
        self.table: RequestTable | None = None
        # (plan, batch, forward, finished req ids) between execute_model and sample_tokens
        self._pending: tuple[StepPlan, StepBatch, ForwardState, set[str]] | None = None
        self.connector: TpuserveHostOffloadConnector | TpuservePDConnector | None = None
        self._compiled_after_warmup: int | None = None
        self.speculation = NgramSettings.from_vllm(vllm_config)
        self.drafter: DraftPlanner | None = None
        self._drafts: DraftTokenIds | None = None  # proposed by sample_tokens, taken by the engine core

    def _device_worker(self) -> Worker:
        if self.worker is None:
            raise RuntimeError("TpuserveWorker: init_device() must run first")
        return self.worker

    def _loaded_arch(self) -> ModelArch:
        if self.arch is None:
            raise RuntimeError("TpuserveWorker: load_model() must run first")
        return self.arch

    def _built_runner(self) -> ModelRunner:
        if self.runner is None:
            raise RuntimeError("TpuserveWorker: initialize_from_config() must run first")
        return self.runner

    def _request_table(self) -> RequestTable:
        if self.table is None:
            raise RuntimeError("TpuserveWorker: initialize_from_config() must run first")
        return self.table

    # ---- start-up ----

    def _engine_config(self) -> EngineConfig:
        spec = self.speculation
        return engine_config_from_vllm(
            self.model_config,
            self.scheduler_config,
            self.cache_config,
            self.parallel_config,
            self.options,
            spec.engine_section() if spec is not None else None,
        )

    def init_device(self) -> None:
        # JAX loads here, with the device, not wherever vLLM merely imports the worker class
        from tpuserve.tpu_platform.worker import Worker

        _no_torch_accelerator_cache_release()  # this is the engine-core process vLLM tears down later
        worker = self.worker = Worker(self._engine_config())
        info = worker.device
        # vLLM's own tensors around this worker stay on the host (see platform.py).
        self.device = torch.device("cpu")
        mesh = worker.mesh
        log.info(
            "tpuserve worker on JAX %s (%d x %s), %s, dtype %s, XLA cache %s",
            info.backend,
            info.device_count,
            info.device_kind,
            "one device"
            if mesh is None
            else f"tensor parallel {worker.tensor_parallel_size} over mesh {dict(mesh.shape)}",
            worker.config.model.dtype,
            worker.compilation_cache_dir,
        )

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        if load_dummy_weights:
            raise NotImplementedError("dummy weights are not supported on the tpuserve platform")
        fmt = str(self.load_config.load_format)
        if fmt not in ("auto", "safetensors", "gguf", "LoadFormats.AUTO"):
            raise ValueError(f"load_format={fmt!r}: the tpuserve platform loads safetensors or GGUF")
        w = self._device_worker()
        w.load()
        arch = self.arch = w.loaded_arch()
        log.info(
            "weights: %s (%.1f MiB); KV cache dtype %s",
            w.quantization or "dense",
            w.weight_bytes / 2**20,
            w.kv_cache_dtype.name,
        )
        vocab = self.model_config.get_vocab_size()
        if vocab != arch.vocab_size:
            raise ValueError(
                f"vocab size mismatch: vLLM's config says {vocab}, the checkpoint has {arch.vocab_size}"
            )

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        """One full-attention spec per layer, with vLLM's page bytes equal to ours.

        vLLM's page (per layer) = 2 * block_size * num_kv_heads * head_size * itemsize, which is our
        interleaved page [page_size, 2*Hkv, D]; where the attention backend pads the combined-head
        axis (TPU sublane tiles), ``page_size_padded`` tells vLLM the real per-layer bytes so its
        block count matches what we allocate. A sliding-window layer is described as full
        attention with its window recorded (vLLM's form for a model served without its hybrid KV
        manager, which this platform declines): vLLM keeps every page of every layer, all layers
        share one block table, and our attention applies each layer's window. gpt-oss alternates
        windowed and full layers, so the window is read per layer (``ModelArch.layer_window``).
        """
        a = self._loaded_arch()
        w = self._device_worker()
        padded, plain = (b // a.num_layers for b in w.page_bytes_padded_and_plain())
        # The element type vLLM sizes blocks by is our cache's: float8_e4m3fn (per-tensor scales)
        # under --kv-cache-dtype fp8, else the model dtype.
        dtype, mode = spec_dtype_and_mode(
            self.cache_config.cache_dtype, self.model_config.dtype, w.kv_cache_dtype.itemsize
        )

        def spec(window: int | None, page_size_padded: int | None) -> FullAttentionSpec:
            return FullAttentionSpec(
                block_size=self.cache_config.block_size,
                num_kv_heads=a.num_kv_heads,
                head_size=a.head_dim,
                dtype=dtype,
                kv_quant_mode=mode,
                sliding_window=window,
                page_size_padded=page_size_padded,
            )

        unpadded = spec(None, None).page_size_bytes
        if unpadded != plain:
            raise RuntimeError(
                f"vLLM's KV page ({unpadded} B per layer, {dtype}) differs "
                f"from the worker's ({plain} B, {w.kv_cache_dtype.name})"
            )
        pad = padded if padded != plain else None
        windows = [a.layer_window(i) for i in range(a.num_layers)]
        if any(windows):
            log.info(
                "KV cache spec: sliding windows by layer %s (vLLM keeps every page; the model applies them)",
                windows,
            )
        return {f"model.layers.{i}.self_attn.attn": spec(win, pad) for i, win in enumerate(windows)}

    def get_supported_kv_cache_layouts(self) -> list[str]:
        # Our cache is [L, pages, page_size, 2*Hkv (K,V interleaved), D]: blocks, then tokens, then
        # heads. The base class would ask vLLM's torch attention backends, which we do not build.
        return ["LBNHC"]

    def determine_available_memory(self) -> int:
        """Bytes for the KV cache: the Worker's one budget formula (vLLM's --kv-cache-memory-bytes
        if given; else gpu_memory_utilization of the accelerator less weights and activations;
        1 GiB on a CPU host)."""
        return self._device_worker().kv_cache_budget()

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        """Allocate our KV pages: vLLM's block ids index them directly (an FP8 cache calibrates
        its k/v scales here when the checkpoint carries none)."""
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise ValueError(f"expected one KV cache group, vLLM built {len(groups)}")
        block_size = groups[0].kv_cache_spec.block_size
        w = self._device_worker()
        if block_size != w.config.cache.block_size:
            raise ValueError(
                f"vLLM chose block size {block_size}, the worker was set up for {w.config.cache.block_size}"
            )
        # The connector exists before the KV cache is allocated (vLLM's order), and gets the runner,
        # whose cache it reads and replaces, once it does.
        self.connector = _make_connector(self.vllm_config, kv_cache_config)
        runner = self.runner = w.init_kv_cache(int(kv_cache_config.num_blocks))
        scales = w.kv_scales
        log.info(
            "KV cache: %d pages of %d tokens, %s%s; decoder layers: %s",
            int(kv_cache_config.num_blocks),
            block_size,
            w.kv_cache_dtype.name,
            "" if scales is None else f" (k_scale {scales[0]:.6g}, v_scale {scales[1]:.6g})",
            runner.layer_loop,
        )
        moe = self._loaded_arch().moe
        if runner.expert_parallel and moe is not None:  # the runner's own line is not in vLLM's log
            ep = w.tensor_parallel_size  # the experts split over the mesh's model axis (EP = TP)
            log.info(
                "expert parallel: %d experts over %d devices, %d each",
                moe.num_experts,
                ep,
                moe.num_experts // ep,
            )
        if self.connector is not None:
            self.connector.register_runner(runner)
        self.table = RequestTable(block_size, self._loaded_arch().vocab_size, seed=w.config.model.seed)
        if self.speculation is not None:
            self.drafter = DraftPlanner(self.speculation, int(self.model_config.max_model_len))

    def compile_or_warm_up_model(self) -> CompilationTimes:
        warmup = self.options.warmup
        if warmup is None:
            warmup = self._device_worker().device.is_accelerator
        if not warmup:
            log.info(
                "warm-up skipped (%s): programs compile on first use and persist in the XLA cache",
                "JAX CPU backend" if self.options.warmup is None else "warmup=false / --enforce-eager",
            )
            return CompilationTimes(language_model=0.0, encoder=0.0)
        t0 = time.perf_counter()
        w = self._device_worker()
        n = w.warmup()
        if self.connector is not None:
            n += self.connector.warmup(
                warmup_pages(
                    self.model_config.max_model_len,
                    w.config.cache.block_size,
                    self.scheduler_config.max_num_batched_tokens,
                )
            )
        self._compiled_after_warmup = self._built_runner().compile_count
        secs = time.perf_counter() - t0
        log.info("warm-up compiled %d programs in %.1f s", n, secs)  # in vLLM's log
        return CompilationTimes(language_model=secs, encoder=0.0)

    def update_max_model_len(self, max_model_len: int) -> None:
        # Called only when vLLM shrinks the length to fit memory, before initialize_from_config.
        self.model_config.max_model_len = max_model_len

    # ---- steps ----

    def execute_model(self, scheduler_output: Any) -> ModelRunnerOutput | None:
        conn = self.connector
        if conn is None and getattr(scheduler_output, "kv_connector_metadata", None) is not None:
            raise NotImplementedError(
                "this step carries KV connector metadata, but no connector runs in the tpuserve worker"
            )
        table = self._request_table()
        plan = table.plan(scheduler_output)
        if conn is not None:
            meta = scheduler_output.kv_connector_metadata
            if meta is None:
                raise RuntimeError("a KV connector is configured but the step carries no metadata")
            conn.handle_preemptions(meta)
            conn.bind_connector_metadata(meta)
            conn.start_load_kv(None)  # host-tier loads are synchronous: scattered before the forward
        if not plan.seqs:  # a step that only retired requests (or only moves KV)
            if conn is None:
                return EMPTY_MODEL_RUNNER_OUTPUT
            return ModelRunnerOutput.with_kv_conn_output_only(
                self._finish_connector(conn, scheduler_output.finished_req_ids)
            )
        # Dispatch the forward now; the grammar bitmask only exists at sample_tokens, and vLLM
        # builds it on the host while the device runs this.
        runner = self._built_runner()
        batch = runner.build_batch(plan.scheduled(table))
        self._pending = (plan, batch, runner.forward(batch), set(scheduler_output.finished_req_ids))
        return None  # vLLM now calls sample_tokens with the grammar bitmask

    def sample_tokens(self, grammar_output: Any) -> ModelRunnerOutput:
        pending, self._pending = self._pending, None
        if pending is None:
            return EMPTY_MODEL_RUNNER_OUTPUT
        plan, batch, fwd, finished = pending
        table, runner = self._request_table(), self._built_runner()
        sampling = None
        masks = self._grammar_masks(grammar_output, plan)
        if masks:
            rows = [s.sampling for s in plan.scheduled(table, masks)]
            sampling = pack_sampling_rows(rows, len(batch.kv_lens), self._loaded_arch().vocab_size)
        step = runner.sample(fwd, sampling)
        # Stores go after the sampler in device order, so they do not delay this step's tokens.
        conn = self.connector
        kv_out = self._finish_connector(conn, finished) if conn is not None else None
        result = plan.finish(table, runner.fetch(step))
        if self.drafter is not None:
            # vLLM's GPU runner proposes here too: from each request's tokens including this step's.
            sampled = [rid for rid, toks in zip(result.req_ids, result.sampled_token_ids) if toks]
            d = self.drafter.propose(table, sampled)
            self._drafts = DraftTokenIds(d.req_ids, d.draft_token_ids) if d.req_ids else None
        self._check_recompiles()
        out = _to_vllm_output(result)
        out.kv_connector_output = kv_out
        return out

    def _finish_connector(
        self, conn: TpuserveHostOffloadConnector | TpuservePDConnector, finished_req_ids: set[str]
    ) -> KVConnectorOutput:
        """The connector's end of a step (stores dispatched, results and stats collected, metadata cleared)."""
        conn.wait_for_save()
        done = conn.get_transfer_results(finished_req_ids)
        out = KVConnectorOutput(
            finished_sending=done.finished_sending,
            finished_recving=done.finished_recving,
            failed_recving=done.failed_recving,
            invalid_block_ids=conn.get_block_ids_with_load_errors(),
            kv_connector_stats=conn.get_kv_connector_stats(),
            kv_cache_events=conn.get_kv_connector_kv_cache_events(),
            kv_connector_worker_meta=conn.build_connector_worker_meta(),
        )
        conn.clear_connector_metadata()
        return out

    def _grammar_masks(self, grammar_output: Any, plan: StepPlan) -> dict[str, np.ndarray]:
        """Structured-output bitmask rows by request id (xgrammar's layout, as our sampler takes).

        With speculation vLLM sends 1 + (scheduled drafts) rows per request, one per position; we
        verify no drafts under a grammar, so each request's first row (its next token) is the one.
        """
        if grammar_output is None:
            return {}
        words = (self._loaded_arch().vocab_size + 31) // 32
        bitmask = np.asarray(grammar_output.grammar_bitmask, dtype=np.int32)
        if bitmask.ndim != 2:
            raise ValueError(f"grammar bitmask must be 2-D, got shape {bitmask.shape}")
        if bitmask.shape[1] < words:  # tokens past the grammar's vocabulary stay disallowed
            bitmask = np.pad(bitmask, ((0, 0), (0, words - bitmask.shape[1])))
        out, row = {}, 0
        for rid in grammar_output.structured_output_request_ids:
            out[rid] = bitmask[row, :words]
            row += 1 + plan.scheduled_drafts.get(rid, 0)
        if row > bitmask.shape[0]:
            raise ValueError(
                f"grammar bitmask has {bitmask.shape[0]} rows, the step's structured "
                f"requests and their drafts need {row}"
            )
        return out

    def _check_recompiles(self) -> None:
        if self._compiled_after_warmup is None:
            return
        now = self._built_runner().compile_count
        if now > self._compiled_after_warmup:
            log.warning(
                "compiled %d program(s) after warm-up (a shape bucket or sampler variant it did not cover)",
                now - self._compiled_after_warmup,
            )
            self._compiled_after_warmup = now

    # ---- the rest of vLLM's worker interface ----

    def get_kv_connector_handshake_metadata(self) -> dict | None:
        """Out-of-band handshake data by (pp_rank, tp_rank); the host tier has none."""
        if self.connector is None:
            return None
        meta = self.connector.get_handshake_metadata()
        return None if meta is None else {(0, 0): meta}

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        """The drafts the last ``sample_tokens`` proposed (vLLM's engine core asks once per step)."""
        drafts, self._drafts = self._drafts, None
        return drafts

    def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    def get_cache_block_size_bytes(self) -> int:
        runner = self._built_runner()
        assert runner.kv_spec is not None  # init_kv_cache allocated the cache it describes
        return runner.kv_spec.page_bytes(runner.attn_impl)

    def get_model(self) -> NoReturn:
        raise NotImplementedError("the tpuserve platform's model is a JAX program, not a torch module")

    def synchronize_device(self) -> None:
        if self.runner is not None:
            import jax

            jax.block_until_ready(self.runner.kv_cache)

    def reset_encoder_cache(self) -> None:
        return None  # text-only: no encoder cache

    def check_health(self) -> None:
        if self.worker is None:
            raise RuntimeError("tpuserve worker: device not initialised")

    def add_lora(self, lora_request: LoRARequest) -> bool:
        raise NotImplementedError("LoRA is not supported on the tpuserve platform")

    def remove_lora(self, lora_id: int) -> bool:
        raise NotImplementedError("LoRA is not supported on the tpuserve platform")

    def pin_lora(self, lora_id: int) -> bool:
        raise NotImplementedError("LoRA is not supported on the tpuserve platform")

    def list_loras(self) -> set[int]:
        return set()

    def shutdown(self) -> None:
        self._pending = None
        if self.connector is not None:
            self.connector.shutdown()  # finishes in-flight host-tier saves
            self.connector = None
        self.table = None
        self.runner = None
        if self.worker is not None:
            self.worker.shutdown()  # drops the KV cache and weights


def _no_torch_accelerator_cache_release() -> None:
    """Make ``torch.accelerator.empty_cache`` / ``empty_host_cache`` no-ops when torch has no accelerator.

    vLLM's engine-core teardown (``cleanup_dist_env_and_memory``) calls both on every platform but
    its in-tree CPU one, judged by ``is_cpu()``; with a torch build that drives no accelerator they
    raise "Cannot access accelerator device when none is available" and shutdown ends in a
    traceback. vLLM offers no platform hook for that release, and answering ``is_cpu()`` True would
    also switch vLLM's CPU defaults and code paths on (platform.py). Torch caches nothing here (the
    model's memory is JAX's, freed by ``Worker.shutdown``), so a no-op is the true release; vLLM's
    own CPU worker installs the same no-ops. A torch with an accelerator is left untouched.
    """
    if torch.accelerator.current_accelerator() is not None:
        return
    torch.accelerator.empty_cache = _nothing_to_release
    torch.accelerator.empty_host_cache = _nothing_to_release


def _nothing_to_release() -> None:
    return None


def _make_connector(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
) -> TpuserveHostOffloadConnector | TpuservePDConnector | None:
    """This worker's side of the configured KV connector; only ours can drive a JAX KV cache.

    vLLM's ``ensure_kv_transfer_initialized`` would build it too, but first broadcasts the engine id
    over vLLM's tensor-parallel torch process group, which this worker never creates (one JAX process
    drives every device, so there is nothing to sync). The worker builds the connector through the
    same factory and keeps it itself: nothing outside vLLM's own GPU workers reads the global one.
    """
    ktc = vllm_config.kv_transfer_config
    if ktc is None or not ktc.is_kv_transfer_instance:
        return None
    conn = KVConnectorFactory.create_connector(
        config=vllm_config, role=KVConnectorRole.WORKER, kv_cache_config=kv_cache_config
    )
    if not isinstance(conn, (TpuserveHostOffloadConnector, TpuservePDConnector)):
        raise NotImplementedError(
            f"KV connector {type(conn).__name__}: vLLM's connectors move torch device tensors; the "
            f"tpuserve platform runs its host-tier connector (--kv-offloading-size) and its P/D "
            f"connector (TpuservePDConnector)"
        )
    return conn


def _to_vllm_output(r: StepResult) -> ModelRunnerOutput:
    logprobs = None
    if r.logprob_token_ids is not None:
        logprobs = LogprobsLists(
            logprob_token_ids=r.logprob_token_ids,
            logprobs=r.logprobs,
            sampled_token_ranks=r.sampled_ranks,
            cu_num_generated_tokens=r.cu_num_generated_tokens,
        )
    prompt = {
        rid: LogprobsTensors(
            logprob_token_ids=torch.from_numpy(b.token_ids),
            logprobs=torch.from_numpy(b.logprobs),
            selected_token_ranks=torch.from_numpy(b.ranks),
        )
        for rid, b in r.prompt_logprobs.items()
    }
    return ModelRunnerOutput(
        req_ids=r.req_ids,
        req_id_to_index={rid: i for i, rid in enumerate(r.req_ids)},
        sampled_token_ids=r.sampled_token_ids,
        logprobs=logprobs,
        prompt_logprobs_dict=prompt,
    )
