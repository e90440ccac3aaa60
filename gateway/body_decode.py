"""Request bodies as their wire types: JSON or MessagePack, integral floats where JSON Schema
counts them as integers, and large bodies decoded in worker processes.

msgspec decodes with the GIL held, so a thread would not free the event loop: a 64 MiB body of
token ids holds it for seconds. A body of `Limits.decode_worker_bytes` or more is decoded by a
worker process (gateway/body_worker.py) instead, which sends back the error the decode raised here
would have, or, for a valid body: a dense request as MessagePack with its token-id rows packed as
int32 bytes (one bytes object, nothing walked id by id on the loop), decoded here again as its
type; any other request as valid only, decoded here from its own body then (its structs' own
checks, such as a seed's wrap in __post_init__, do not survive a second decode of their output,
and a pickle of many small structs loads slower than the body decodes). So a body that fails
costs the loop nothing, a valid dense body its rows' bytes, another valid body its decode. A
worker that dies, or whose request is cancelled, is replaced.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import struct
import sys
from collections.abc import Hashable
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from gateway.errors import InvalidRequestError, RateLimitError
from gateway.schemas.logprobs import NextTokenLogprobsRequest

T = TypeVar("T")

# worker protocol: a job is (type name length, binary, max rows, body length), the type name, the
# body; an answer is (ok, length), then MessagePack: a dense request, or nil (another valid
# request), or [error class, message, param]
JOB_HEADER = struct.Struct("<I?IQ")
ANSWER_HEADER = struct.Struct("<?Q")
_WRITE_CHUNK = 2**20
_PROJECT_ROOT = str(Path(__file__).resolve().parent.parent)


def decode_body(body: bytes, binary: bool, body_type: type[T]) -> T:
    """A request body (MessagePack when `binary`, else JSON) as `body_type`; errors become 400s."""
    try:
        try:
            if binary:
                return msgspec.msgpack.decode(body, type=body_type)
            return msgspec.json.decode(body, type=body_type)
        except msgspec.ValidationError as exc:
            if len(body) > INTEGRAL_FLOAT_RETRY_BYTES or _GOT_FLOAT not in str(exc):
                raise
            return _decode_with_integral_floats(body, binary, body_type, exc)
    except UnicodeDecodeError as exc:
        # msgspec raises this (not a DecodeError) for a string that is not UTF-8, in either format
        raise InvalidRequestError(f"request body has a string that is not valid UTF-8: {exc}") from None
    except RecursionError:
        # msgspec recurses once per level of nesting, in fields the type ignores too
        raise InvalidRequestError("request body is nested too deeply") from None


_INT64 = range(-(2**63), 2**63)
# The integral-float retry decodes the body again untyped, which costs several times the typed
# decode in time and memory: only for the error it can fix, and only for bodies small enough that
# the retry stays short (a larger body keeps the typed decode's error).
INTEGRAL_FLOAT_RETRY_BYTES = 1 << 20
_GOT_FLOAT = ", got `float`"  # where an integer (or a union with one) belongs


def _integral_floats_to_ints(document: Any) -> bool:
    """Turn, in place, every finite float with no fractional part (within int64) into an int; True
    when there was one. Walks with a stack: documents nest as deep as the body does."""
    changed = False
    stack = [document]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            items: Any = node.items()
        elif isinstance(node, list):
            items = enumerate(node)
        else:
            continue
        for key, value in list(items):
            if isinstance(value, float) and value.is_integer() and int(value) in _INT64:
                node[key] = int(value)
                changed = True
            elif isinstance(value, (dict, list)):
                stack.append(value)
    return changed


def _decode_with_integral_floats(
    body: bytes, binary: bool, body_type: type[T], error: msgspec.ValidationError
) -> T:
    """JSON Schema, and so the OpenAPI document, counts 1.0 as an integer: a body the typed decode
    refused is decoded again with such floats as ints. With none, the typed decode's error stands."""
    try:
        document = msgspec.msgpack.decode(body) if binary else msgspec.json.decode(body)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        raise error from None
    if not _integral_floats_to_ints(document):
        raise error
    # An error now names a field that is wrong as read, not a 1.0 that the retry accepts.
    return msgspec.convert(document, type=body_type, strict=True)


# what a worker's error is raised as here: the same classes decode_body raises
_ERRORS: dict[str, type[Exception]] = {
    "ValidationError": msgspec.ValidationError,
    "DecodeError": msgspec.DecodeError,
    "InvalidRequestError": InvalidRequestError,
}


class _Worker:
    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    async def decode(self, body: bytes, binary: bool, body_type: type, max_rows: int) -> tuple[bool, bytes]:
        name = f"{body_type.__module__}:{body_type.__qualname__}".encode()
        stdin, stdout = self.process.stdin, self.process.stdout
        assert stdin is not None and stdout is not None
        stdin.write(JOB_HEADER.pack(len(name), binary, max_rows, len(body)) + name)
        view = memoryview(body)
        for start in range(0, len(body), _WRITE_CHUNK):  # the transport copies what the pipe does not take
            stdin.write(view[start : start + _WRITE_CHUNK])
            await stdin.drain()
        ok, size = ANSWER_HEADER.unpack(await stdout.readexactly(ANSWER_HEADER.size))
        return ok, await stdout.readexactly(size)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()


