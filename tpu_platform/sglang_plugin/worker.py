"""The TP worker SGLang's scheduler drives when the tpuserve platform is active.

SGLang 0.5.23 has no platform hook for the model executor, so hooks.py builds this worker in place of
``TpModelWorker`` (the in-tree MLX backend does the same with its own worker). Per scheduled batch:

  SGLang (torch, host)                          ->  our runtime (JAX)
  input_ids, seq_lens, extend lens, req_to_token     ScheduledSeq list: tokens, computed length,
  rows, out_cache_loc (int metadata)                 page table = SGLang's own page ids
  sampling params of each Req                        SamplingRow
  next_token_ids (int64 tensor)                 <-   sampled ids (int32 numpy)

Nothing else crosses: no logits, no hidden states, no KV. SGLang's scheduler, radix cache and
allocator keep deciding what runs and where each token's K/V goes; ``slots.check_new_slots``
proves each step that our writes land in exactly the slots SGLang chose.

Speculative decoding (NGRAM only) drives ``verify_chains`` through spec_ngram.py's worker.

Not supported on this path yet: logprobs, structured output (grammars), logit bias, custom logit
processors. Requests asking for them are refused at admission with a 400
(hooks.refuse_unsupported_request); ``_refuse_unsupported`` here is the backstop.
"""

from __future__ import annotations

import logging
import zlib

import numpy as np
import torch
from sglang.srt.managers.tp_worker import TpModelWorker
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.runtime_context import get_model, get_schedule, get_spec

from tpuserve.tpu_platform.sglang_plugin.executor import ExecutorConfig, JaxExecutor, loader_options
from tpuserve.tpu_platform.sglang_plugin.quantization import engine_kv_cache_dtype, resolve_quantization
from tpuserve.tpu_platform.sglang_plugin.slots import check_new_slots, page_table
from tpuserve.tpu_platform.step_batch import SamplingRow, ScheduledSeq, sampling_row

log = logging.getLogger(__name__)

# SGLang's dtype names -> ours ("auto" lets our device discovery pick: bf16 on TPU/GPU, f32 on CPU).
_DTYPES = {
    "auto": "auto",
    "float32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "half": "float16",
}


class UnsupportedOnTpuServe(NotImplementedError):
    pass


def executor_config(model_path: str, context_len: int) -> ExecutorConfig:
    """Our executor's settings from SGLang's resolved configuration.

    The KV cache is sized by ``--max-total-tokens`` when given, else by our own rule (half the JAX
    device's memory minus the weights on an accelerator, 1 GiB on a CPU host). SGLang's
    ``--mem-fraction-static`` is not used: SGLang resolves it for its torch device (the host here),
    so its default says nothing about the accelerator JAX owns.

    ``--quantization`` / ``--kv-cache-dtype`` become our worker's ``quantization`` (quantize at load,
    or the pre-quantized checkpoint's own method) and ``kv_cache_dtype``. Unsupported values were
    refused at start-up already (quantization.py); this resolves them the same way again.
    """
    sched = get_schedule()
    model = get_model()
    dtype = str(model.dtype)
    if dtype not in _DTYPES:
        raise UnsupportedOnTpuServe(
            f"--dtype {dtype} is not supported by tpuserve; use one of {sorted(_DTYPES)}"
        )
    chunk = sched.chunked_prefill_size
    spec = get_spec()
    # NGRAM: the root plus drafts make --speculative-num-draft-tokens (spec_ngram.py).
    drafts = int(spec.speculative_num_draft_tokens) - 1 if spec.speculative_algorithm == "NGRAM" else None
    options = loader_options(getattr(model, "model_loader_extra_config", None) or {})
    return ExecutorConfig(
        layer_loop=options.get("layer_loop"),
        model_path=model_path,
        page_size=sched.page_size,
        max_model_len=context_len,
        dtype=_DTYPES[dtype],
        max_total_tokens=sched.max_total_tokens,
        max_num_seqs=sched.max_running_requests or None,  # unset: EngineConfig's
        # One runner step per SGLang prefill chunk when chunking is on; bigger batches are split.
        max_num_batched_tokens=chunk if chunk and chunk > 0 else None,
        quantization=resolve_quantization(model.quantization, model_path),
        kv_cache_dtype=engine_kv_cache_dtype(model.kv_cache_dtype),
        num_speculative_tokens=drafts,
    )


