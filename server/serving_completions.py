"""POST /v1/completions: prompts (text, token ids, or lists of either) -> text completions."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from tpuserve.server.api_errors import APIError, bad_request
from tpuserve.server.outputs import RequestOutput
from tpuserve.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    usage_info,
)
from tpuserve.server.serving_common import (
    MAX_PROMPTS,
    SSE_DONE,
    ServingContext,
    StreamingResult,
    collect_final,
    finite,
    make_sampling_params,
    merge_streams,
    outputs_or_error,
    ranked_top,
    resolve_max_tokens,
    sse,
    structured_from_request,
    token_text,
)


class CompletionHandler:
    def __init__(self, ctx: ServingContext):
        self.ctx = ctx

    async def _prompts(self, req: CompletionRequest) -> list[tuple[str | None, list[int]]]:
        p = req.prompt
        if isinstance(p, str):
            raw: list = [p]
        elif p and all(isinstance(t, int) for t in p):
            raw = [list(p)]
        else:
            raw = list(p)
        if not raw:
            raise bad_request("prompt: must not be empty", "prompt")
        if len(raw) > MAX_PROMPTS:
            raise bad_request(f"prompt: at most {MAX_PROMPTS} prompts per request, got {len(raw)}", "prompt")
        for item in raw:  # every length limit before any tokenizer time is spent
            if isinstance(item, str):
                self.ctx.check_prompt_chars(len(item), "prompt")
        out: list[tuple[str | None, list[int]]] = []
        for item in raw:
            if isinstance(item, str):
                if not item:
                    raise bad_request("prompt: must not be empty", "prompt")
                out.append((item, await self.ctx.tokenize(item, req.add_special_tokens)))
            else:
                if not item:
                    raise bad_request("prompt: a token id list must not be empty", "prompt")
                self.ctx.check_token_ids(item, "prompt")
                out.append((None, list(item)))
        return out

    async def create(self, req: CompletionRequest):
        """Validate and submit; returns a CompletionResponse, or an SSE iterator when streaming."""
        ctx = self.ctx
        ctx.check_model(req.model)
        if req.suffix:
            raise bad_request("suffix: not supported by this server", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of: only best_of == n is supported", "best_of")
        if req.stream_options is not None and not req.stream:
            raise bad_request("stream_options: only allowed when stream is true", "stream_options")
        logprobs = req.logprobs
        if logprobs is not None:
            max_logprobs = ctx.engine.engine.config.model.max_logprobs
            if logprobs > max_logprobs:
                raise bad_request(f"logprobs: must be <= {max_logprobs}", "logprobs")
        prompts = await self._prompts(req)
        structured = structured_from_request(req)
        await ctx.compile_grammar(structured)
        prompt_logprobs = req.prompt_logprobs
        if req.echo and logprobs is not None:
            prompt_logprobs = max(prompt_logprobs or 0, logprobs)
        explicit = "max_tokens" in req.model_fields_set and req.max_tokens is not None
        request_id = f"cmpl-{uuid.uuid4().hex}"
        items = []
        for i, (text, ids) in enumerate(prompts):
            max_tokens = resolve_max_tokens(req.max_tokens, explicit, len(ids), ctx.max_model_len)
            params = make_sampling_params(
                req,
                max_tokens=max_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                structured=structured,
            )
            items.append((f"{request_id}-{i}", text, ids, params))
        echo_texts = None
        if req.echo:
            echo_texts = [
                text if text is not None else await ctx.blocking(ctx.tokenizer.decode, ids)
                for text, ids in prompts
            ]
        streams = await ctx.submit(
            items, cache_salt=req.cache_salt, kv_transfer_params=req.kv_transfer_params
        )
        created = int(time.time())
        if req.stream:
            return StreamingResult(
                self._stream(req, request_id, created, streams, prompts, echo_texts), streams
            )
        finals = await collect_final(streams)
        return self._response(req, request_id, created, finals, prompts, echo_texts)

    # ---- building responses ----

    def _logprobs(self, token_ids: list[int], positions: list, k: int, offset: int) -> CompletionLogprobs:
        tok = self.ctx.tokenizer
        out = CompletionLogprobs()
        for tid, entry in zip(token_ids, positions):
            if entry is None:  # the first prompt token has nothing before it
                text = token_text(None, tok, tid)
                out.tokens.append(text)
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
            else:
                chosen = entry.get(tid)
                text = token_text(chosen, tok, tid)
                out.tokens.append(text)
                out.token_logprobs.append(finite(chosen.logprob) if chosen is not None else None)
                top = {token_text(lp, tok, t): finite(lp.logprob) for t, lp in ranked_top(entry, k)}
                if chosen is not None:
                    top.setdefault(text, finite(chosen.logprob))
                out.top_logprobs.append(top)
            out.text_offset.append(offset)
            offset += len(text)
        return out

    def _echo_logprobs(self, out: RequestOutput, k: int) -> CompletionLogprobs:
        positions = list(out.prompt_logprobs or [])
        positions += [None] * (len(out.prompt_token_ids) - len(positions))
        return self._logprobs(out.prompt_token_ids, positions, k, 0)

    def _response(
        self,
        req: CompletionRequest,
        request_id: str,
        created: int,
        finals: list[RequestOutput],
        prompts,
        echo_texts,
    ) -> CompletionResponse:
        choices = []
        completion_tokens = 0
        for i, out in enumerate(finals):
            if out.error:
                raise APIError(out.error_status, f"request failed: {out.error}")
            for c in out.outputs:
                text = c.text
                lps = None
                if req.logprobs is not None:
                    prefix = self._echo_logprobs(out, req.logprobs) if req.echo else None
                    start = len(echo_texts[i]) if req.echo else 0
                    lps = self._logprobs(c.token_ids, c.logprobs or [], req.logprobs, start)
                    if prefix is not None:
                        lps = _join_logprobs(prefix, lps)
                if req.echo:
                    text = echo_texts[i] + text
                choices.append(
                    CompletionChoice(
                        index=i * req.n + c.index,
                        text=text,
                        logprobs=lps,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                    )
                )
                completion_tokens += len(c.token_ids)
        choices.sort(key=lambda c: c.index)
        prompt_tokens = sum(len(ids) for _, ids in prompts)
        cached = sum(out.num_cached_tokens for out in finals)
        return CompletionResponse(
            id=request_id,
            created=created,
            model=self.ctx.model_name,
            choices=choices,
            usage=usage_info(prompt_tokens, completion_tokens, cached),
            kv_transfer_params=finals[0].kv_transfer_params if finals else None,
        )

    async def _stream(
        self, req: CompletionRequest, request_id: str, created: int, streams, prompts, echo_texts
    ) -> AsyncIterator[str]:
        n = req.n
        total = len(streams) * n
        sent_chars = [0] * total
        sent_tokens = [0] * total
        offsets = [0] * total
        done = [False] * total
        echoed = [not req.echo] * total
        finals: dict[int, RequestOutput] = {}
        model = self.ctx.model_name

        def chunk(index: int, text: str, lps, finish=None, stop_reason=None) -> str:
            return sse(
                CompletionResponse(
                    id=request_id,
                    created=created,
                    model=model,
                    choices=[
                        CompletionChoice(
                            index=index,
                            text=text,
                            logprobs=lps,
                            finish_reason=finish,
                            stop_reason=stop_reason,
                        )
                    ],
                ).model_dump_json(exclude={"usage"})
            )

        async for i, out in outputs_or_error(merge_streams(streams)):
            if isinstance(out, str):  # a request failed or the engine stopped: an SSE error event
                yield out
                break
            if out.finished:
                finals[i] = out
            for c in out.outputs:
                idx = i * n + c.index
                if done[idx]:
                    continue
                prefix_text, prefix_lps = "", None
                if not echoed[idx] and (c.token_ids or c.finish_reason):
                    # Echo once the prompt is fully computed (its logprobs are complete then).
                    echoed[idx] = True
                    prefix_text = echo_texts[i]
                    if req.logprobs is not None:
                        prefix_lps = self._echo_logprobs(out, req.logprobs)
                    offsets[idx] = len(prefix_text)
                delta = c.text[sent_chars[idx] :]
                new_ids = c.token_ids[sent_tokens[idx] :]
                if not (prefix_text or delta or new_ids or c.finish_reason):
                    continue
                lps = None
                if req.logprobs is not None:
                    positions = (c.logprobs or [])[sent_tokens[idx] :]
                    lps = self._logprobs(new_ids, positions, req.logprobs, offsets[idx])
                    offsets[idx] += sum(len(t) for t in lps.tokens)
                    if prefix_lps is not None:
                        lps = _join_logprobs(prefix_lps, lps)
                sent_chars[idx] = len(c.text)
                sent_tokens[idx] = len(c.token_ids)
                if c.finish_reason is not None:
                    done[idx] = True
                yield chunk(idx, prefix_text + delta, lps, c.finish_reason, c.stop_reason)
        else:
            if req.stream_options is not None and req.stream_options.include_usage:
                prompt_tokens = sum(len(ids) for _, ids in prompts)
                completion_tokens = sum(len(c.token_ids) for o in finals.values() for c in o.outputs)
                cached = sum(o.num_cached_tokens for o in finals.values())
                usage = usage_info(prompt_tokens, completion_tokens, cached)
                yield sse(
                    CompletionResponse(id=request_id, created=created, model=model, choices=[], usage=usage)
                )
        yield SSE_DONE


def _join_logprobs(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(
        text_offset=a.text_offset + b.text_offset,
        token_logprobs=a.token_logprobs + b.token_logprobs,
        tokens=a.tokens + b.tokens,
        top_logprobs=a.top_logprobs + b.top_logprobs,
    )
