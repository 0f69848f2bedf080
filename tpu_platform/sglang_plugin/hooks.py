"""The hooks our general plugin puts into SGLang (``HookRegistry``), inert unless our platform is active.

SGLang runs general plugins in every one of its processes, whether or not our platform won, so each
hook body first asks which platform SGLang resolved.

  * ``Scheduler.init_tp_model_worker`` (AROUND): build our TP worker instead of SGLang's. This is the
    only way to put an executor under SGLang's scheduler in 0.5.23 (its MLX backend is wired the
    same way, by a branch in that very method).
  * ``TokenizerManager._validate_one_request`` (BEFORE): refuse, with a 400, request features our
    worker does not serve yet (logprobs, structured output, logit bias, custom logit processors)
    instead of failing inside the scheduler, which would take the server down.
  * ``arg_groups.pipeline.run_resolution_pipeline`` (BEFORE): ``--device tpu`` while our platform is
    not active gets a clear error instead of SGLang's crash on a torch device named "tpu". (When
    it is active, platform.py serves the flag.)
  * ``ModelConfig._verify_quantization`` (AROUND): SGLang's check asks its torch quantization
    registry; ours asks our loader and keeps only what tpuserve serves (quantization.py).
  * ``arg_groups.model_hook.handle_model_specific_adjustments`` (AROUND): gpt-oss's adjustments
    assert one of SGLang's torch attention kernels and force bfloat16 on its MXFP4 checkpoints for
    SGLang's Triton kernels; ours run in JAX, so our backend and dtype stay
    (model_specific_adjustments).
  * ``mem_cache.allocation.get_last_loc`` and ``assign_req_to_token_pool_func`` (AROUND): the slot
    bookkeeping of speculative decoding (``--speculative-algorithm NGRAM``) picks Triton kernels by
    attention-backend name and host type, neither of which knows an out-of-tree platform; ours
    are torch ops on SGLang's host tensors (the same arithmetic as the kernels).
  * ``--quantization`` choices: "nvfp4" is added through SGLang's extension point for out-of-tree
    platforms (``add_quantization_method_choices``) when our platform is active.
"""

from __future__ import annotations

import json
import logging
import os

from tpuserve.tpu_platform.sglang_plugin.activation import PLUGIN_NAME
from tpuserve.tpu_platform.sglang_plugin.quantization import ONLINE_METHODS, verify_model_config_quantization

log = logging.getLogger(__name__)

# SGLang's modules, and ours that import them (platform.py, worker.py), are imported in the hook
# bodies: SGLang imports this module while it is still loading its plugins.

SCHEDULER_INIT_WORKER = "sglang.srt.managers.scheduler.Scheduler.init_tp_model_worker"
RESOLUTION_PIPELINE = "sglang.srt.arg_groups.pipeline.run_resolution_pipeline"
VALIDATE_REQUEST = "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request"
VERIFY_QUANTIZATION = "sglang.srt.configs.model_config.ModelConfig._verify_quantization"
MODEL_ADJUSTMENTS = "sglang.srt.arg_groups.model_hook.handle_model_specific_adjustments"
LAST_LOC = "sglang.srt.mem_cache.allocation.get_last_loc"
ASSIGN_SLOTS = "sglang.srt.mem_cache.allocation.assign_req_to_token_pool_func"

# Architectures whose model-specific adjustments assert one of SGLang's own torch attention
# kernels (gpt-oss: sliding windows and sinks), and a kernel name from SGLang's list that stands in
# for ours while that check runs. Our attention (windows and sinks included) runs in JAX.
_ATTENTION_CHECKED_ARCHS = ("GptOssForCausalLM",)
_STAND_IN_ATTENTION = "triton"
_ATTENTION_FIELDS = ("attention_backend", "prefill_attention_backend", "decode_attention_backend")
# What those adjustments may decide for SGLang's own kernels that is ours to decide: the attention
# backend names above and the model dtype (gpt-oss's MXFP4 checkpoints get bfloat16 "for mxfp4
# triton kernels"; our executor runs the MXFP4 experts in whatever dtype --dtype resolves to).
_OUR_FIELDS = (*_ATTENTION_FIELDS, "dtype")

