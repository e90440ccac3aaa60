"""POST /v1/chat/completions: the model's chat template, then the shared generation."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import msgspec
from litestar import Request, Response, post

from backends.types import TokenStep
from backends.vocab import token_display
from gateway.errors import InvalidRequestError
from gateway.generation import choices as gen
from gateway.generation import sampling
from gateway.generation.structured import requested_grammar
from gateway.openai.tools import ToolCalls, requested_calls, template_tools
from gateway.openapi.operation import OPENAPI, SSE, Operation
from gateway.prompts import check_text_chars, tokenize
from gateway.registry import ServedModel
from gateway.requests import decode_json, reserve_stream, resolve_model, settings
from gateway.responses import json_response, new_id, now, sse_event, sse_response
from gateway.schemas.chat import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessage,
    ChoiceLogprobs,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
    TopLogprob,
)
from gateway.schemas.common import Usage
from gateway.settings import Limits


def _content(message: ChatMessage) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    return "".join(part.text for part in message.content)


def _turn(message: ChatMessage) -> dict[str, Any]:
    turn: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role}
    turn["content"] = _content(message)
    if message.tool_calls:
        turn["tool_calls"] = msgspec.to_builtins(message.tool_calls)
    if message.tool_call_id is not None:
        turn["tool_call_id"] = message.tool_call_id
    return turn


def chat_prompt_ids(
    served: ServedModel,
    messages: list[ChatMessage],
    limits: Limits,
    *,
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """The conversation (and `tools`, for templates that show them) templated and tokenized;
    blocks as long as that takes: call it off the event loop. Its text counts as one text against
    `limits.max_text_chars`."""
    if not messages:
        raise InvalidRequestError("messages must not be empty", param="messages")
    tokenizer = served.require_engine().tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError(
            f"model {served.name!r} has no chat template; use /v1/completions", param="model"
        )
    conversation = [_turn(m) for m in messages]
    chars = sum(len(turn["content"]) for turn in conversation)
    chars += sum(len(call.function.arguments) for m in messages for call in m.tool_calls or ())
    check_text_chars(served, limits, chars + (len(msgspec.json.encode(tools)) if tools else 0), "messages")
    try:
        text = tokenizer.apply_chat_template(
            conversation, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
        )
    except Exception as exc:  # templates raise on conversations they do not support
        raise InvalidRequestError(
            f"the model's chat template rejected the messages: {exc}", param="messages"
        ) from None
    # The template already spells the special tokens; adding them again would duplicate BOS.
    return tokenize(served, text, add_special_tokens=False, param="messages")


def _token_logprobs(served: ServedModel, steps: Sequence[TokenStep]) -> list[TokenLogprob]:
    def entry(token_id: int) -> tuple[str, list[int]]:
        raw = served.token_bytes[token_id]
        return token_display(raw), list(raw)

    out = []
    for s in steps:
        token, raw = entry(s.token_id)
        top = []
        for token_id, value in zip(s.top_ids, s.top_logprobs, strict=True):
            alt, alt_raw = entry(int(token_id))
            top.append(TopLogprob(token=alt, logprob=float(value), bytes=alt_raw))
        out.append(TokenLogprob(token=token, logprob=s.logprob, bytes=raw, top_logprobs=top))
    return out


@post(
    "/v1/chat/completions",
    status_code=200,
    summary="Create a chat completion",
    description="OpenAI's chat completions through the model's chat template; with `stream: true`, "
    "server-sent events of `ChatCompletionChunk`.",
    tags=["OpenAI"],
    opt={
        OPENAPI: Operation(
            request=ChatCompletionRequest,
            content={"application/json": ChatCompletionResponse, "text/event-stream": SSE},
            example={
                "model": "smollm2-135m",
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 16,
            },
        )
    },
)
async def create_chat_completion(request: Request) -> Response:
    body = await decode_json(request, ChatCompletionRequest)
    gen.check_stream_options(body.stream, body.stream_options)
    limits = settings(request).limits
    served, adapter = resolve_model(request, body.model)
    served.require_engine()
    n = sampling.check_choices(body.n or 1, limits)
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequestError("top_logprobs requires logprobs to be true", param="top_logprobs")
    stops = sampling.check_stop(body.stop, limits)
    calls = requested_calls(body)
    prompt_ids = await asyncio.to_thread(
        lambda: chat_prompt_ids(served, body.messages, limits, tools=template_tools(body))
    )
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    wanted = (calls.grammar, "tool_choice") if calls is not None else requested_grammar(body)
    grammar = await sampling.checked_grammar(served, limits, *wanted)
    params = sampling.sampling_params(
        served,
        limits,
        max_tokens=sampling.check_context(served, len(prompt_ids), requested, limits),
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        top_logprobs=body.top_logprobs or 0,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        logit_bias=body.logit_bias,
        grammar=grammar,
    )
    if body.logprobs:  # per token: its logprob and its top_logprobs
        entries = n * params.max_tokens * (1 + params.top_logprobs)
        sampling.check_logprob_entries(
            entries, limits, "ask fewer top_logprobs, n or max_tokens", "top_logprobs"
        )
    streams = [
        gen.run_choice(served, prompt_ids, sampling.choice_params(params, j), stops, adapter)
        for j in range(n)
    ]
    usage = _UsageCounter(served, adapter, len(prompt_ids))
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        reserve_stream(request)
        return sse_response(_stream(served, body, streams, usage, include_usage, calls))
    pieces = await asyncio.gather(*(gen.collect(s) for s in streams))
    choices = []
    for index, piece in enumerate(pieces):
        usage.add(piece.steps)
        logprobs = ChoiceLogprobs(content=_token_logprobs(served, piece.steps)) if body.logprobs else None
        made = _made_calls(calls, piece.text, piece.finish_reason)
        message = (
            AssistantMessage(content=None, tool_calls=made) if made else AssistantMessage(content=piece.text)
        )
        finish = "tool_calls" if made else piece.finish_reason
        choices.append(ChatChoice(index=index, message=message, logprobs=logprobs, finish_reason=finish))  # type: ignore[arg-type]
    return json_response(
        ChatCompletionResponse(
            id=new_id("chatcmpl"), created=now(), model=body.model, choices=choices, usage=usage.usage()
        )
    )


def _made_calls(calls: ToolCalls | None, text: str, finish_reason: str | None) -> list[ToolCall] | None:
    """The calls of a finished choice held to a call's grammar; None where it is text (no call
    asked, or its JSON cut short by max_tokens or a stop string: then the text is the answer)."""
    if calls is None or finish_reason != "stop":
        return None
    try:
        return calls.calls(text)
    except ValueError:
        return None


class _UsageCounter:
    def __init__(self, served: ServedModel, adapter: str | None, prompt_tokens: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        labels = (served.name, adapter or "", "chat")
        served.metrics.prompt_tokens.labels(*labels).inc(prompt_tokens)
        self._generated = served.metrics.generation_tokens.labels(*labels)

    def add(self, steps: Sequence[TokenStep]) -> None:
        self.completion_tokens += len(steps)
        self._generated.inc(len(steps))

    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=self.prompt_tokens + self.completion_tokens,
        )


async def _stream(
    served: ServedModel,
    body: ChatCompletionRequest,
    streams: list[AsyncIterator[gen.Piece]],
    usage: _UsageCounter,
    include_usage: bool,
    calls: ToolCalls | None,
) -> AsyncIterator[bytes]:
    chunk_id, created = new_id("chatcmpl"), now()

    def chunk(choices: list[ChatChunkChoice], final_usage: Usage | None = None) -> bytes:
        return sse_event(
            ChatCompletionChunk(
                id=chunk_id, created=created, model=body.model, choices=choices, usage=final_usage
            )
        )

    held = [""] * len(streams)  # a call's JSON, sent as one delta of calls when it is whole
    for index in range(len(streams)):
        yield chunk([ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content=""))])
    async for index, piece in gen.merge(streams):
        usage.add(piece.steps)
        finish = piece.finish_reason
        delta = ChatDelta(content=piece.text) if piece.text else ChatDelta()
        if calls is not None:
            held[index] += piece.text
            delta = ChatDelta()
            if finish is not None:
                made = _made_calls(calls, held[index], finish)
                if made:
                    delta, finish = (
                        ChatDelta(tool_calls=[_call_delta(i, c) for i, c in enumerate(made)]),
                        "tool_calls",
                    )
                else:
                    delta = ChatDelta(content=held[index])
        if not (delta.content or delta.tool_calls or finish or (body.logprobs and piece.steps)):
            continue
        logprobs = ChoiceLogprobs(content=_token_logprobs(served, piece.steps)) if body.logprobs else None
        yield chunk([ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish)])  # type: ignore[arg-type]
    if include_usage:
        yield chunk([], usage.usage())


def _call_delta(index: int, call: ToolCall) -> ToolCallDelta:
    return ToolCallDelta(index=index, id=call.id, function=call.function)
