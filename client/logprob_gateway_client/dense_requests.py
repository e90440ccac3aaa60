"""How the gateway client's dense requests travel and where their answers land: the request body
for rows of packed ids, the async httpx client (on socket_transport.py's transport for plain-http
URLs, which reads each body off the socket into one buffer) or the sync one, the gateway's Unix
socket once an answer names it (local_socket.py), and the answer as one matrix, written by a
gateway on the same host into this process's shared memory (shared_memory.py) or decoded from
the body. A mixin of `logprob_gateway_client.AsyncGatewayLM`, which batches and caches the rows.

Behind a router that forwards SGLang's and OpenAI's generation routes only (SGLang's model
gateway answers 404 `unknown_url` to /v1/next_token_logprobs), the same rows are asked of
SGLang's `/generate` with `next_token_logprobs`, as JSON (the router reads it). Where the router's
answer names the replica it chose (SMG's `x-smg-routed-worker-id`), later calls go to that
replica's own dense route, as to one gateway: the router placed them (by the client's routing
key), and the rows no longer pass through it. A replica that cannot be reached, or answers 503
(loading, draining), sends the calls back through the router. docs/fleet.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import httpx
import numpy as np

from logprob_gateway_client.buffer_lru import BufferLRU
from logprob_gateway_client.encoding import ITEMSIZE, Dtype
from logprob_gateway_client.local_socket import HEADER as LOCAL_SOCKET_HEADER
from logprob_gateway_client.local_socket import LocalSocket, LocalSocketLost
from logprob_gateway_client.schemas import NextTokenLogprobsSharedMemoryResponse
from logprob_gateway_client.shared_memory import Segment, SharedSegments, memfd_supported
from logprob_gateway_client.socket_transport import SocketTransport, usable_for
from logprob_gateway_client.wire import (
    GatewayClientError,
    body_matrix,
    decode_dense_answer,
    encode_request,
    packed_rows,
    raise_for_error,
    read_into_buffer,
)

log = logging.getLogger(__name__)
DENSE_PATH = "/v1/next_token_logprobs"
ROUTED_PATH = "/generate"  # the same rows through a router that forwards generation routes only
PLACED_HEADER = "x-smg-routed-worker-id"  # the replica SGLang's model gateway sent a request to
CONNECT_TIMEOUT_S = 10.0  # a replica the router named but this host cannot reach fails this soon


def http_timeout(seconds: float) -> httpx.Timeout:
    """`seconds` for a call, at most CONNECT_TIMEOUT_S of it to connect."""
    return httpx.Timeout(seconds, connect=min(seconds, CONNECT_TIMEOUT_S))


def _router_refused(status: int, content: bytes | bytearray | memoryview) -> bool:
    """Whether an answer to DENSE_PATH is a router's "no such route" (SGLang's model gateway's
    404 `unknown_url`), not the gateway's."""
    return status == 404 and b'"unknown_url"' in bytes(content[:2048])


class RoutedElsewhere(Exception):
    """A router answered that it has no dense route: the call is asked again, routed."""