# Request features our worker does not serve yet; refused at admission (HTTP 400), not mid-batch.
_UNSUPPORTED_SAMPLING_KEYS = ("json_schema", "regex", "ebnf", "structural_tag", "logit_bias")


def our_platform_active() -> bool:
    from sglang.srt.platforms import current_platform

    from tpuserve.tpu_platform.sglang_plugin.platform import TpuServeSRTPlatform

    return isinstance(current_platform, TpuServeSRTPlatform)


def init_tp_model_worker(original, scheduler, *args, **kwargs):
    """AROUND hook: our worker when our platform is active, SGLang's otherwise."""
    if not our_platform_active():
        return original(scheduler, *args, **kwargs)
    from sglang.srt.runtime_context import get_device

    from tpuserve.tpu_platform.sglang_plugin.worker import TpuServeTpModelWorker

    _register_attention_backend_name()
    log.info(
        "tpuserve platform active: building TpuServeTpModelWorker (JAX executor) in place of "
        "SGLang's TpModelWorker"
    )
    scheduler.tp_worker = TpuServeTpModelWorker(
        server_args=scheduler.server_args, gpu_id=get_device().gpu_id, nccl_port=scheduler.nccl_port
    )


def _register_attention_backend_name() -> None:
    """Make the attention backend name our platform reports a known one; building it is an error."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    from tpuserve.tpu_platform.sglang_plugin.platform import ATTENTION_BACKEND_NAME

    def _never_built(runner):
        raise RuntimeError(
            "tpuserve: attention runs inside the JAX model; there is no torch attention backend to build"
        )

    ATTENTION_BACKENDS.setdefault(ATTENTION_BACKEND_NAME, _never_built)


def explain_device_tpu(server_args, *args, **kwargs):
    """BEFORE hook on argument resolution: ``--device tpu`` without our platform fails clearly.

    SGLang resolves its platform once per process, on ``import sglang`` - before any plugin hook
    runs or any flag is parsed - so a flag cannot select a platform. Our platform is active when a
    TPU is visible or ``SGLANG_PLATFORM=tpuserve`` is set; then it serves ``--device tpu``
    (platform.py). Otherwise SGLang would crash deep in torch with "tpu" as a torch device; say why.
    """
    from sglang.srt.arg_groups.overrides import resolving_view

    device = resolving_view(server_args).device
    if device is None or str(device).split(":")[0] != "tpu" or our_platform_active():
        return None
    raise ValueError(
        f"--device tpu is served by the '{PLUGIN_NAME}' SGLang platform, which is not active in "
        f"this process: no TPU is visible (libtpu + /dev/accel* or /dev/vfio) and "
        f"SGLANG_PLATFORM is not '{PLUGIN_NAME}'. On a TPU host this flag works as is; to run "
        f"tpuserve on JAX's CPU or GPU backend set SGLANG_PLATFORM={PLUGIN_NAME} and drop --device"
    )


def refuse_unsupported_request(tokenizer_manager, obj, *args, **kwargs):
    """BEFORE hook on SGLang's per-request validation (launcher process)."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    if not isinstance(obj, GenerateReqInput) or not our_platform_active():
        return None
    wanted = []
    if obj.return_logprob:
        wanted.append("logprobs")
    if obj.custom_logit_processor:
        wanted.append("custom_logit_processor")
    params = obj.sampling_params if isinstance(obj.sampling_params, dict) else {}
    wanted += [k for k in _UNSUPPORTED_SAMPLING_KEYS if params.get(k) is not None]
    if wanted:
        raise ValueError(f"not supported by the tpuserve SGLang platform yet: {', '.join(wanted)}")
    return None


def verify_quantization(original, model_config, *args, **kwargs):
    """AROUND hook on ``ModelConfig._verify_quantization``: ours when our platform is active.

    SGLang's version maps the checkpoint's ``quantization_config`` through its torch quantization
    classes and requires one of them to exist for the result; ours asks our loader what it reads
    and sets ``model_config.quantization`` to the method our worker serves (or refuses clearly).
    """
    if not our_platform_active():
        return original(model_config, *args, **kwargs)
    verify_model_config_quantization(model_config)
    return None


