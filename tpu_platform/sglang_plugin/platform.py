"""The SGLang platform object for tpuserve: SGLang keeps its scheduler, our JAX runtime runs the model.

What the platform declares, and why:
  * torch's side is the host. SGLang's scheduler keeps int metadata in torch tensors (``req_to_token``,
    ``out_cache_loc``, sampled ids); they live on ``cpu``. The accelerator belongs to JAX. No torch
    device named "tpu" is invented: ``--device tpu`` means "the model runs on a TPU"; it is
    accepted when JAX could open one (else a clear error) and SGLang's torch-side device resolves
    to ``cpu``, where its tensors really are. SGLang picks its platform on ``import sglang``, before
    flags are parsed, so the flag cannot *select* this platform: a visible TPU or
    ``SGLANG_PLATFORM=tpuserve`` does (activation.py).
  * ``page_size`` defaults to our KV block size so SGLang's page ids are our page ids (slots.py).
  * the overlap scheduler is off: it relays sampled ids through device streams and a future map
    built for CUDA; our worker answers each batch synchronously (the forward itself is async in
    JAX until the sampled ids are read back).
  * no graph capture, no Triton, no HiCache device kernels: all capabilities stay False.
  * ``--enable-hierarchical-cache`` (HiCache) and ``--enable-lmcache`` are refused: both copy KV
    pages between SGLang's torch device pool and host memory with their own kernels, and on this
    platform the pages live in a JAX array those kernels cannot reach. tpuserve's own host tier
    (``tpuserve serve --kv-offloading-size GiB``, or vLLM with ``--device tpu
    --kv-offloading-size GiB``) is the supported way to keep evicted prefixes in host memory.
  * ``--speculative-algorithm NGRAM`` runs SGLang's n-gram corpus with our runner verifying its
    drafts as a chain (``--speculative-ngram-max-bfs-breadth`` is set to 1; spec_ngram.py); other
    algorithms are refused naming the flag.
  * ``--model-loader-extra-config '{"layer_loop": "scan"}'`` chooses how our decoder runs its layers
    (executor.loader_options); unknown keys are refused here, at start-up.
  * ``--quantization`` fp8 / mxfp4 / nvfp4 (and pre-quantized checkpoints our loader reads) and
    ``--kv-cache-dtype fp8_e4m3`` are served by our worker in JAX; any other value is refused here,
    naming the flag (quantization.py; SGLang's own ModelConfig check is replaced by a hook).
"""

from __future__ import annotations

import logging
import os

from sglang.srt.platforms.device_mixin import PlatformEnum
from sglang.srt.platforms.interface import PlatformCapabilities, SRTPlatform

from tpuserve.tpu_platform.config import CacheConfig, SchedulerConfig
from tpuserve.tpu_platform.sglang_plugin import activation
from tpuserve.tpu_platform.sglang_plugin.executor import loader_options
from tpuserve.tpu_platform.sglang_plugin.quantization import refuse_unsupported_flags

log = logging.getLogger(__name__)

ATTENTION_BACKEND_NAME = "tpuserve"  # a registered name that is never built: attention runs in JAX
# Where SGLang leaves them unset: our EngineConfig's defaults (read from it, never restated).
DEFAULT_PAGE_SIZE = CacheConfig().block_size
DEFAULT_CHUNKED_PREFILL = SchedulerConfig().max_num_batched_tokens  # one runner step
DEFAULT_MAX_RUNNING = SchedulerConfig().max_num_seqs
MAX_DRAFT_TOKENS = 17  # NGRAM's root + our runner's most drafts a step (SpeculativeConfig: 16)


def _speculative_refusal(algorithm) -> str:
    return (
        f"--speculative-algorithm {algorithm} is not supported by the tpuserve SGLang platform: "
        "it serves NGRAM (SGLang's n-gram drafts, verified by tpuserve's runner). For EAGLE-3 or "
        "MTP draft heads use `tpuserve serve MODEL --speculative-config` with method eagle3 or mtp"
    )


def _speculative_defaults(server_args) -> None:
    """NGRAM runs as a chain of drafts (spec_ngram.py): one BFS branch per node. Anything else is
    refused naming the flag."""
    algorithm = getattr(server_args, "speculative_algorithm", None)
    if algorithm is None:
        return
    if str(algorithm).upper() != "NGRAM":
        raise ValueError(_speculative_refusal(algorithm))
    if (server_args.speculative_ngram_max_bfs_breadth or 1) > 1:
        log.warning(
            "tpuserve: --speculative-ngram-max-bfs-breadth %s -> 1: tpuserve's runner verifies a "
            "chain of drafts, so the n-gram corpus builds one",
            server_args.speculative_ngram_max_bfs_breadth,
        )
        server_args.speculative_ngram_max_bfs_breadth = 1
    if (server_args.speculative_ngram_min_bfs_breadth or 1) > 1:
        server_args.speculative_ngram_min_bfs_breadth = 1
    n = server_args.speculative_num_draft_tokens
    if n is not None and not 1 <= n <= MAX_DRAFT_TOKENS:
        raise ValueError(
            f"--speculative-num-draft-tokens {n}: the tpuserve SGLang platform verifies 1 to "
            f"{MAX_DRAFT_TOKENS} tokens a step (the last sampled token and up to "
            f"{MAX_DRAFT_TOKENS - 1} drafts)"
        )


