"""POST /v1/chat/completions: messages through the model's chat template, tools, response formats."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from tpuserve.server.api_errors import APIError, bad_request
from tpuserve.server.harmony import HarmonyDelta, HarmonyParser, HarmonyTokens, parse_harmony
from tpuserve.server.outputs import RequestOutput
from tpuserve.server.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    NamedToolChoice,
    TokenLogprob,
    ToolCallFunction,
    ToolCallOut,
    TopLogprob,
    usage_info,
)
from tpuserve.server.sampling_params import StructuredOutputParams
from tpuserve.server.serving_common import (
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
from tpuserve.server.structured_output import tool_call_grammar
from tpuserve.server.tool_parser import StreamingToolParser, ToolCall, parse_tool_calls, tools_system_prompt

# Arguments of apply_chat_template that chat_template_kwargs may not override.
_RESERVED_TEMPLATE_KWARGS = {
    "conversation",
    "tools",
    "documents",
    "chat_template",
    "tokenize",
    "add_generation_prompt",
    "continue_final_message",
    "return_dict",
    "return_tensors",
    "padding",
    "truncation",
    "max_length",
    "tokenizer_kwargs",
    "return_assistant_tokens_mask",
}


def _message_dict(i: int, m: ChatMessage) -> dict:
    content = m.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.type != "text" or part.text is None:
                raise bad_request(
                    f"messages[{i}].content: only text parts are supported, got a {part.type!r} part",
                    "messages",
                )
            texts.append(part.text)
        content = "\n".join(texts)
    d: dict = {"role": m.role, "content": content or ""}
    reasoning = m.reasoning if m.reasoning is not None else m.reasoning_content
    if reasoning is not None and m.role == "assistant":
        # gpt-oss's template reads an assistant turn's reasoning as "thinking", Qwen3's and
        # DeepSeek's as "reasoning_content".
        d["thinking"] = d["reasoning_content"] = reasoning
    if m.name is not None:
        d["name"] = m.name
    if m.tool_calls:
        calls = []
        for tc in m.tool_calls:
            args = tc.function.arguments
            if isinstance(args, str):
                try:
                    parsed = json.loads(args)
                    args = parsed if isinstance(parsed, dict) else args
                except json.JSONDecodeError:
                    pass
            calls.append(
                {
                    "id": tc.id or f"call_{i}",
                    "type": "function",
                    "function": {"name": tc.function.name, "arguments": args},
                }
            )
        d["tool_calls"] = calls
    if m.tool_call_id is not None:
        d["tool_call_id"] = m.tool_call_id
    return d


def _inline_tool_calls(message: dict) -> dict:
    """For templates that ignore ``tool_calls``: write an assistant's calls into its content the
    way the model is asked to produce them (Hermes ``<tool_call>`` blocks)."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    blocks = []
    for c in calls:
        args = c["function"]["arguments"]
        body = {
            "name": c["function"]["name"],
            "arguments": args if isinstance(args, dict) else _maybe_json(args),
        }
        blocks.append("<tool_call>\n" + json.dumps(body, ensure_ascii=False) + "\n</tool_call>")
    text = "\n".join(([message["content"]] if message.get("content") else []) + blocks)
    return {k: v for k, v in message.items() if k != "tool_calls"} | {"content": text}


def _conversation_chars(conversation: list[dict]) -> int:
    """The characters the messages bring to the rendered chat (a lower bound of its length)."""
    n = 0
    for m in conversation:
        n += len(m.get("content") or "")
        for c in m.get("tool_calls") or ():
            args = c["function"]["arguments"]
            n += len(args) if isinstance(args, str) else len(json.dumps(args))
    return n


def _maybe_json(text: str):
    try:
        return json.loads(text)
    except (json.JSONDecodeError, TypeError):
        return text


