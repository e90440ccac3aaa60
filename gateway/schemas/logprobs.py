"""POST /v1/next_token_logprobs and the vocabulary/tokenizer endpoints a remote client needs."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from gateway.schemas.chat import ChatMessage
from gateway.schemas.common import ModelName, TokenId
from logprob_gateway_client.encoding import Dtype

# The MessagePack matrix answers and the fields they share are defined once, in the client's
# schemas (the client decodes answers with them); the gateway's code imports them from here.
from logprob_gateway_client.schemas import (
    NextTokenLogprobsBinaryMatrixResponse,  # noqa: F401
    NextTokenLogprobsDocument,
    NextTokenLogprobsMatrixDocument,
    NextTokenLogprobsSharedMemoryResponse,  # noqa: F401
    NextTokenLogprobsUsage,  # noqa: F401
    SharedMemoryTarget,
)

# A token-id list, several of them, a string, or several strings (see the completions prompt).
Input = str | list[str | TokenId | list[TokenId]]


# A row's length: an int32 count, as the ids are (a larger one could not index them, nor be summed
# with the others in int64).
RowLength = Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)]


class PackedTokenIds(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Token-id rows packed: every row's ids one after another as little-endian int32 (raw bytes in
    MessagePack, base64 in JSON); row i is the next `lengths[i]` of them. What AsyncGatewayLM
    sends: the gateway reads and checks them in one pass of C, not one Python int per id."""

    ids: bytes
    lengths: list[RowLength]


class NextTokenLogprobsRequest(msgspec.Struct, kw_only=True):
    model: ModelName
    input: Input | PackedTokenIds
    encoding_format: Literal["float", "base64"] = "float"
    dtype: Dtype = "float32"
    add_special_tokens: bool = False
    # "rows": one object per input (OpenAI's embeddings shape); "matrix": one [inputs, vocab_size]
    # array, row-major (a single MessagePack `bin` that clients read without copying).
    layout: Literal["rows", "matrix"] = "rows"
    # With layout "matrix": write the matrix into this segment, when the gateway can open it, and
    # answer where it lies (NextTokenLogprobsSharedMemoryResponse); else the body carries it.
    shared_memory: SharedMemoryTarget | None = None
    # False: every row computed by the engine now, the output cache neither read nor written
    # (to measure the engine; the rows are the same numbers either way).
    cache: bool = True


class NextTokenLogprobsRow(msgspec.Struct, kw_only=True):
    object: Literal["next_token_logprobs"] = "next_token_logprobs"
    index: int
    # "float": JSON numbers (-inf as null); "base64": little-endian `dtype` bytes, base64-encoded
    logprobs: list[float | None] | str


class NextTokenLogprobsBinaryRow(msgspec.Struct, kw_only=True):
    object: Literal["next_token_logprobs"] = "next_token_logprobs"
    index: int
    logprobs: bytes  # MessagePack: raw little-endian `dtype` bytes


class NextTokenLogprobsResponse(NextTokenLogprobsDocument, kw_only=True):
    data: list[NextTokenLogprobsRow]


class NextTokenLogprobsBinaryResponse(NextTokenLogprobsDocument, kw_only=True):
    """The MessagePack form (`Accept: application/msgpack`): rows as raw bytes."""

    data: list[NextTokenLogprobsBinaryRow]


class NextTokenLogprobsMatrixResponse(NextTokenLogprobsMatrixDocument, kw_only=True):
    """`layout: matrix` as JSON: nested lists ("float", -inf as null), or the whole matrix's
    little-endian `dtype` bytes, base64-encoded ("base64")."""

    logprobs: list[list[float | None]] | str


class _VocabularyDocument(msgspec.Struct, kw_only=True):
    object: Literal["vocabulary"] = "vocabulary"
    model: str
    vocab_size: int  # logits width: entries past the tokenizer's own size are b""
    tokenizer_size: int
    eos_token_ids: list[int]
    bos_token_id: int | None
    special_token_ids: list[int]


class Vocabulary(_VocabularyDocument, kw_only=True):
    tokens: list[str]  # every token id's exact bytes, base64-encoded


class VocabularyBinary(_VocabularyDocument, kw_only=True):
    """The MessagePack form (`Accept: application/msgpack`): tokens as raw bytes."""

    tokens: list[bytes]


class TokenizerFiles(msgspec.Struct, kw_only=True):
    object: Literal["tokenizer"] = "tokenizer"
    model: str
    files: dict[str, str]  # file name -> text, as written by the tokenizer's save_pretrained


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: ModelName
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class TokenizeResponse(msgspec.Struct, kw_only=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: ModelName
    tokens: list[TokenId]


class DetokenizeResponse(msgspec.Struct, kw_only=True):
    prompt: str


class EnginePassStats(msgspec.Struct, kw_only=True):
    """An engine's own shared passes, where concurrent dense calls and generation steps meet."""

    passes: int
    submissions: int  # dense calls and generation steps served
    rows: int  # rows computed, identical rows of one pass once
    largest: int  # most submissions in one pass


class DenseStats(msgspec.Struct, kw_only=True, omit_defaults=True):
    model: str
    requests: int  # dense requests that asked the engine for rows (not all cached)
    rows: int  # rows they asked the engine for
    engine_rows: int  # distinct rows of the engine calls answered
    engine_calls: int  # a request over max_batch_rows distinct rows makes several
    largest_call: int  # most distinct rows in one engine call
    engine_passes: EnginePassStats | None = None  # absent: the engine reports none (vLLM, SGLang, mock)
