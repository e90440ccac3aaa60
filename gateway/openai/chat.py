"""POST /v1/chat/completions: the model's chat template, then the shared generation."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
from litestar import Request, Response, post

from backends.types import TokenStep
from backends.vocab import token_display
from gateway.contract.operation import OPENAPI, SSE, Operation
from gateway.errors import InvalidRequestError
from gateway.generation import choices as gen
from gateway.generation import sampling
from gateway.models.served import ServedModel
from gateway.openai.serving import Admitted, admit
from gateway.openai.tool_reader import CallStarted, ContentDelta, Event
from gateway.openai.tools import ToolCalls, requested_calls, template_tool_calls, template_tools
from gateway.prompts import check_text_chars, tokenize
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
    FunctionCall,
    FunctionCallDelta,
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
        turn["tool_calls"] = template_tool_calls(message.tool_calls)
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
    tokenizer = served.require_engine().info.tokenizer
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


def token_logprobs(served: ServedModel, steps: Sequence[TokenStep]) -> list[TokenLogprob]:
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
    admitted = await admit(request, ChatCompletionRequest)
    run = await start_chat(admitted)
    served, body, usage, calls = run.served, run.body, run.usage, run.calls
    if body.stream:
        return sse_response(_stream(served, body, run.streams, usage, admitted.include_usage, calls))
    pieces = await asyncio.gather(*(gen.collect(s) for s in run.streams))
    choices = []
    for index, piece in enumerate(pieces):
        usage.add(piece.steps)
        logprobs = ChoiceLogprobs(content=token_logprobs(served, piece.steps)) if body.logprobs else None
        message, finish = finished_message(calls, piece.text, piece.finish_reason)
        choices.append(ChatChoice(index=index, message=message, logprobs=logprobs, finish_reason=finish))  # type: ignore[arg-type]
    return json_response(
        ChatCompletionResponse(
            id=new_id("chatcmpl"), created=now(), model=body.model, choices=choices, usage=usage.usage()
        )
    )


@dataclass(frozen=True)
class ChatRun:
    """A chat request started: its choices' text pieces as they come, the calls they may make
    (None: a text answer) and the usage they count."""

    served: ServedModel
    body: ChatCompletionRequest
    streams: list[AsyncIterator[gen.Piece]]
    usage: UsageCounter
    calls: ToolCalls | None


async def start_chat(admitted: Admitted[ChatCompletionRequest], endpoint: str = "chat") -> ChatRun:
    """The chat generation of an admitted request (/v1/chat/completions, and /v1/responses turned
    into one): its calls, its prompt templated, its SamplingParams checked, its choices started.
    Raises the gateway's errors naming the chat request's fields; nothing refuses after it returns.
    `endpoint` labels its token metrics."""
    body, served, limits = admitted.body, admitted.served, admitted.limits
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequestError("top_logprobs requires logprobs to be true", param="top_logprobs")
    calls = requested_calls(body, served)
    prompt_ids = await admitted.prompts(
        lambda: admitted.truncated(chat_prompt_ids(served, body.messages, limits, tools=template_tools(body)))
    )
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = await admitted.sampling_params(
        [len(prompt_ids)],
        requested,
        top_logprobs=body.top_logprobs or 0,
        top_logprobs_field="top_logprobs",
        logprobs=bool(body.logprobs),
        grammar=(calls.grammar, "tool_choice") if calls is not None else None,
    )
    if body.logprobs:  # per token: its logprob and its top_logprobs
        entries = admitted.n * params.max_tokens * (1 + params.top_logprobs)
        sampling.check_logprob_entries(
            entries, limits, "ask fewer top_logprobs, n or max_tokens", "top_logprobs"
        )
    streams = admitted.choices(prompt_ids, params, calls.shown_ids if calls is not None else ())
    # counted once admitted: nothing refuses after
    usage = UsageCounter(served, admitted.adapter, len(prompt_ids), endpoint)
    return ChatRun(served, body, streams, usage, calls)


def finished_message(
    calls: ToolCalls | None, text: str, finish_reason: str | None
) -> tuple[AssistantMessage, str | None]:
    """A finished choice's message and finish reason: its text, or the text before its calls
    (None where empty) and the calls, finish reason "tool_calls" when the last one ended."""
    if calls is None:
        return AssistantMessage(content=text), finish_reason
    reader = calls.reader()
    reader.feed(text)
    reader.finish()
    if not reader.calls:  # a forced call cut before its name: no text either
        return AssistantMessage(content=reader.content or (None if calls.forced else "")), finish_reason
    made = [
        ToolCall(id=new_id("call"), function=FunctionCall(name=call.name, arguments=call.arguments))
        for call in reader.calls
    ]
    finish = finish_reason if reader.truncated else "tool_calls"
    return AssistantMessage(content=reader.content or None, tool_calls=made), finish


class UsageCounter:
    def __init__(self, served: ServedModel, adapter: str | None, prompt_tokens: int, endpoint: str) -> None:
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        labels = (served.name, adapter or "", endpoint)
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
    usage: UsageCounter,
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

    readers = [calls.reader() if calls is not None else None for _ in streams]
    for index in range(len(streams)):
        # OpenAI's first delta: content "" for text; none where the answer may be calls
        first = ChatDelta(role="assistant") if calls is not None else ChatDelta(role="assistant", content="")
        yield chunk([ChatChunkChoice(index=index, delta=first)])
    async for index, piece in gen.merge(streams):
        usage.add(piece.steps)
        logprobs = ChoiceLogprobs(content=token_logprobs(served, piece.steps)) if body.logprobs else None
        reader = readers[index]
        if reader is None:
            deltas = [ChatDelta(content=piece.text)] if piece.text else []
        else:
            events = reader.feed(piece.text) + (reader.finish() if piece.finish_reason else [])
            deltas = [_delta(event) for event in events]
        if logprobs is not None and piece.steps and not deltas:
            deltas = [ChatDelta()]
        for number, delta in enumerate(deltas):
            entries = logprobs if number == 0 else None
            yield chunk([ChatChunkChoice(index=index, delta=delta, logprobs=entries)])
        if piece.finish_reason is not None:
            finish = piece.finish_reason
            if reader is not None and reader.calls and not reader.truncated:
                finish = "tool_calls"
            # alone, as OpenAI sends it: the SDK's stream helper closes the last call on this chunk
            yield chunk([ChatChunkChoice(index=index, delta=ChatDelta(), finish_reason=finish)])  # type: ignore[arg-type]
    if include_usage:
        yield chunk([], usage.usage())


def _delta(event: Event) -> ChatDelta:
    if isinstance(event, ContentDelta):
        return ChatDelta(content=event.text)
    if isinstance(event, CallStarted):
        call = ToolCallDelta(
            index=event.index,
            id=new_id("call"),
            type="function",
            function=FunctionCallDelta(name=event.name, arguments=""),
        )
    else:
        call = ToolCallDelta(index=event.index, function=FunctionCallDelta(arguments=event.text))
    return ChatDelta(tool_calls=[call])
