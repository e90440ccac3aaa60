"""Types shared by several endpoints."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
TokenId = Annotated[int, msgspec.Meta(ge=0)]
# Free text the gateway stores, echoes or compares (names, ids, versions, stop strings): bounded
# at decode, so none of it is carried around at the body's size (a 400 beyond)
Name = Annotated[str, msgspec.Meta(max_length=256)]
ModelName = Annotated[str, msgspec.Meta(max_length=512)]  # `base:adapter`
FilePath = Annotated[str, msgspec.Meta(max_length=4096)]
StopString = Annotated[str, msgspec.Meta(max_length=1024)]
Stop = StopString | list[StopString]
Seed = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]


def sampling_seed(seed: int | None) -> int | None:
    """Negative seeds as the unsigned 64-bit seed they wrap to (numpy's generators refuse
    negative seeds; choices after the first already wrap this way)."""
    return None if seed is None else seed % 2**64


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


# Fields of OpenAI's (and vLLM's) request bodies that ask for more than plain text, which the
# gateway does not give yet: typed to the values that ask for nothing more, so anything else is a
# 400 naming the field, never silently ignored (docs/api.md lists them).
_NOT_YET = "only what asks for plain text is accepted: the gateway does not constrain output yet"
_NO_TOOLS = "the gateway does not call functions"
NoneOnly = Annotated[None, msgspec.Meta(description=_NOT_YET)]


class PlainText(msgspec.Struct, kw_only=True):
    type: Literal["text"]


class OutputControls(msgspec.Struct, kw_only=True):
    response_format: Annotated[PlainText, msgspec.Meta(description=_NOT_YET)] | None = None
    tools: Annotated[list[dict[str, Any]], msgspec.Meta(max_length=0, description=_NO_TOOLS)] | None = None
    tool_choice: Annotated[Literal["none", "auto"], msgspec.Meta(description=_NO_TOOLS)] | None = None
    functions: Annotated[list[dict[str, Any]], msgspec.Meta(max_length=0, description=_NO_TOOLS)] | None = (
        None
    )
    function_call: Annotated[Literal["none", "auto"], msgspec.Meta(description=_NO_TOOLS)] | None = None
    modalities: list[Literal["text"]] | None = None
    audio: NoneOnly = None
    web_search_options: NoneOnly = None
    # vLLM's structured-output fields
    guided_json: NoneOnly = None
    guided_regex: NoneOnly = None
    guided_choice: NoneOnly = None
    guided_grammar: NoneOnly = None
    structured_outputs: NoneOnly = None


# What a refusal of each of those fields adds to msgspec's message.
NOT_SUPPORTED = {
    name: _NO_TOOLS if "tool" in name or "function" in name else _NOT_YET
    for name in OutputControls.__struct_fields__
}