class DenseRequests:
    """Dense requests for rows of packed ids (`pack_ids`), each answered by one float32 (or the
    client's `dtype`) matrix. Uses the client's `base_url`, `dtype`, `vocab_size`,
    `max_rows_per_request`, `server_cache`, `_headers` and `_sync` (its httpx client);
    `_open_connections` sets up the rest."""

    base_url: str
    server_cache: bool
    dtype: Dtype
    vocab_size: int
    max_rows_per_request: int
    _headers: dict[str, str]
    _sync: httpx.Client

    def _open_connections(
        self,
        timeout: float,
        api_key: str | None,
        shared_memory: bool | None,
        local_socket: bool,
        cache: BufferLRU,
    ) -> None:
        """`shared_memory` and `local_socket` as AsyncGatewayLM takes them; `cache` holds the
        rows, and drops those of a segment that is reused."""
        self._timeout = timeout
        self._api_key = api_key
        self._async: httpx.AsyncClient | None = None
        self._async_loop: asyncio.AbstractEventLoop | None = None
        self._transport: SocketTransport | None = None  # the async client's, where it reads sockets
        # Until an answer needs httpx's own transport (then the transport stops reading sockets).
        self._socket_usable = usable_for(self.base_url)
        self.requests_sent = 0  # dense-row HTTP requests, for diagnostics
        self.server_timing: str | None = None  # the last dense answer's Server-Timing header
        if shared_memory and not memfd_supported():
            raise ValueError("shared_memory needs Linux's memfd_create")
        use = shared_memory is not False and memfd_supported()
        self._segments = SharedSegments(evict=cache.drop_owner) if use else None
        self._local_wanted = local_socket
        self._ask_directly()
        self._local: LocalSocket | None = None
        self.local_socket_answers = 0  # dense answers that came over the local socket
        self.shared_memory_answers = 0  # dense answers the gateway wrote into shared memory
        self.routed = False  # behind a router: rows asked of ROUTED_PATH, or of `replica_url`
        self.replica_url: str | None = None  # the replica the router placed this client's calls on

    def _chunks(self, rows: list[bytes]) -> list[list[bytes]]:
        step = self.max_rows_per_request
        return [rows[start : start + step] for start in range(0, len(rows), step)]

    def _answer_bytes(self, rows: int) -> int:
        return rows * self.vocab_size * ITEMSIZE[self.dtype]

    def _request(self, model: str, rows: list[bytes]) -> tuple[bytes, Segment | None]:
        """The request's body for rows of packed ids (`pack_ids`), and the segment it asks the
        gateway to write the answer into."""
        if self.routed and self.replica_url is None:  # JSON lists, which the router reads; no segment
            self.requests_sent += 1
            return self._routed_request(model, rows), None
        body: dict[str, Any] = {
            "model": model,
            "input": packed_rows(rows),
            "dtype": self.dtype,
            "layout": "matrix",
        }
        if not self.server_cache:
            body["cache"] = False
        segment = None
        if self._segments is not None and self._ask_shared_memory:
            segment = self._segments.lease(self._answer_bytes(len(rows)))
            if segment is not None:
                body["shared_memory"] = segment.target()
        self.requests_sent += 1
        return encode_request(body), segment

    def _routed_request(self, model: str, rows: list[bytes]) -> bytes:
        options = {"layout": "matrix", "dtype": self.dtype, "msgpack": True, "cache": self.server_cache}
        ids = [np.frombuffer(row, dtype="<i4").tolist() for row in rows]
        return json.dumps({"model": model, "input_ids": ids, "next_token_logprobs": options}).encode()

    def _post_args(self, body: bytes) -> dict[str, Any]:
        if self.replica_url is not None:
            return {"url": self.replica_url + DENSE_PATH, "content": body}
        if self.routed:
            return {"url": ROUTED_PATH, "content": body, "headers": {"Content-Type": "application/json"}}
        return {"url": DENSE_PATH, "content": body}

    def _route_through_router(self) -> None:
        log.info(
            "the server answers 404 unknown_url to %s: a router; asking %s instead", DENSE_PATH, ROUTED_PATH
        )
        self.routed = True
        self._ask_shared_memory = False
        self._use_local_socket = self._local_allowed = False

    def _ask_directly(self) -> None:
        """Talking to a gateway itself (not through a router): answers into this process's memory
        until the gateway answers in the body, and the gateway's Unix socket once an answer in
        this process's memory names it (local_socket.py)."""
        self._ask_shared_memory = self._segments is not None
        self._local_allowed = self._use_local_socket = self._local_wanted and self._segments is not None

    def _follow_placement(self, headers: httpx.Headers) -> None:
        """After a routed answer: the replica the router chose, asked directly from now on (its
        shared memory and local socket too, where it runs on this host)."""
        url = headers.get(PLACED_HEADER, "")
        if self.replica_url is None and url.startswith(("http://", "https://")):
            log.info("the router placed this client's calls on %s: asking it directly", url)
            self.replica_url = url.rstrip("/")
            self._ask_directly()

    def _placement_lost(self) -> None:
        """The replica the router placed the calls on is out of reach: back through the router,
        which knows where its replicas are."""
        log.info("replica %s is out of reach: asking through the router again", self.replica_url)
        self.replica_url = None
        self._route_through_router()

    def _matrix(
        self, content: bytes | bytearray | memoryview, count: int, segment: Segment | None
    ) -> np.ndarray:
        document = decode_dense_answer(content, count)
        if not isinstance(document, NextTokenLogprobsSharedMemoryResponse):
            if segment is not None and self._segments is not None:
                # The gateway cannot see this process's memory (another host): stop asking.
                self._ask_shared_memory = False
                self._segments.release(segment)
                self._segments.drop_idle()
            return body_matrix(document, count)
        if (
            segment is None
            or document.offset != 0
            or document.nbytes != self._answer_bytes(count)
            or document.dtype != self.dtype
        ):
            raise ValueError("a shared memory answer that does not match the request")
        self.shared_memory_answers += 1
        assert self._segments is not None
        return self._segments.matrix(segment, count, self.vocab_size, self.dtype)

    def _retire(self, segment: Segment | None) -> None:
        """A request that failed after it was sent: the gateway may still write into its segment,
        so no later answer may go there."""
        if segment is not None and self._segments is not None:
            self._segments.retire(segment)

    def _fetch_sync(self, model: str, rows: list[bytes]) -> np.ndarray:
        parts = []
        for chunk in self._chunks(rows):
            body, segment = self._request(model, chunk)
            try:
                try:
                    response = self._sync.post(**self._post_args(body))
                    lost = self.replica_url is not None and response.status_code == 503
                except httpx.TransportError:
                    if self.replica_url is None:
                        raise
                    lost = True
                if lost:  # the replica is gone, loading or draining: the router knows another
                    self._retire(segment)
                    self._placement_lost()
                    body, segment = self._request(model, chunk)
                    response = self._sync.post(**self._post_args(body))
                if not self.routed and _router_refused(response.status_code, response.content):
                    self._retire(segment)
                    self._route_through_router()
                    body, segment = self._request(model, chunk)
                    response = self._sync.post(**self._post_args(body))
                self.server_timing = response.headers.get("server-timing")
                raise_for_error(response)
                if self.routed:
                    self._follow_placement(response.headers)
                parts.append(self._matrix(response.content, len(chunk), segment))
            except BaseException:
                self._retire(segment)
                raise
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    async def _fetch(self, model: str, rows: list[bytes]) -> np.ndarray:
        parts = []
        for chunk in self._chunks(rows):
            body, segment = self._request(model, chunk)
            try:
                # The call goes again over HTTP (the local socket lost), then through the router
                # (its replica out of reach, or no dense route there).
                for attempt in range(3):
                    try:
                        content = await self._post_dense(body, segment is not None)
                        break
                    except (LocalSocketLost, RoutedElsewhere):
                        if attempt == 2:
                            raise
                        self._retire(segment)
                        body, segment = self._request(model, chunk)
                parts.append(self._matrix(content, len(chunk), segment))
            except BaseException:
                self._retire(segment)
                raise
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    async def _post_dense(self, body: bytes, shared: bool) -> bytes | bytearray | memoryview:
        """The body of a successful dense answer, in one buffer (the transport's own where it
        read the socket): over the gateway's local socket once it named one, for a request whose
        answer goes into shared memory (`shared`), else over HTTP."""
        if self._local is not None and shared:
            try:
                content, self.server_timing = await self._local.call(body)
            except LocalSocketLost:
                self._local.close()
                self._local = None
                self._use_local_socket = self._local_allowed  # connect again once an answer says where
                raise
            self.local_socket_answers += 1
            return content
        client = self._async_client()
        try:
            async with client.stream("POST", **self._post_args(body)) as response:
                self.server_timing = response.headers.get("server-timing")
                if response.status_code >= 400:
                    await response.aread()
                    if not self.routed and _router_refused(response.status_code, response.content):
                        self._route_through_router()
                        raise RoutedElsewhere
                    if self.replica_url is not None and response.status_code == 503:
                        self._placement_lost()  # loading or draining: the router knows another
                        raise RoutedElsewhere
                    raise_for_error(response)
                content = await read_into_buffer(response)
                path = response.headers.get(LOCAL_SOCKET_HEADER)
                if self.routed:
                    self._follow_placement(response.headers)
        except httpx.TransportError:
            if self.replica_url is None:
                raise
            self._placement_lost()
            raise RoutedElsewhere from None
        if path and self._use_local_socket:
            await self._open_local(path)
        return content

    async def _open_local(self, path: str) -> None:
        """Connect to the socket an answer named; one that cannot be reached or greeted is not
        tried again (a gateway in another container, say): HTTP serves every call."""
        self._use_local_socket = False
        local = LocalSocket(path, self._api_key, min(self._timeout, 10.0))
        try:
            await local.connect()
        except (OSError, TimeoutError, GatewayClientError) as exc:
            log.info("the gateway's local socket %s is out of reach (%s); staying on HTTP", path, exc)
            return
        self._local = local

    def _same_loop(self) -> None:
        """Connections belong to the event loop that opened them: a new loop starts afresh."""
        loop = asyncio.get_running_loop()
        if self._async_loop is not loop:
            self._drop_async()
            self._async_loop = loop

    def _drop_async(self) -> None:
        """Forgets the async client, closing the sockets its transport pooled (which needs no
        event loop); httpx's own connections go with the client."""
        if self._transport is not None:
            self._socket_usable = self._transport.reads_sockets
            self._transport.close_sockets()
        self._transport = None
        self._async = None

    def _async_client(self) -> httpx.AsyncClient:
        self._same_loop()
        if self._async is None:
            self._transport = SocketTransport() if self._socket_usable else None
            self._async = httpx.AsyncClient(
                base_url=self.base_url,
                headers=self._headers,
                timeout=http_timeout(self._timeout),
                transport=self._transport,
            )
        return self._async

    async def _close_async(self) -> None:
        if self._async is not None:
            await self._async.aclose()  # its transport too: pooled sockets, httpx's connections
        self._drop_async()

    def _close_connections(self) -> None:
        """Everything but the sync client, which the client closes."""
        if self._transport is not None:
            self._transport.close_sockets()
        if self._local is not None:
            self._local.close()
        if self._segments is not None:
            self._segments.close()
