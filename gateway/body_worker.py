"""The worker process of gateway/body_decode.py: decodes request bodies, one at a time, off the
serving process's event loop. Reads jobs on stdin, answers on stdout; ends when stdin closes.

A dense request comes back as MessagePack, its token-id rows packed (PackedTokenIds: int32 bytes
and lengths) when they can be, so the serving process decodes one bytes object, not one int per
id; rows that cannot be (an empty row, an id beyond int32) come back as lists, for the route's own
errors. Another valid request comes back as valid only (the serving process decodes its body).
"""

from __future__ import annotations

import ctypes
import importlib
import sys
from typing import Any, BinaryIO

import msgspec
import numpy as np

from gateway.body_decode import ANSWER_HEADER, JOB_HEADER, decode_body
from gateway.errors import InvalidRequestError, too_many_inputs
from gateway.schemas.logprobs import NextTokenLogprobsRequest, PackedTokenIds

_INT32_MAX = 2**31 - 1


def packed_rows(value: Any) -> PackedTokenIds | None:
    """A dense `input` of token-id rows (or one row), packed; None when it is not one or cannot be."""
    if not isinstance(value, list) or not value:
        return None
    rows = [value] if all(isinstance(v, int) for v in value) else value
    if not all(isinstance(row, list) and row and all(isinstance(i, int) for i in row) for row in rows):
        return None
    try:
        flat = np.fromiter((i for row in rows for i in row), dtype=np.int64)
    except OverflowError:
        return None
    if flat.size and flat.max() > _INT32_MAX:
        return None
    return PackedTokenIds(ids=flat.astype("<i4").tobytes(), lengths=[len(row) for row in rows])


def input_count(value: Any) -> int:
    """How many inputs a dense `input` holds, as the route counts them (one string or one row of
    ids is one)."""
    if isinstance(value, list) and value and not all(isinstance(v, int) for v in value):
        return len(value)
    return 1


def answer(body: bytes, binary: bool, type_name: str, max_rows: int) -> tuple[bool, bytes]:
    """(True, a dense request as MessagePack, or nil for another valid request) or (False,
    MessagePack [error class name, message, param]). A dense request of more than `max_rows`
    inputs (0: no limit) is refused here, before its rows are packed."""
    module, _, qualname = type_name.partition(":")
    body_type = getattr(importlib.import_module(module), qualname)
    try:
        request = decode_body(body, binary, body_type)
        if isinstance(request, NextTokenLogprobsRequest) and max_rows:
            if not isinstance(request.input, PackedTokenIds) and input_count(request.input) > max_rows:
                raise too_many_inputs(max_rows, "input")
    except (msgspec.DecodeError, InvalidRequestError) as exc:  # ValidationError is a DecodeError
        return False, msgspec.msgpack.encode([type(exc).__name__, str(exc), getattr(exc, "param", None)])
    if not isinstance(request, NextTokenLogprobsRequest):
        return True, msgspec.msgpack.encode(None)
    packed = packed_rows(request.input)
    if packed is not None:
        request.input = packed
    return True, msgspec.msgpack.encode(request)


def _read(stream: BinaryIO, size: int) -> bytes:
    data = stream.read(size)
    if len(data) != size:
        raise EOFError
    return data


def main() -> None:
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while True:
        try:
            name_size, binary, max_rows, body_size = JOB_HEADER.unpack(_read(stdin, JOB_HEADER.size))
            type_name = _read(stdin, name_size).decode()
            body = _read(stdin, body_size)
        except EOFError:
            return  # the serving process is gone, or closed us
        ok, data = answer(body, binary, type_name, max_rows)
        del body
        stdout.write(ANSWER_HEADER.pack(ok, len(data)))
        stdout.write(data)
        stdout.flush()
        del data
        _release_memory()


def _release_memory() -> None:
    """Give the freed heap of the last decode back to the system (glibc keeps it otherwise)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


if __name__ == "__main__":
    main()
