"""uvicorn's HTTP protocol, with the gateway's error shape and two time limits per connection.

uvicorn itself answers a request whose HTTP it cannot parse (a bad request line or header, a broken
chunked body), before the app sees it: in plain text, where OpenAI's clients read every error as
JSON. This is the protocol uvicorn's `auto` picks (httptools when installed, else h11) with that
answer in the gateway's error shape; its own warning is still logged. Limits uvicorn lacks:

- a request head (request line and headers) must arrive within `header_timeout_s` of the connection
  opening or of the previous response's end, else a 408 and the connection closes: a client that
  trickles header bytes, or sends none, holds no connection for long;
- a request head of more than `max_head_bytes` gets a 431 as soon as that many bytes are in, and the
  connection closes (httptools has no bound of its own, and h11's answers in plain text); so do a
  chunked body's trailers and chunk framing beyond a head's worth of bytes (httptools gathers a
  trailer's value by concatenation, in time quadratic in its length; h11 caps trailers at 16 KiB);
- a request body must be complete within `body_timeout_s` of its head, else a 408 (when nothing
  was answered yet) and the connection closes: a client trickling a body, or stopping short of its
  Content-Length, holds neither the connection nor the bytes it sent for longer;
- the bytes of bodies not yet whole, all connections together, stay within
  `max_unfinished_body_bytes`: the connection whose bytes would pass it gets a 429 (Retry-After)
  and closes, so many half-sent bodies cannot hold the server's memory between them;
- a client that keeps more than the transport's high-water mark of an answer unread for
  `write_stall_timeout_s` is cut off: what the server had buffered for it is dropped, and the
  request's work is cancelled (gateway/guard.py sees the disconnect).
"""

from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.auto import AutoHTTPProtocol

from gateway.errors import error_body
from gateway.settings import Limits

log = logging.getLogger(__name__)


class UnfinishedBodyBytes:
    """Bytes of request bodies received and not yet whole, server-wide, against a budget."""

    def __init__(self, budget: int) -> None:
        self.budget, self.held = budget, 0

    def take(self, nbytes: int) -> bool:
        if self.held + nbytes > self.budget:
            return False
        self.held += nbytes
        return True

    def give_back(self, nbytes: int) -> None:
        self.held -= nbytes

    def refusal(self) -> str:
        return (
            f"the server is receiving {self.held} bytes of unfinished request bodies, its limit is "
            f"{self.budget}; send the request again shortly"
        )


class GatewayHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc,valid-type]
    header_timeout_s: float = Limits().header_timeout_s
    write_stall_timeout_s: float = Limits().write_stall_timeout_s
    max_head_bytes: int = Limits().max_head_bytes
    body_timeout_s: float = Limits().body_timeout_s
    # the server's bytes of unfinished bodies, one counter shared by its connections
    unfinished_body_bytes = UnfinishedBodyBytes(Limits().max_unfinished_body_bytes)

    _head_timer: asyncio.TimerHandle | None = None
    _stall_timer: asyncio.TimerHandle | None = None
    _body_timer: asyncio.TimerHandle | None = None
    _head_bytes = 0  # bytes received since the head being read began
    _body_bytes = 0  # bytes of the current request's unfinished body counted in the server's budget
    # Of those, the body's own bytes and its chunks (httptools' callbacks; h11 calls neither): the
    # rest is the head's first read, chunk framing and trailers.
    _payload_bytes = 0
    _chunks = 0
    chunk_framing_bytes = 32  # a chunk's size line and CRLFs, generously
    # After an error answer the connection is half-closed and what the client still sends is read
    # and dropped, for at most this long: closed with its bytes unread, the connection would be
    # reset and a client still sending its body could lose the answer.
    linger_s: float = 2.0
    _lingering = False
    _linger_timer: asyncio.TimerHandle | None = None
    _deferred_400: str | None = None  # malformed bytes after a request still being answered

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return  # answered already: the rest of the request is dropped
        awaiting = self._awaiting_head()
        super().data_received(data)
        if self.transport.is_closing():
            return
        if not self._awaiting_head():
            self._head_bytes = 0
            if not self.cycle.more_body:
                self._release_body_bytes()
                return
            if awaiting and self._body_timer is None:
                self._body_timer = self.loop.call_later(self.body_timeout_s, self._body_overdue, self.cycle)
            if not self.unfinished_body_bytes.take(len(data)):
                self._release_body_bytes()
                self._abandon_body(
                    b"429 Too Many Requests", self.unfinished_body_bytes.refusal(), "server_busy"
                )
                return
            self._body_bytes += len(data)
            if self._chunks and self._body_bytes - self._payload_bytes > self._framing_allowance():
                self._release_body_bytes()
                message = f"the chunked body's trailers and chunk framing are larger than {self.max_head_bytes} bytes"
                self._abandon_body(
                    b"431 Request Header Fields Too Large", message, "request_header_fields_too_large"
                )
            return
        self._release_body_bytes()
        self._head_bytes += len(data)
        if self._head_bytes > self.max_head_bytes:
            message = f"the request line and headers are larger than {self.max_head_bytes} bytes"
            self._send_error_and_close(
                b"431 Request Header Fields Too Large", message, code="request_header_fields_too_large"
            )

    def on_body(self, body: bytes) -> None:
        self._payload_bytes += len(body)
        super().on_body(body)

    def on_chunk_header(self) -> None:  # httptools calls it when the protocol has it
        self._chunks += 1

    def _framing_allowance(self) -> int:
        # The first read's head (at most max_head_bytes), then a head's worth of trailers.
        return 2 * self.max_head_bytes + self.chunk_framing_bytes * self._chunks

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._release_body_bytes()
        for timer in (self._head_timer, self._stall_timer, self._body_timer, self._linger_timer):
            if timer is not None:
                timer.cancel()
        super().connection_lost(exc)

    def eof_received(self) -> bool | None:
        if self._lingering:  # the client has sent all it will: the answer is out, close
            self.transport.close()
            return None
        return super().eof_received()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._deferred_400 is not None and not self._answering():
            self._send_error_and_close(b"400 Bad Request", self._deferred_400)
            return
        self._release_body_bytes()
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        if self.transport.is_closing():
            return
        if self.cycle.response_complete and self.cycle.more_body:
            # Answered before its body was whole (a 413, a 401): what the client still sends is the
            # rest of that body, not a next request's head, so it is dropped and the connection ends.
            self._linger()
            return
        self._arm_head_timer()  # the next request's head starts now

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall_timer is None:
            self._stall_timer = self.loop.call_later(self.write_stall_timeout_s, self._write_stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None

    def _arm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_overdue)

    def _awaiting_head(self) -> bool:
        # A request whose head is complete has a cycle until its response ends (both parsers).
        return self.cycle is None or self.cycle.response_complete

    def _head_overdue(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or not self._awaiting_head():
            return  # a request is being served: on_response_complete arms the next deadline
        message = f"the request head did not arrive within {self.header_timeout_s:g} s"
        self._send_error_and_close(b"408 Request Timeout", message, code="request_timeout")

    def _body_overdue(self, cycle: object) -> None:
        self._body_timer = None
        if self.transport.is_closing() or self.cycle is not cycle or not self.cycle.more_body:
            return  # that request's body came in whole
        message = f"the request body did not arrive within {self.body_timeout_s:g} s"
        self._abandon_body(b"408 Request Timeout", message, "request_timeout")

    def _abandon_body(self, status: bytes, message: str, code: str) -> None:
        """Answer `status` for a request whose body is still arriving, and close the connection."""
        if self.cycle.response_started:  # an answer is under way: no room for another
            self.transport.abort()
            return
        # The app's reads now end in a disconnect, and nothing it sends is written after this.
        self.cycle.disconnected = True
        self.cycle.message_event.set()
        self._send_error_and_close(status, message, code=code)

    def _release_body_bytes(self) -> None:
        if self._body_bytes:
            self.unfinished_body_bytes.give_back(self._body_bytes)
            self._body_bytes = 0
        self._payload_bytes = self._chunks = 0

    def _write_stalled(self) -> None:
        self._stall_timer = None
        if self.transport.is_closing():
            return
        log.warning(
            "closing a connection whose client read none of %d buffered bytes for %g s",
            self.transport.get_write_buffer_size(),
            self.write_stall_timeout_s,
        )
        self.transport.abort()  # drops the buffer now; close() would keep it until it is sent

    def send_400_response(self, msg: str) -> None:
        if self._answering():  # bytes pipelined after a whole request: its answer goes out first
            self._deferred_400 = self._deferred_400 or msg
            return
        self._send_error_and_close(b"400 Bad Request", msg)

    def _answering(self) -> bool:
        """A request read whole is still being answered, or waits in uvicorn's pipeline (httptools)."""
        return bool(getattr(self, "pipeline", None)) or (
            self.cycle is not None and not self.cycle.response_complete and not self.cycle.more_body
        )

    def _send_error_and_close(self, status: bytes, message: str, code: str | None = None) -> None:
        busy = status.startswith(b"429")
        body = error_body(message, "rate_limit_error" if busy else "invalid_request_error", code=code)
        head = [b"HTTP/1.1 " + status + b"\r\n"]
        head.extend(name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers)
        if busy:
            head.append(b"retry-after: 1\r\n")
        head.append(b"content-type: application/json\r\n")
        head.append(b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body))
        # Written as bytes by both parsers' protocols: no request is in progress and the connection closes.
        if self._lingering:
            return  # answered already
        self.transport.write(b"".join(head) + body)
        self._linger()

    def _linger(self) -> None:
        """Close once the answer is out: half-close now (the answer, then end of stream), drop what
        the client still sends, and close at its end of stream or after `linger_s`."""
        try:
            self.transport.write_eof()
        except (NotImplementedError, RuntimeError, OSError):
            self.transport.close()
            return
        self._lingering = True
        self._release_body_bytes()
        self._linger_timer = self.loop.call_later(self.linger_s, self.transport.close)


def protocol_with_limits(limits: Limits) -> type[GatewayHTTPProtocol]:
    """The protocol class uvicorn instantiates per connection, with the configured limits (and one
    budget of unfinished body bytes for all its connections)."""
    return type(
        "GatewayHTTPProtocol",
        (GatewayHTTPProtocol,),
        {
            "header_timeout_s": limits.header_timeout_s,
            "write_stall_timeout_s": limits.write_stall_timeout_s,
            "max_head_bytes": limits.max_head_bytes,
            "body_timeout_s": limits.body_timeout_s,
            "unfinished_body_bytes": UnfinishedBodyBytes(limits.max_unfinished_body_bytes),
        },
    )
