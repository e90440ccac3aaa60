"""The wire types both sides share, defined here once: the dense request's `shared_memory` field
and the MessagePack `layout: matrix` answers (with the usage and document fields they carry). The
gateway encodes its answers and writes its OpenAPI document with these classes (it imports them
through gateway.schemas.logprobs); the client decodes answers with them. Needs msgspec and numpy.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from logprob_gateway_client.encoding import Dtype

SHARED_MEMORY_ANSWER = "next_token_logprobs.shared_memory"


class SharedMemoryTarget(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A memfd of a client on the gateway's host to write the matrix into (gateway/dense/shared_memory.py):
    created by `memfd_create(name)`, sealed with F_SEAL_SHRINK, open as `fd` in process `pid`, its
    last 16 bytes the random `key` (hex) that proves the request is its owner's."""

    pid: Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)]
    fd: Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]
    # The lengths refuse what `$` lets through: a final newline.
    name: Annotated[str, msgspec.Meta(pattern="^logprob-gateway-[0-9a-f]{32}$", max_length=48)]
    key: Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{32}$", max_length=32)]
    offset: Annotated[int, msgspec.Meta(ge=0, le=2**62)] = 0


class NextTokenLogprobsUsage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    total_tokens: int
    cache_hits: int = 0


# The base classes carry no docstring: msgspec would give it to every answer's JSON Schema.
class NextTokenLogprobsDocument(msgspec.Struct, kw_only=True):
    object: Literal["list"] = "list"
    model: str
    vocab_size: int
    dtype: Dtype
    usage: NextTokenLogprobsUsage


class NextTokenLogprobsMatrixDocument(NextTokenLogprobsDocument, kw_only=True):
    object: Literal["next_token_logprobs.matrix"] = "next_token_logprobs.matrix"  # type: ignore[assignment]
    rows: int  # the matrix is [rows, vocab_size], in input order


class NextTokenLogprobsBinaryMatrixResponse(NextTokenLogprobsMatrixDocument, kw_only=True):
    """`layout: matrix` as MessagePack: the whole matrix as one `bin` of little-endian `dtype` bytes.
    It is the last field, so the body ends with the matrix."""

    # msgspec encodes a memoryview as `bin`, as it does bytes, and decodes into a view of the body.
    logprobs: memoryview


class NextTokenLogprobsSharedMemoryResponse(NextTokenLogprobsMatrixDocument, kw_only=True):
    """`shared_memory` honoured: the matrix's little-endian `dtype` bytes, row-major, were written
    into the client's segment, `nbytes` of them from `offset`, before this answer was sent."""

    object: Literal["next_token_logprobs.shared_memory"] = "next_token_logprobs.shared_memory"  # type: ignore[assignment]
    offset: int
    nbytes: int


# A MessagePack `layout: matrix` answer, either form of it.
DenseAnswer = NextTokenLogprobsBinaryMatrixResponse | NextTokenLogprobsSharedMemoryResponse
