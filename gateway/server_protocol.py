"""uvicorn's HTTP protocol, answering a request it cannot parse with OpenAI's error object.

uvicorn itself answers a request whose HTTP it cannot parse (a bad request line or header, a broken
chunked body), before the app sees it: in plain text, where OpenAI's clients read every error as
JSON. This is the protocol uvicorn's `auto` picks (httptools when installed, else h11) with that one
answer in the gateway's error shape; its own warning is still logged.
"""

from __future__ import annotations

from uvicorn.protocols.http.auto import AutoHTTPProtocol

from gateway.errors import error_body


class GatewayHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc,valid-type]
    def send_400_response(self, msg: str) -> None:
        body = error_body(msg, "invalid_request_error")
        head = [b"HTTP/1.1 400 Bad Request\r\n"]
        head.extend(name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers)
        head.append(b"content-type: application/json\r\n")
        head.append(b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body))
        # Written as bytes by both parsers' protocols: the request is over and the connection closes.
        self.transport.write(b"".join(head) + body)
        self.transport.close()