def model_specific_adjustments(original, server_args, *args, **kwargs):
    """AROUND hook on SGLang's per-architecture argument adjustments.

    For gpt-oss SGLang asserts that the attention backend is one of its torch kernels that
    implement sliding windows and attention sinks, and gives an MXFP4 checkpoint bfloat16 for its
    Triton MXFP4 kernels. On our platform attention runs in our JAX model (windows and sinks
    included) under the backend name the platform declares, and the experts' MXFP4 records run in
    the dtype --dtype resolves to (f32 on a CPU host). So while SGLang's adjustments run, a kernel
    name from its list stands in (declared through SGLang's own resolution record), and after them
    our attention backend and the dtype as it was are declared back. Everything else the
    adjustments decide for the model is kept."""
    if not our_platform_active() or _architecture(server_args) not in _ATTENTION_CHECKED_ARCHS:
        return original(server_args, *args, **kwargs)
    from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view

    view = resolving_view(server_args)
    ours = {name: getattr(view, name) for name in _OUR_FIELDS}
    source = "tpuserve: the model runs in JAX"
    declare_resolution(
        server_args,
        source,
        attention_backend=_STAND_IN_ATTENTION,
        prefill_attention_backend=None,
        decode_attention_backend=None,
    )
    try:
        return original(server_args, *args, **kwargs)
    finally:
        if view.dtype != ours["dtype"]:
            log.info(
                "tpuserve: keeping --dtype %s (SGLang's %s for this model is for its own kernels)",
                ours["dtype"],
                view.dtype,
            )
        declare_resolution(server_args, source, **ours)


def _architecture(server_args) -> str | None:
    """The checkpoint's first architecture, read off its config.json (None when there is none)."""
    from sglang.srt.arg_groups.overrides import resolving_view

    path = os.path.join(os.path.expanduser(str(resolving_view(server_args).model_path or "")), "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        archs = json.load(f).get("architectures") or [None]
    return archs[0]


def last_loc_on_host(original, req_to_token, req_pool_indices, prefix_lens):
    """AROUND hook: each request's slot before position ``prefix_lens`` (-1 when it has none)."""
    if not our_platform_active():
        return original(req_to_token, req_pool_indices, prefix_lens)
    from sglang.srt.mem_cache.allocation import get_last_loc_torch  # SGLang's own torch version

    return get_last_loc_torch(req_to_token, req_pool_indices, prefix_lens)


def assign_slots_on_host(
    original, req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, batch_size
):
    """AROUND hook: request i's positions start..end-1 take the next end-start slots of
    ``out_cache_loc`` (requests in order)."""
    if not our_platform_active():
        return original(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, batch_size)
    rows = req_pool_indices[:batch_size].tolist()
    starts = start_offset[:batch_size].tolist()
    ends = end_offset[:batch_size].tolist()
    off = 0
    for row, a, b in zip(rows, starts, ends):
        req_to_token[row, a:b] = out_cache_loc[off : off + b - a].to(req_to_token.dtype)
        off += b - a


def add_quantization_choices() -> None:
    """Let argparse accept every ``--quantization`` method we serve (SGLang lacks "nvfp4")."""
    if not our_platform_active():
        return
    from sglang.srt.arg_groups.choices import QUANTIZATION_CHOICES, add_quantization_method_choices

    add_quantization_method_choices([m for m in ONLINE_METHODS if m not in QUANTIZATION_CHOICES])


def register_all() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(SCHEDULER_INIT_WORKER, init_tp_model_worker, HookType.AROUND)
    HookRegistry.register(RESOLUTION_PIPELINE, explain_device_tpu, HookType.BEFORE)
    HookRegistry.register(VALIDATE_REQUEST, refuse_unsupported_request, HookType.BEFORE)
    HookRegistry.register(VERIFY_QUANTIZATION, verify_quantization, HookType.AROUND)
    HookRegistry.register(MODEL_ADJUSTMENTS, model_specific_adjustments, HookType.AROUND)
    HookRegistry.register(LAST_LOC, last_loc_on_host, HookType.AROUND)
    HookRegistry.register(ASSIGN_SLOTS, assign_slots_on_host, HookType.AROUND)
    add_quantization_choices()
