"""uvicorn's HTTP protocol, with the gateway's error shape and two time limits per connection.

uvicorn itself answers a request whose HTTP it cannot parse (a bad request line or header, a broken
chunked body), before the app sees it: in plain text, where OpenAI's clients read every error as
JSON. This is the protocol uvicorn's `auto` picks (httptools when installed, else h11) with that
answer in the gateway's error shape; its own warning is still logged. Two limits uvicorn lacks:

- a request head (request line and headers) must arrive within `header_timeout_s` of the connection
  opening or of the previous response's end, else a 408 and the connection closes: a client that
  trickles header bytes, or sends none, holds no connection for long;
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


class GatewayHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc,valid-type]
    header_timeout_s: float = Limits().header_timeout_s
    write_stall_timeout_s: float = Limits().write_stall_timeout_s

    _head_timer: asyncio.TimerHandle | None = None
    _stall_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._head_timer, self._stall_timer):
            if timer is not None:
                timer.cancel()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():  # the next request's head starts now
            self._arm_head_timer()

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
        self._send_error_and_close(b"400 Bad Request", msg)

    def _send_error_and_close(self, status: bytes, message: str, code: str | None = None) -> None:
        body = error_body(message, "invalid_request_error", code=code)
        head = [b"HTTP/1.1 " + status + b"\r\n"]
        head.extend(name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers)
        head.append(b"content-type: application/json\r\n")
        head.append(b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body))
        # Written as bytes by both parsers' protocols: no request is in progress and the connection closes.
        self.transport.write(b"".join(head) + body)
        self.transport.close()


def protocol_with_limits(limits: Limits) -> type[GatewayHTTPProtocol]:
    """The protocol class uvicorn instantiates per connection, with the configured time limits."""
    return type(
        "GatewayHTTPProtocol",
        (GatewayHTTPProtocol,),
        {"header_timeout_s": limits.header_timeout_s, "write_stall_timeout_s": limits.write_stall_timeout_s},
    )