class ChatHandler:
    def __init__(self, ctx: ServingContext):
        self.ctx = ctx
        self._harmony: HarmonyTokens | None | bool = False  # False: not looked up yet

    @property
    def harmony(self) -> HarmonyTokens | None:
        """The harmony special tokens when the model answers in harmony messages (gpt-oss)."""
        if self._harmony is False:
            tok = self.ctx.tokenizer
            self._harmony = HarmonyTokens.of(tok) if tok is not None else None
        return self._harmony  # type: ignore[return-value]

    async def prompt_ids(
        self, conversation: list[dict], tools: list[dict] | None, req: ChatCompletionRequest
    ) -> list[int]:
        """Render and tokenize on a tokenizer lane; 400 for text over the prompt limit (checked on
        the messages before rendering, then on the rendered text before tokenizing)."""
        n_chars = _conversation_chars(conversation)
        self.ctx.check_prompt_chars(n_chars, "messages", "chat")
        try:
            return await self.ctx.with_tokenizer(n_chars, self._render, conversation, tools, req)
        except ValueError as e:
            raise bad_request(str(e), "messages") from e

    def _render(
        self, tok, conversation: list[dict], tools: list[dict] | None, req: ChatCompletionRequest
    ) -> list[int]:
        """Chat template -> prompt token ids (runs on a tokenizer lane, with that lane's tokenizer)."""
        template = self.ctx.chat_template or getattr(tok, "chat_template", None)
        if not template:
            raise ValueError(
                "messages: this model has no chat template; start the server with "
                "--chat-template or use /v1/completions"
            )
        if tools and "tools" not in template:
            # The template cannot show tools to the model: describe them in the system message.
            block = tools_system_prompt(tools)
            if conversation and conversation[0]["role"] == "system":
                first = dict(conversation[0], content=conversation[0]["content"] + "\n\n" + block)
                conversation = [first] + conversation[1:]
            else:
                conversation = [{"role": "system", "content": block}] + conversation
            tools = None
        if "tool_calls" not in template:
            conversation = [_inline_tool_calls(m) for m in conversation]
        if "developer" not in template:
            # Templates without a developer role take its instructions as the system message.
            conversation = [dict(m, role="system") if m["role"] == "developer" else m for m in conversation]
        kwargs = {
            k: v for k, v in (req.chat_template_kwargs or {}).items() if k not in _RESERVED_TEMPLATE_KWARGS
        }
        if req.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", req.reasoning_effort)
            kwargs.setdefault("enable_thinking", req.reasoning_effort != "none")
        try:
            text = tok.apply_chat_template(
                conversation,
                tools=tools,
                chat_template=template,
                tokenize=False,
                add_generation_prompt=req.add_generation_prompt and not req.continue_final_message,
                continue_final_message=req.continue_final_message,
                **kwargs,
            )
        except Exception as e:  # jinja raises many kinds (TemplateError, TypeError, ...)
            raise ValueError(
                f"messages: the chat template could not render them: {type(e).__name__}: {e}"
            ) from e
        if not isinstance(text, str):
            raise ValueError("messages: the chat template did not produce text")
        self.ctx.check_prompt_chars(len(text), "messages", "rendered chat")
        return list(tok.encode(text, add_special_tokens=False))

    def _tools(self, req: ChatCompletionRequest):
        """-> (tools for the template, whether to parse tool calls, forced-call grammar or None)."""
        tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
        choice = req.tool_choice
        if not tools:
            if choice not in (None, "none"):
                raise bad_request("tool_choice: needs tools", "tool_choice")
            return None, False, None
        if choice == "none":
            return None, False, None
        if choice is None or choice == "auto":
            return tools, True, None
        funcs = [t["function"] for t in tools]
        if isinstance(choice, NamedToolChoice):
            funcs = [f for f in funcs if f["name"] == choice.function.name]
            if not funcs:
                raise bad_request(
                    f"tool_choice: no tool named {choice.function.name!r} in tools", "tool_choice"
                )
        try:
            grammar = tool_call_grammar(funcs)
        except ValueError as e:
            raise bad_request(str(e), "tools") from e
        return tools, True, StructuredOutputParams(grammar=grammar)

    async def create(self, req: ChatCompletionRequest):
        ctx = self.ctx
        ctx.check_model(req.model)
        if req.stream_options is not None and not req.stream:
            raise bad_request("stream_options: only allowed when stream is true", "stream_options")
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs: requires logprobs to be true", "top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        tools, parse_tools, forced = await ctx.blocking(self._tools, req)
        structured = structured_from_request(req)
        if forced is not None:
            if structured is not None:
                raise bad_request("tool_choice: cannot be combined with response_format", "tool_choice")
            structured = forced
        conversation = [_message_dict(i, m) for i, m in enumerate(req.messages)]
        prompt_ids = await self.prompt_ids(conversation, tools, req)
        if not prompt_ids:
            raise bad_request("messages: the rendered prompt is empty", "messages")
        requested = req.max_completion_tokens or req.max_tokens
        max_tokens = resolve_max_tokens(requested, requested is not None, len(prompt_ids), ctx.max_model_len)
        params = make_sampling_params(req, max_tokens=max_tokens, logprobs=logprobs, structured=structured)
        await ctx.compile_grammar(structured)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await ctx.submit(
            [(request_id, None, prompt_ids, params)],
            cache_salt=req.cache_salt,
            kv_transfer_params=req.kv_transfer_params,
        )
        created = int(time.time())
        if req.stream:
            return StreamingResult(
                self._stream(req, request_id, created, streams, parse_tools, len(prompt_ids)), streams
            )
        finals = await collect_final(streams)
        return self._response(req, request_id, created, finals[0], parse_tools)

    # ---- building responses ----

    def _logprobs(self, token_ids: list[int], positions: list, k: int) -> list[TokenLogprob]:
        tok = self.ctx.tokenizer
        out = []
        for tid, entry in zip(token_ids, positions):
            chosen = entry.get(tid) if entry else None
            text = token_text(chosen, tok, tid)
            tops = []
            for t, lp in ranked_top(entry or {}, k):
                t_text = token_text(lp, tok, t)
                tops.append(
                    TopLogprob(
                        token=t_text,
                        logprob=finite(lp.logprob),
                        bytes=list(t_text.encode("utf-8", errors="replace")),
                    )
                )
            out.append(
                TokenLogprob(
                    token=text,
                    logprob=finite(chosen.logprob) if chosen else -9999.0,
                    bytes=list(text.encode("utf-8", errors="replace")),
                    top_logprobs=tops,
                )
            )
        return out

    @staticmethod
    def _harmony_out(delta: HarmonyDelta, parse_tools: bool) -> HarmonyDelta:
        """Without tools in the request a call the model made anyway is not a tool call: its
        arguments stay in the content, as the text of a model without a tool parser would."""
        if parse_tools or not delta.calls:
            return delta
        text = "".join(c.arguments for c in delta.calls)
        return HarmonyDelta(reasoning=delta.reasoning, content=delta.content + text)

    @staticmethod
    def _tool_calls_out(calls: list[ToolCall]) -> list[ToolCallOut]:
        return [
            ToolCallOut(id=c.id, function=ToolCallFunction(name=c.name, arguments=c.arguments)) for c in calls
        ]

    def _response(
        self, req: ChatCompletionRequest, request_id: str, created: int, out: RequestOutput, parse_tools: bool
    ) -> ChatCompletionResponse:
        if out.error:
            raise APIError(out.error_status, f"request failed: {out.error}")
        choices = []
        for c in out.outputs:
            reasoning = None
            if self.harmony is not None:
                parsed = self._harmony_out(
                    parse_harmony(self.ctx.tokenizer, self.harmony, c.token_ids), parse_tools
                )
                content, calls, reasoning = parsed.content or None, parsed.calls, parsed.reasoning or None
                if not req.include_reasoning:
                    reasoning = None
            else:
                content, calls = parse_tool_calls(c.text) if parse_tools else (c.text, [])
            finish = "tool_calls" if calls else c.finish_reason
            lps = None
            if req.logprobs:
                # One entry per token of the content: not the end token the text leaves out.
                n = self.ctx.visible_token_count(c, req.ignore_eos)
                lps = ChatLogprobs(
                    content=self._logprobs(c.token_ids[:n], (c.logprobs or [])[:n], req.top_logprobs or 0)
                )
            choices.append(
                ChatChoice(
                    index=c.index,
                    message=ChatResponseMessage(
                        content=content,
                        tool_calls=self._tool_calls_out(calls),
                        reasoning=reasoning,
                        reasoning_content=reasoning,
                    ),
                    logprobs=lps,
                    finish_reason=finish,
                    stop_reason=c.stop_reason,
                )
            )
        prompt_tokens = len(out.prompt_token_ids)
        completion_tokens = sum(len(c.token_ids) for c in out.outputs)
        return ChatCompletionResponse(
            id=request_id,
            created=created,
            model=self.ctx.model_name,
            choices=choices,
            usage=usage_info(prompt_tokens, completion_tokens, out.num_cached_tokens),
            kv_transfer_params=out.kv_transfer_params,
        )

    async def _stream(
        self,
        req: ChatCompletionRequest,
        request_id: str,
        created: int,
        streams,
        parse_tools: bool,
        prompt_tokens: int,
    ) -> AsyncIterator[str]:
        n = req.n
        model = self.ctx.model_name
        sent_chars = [0] * n
        sent_tokens = [0] * n
        done = [False] * n
        harmony = self.harmony
        parsers = [StreamingToolParser() if parse_tools and harmony is None else None for _ in range(n)]
        readers = [
            HarmonyParser(self.ctx.tokenizer, harmony) if harmony is not None else None for _ in range(n)
        ]
        stream_calls = [0] * n  # tool calls sent so far, per choice: the next call's index
        final: RequestOutput | None = None

        def chunk(choice: ChatStreamChoice) -> str:
            return sse(
                ChatCompletionChunk(
                    id=request_id, created=created, model=model, choices=[choice]
                ).model_dump_json(exclude_none=True)
            )

        for i in range(n):
            yield chunk(ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content="")))
        async for _, out in outputs_or_error(merge_streams(streams)):
            if isinstance(out, str):  # a request failed or the engine stopped: an SSE error event
                yield out
                break
            if out.finished:
                final = out
            for c in out.outputs:
                idx = c.index
                if done[idx]:
                    continue
                delta_text = c.text[sent_chars[idx] :]
                # Logprobs cover the content's tokens only: not a final end token.
                visible = (
                    self.ctx.visible_token_count(c, req.ignore_eos) if c.finish_reason else len(c.token_ids)
                )
                new_ids = c.token_ids[sent_tokens[idx] : visible]
                positions = (c.logprobs or [])[sent_tokens[idx] : visible]
                generated = c.token_ids[sent_tokens[idx] :]
                sent_chars[idx], sent_tokens[idx] = len(c.text), len(c.token_ids)
                content, calls, reasoning = delta_text, [], ""
                parser, reader = parsers[idx], readers[idx]
                if parser is not None:
                    td = parser.feed(delta_text)
                    content, calls = td.content, list(td.calls or [])
                    if c.finish_reason is not None:
                        tail = parser.flush()
                        content += tail.content
                        calls += tail.calls or []
                elif reader is not None:
                    hd = reader.feed(generated)
                    if c.finish_reason is not None:
                        hd.extend(reader.flush())
                    hd = self._harmony_out(hd, parse_tools)
                    content, calls = hd.content, hd.calls
                    reasoning = hd.reasoning if req.include_reasoning else ""
                first_call = stream_calls[idx]
                stream_calls[idx] += len(calls)
                finish = c.finish_reason
                if finish is not None:
                    done[idx] = True
                    if stream_calls[idx]:
                        finish = "tool_calls"
                lps = None
                if req.logprobs and new_ids:
                    lps = ChatLogprobs(content=self._logprobs(new_ids, positions, req.top_logprobs or 0))
                if not (content or calls or reasoning or lps or finish):
                    continue
                delta = DeltaMessage(
                    content=content or None, reasoning=reasoning or None, reasoning_content=reasoning or None
                )
                if calls:
                    delta.tool_calls = [
                        DeltaToolCall(
                            index=first_call + k,
                            id=call.id,
                            type="function",
                            function=DeltaFunctionCall(name=call.name, arguments=call.arguments),
                        )
                        for k, call in enumerate(calls)
                    ]
                yield chunk(
                    ChatStreamChoice(
                        index=idx, delta=delta, logprobs=lps, finish_reason=finish, stop_reason=c.stop_reason
                    )
                )
        else:
            if req.stream_options is not None and req.stream_options.include_usage:
                completion_tokens = sum(len(c.token_ids) for c in final.outputs) if final else 0
                usage = usage_info(prompt_tokens, completion_tokens, final.num_cached_tokens if final else 0)
                yield sse(
                    ChatCompletionChunk(id=request_id, created=created, model=model, choices=[], usage=usage)
                )
        yield SSE_DONE