def request_sampling_row(req, vocab_size: int, eos_token_ids=()) -> SamplingRow:
    """One SGLang request's sampling parameters in our terms (built by the shared ``sampling_row``)."""
    sp = req.sampling_params
    # SGLang normalises temperature 0 to (temperature 1, top_k 1): that is greedy.
    greedy = sp.top_k == 1
    top_k = 0 if sp.top_k is None or sp.top_k < 0 or sp.top_k >= vocab_size else int(sp.top_k)
    seed = sp.sampling_seed
    if seed is None:
        # A per-request seed that does not depend on batch composition: (seed, step) keys the PRNG.
        seed = zlib.crc32(str(req.rid).encode())
    # min_new_tokens holds back the stop token ids and, unless ignore_eos, the end tokens.
    stop_ids = set(getattr(sp, "stop_token_ids", None) or ())
    if not getattr(sp, "ignore_eos", False):
        stop_ids |= set(getattr(req, "eos_token_ids", None) or ()) | set(eos_token_ids)
    return sampling_row(
        temperature=0.0 if greedy else float(sp.temperature),
        top_k=0 if greedy else top_k,
        top_p=float(sp.top_p),
        min_p=float(sp.min_p),
        seed=int(seed),
        prompt_ids=list(req.origin_input_ids),
        output_ids=list(req.output_ids),
        repetition_penalty=float(sp.repetition_penalty),
        presence_penalty=float(sp.presence_penalty),
        frequency_penalty=float(sp.frequency_penalty),
        min_tokens=int(getattr(sp, "min_new_tokens", 0) or 0),
        min_tokens_stop_ids=stop_ids,
    )


def _refuse_unsupported(batch) -> None:
    if batch.return_logprob:
        raise UnsupportedOnTpuServe("logprobs are not supported by the tpuserve SGLang worker yet")
    if batch.has_grammar:
        raise UnsupportedOnTpuServe(
            "structured output (grammars) is not supported by the tpuserve SGLang worker yet"
        )
    info = batch.sampling_info
    if info is not None and (info.logit_bias is not None or info.has_custom_logit_processor):
        raise UnsupportedOnTpuServe(
            "logit_bias / custom logit processors are not supported by the tpuserve SGLang worker yet"
        )


def scheduled_seqs(
    batch, req_to_token: torch.Tensor, page_size: int, vocab_size: int, eos_token_ids=()
) -> list[ScheduledSeq]:
    """SGLang's batch -> our per-sequence work items (int metadata only)."""
    reqs = batch.reqs
    input_ids = batch.input_ids.numpy().astype(np.int32)
    seq_lens = batch.seq_lens_cpu.numpy()
    pool_idx = batch.req_pool_indices.numpy()
    out_loc = batch.out_cache_loc.numpy()
    if batch.forward_mode.is_decode():
        new_lens = [1] * len(reqs)
    else:
        new_lens = list(batch.extend_lens)
    table = req_to_token.numpy()  # a view of SGLang's host tensor, no copy
    seqs: list[ScheduledSeq] = []
    off = 0
    for i, req in enumerate(reqs):
        n = int(new_lens[i])
        total = int(seq_lens[i])
        slots = table[int(pool_idx[i]), :total]
        start = total - n
        check_new_slots(slots, start, out_loc[off : off + n], page_size, where=f"request {req.rid}: ")
        seqs.append(
            ScheduledSeq(
                token_ids=input_ids[off : off + n].tolist(),
                num_computed=start,
                page_ids=page_table(slots, page_size).tolist(),
                sampling=request_sampling_row(req, vocab_size, eos_token_ids),
            )
        )
        off += n
    if off != len(input_ids):
        raise RuntimeError(f"batch has {len(input_ids)} input ids but its requests account for {off}")
    return seqs