class TpuServeSRTPlatform(SRTPlatform):
    _enum = PlatformEnum.OOT
    device_name = "tpuserve"
    device_type = "cpu"  # where SGLang's own torch tensors live; the model runs in JAX
    capabilities = PlatformCapabilities()

    # ---- configuration ----

    def apply_server_args_defaults(self, server_args) -> None:
        device = (server_args.device or "cpu").split(":")[0]
        if device not in ("cpu", "tpu"):
            raise ValueError(
                f"the tpuserve SGLang platform runs the model in JAX and keeps SGLang's tensors on "
                f"the host; --device {server_args.device} is not supported (use --device tpu or "
                f"leave --device unset)"
            )
        if device == "tpu":
            if not activation.tpu_visible():
                raise ValueError(
                    "--device tpu: no TPU is visible here (libtpu + /dev/accel* or /dev/vfio); "
                    "the tpuserve platform runs on JAX's default backend when --device is left "
                    "unset"
                )
            log.info(
                "tpuserve: --device tpu -> the model runs on JAX's TPU; SGLang's scheduler "
                "tensors (int metadata) stay on torch device 'cpu'"
            )
        server_args.device = "cpu"
        refuse_unsupported_flags(server_args)
        loader_options(getattr(server_args, "model_loader_extra_config", None) or {})
        for flag, attr in (
            ("--enable-hierarchical-cache", "enable_hierarchical_cache"),
            ("--enable-lmcache", "enable_lmcache"),
        ):
            if getattr(server_args, attr, False):
                raise ValueError(
                    f"{flag} is not supported by the tpuserve SGLang platform: it moves KV pages "
                    f"between SGLang's torch device pool and host memory, while here the pages live "
                    f"in tpuserve's JAX cache. For a host-memory KV tier use tpuserve's own: "
                    f"`tpuserve serve MODEL --kv-offloading-size GiB`, or `vllm serve MODEL --device "
                    f"tpu --kv-offloading-size GiB`; or drop {flag}"
                )
        # One SGLang rank drives one JAX executor; sharding belongs inside JAX (a mesh), not to
        # SGLang's torch process groups, which would each load their own full copy.
        for name in ("tp_size", "pp_size"):
            if (getattr(server_args, name, 1) or 1) > 1:
                raise ValueError(
                    f"--{name.replace('_', '-')} > 1 is not supported by the tpuserve "
                    f"SGLang platform (one SGLang rank drives one JAX executor, and "
                    f"SGLang's ranks would each load the whole model). For tensor "
                    f"parallelism over a JAX mesh use `tpuserve serve MODEL "
                    f"--tensor-parallel-size N` or `vllm serve MODEL --device tpu "
                    f"--tensor-parallel-size N`"
                )
        _speculative_defaults(server_args)
        if server_args.page_size is None:
            server_args.page_size = DEFAULT_PAGE_SIZE
        if server_args.chunked_prefill_size is None:
            server_args.chunked_prefill_size = DEFAULT_CHUNKED_PREFILL
        if server_args.max_running_requests is None:
            server_args.max_running_requests = DEFAULT_MAX_RUNNING
        server_args.disable_overlap_schedule = True
        # Attention runs inside our JAX model whatever is named here; name it truthfully (SGLang's
        # CPU defaults, applied earlier because the torch device is "cpu", would say torch_native).
        server_args.attention_backend = ATTENTION_BACKEND_NAME
        if server_args.sampling_backend is None:
            server_args.sampling_backend = "pytorch"  # never called: our runner samples in JAX
        log.info(
            "tpuserve SGLang platform active: the model runs in JAX (tpuserve executor); "
            "page_size=%s, chunked_prefill_size=%s, max_running_requests=%s, overlap "
            "schedule off, quantization=%s, kv_cache_dtype=%s",
            server_args.page_size,
            server_args.chunked_prefill_size,
            server_args.max_running_requests,
            server_args.quantization,
            server_args.kv_cache_dtype,
        )

    def get_speculative_worker_cls(self, algorithm: str):
        if str(algorithm).upper() != "NGRAM":  # refused at start-up already (_speculative_defaults)
            raise ValueError(_speculative_refusal(algorithm))
        # on use: SGLang's speculative workers are a heavy import
        from tpuserve.tpu_platform.sglang_plugin.spec_ngram import TpuServeNgramWorker

        return TpuServeNgramWorker

    def get_default_attention_backend(self) -> str:
        return ATTENTION_BACKEND_NAME

    # ---- device identity: the torch side is the host ----

    def get_device(self, device_id: int | None = None) -> str:
        return "cpu"

    def set_device(self, device) -> None:
        pass

    def get_device_name(self, device_id: int = 0) -> str:
        return "tpuserve (JAX)"

    def get_device_total_memory(self, device_id: int = 0) -> int:
        # SGLang asks about the memory its torch tensors use: host RAM. The KV cache is sized by
        # our executor from the JAX device's memory (or --max-total-tokens), not from this.
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def get_current_memory_usage(self, device=None) -> float:
        return 0.0

    def get_available_memory(self, device_id: int = 0) -> tuple[int, int]:
        total = self.get_device_total_memory(device_id)
        free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        return free, total

    def get_torch_distributed_backend_str(self) -> str:
        return "gloo"  # SGLang's process groups carry host objects only

    # ---- lifecycle ----

    def init_backend(self) -> None:
        # SGLang calls this when it imports its model runner, in processes that must not open the
        # TPU (JAX allows one owner). Our worker initialises JAX itself, in the scheduler process.
        pass
