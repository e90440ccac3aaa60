"""A streamed /v1/responses answer: the chat generation's text pieces (and the calls its reader
finds in them) as OpenAI's Responses events, each numbered by `sequence_number`.

Its output is the whole answer's (gateway/openai/responses.py): a text answer is one message item,
opened at once; where calls may be made, a message item opens with the first text and a
function_call item with each call. An item closes when the next opens or the generation ends; the
last is "incomplete" when the response is."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from gateway.errors import ErrorDetail
from gateway.openai.chat import ChatRun, token_logprobs
from gateway.openai.response_output import ResponseShape, ending, item_id, message_item
from gateway.openai.tool_reader import ArgumentsDelta, CallStarted, ContentDelta, Event
from gateway.responses import sse_event
from gateway.schemas.chat import TokenLogprob
from gateway.schemas.responses import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ContentPartEvent,
    ErrorEvent,
    FunctionCallItem,
    ItemStatus,
    LifecycleEvent,
    OutputItem,
    OutputItemEvent,
    OutputTextPart,
    TextDeltaEvent,
    TextDoneEvent,
)


class ResponseEvents:
    """The events of one streamed response, numbered in the order they are made."""

    def __init__(self, shape: ResponseShape) -> None:
        self.shape = shape
        self.sequence_number = -1
        self.items: list[OutputItem] = []  # closed ones
        self.message_id: str | None = None  # the open message item
        self.text = ""
        self.logprobs: list[TokenLogprob] = []
        self.call: FunctionCallItem | None = None  # the open function_call item

    def event(self, event_type: type, **fields: Any) -> bytes:
        self.sequence_number += 1
        body = event_type(sequence_number=self.sequence_number, **fields)
        return sse_event(body, body.type)

    def error(self, error: ErrorDetail) -> bytes:
        """OpenAI's `error` event, for a failure mid-stream (gateway/responses.py sends it)."""
        return self.event(ErrorEvent, code=error.code, message=error.message, param=error.param)

    @property
    def index(self) -> int:
        """The output index of the open item (or of the next one)."""
        return len(self.items)

    def open_message(self) -> list[bytes]:
        events = self.close("completed")
        self.message_id = item_id("msg")
        item = message_item(self.message_id, "", "in_progress")
        item.content = []
        part = OutputTextPart(text="")
        return [
            *events,
            self.event(
                OutputItemEvent, type="response.output_item.added", output_index=self.index, item=item
            ),
            self.event(
                ContentPartEvent,
                type="response.content_part.added",
                item_id=self.message_id,
                output_index=self.index,
                part=part,
            ),
        ]

    def text_delta(self, text: str, logprobs: list[TokenLogprob]) -> list[bytes]:
        events = [] if self.message_id is not None else self.open_message()
        self.text += text
        self.logprobs += logprobs
        if not text:  # tokens that made no text yet: their logprobs come with the done event
            return events
        fields = {"item_id": self.message_id, "output_index": self.index}
        return [*events, self.event(TextDeltaEvent, delta=text, logprobs=logprobs, **fields)]

    def read(self, event: Event) -> list[bytes]:
        """The events of what the call reader found in the text."""
        if isinstance(event, ContentDelta):
            return self.text_delta(event.text, [])
        if isinstance(event, CallStarted):
            events = self.close("completed")
            self.call = FunctionCallItem(
                id=item_id("fc"), call_id=item_id("call"), name=event.name, arguments="", status="in_progress"
            )
            added = self.event(
                OutputItemEvent, type="response.output_item.added", output_index=self.index, item=self.call
            )
            return [*events, added]
        assert isinstance(event, ArgumentsDelta) and self.call is not None
        self.call.arguments += event.text
        fields = {"item_id": self.call.id, "output_index": self.index}
        return [self.event(ArgumentsDeltaEvent, delta=event.text, **fields)]

    def close(self, status: ItemStatus) -> list[bytes]:
        """The open item's closing events; it joins the output with `status`."""
        events = []
        if self.message_id is not None:
            fields = {"item_id": self.message_id, "output_index": self.index}
            item = message_item(self.message_id, self.text, status, self.logprobs)
            events = [
                self.event(TextDoneEvent, text=self.text, logprobs=self.logprobs, **fields),
                self.event(
                    ContentPartEvent, type="response.content_part.done", part=item.content[0], **fields
                ),
                self.event(
                    OutputItemEvent, type="response.output_item.done", output_index=self.index, item=item
                ),
            ]
            self.items.append(item)
            self.message_id, self.text, self.logprobs = None, "", []
        elif self.call is not None:
            call, self.call = self.call, None
            call.status = status
            fields = {"item_id": call.id, "output_index": self.index}
            events = [
                self.event(ArgumentsDoneEvent, name=call.name, arguments=call.arguments, **fields),
                self.event(
                    OutputItemEvent, type="response.output_item.done", output_index=self.index, item=call
                ),
            ]
            self.items.append(call)
        return events


async def response_events(run: ChatRun, events: ResponseEvents) -> AsyncIterator[bytes]:
    """The whole stream of `run`'s one choice, from response.created to response.completed (or
    response.incomplete). Its failures are sent by gateway/responses.py as `events.error` makes them."""
    shape = events.shape
    yield events.event(LifecycleEvent, type="response.created", response=shape.response("in_progress", []))
    yield events.event(
        LifecycleEvent, type="response.in_progress", response=shape.response("in_progress", [])
    )
    reader = run.calls.reader() if run.calls is not None else None
    if reader is None:
        for event in events.open_message():
            yield event
    finish = None
    async for piece in run.streams[0]:
        run.usage.add(piece.steps)
        finish = piece.finish_reason
        if reader is None:
            logprobs = token_logprobs(run.served, piece.steps) if shape.logprobs else []
            made = events.text_delta(piece.text, logprobs)
        else:
            found = reader.feed(piece.text) + (reader.finish() if finish is not None else [])
            made = [event for item in found for event in events.read(item)]
        for event in made:
            yield event
    if reader is not None and reader.calls and not reader.truncated:
        finish = "tool_calls"  # the calls ended, whatever cut the generation after them
    status, incomplete = ending(finish)
    if run.calls is not None and not events.items and events.call is None and events.message_id is None:
        if not run.calls.forced:  # "auto" that made neither text nor a call: an empty message
            for event in events.open_message():
                yield event
    for event in events.close(status):
        yield event
    final = shape.response(status, events.items, run.usage.usage(), incomplete)
    kind = "response.completed" if status == "completed" else "response.incomplete"
    yield events.event(LifecycleEvent, type=kind, response=final)