def verify_seqs(
    batch,
    chains: list[list[int]],
    req_to_token: torch.Tensor,
    page_size: int,
    vocab_size: int,
    eos_token_ids=(),
    max_model_len: int | None = None,
) -> list[ScheduledSeq]:
    """A speculative decode batch -> our work items: each request's chain (root, then drafts) at
    positions seq_len.. of its own slots, which SGLang allocated ahead of the verify. Drafts that
    would reach past ``max_model_len`` are dropped (SGLang ends such a request at its length)."""
    seq_lens = batch.seq_lens.cpu().numpy()  # committed lengths: the root's K/V is not written yet
    pool_idx = batch.req_pool_indices.cpu().numpy()
    table = req_to_token.numpy()
    seqs: list[ScheduledSeq] = []
    for i, req in enumerate(batch.reqs):
        chain = chains[i]
        last = req.output_ids[-1] if len(req.output_ids) else req.origin_input_ids[-1]
        if not chain or int(chain[0]) != int(last):
            raise RuntimeError(
                f"request {req.rid}: the n-gram draft tree's root {chain[:1]} is not the request's "
                f"last token {int(last)}"
            )
        start = int(seq_lens[i])
        if max_model_len is not None:
            chain = chain[: max(1, max_model_len - start)]
        slots = table[int(pool_idx[i]), : start + len(chain)]
        check_new_slots(slots, start, slots[start:], page_size, where=f"request {req.rid}: ")
        seqs.append(
            ScheduledSeq(
                token_ids=[int(chain[0])],
                num_computed=start,
                page_ids=page_table(slots, page_size).tolist(),
                sampling=request_sampling_row(req, vocab_size, eos_token_ids),
                draft_token_ids=[int(t) for t in chain[1:]],
            )
        )
    return seqs


class TpuServeTpModelWorker(TpModelWorker):
    """SGLang's TP worker with our JAX executor in place of its torch model runner."""

    def _init_model_runner(self):
        # on use: SGLang's ModelRunner module, which the stub subclasses, is a heavy import
        from tpuserve.tpu_platform.sglang_plugin.stub_runner import TpuServeModelRunnerStub

        # Executor first: it sizes the KV cache, and SGLang's pools are sized from it.
        cfg = executor_config(get_model().model_path, self.model_config.context_len)
        self._executor = JaxExecutor(cfg)
        self._model_runner = TpuServeModelRunnerStub(
            model_config=self.model_config,
            mem_fraction_static=get_schedule().mem_fraction_static,
            gpu_id=self.gpu_id,
            nccl_port=self.nccl_port,
            server_args=self.server_args,
            is_draft_worker=self.is_draft_worker,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.token_to_kv_pool_allocator,
            memory_pool_config=self.memory_pool_config,
            executor=self._executor,
        )
        self._vocab_size = self._executor.arch.vocab_size
        log.info(
            "tpuserve executor active: SGLang scheduler -> %s (JAX %s backend, weights %s, KV cache %s)",
            type(self).__name__,
            self._executor.device.backend,
            self._executor.quantization or "dense",
            self._executor.kv_cache_dtype.name,
        )

    @property
    def executor(self) -> JaxExecutor:
        return self._executor

    def get_pad_input_ids_func(self):
        return None  # no multimodal padding: there is no torch model to ask

    def forward_batch_generation(
        self,
        batch,
        forward_batch=None,
        pp_proxy_tensors=None,
        is_verify=False,
        skip_attn_backend_init=None,
        *,
        capture_hidden_mode=None,
        return_kv_loc_plan=False,
    ):
        from sglang.srt.layers.logits_processor import LogitsProcessorOutput

        if batch is None or is_verify:
            raise UnsupportedOnTpuServe(
                "only scheduled batches run on tpuserve (no speculative verify, no prebuilt ForwardBatch)"
            )
        empty = LogitsProcessorOutput(next_token_logits=None)
        if batch.forward_mode.is_idle() or not batch.reqs:
            return GenerationBatchResult(
                logits_output=empty,
                can_run_cuda_graph=False,
                next_token_ids=torch.zeros(0, dtype=torch.int64),
            )
        _refuse_unsupported(batch)
        seqs = scheduled_seqs(
            batch,
            self.model_runner.req_to_token_pool.req_to_token,
            self.model_runner.page_size,
            self._vocab_size,
            self._executor.arch.eos_token_ids,
        )
        sampled = self._executor.run(seqs)
        return GenerationBatchResult(
            logits_output=empty,
            can_run_cuda_graph=False,
            next_token_ids=torch.from_numpy(sampled.astype(np.int64)),
        )

    def verify_chains(self, batch, chains: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        """Verify each request's draft chain (spec_ngram.py): (tokens [bs, 1 + K], accepted [bs])."""
        _refuse_unsupported(batch)
        seqs = verify_seqs(
            batch,
            chains,
            self.model_runner.req_to_token_pool.req_to_token,
            self.model_runner.page_size,
            self._vocab_size,
            self._executor.arch.eos_token_ids,
            max_model_len=self._executor.max_model_len,
        )
        return self._executor.verify(seqs)
