"""The wire types both sides share: the dense request's `shared_memory` field and the MessagePack
`layout: matrix` answers as the client reads them. The gateway's request schema and OpenAPI
document use these definitions. Needs only msgspec.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

MATRIX_ANSWER = "next_token_logprobs.matrix"
SHARED_MEMORY_ANSWER = "next_token_logprobs.shared_memory"


class SharedMemoryTarget(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A memfd of a client on the gateway's host to write the matrix into (gateway/shared_memory.py):
    created by `memfd_create(name)`, sealed with F_SEAL_SHRINK, open as `fd` in process `pid`, its
    last 16 bytes the random `key` (hex) that proves the request is its owner's."""

    pid: Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)]
    fd: Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]
    # The lengths refuse what `$` lets through: a final newline.
    name: Annotated[str, msgspec.Meta(pattern="^logprob-gateway-[0-9a-f]{32}$", max_length=48)]
    key: Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{32}$", max_length=32)]
    offset: Annotated[int, msgspec.Meta(ge=0, le=2**62)] = 0


class DenseAnswer(msgspec.Struct):
    """A MessagePack `layout: matrix` answer, either form of it (the gateway's
    NextTokenLogprobsBinaryMatrixResponse or NextTokenLogprobsSharedMemoryResponse; fields the
    client does not read are skipped): the matrix in the body, or where in the client's shared
    memory the gateway wrote it."""

    vocab_size: int
    rows: int
    dtype: str
    object: str = MATRIX_ANSWER
    logprobs: memoryview | None = None  # a view into the body; None when in shared memory
    offset: int = 0
    nbytes: int = 0