class BodyDecoder:
    """Decodes bodies of `worker_bytes` or more in up to `workers` worker processes (started when
    first needed, kept for the next body); up to `max_waiting` more wait their turn, and beyond
    that a body is a 429 (RateLimitError) at once. Smaller bodies inline, where that is quicker
    than a trip. A worker's peak memory is what decoding its body takes: for token ids, about five
    times the body.

    Workers are shared fairly between clients (API keys; None, every client without one, is not
    capped): a client may have at most half the waiting places, and a freed worker goes to the first waiting body of the
    clients with the fewest bodies decoding, not the client it just served where another waits, so
    one client sending body after body delays another's by one body at most."""

    def __init__(self, worker_bytes: int, workers: int = 1, max_waiting: int = 4) -> None:
        self.worker_bytes, self.max_waiting = worker_bytes, max_waiting
        self.loop: asyncio.AbstractEventLoop | None = None  # its workers' pipes are this loop's
        self._free: list[_Worker] = []
        self._slots = workers  # workers not decoding
        self._decoding: dict[Hashable, int] = {}  # bodies being decoded, per client
        self._waiting: list[tuple[Hashable, asyncio.Future[None]]] = []  # in arrival order

    def inline(self, body: bytes) -> bool:
        """Whether `body` is decoded here (decode_body), small enough not to need a worker."""
        return self.worker_bytes == 0 or len(body) < self.worker_bytes

    async def decode(
        self, body: bytes, binary: bool, body_type: type[T], *, client: Hashable = None, max_rows: int = 0
    ) -> T:
        """`body` as `body_type`; a dense request of more than `max_rows` inputs (0: any number) is
        refused before its rows are packed."""
        if self.inline(body):
            return decode_body(body, binary, body_type)
        self.loop = asyncio.get_running_loop()
        await self._turn(client)
        try:
            worker = self._free.pop() if self._free else await self._start()
            try:
                ok, answer = await worker.decode(body, binary, body_type, max_rows)
            except (asyncio.IncompleteReadError, ConnectionError):
                worker.kill()
                raise InvalidRequestError("the request body could not be decoded") from None
            except BaseException:  # cancelled mid-job: its answer would be read as the next one's
                worker.kill()
                raise
            self._free.append(worker)
        finally:
            self._done(client)
        if not ok:
            error, message, param = msgspec.msgpack.decode(answer)
            raise (
                InvalidRequestError(message, param=param)
                if error == "InvalidRequestError"
                else _ERRORS[error](message)
            )
        if body_type is NextTokenLogprobsRequest:
            return msgspec.msgpack.decode(answer, type=body_type)
        return decode_body(body, binary, body_type)  # valid: its one decode here

    async def _turn(self, client: Hashable) -> None:
        """Until a worker is `client`'s; a 429 at once where no place is left for it to wait."""
        if self._slots and not self._waiting:
            self._take(client)
            return
        own = sum(1 for waiting, _ in self._waiting if waiting == client) if client is not None else 0
        if len(self._waiting) >= self.max_waiting or own >= max(1, self.max_waiting // 2):
            raise RateLimitError(
                f"{len(self._waiting)} large request bodies are waiting to be decoded, {own} of them "
                "this client's; send it again shortly",
                retry_after=1,
            )
        entry = (client, asyncio.get_running_loop().create_future())
        self._waiting.append(entry)
        try:
            await entry[1]
        except BaseException:
            if entry in self._waiting:
                self._waiting.remove(entry)
            elif not entry[1].cancelled():  # given a worker as it was cancelled: pass it on
                self._done(client)
            raise

    def _take(self, client: Hashable) -> None:
        self._slots -= 1
        self._decoding[client] = self._decoding.get(client, 0) + 1

    def _done(self, client: Hashable) -> None:
        self._slots += 1
        self._decoding[client] -= 1
        if not self._decoding[client]:
            del self._decoding[client]
        if self._waiting:
            # the first waiting body of the clients with the fewest decoding, another's than the
            # client just served where there is one
            entry = min(self._waiting, key=lambda e: (self._decoding.get(e[0], 0), e[0] == client))
            self._waiting.remove(entry)
            self._take(entry[0])
            entry[1].set_result(None)

    async def _start(self) -> _Worker:
        path = os.pathsep.join(filter(None, [_PROJECT_ROOT, os.environ.get("PYTHONPATH")]))
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "gateway.body_worker",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": path},
            limit=2**20,
        )
        return _Worker(process)

    def kill_workers(self) -> None:
        """Ends the idle workers without waiting (their loop may be gone)."""
        workers, self._free = self._free, []
        for worker in workers:
            worker.kill()

    async def aclose(self) -> None:
        """Ends the idle workers (a busy one ends with its job's cancellation)."""
        workers, self._free = self._free, []
        for worker in workers:
            worker.kill()
            await worker.process.wait()
