"""Offline batch generation with vLLM's ``LLM`` interface: ``LLM(model).generate(prompts, params)``."""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from typing import Any, cast

from tpuserve.server.engine import LLMEngine
from tpuserve.server.outputs import CompletionOutput, RequestOutput
from tpuserve.server.sampling_params import SamplingParams
from tpuserve.tpu_platform.config import ConfigError, EngineConfig

PromptType = str | list[int] | dict


class LLM:
    """``LLM(model=None)`` runs the default model. Keyword arguments are EngineConfig fields
    (named as vLLM names them: dtype, max_model_len, max_num_seqs, seed, ...).

    ``warmup`` (default on, as vLLM compiles in its constructor): compile every shape bucket here,
    on a thread pool, so that a first ``generate`` runs at full speed; False skips it (each new
    shape then compiles on its first use)."""

    def __init__(self, model: str | None = None, *, warmup: bool = True, **kwargs: Any):
        self.config = EngineConfig.from_kwargs(model=model, **kwargs)
        if self.config.parallel.data_parallel_size > 1:
            raise ConfigError(
                f"data_parallel_size={self.config.parallel.data_parallel_size}: offline "
                f"LLM runs one engine; replicas are served by `tpuserve serve "
                f"--data-parallel-size N` (tensor_parallel_size works here)"
            )
        par = self.config.parallel
        if par.multi_host and par.host_rank != 0:
            raise ConfigError(
                f"host_rank={par.host_rank}: LLM runs on host 0; the other hosts run "
                f"tpuserve.tpu_platform.multihost.run_follower(config) with the same engine arguments"
            )
        grammar_factory = _default_grammar_factory()
        self.engine = LLMEngine(self.config, grammar_factory=grammar_factory)
        if warmup:
            self.engine.warmup()
        # The start-up line: written by the warm-up when there was one, else here (load only).
        self.engine.log_startup()

    def shutdown(self) -> None:
        """Release a multi-host engine's other hosts (their follower loops return); one host:
        stops a background warm-up, nothing else."""
        self.engine.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | SequenceABC[PromptType],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order.

        A prompt is a string, a list of token ids, or {"prompt": str} / {"prompt_token_ids": [...]}.
        A bad prompt or parameter fails that request alone (its output carries ``error``).
        """
        prompts = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"sampling_params: {len(params_list)} given for {len(prompts)} prompts")
        return self._run(prompts, params_list, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        one = bool(messages) and isinstance(messages[0], dict)  # one conversation, or a list of them
        convs = cast(list[list[dict]], [messages] if one else list(messages))
        prompts = [
            self.apply_chat_template(
                c,
                chat_template=chat_template,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                **(chat_template_kwargs or {}),
            )
            for c in convs
        ]
        return self.generate([{"prompt_token_ids": p} for p in prompts], sampling_params, use_tqdm)

    def apply_chat_template(self, conversation: list[dict], **kwargs) -> list[int]:
        tok = self.engine.tokenizer
        if not getattr(tok, "chat_template", None) and not kwargs.get("chat_template"):
            raise ValueError("this model's tokenizer has no chat template; pass chat_template=")
        text = tok.apply_chat_template(conversation, tokenize=False, **kwargs)
        # The template already wrote any special tokens it wants: do not add BOS twice.
        return list(tok.encode(text, add_special_tokens=False))

    def _run(
        self, prompts: list[PromptType], params_list: list[SamplingParams], use_tqdm: bool
    ) -> list[RequestOutput]:
        engine = self.engine
        results: dict[str, RequestOutput] = {}
        order: list[str] = []
        for i, (prompt, params) in enumerate(zip(prompts, params_list)):
            rid = f"offline-{id(self)}-{i}"
            order.append(rid)
            try:
                text, ids = _split_prompt(prompt)
                engine.add_request(rid, text, params, prompt_token_ids=ids)
            except ValueError as e:
                results[rid] = _error_output(rid, prompt, str(e))
        bar = _progress(len(order) - len(results)) if use_tqdm else None
        while engine.has_unfinished_requests():
            for out in engine.step(finished_only=True):
                if out.finished:
                    results[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [results[r] for r in order]


def _default_grammar_factory():
    try:
        from tpuserve.server.structured_output import make_grammar_matcher
    except ImportError:  # structured output is optional for offline use
        return None
    return make_grammar_matcher


def _as_prompt_list(prompts) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def _split_prompt(prompt: PromptType) -> tuple[str | None, list[int] | None]:
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"], None
        raise ValueError("prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return None, prompt
    raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")


def _error_output(rid: str, prompt: PromptType, message: str) -> RequestOutput:
    return RequestOutput(
        request_id=rid,
        prompt=prompt if isinstance(prompt, str) else None,
        prompt_token_ids=[],
        outputs=[CompletionOutput(index=0, finish_reason="error")],
        finished=True,
        error=message,
    )


def _progress(total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Generating", unit="req", disable=total < 8)
