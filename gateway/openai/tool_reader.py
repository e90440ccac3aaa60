"""A choice's text read as it is generated into OpenAI's content and tool calls.

The grammar (gateway/openai/tool_formats.py) has already held the text to its format, so reading
it needs no JSON parser: content until the trigger, then each call's head (its name), then its
arguments, whose end is where their JSON value closes. The arguments come out compact (no
whitespace outside strings), as OpenAI's do, however the model's format spaces them. Text and
argument fragments come out as soon as they are known, which is what a stream sends; the whole
answer is the same events gathered.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from gateway.openai.tool_formats import ToolFormat

_JSON_WHITESPACE = " \t\n\r"
_CALL_HEAD = re.compile(r'\{"name":\s?"([A-Za-z0-9_-]{1,64})",\s?"(?:arguments|parameters)":\s?(?=\S)')


@dataclass
class CallStarted:
    index: int
    name: str


@dataclass
class ArgumentsDelta:
    index: int
    text: str


@dataclass
class ContentDelta:
    text: str


Event = CallStarted | ArgumentsDelta | ContentDelta


@dataclass
class ReadCall:
    name: str
    arguments: str = ""
    complete: bool = False


@dataclass
class _JsonValueEnd:
    """Where a JSON value that the grammar guarantees well formed ends, read a character at a time."""

    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    started: bool = False

    def ends_at(self, char: str) -> bool:
        """Whether `char` is the value's last character (scalars: whether it is past the value)."""
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif char == "\\":
                self.escaped = True
            elif char == '"':
                self.in_string = False
                return self.depth == 0
            return False
        if not self.started:
            self.started = True
            if char == '"':
                self.in_string = True
                return False
        if char in "{[":
            self.depth += 1
        elif char in "}]":
            self.depth -= 1
            return self.depth == 0
        elif char == '"':
            self.in_string = True
        return False


@dataclass
class CallReader:
    """Feed a choice's text in pieces; get the events each piece completes. `named`: the whole
    output is this function's arguments (a forced call on a model whose template shows none)."""

    fmt: ToolFormat | None
    named: str | None = None
    content: str = ""
    calls: list[ReadCall] = field(default_factory=list)
    _state: str = "text"  # "text", "calls" (between calls), "arguments"
    _buffer: str = ""
    _value: _JsonValueEnd = field(default_factory=_JsonValueEnd)
    _seen_text: bool = False
    _announced: bool = False

    def __post_init__(self) -> None:
        if self.named is not None:
            self.calls.append(ReadCall(self.named))
            self._state = "arguments"
        elif self.fmt is not None and not self.fmt.trigger:
            self._state = "calls"

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        events: list[Event] = []
        if self.named is not None and not self._announced:
            self._announced = True
            events.append(CallStarted(0, self.named))
        while self._buffer:
            before = (self._state, len(self._buffer))
            if self._state == "text":
                self._read_text(events)
            elif self._state == "calls":
                self._read_head(events)
            else:
                self._read_arguments(events)
            if (self._state, len(self._buffer)) == before:
                break  # waiting for more text
        return events

    def finish(self) -> list[Event]:
        """The events of the text held back at the end (content that looked like a trigger's start)."""
        if self._state == "text" and self._buffer:
            text, self._buffer = self._buffer, ""
            self.content += text
            return [ContentDelta(text)]
        return []

    @property
    def truncated(self) -> bool:
        """Whether the output ended inside a call (max_tokens, a stop string)."""
        return any(not call.complete for call in self.calls)

    def _read_text(self, events: list[Event]) -> None:
        fmt = self.fmt
        assert fmt is not None
        buffer = self._buffer
        if fmt.at_start_only:
            if not self._seen_text:
                if fmt.bare_start and buffer.startswith("{"):
                    self._state = "calls"
                    return
                if buffer.startswith(fmt.trigger):
                    self._buffer, self._state = buffer[len(fmt.trigger) :], "calls"
                    return
                if fmt.trigger.startswith(buffer):
                    return  # could still become the trigger
            self._emit_content(buffer, events)
            self._buffer = ""
            return
        found = buffer.find(fmt.trigger)
        if found >= 0:
            self._emit_content(buffer[:found], events)
            self._buffer, self._state = buffer[found + len(fmt.trigger) :], "calls"
            return
        keep = next(
            (
                n
                for n in range(min(len(fmt.trigger) - 1, len(buffer)), 0, -1)
                if fmt.trigger.startswith(buffer[-n:])
            ),
            0,
        )
        self._emit_content(buffer[: len(buffer) - keep], events)
        self._buffer = buffer[len(buffer) - keep :]

    def _emit_content(self, text: str, events: list[Event]) -> None:
        if text:
            self._seen_text = True
            self.content += text
            events.append(ContentDelta(text))

    def _read_head(self, events: list[Event]) -> None:
        head = _CALL_HEAD.search(self._buffer)
        if head is None:
            return
        self.calls.append(ReadCall(head.group(1)))
        events.append(CallStarted(len(self.calls) - 1, head.group(1)))
        self._buffer, self._state, self._value = self._buffer[head.end() :], "arguments", _JsonValueEnd()

    def _read_arguments(self, events: list[Event]) -> None:
        call, buffer, value = self.calls[-1], self._buffer, self._value
        kept: list[str] = []
        for i, char in enumerate(buffer):
            if value.started and value.depth == 0 and not value.in_string and char in ",}];\n":
                # a scalar's end is the first character past it
                self._close_call("".join(kept), buffer[i:], events)
                return
            if not value.in_string and char in _JSON_WHITESPACE:
                continue  # compact, as OpenAI's arguments are (the template's JSON is spaced)
            kept.append(char)
            if value.ends_at(char):
                self._close_call("".join(kept), buffer[i + 1 :], events)
                return
        text = "".join(kept)
        call.arguments += text
        if text:
            events.append(ArgumentsDelta(len(self.calls) - 1, text))
        self._buffer = ""

    def _close_call(self, arguments: str, rest: str, events: list[Event]) -> None:
        call = self.calls[-1]
        call.arguments += arguments
        call.complete = True
        if arguments:
            events.append(ArgumentsDelta(len(self.calls) - 1, arguments))
        self._buffer, self._state = rest, "calls"
