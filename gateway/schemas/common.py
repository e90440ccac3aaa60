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


# Fields of OpenAI's (and vLLM's) request bodies that ask for what the gateway does not give:
# typed to the values that ask for nothing more, so anything else is a 400 naming the field, never
# silently ignored (docs/api.md lists them).
_NO_TOOLS = 'function calls are made on /v1/chat/completions, with tool_choice "required" or a named function'
_DEPRECATED = "vLLM's deprecated field: use response_format or structured_outputs"
_NO_MEDIA = "the gateway answers text only"


class TextFormat(msgspec.Struct, kw_only=True, tag_field="type", tag="text"):
    """Plain text (the default)."""


class JsonObjectFormat(msgspec.Struct, kw_only=True, tag_field="type", tag="json_object"):
    """Any JSON object."""


class JsonSchemaSpec(msgspec.Struct, kw_only=True):
    name: Annotated[str, msgspec.Meta(max_length=64, pattern="^[A-Za-z0-9_-]+(?!\\n)$")]
    description: str | None = None
    # The output validates against it; keywords the grammar engine cannot enforce are refused
    # (a 400), whatever `strict` says.
    schema: dict[str, Any]
    strict: bool | None = None


class JsonSchemaFormat(msgspec.Struct, kw_only=True, tag_field="type", tag="json_schema"):
    """JSON that validates against `json_schema.schema`."""

    json_schema: JsonSchemaSpec


ResponseFormat = TextFormat | JsonObjectFormat | JsonSchemaFormat


class StructuredOutputs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's `structured_outputs` (one of its constraints): a JSON schema, a regular expression
    the whole output matches, one of some strings, an EBNF (GBNF) or Lark grammar, any JSON object."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: Annotated[list[str], msgspec.Meta(min_length=1)] | None = None
    grammar: str | None = None
    json_object: bool | None = None


NoneOnly = Annotated[None, msgspec.Meta(description=_DEPRECATED)]


class OutputControls(msgspec.Struct, kw_only=True):
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's
    tools: Annotated[list[dict[str, Any]], msgspec.Meta(max_length=0, description=_NO_TOOLS)] | None = None
    tool_choice: Annotated[Literal["none", "auto"], msgspec.Meta(description=_NO_TOOLS)] | None = None
    functions: Annotated[list[dict[str, Any]], msgspec.Meta(max_length=0, description=_NO_TOOLS)] | None = (
        None
    )
    function_call: Annotated[Literal["none", "auto"], msgspec.Meta(description=_NO_TOOLS)] | None = None
    modalities: list[Literal["text"]] | None = None
    audio: Annotated[None, msgspec.Meta(description=_NO_MEDIA)] = None
    web_search_options: Annotated[None, msgspec.Meta(description="the gateway does not search the web")] = (
        None
    )
    # vLLM's structured-output fields before `structured_outputs`
    guided_json: NoneOnly = None
    guided_regex: NoneOnly = None
    guided_choice: NoneOnly = None
    guided_grammar: NoneOnly = None


class GenerationRequest(OutputControls, kw_only=True):
    """The fields /v1/completions and /v1/chat/completions share: the model (`base:adapter`), the
    sampling, the stream. Each adds its prompt, its token budget and its logprobs fields; a
    negative seed arrives wrapped to its unsigned 64-bit value."""

    model: ModelName
    temperature: Temperature | None = 1.0
    top_p: TopP | None = 1.0
    n: PositiveInt | None = 1
    stop: Stop | None = None
    seed: Seed | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty | None = 0.0
    frequency_penalty: Penalty | None = 0.0
    logit_bias: dict[str, float] | None = None
    user: Name | None = None
    # SGLang's: the adapter, as `model="base:adapter"` names it. Routers that route by base model
    # name only (SGLang's model gateway) forward this field unchanged.
    lora_path: Name | None = None
    # vLLM's sampling fields beyond OpenAI's (gateway/generation/sampling.py: ControlFields)
    top_k: Annotated[int, msgspec.Meta(ge=-1)] | None = None
    min_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0.0)] | None = None
    min_tokens: NonNegativeInt | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[TokenId] | None = None
    bad_words: list[Annotated[str, msgspec.Meta(min_length=1, max_length=1024, pattern=r"\S")]] | None = None
    allowed_token_ids: Annotated[list[TokenId], msgspec.Meta(min_length=1)] | None = None
    truncate_prompt_tokens: Annotated[int, msgspec.Meta(ge=-1)] | None = None
    # refused (a 400 naming the field) unless it holds a value that changes nothing
    # (gateway/openai/unhonoured.py); never ignored.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    use_beam_search: bool | None = None
    best_of: int | None = None
    length_penalty: float | None = None

    def __post_init__(self) -> None:
        self.seed = sampling_seed(self.seed)


# What a refusal of each of those fields adds to msgspec's message.
NOT_SUPPORTED = {
    "tools": _NO_TOOLS,
    "tool_choice": _NO_TOOLS,
    "functions": _NO_TOOLS,
    "function_call": _NO_TOOLS,
    "modalities": _NO_MEDIA,
    "audio": _NO_MEDIA,
    "web_search_options": "the gateway does not search the web",
    **{name: _DEPRECATED for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")},
}
