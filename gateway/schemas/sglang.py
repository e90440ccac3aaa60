"""SGLang's native API (0.5.17): POST /generate and the info endpoints its clients read.

Field names, defaults and response keys are SGLang's (`srt/managers/io_struct.py`,
`srt/sampling/sampling_params.py`). Unknown top-level fields are ignored, as SGLang does; unknown
keys inside `sampling_params` are refused (SGLang fails them with a 500). `null` means "default"
everywhere. Fields SGLang accepts but this gateway cannot honour are checked in
gateway/sglang_api/items.py and refused with a 400 that says so.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from gateway.schemas.common import ModelName, Name, NonNegativeInt, Penalty, PositiveInt, Seed, Stop, TopP
from logprob_gateway_client.encoding import Dtype

Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=100.0)]
UnitInterval = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
RepetitionPenalty = Annotated[float, msgspec.Meta(gt=0.0, le=2.0)]


class SglangSamplingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    max_new_tokens: NonNegativeInt | None = None  # null: 128, or limits.max_tokens if lower
    min_new_tokens: NonNegativeInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: int | None = None
    min_p: UnitInterval | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    stop: Stop | None = None
    stop_token_ids: list[NonNegativeInt] | None = None
    stop_regex: str | list[str] | None = None
    ignore_eos: bool | None = None
    n: PositiveInt | None = None
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    logit_bias: dict[str, float] | None = None
    sampling_seed: Seed | None = None
    stream_interval: int | None = None
    custom_params: dict[str, Any] | None = None


class DenseRowsOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`/generate`'s way to dense rows, for clients behind a router that forwards SGLang's and
    OpenAI's generation routes only: each prompt's next-token log-probabilities over the whole
    vocabulary, answered as `/v1/next_token_logprobs` answers `input` (its options, same names)."""

    encoding_format: Literal["float", "base64"] = "float"
    dtype: Dtype = "float32"
    layout: Literal["rows", "matrix"] = "rows"
    # the answer as MessagePack: a router may not pass the client's Accept header on
    msgpack: bool = False
    cache: bool = True  # False: the output cache neither read nor written


class GenerateRequest(msgspec.Struct, kw_only=True):
    """`text` or `input_ids`: one prompt (a string, a token-id list) or a batch (a list of them)."""

    text: str | list[str] | None = None
    input_ids: list[Any] | None = None  # list[int] | list[list[int]]: checked in the route
    sampling_params: SglangSamplingParams | list[SglangSamplingParams] | None = None
    rid: Name | list[Name] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: NonNegativeInt | list[NonNegativeInt] | None = None
    token_ids_logprob: list[Any] | None = None
    return_text_in_logprobs: bool | None = None
    stream: bool | None = None
    lora_path: Name | list[Name | None] | None = None
    model: ModelName | None = None  # this gateway's: a served model or `base:adapter` (default: the first)
    image_data: Any = None
    # this gateway's: dense rows of the prompts instead of generation (no sampling, no stream)
    next_token_logprobs: DenseRowsOptions | None = None


# [logprob (null: none), token id, token text (null unless return_text_in_logprobs)]
Triple = tuple[float | None, int, str | None]


class FinishReason(msgspec.Struct, kw_only=True):
    type: Literal["stop", "length", "abort"]
    matched: int | str | msgspec.UnsetType = msgspec.UNSET  # a token id, or the stop string
    length: int | msgspec.UnsetType = msgspec.UNSET
    # an abort's (/pause_generation in abort mode): SGLang's FINISH_ABORT
    message: str | msgspec.UnsetType = msgspec.UNSET
    status_code: int | None | msgspec.UnsetType = msgspec.UNSET
    err_type: str | None | msgspec.UnsetType = msgspec.UNSET


# SGLang's FINISH_ABORT of a request that /pause_generation (abort mode) ended
ABORTED = FinishReason(type="abort", message="Aborted by /pause_generation", status_code=None, err_type=None)


class MetaInfo(msgspec.Struct, kw_only=True):
    id: str
    finish_reason: FinishReason | None
    prompt_tokens: int
    weight_version: str = "default"
    num_retractions: int = 0
    input_token_logprobs: list[Triple] | msgspec.UnsetType = msgspec.UNSET
    output_token_logprobs: list[Triple] | msgspec.UnsetType = msgspec.UNSET
    output_token_logprobs_length: int | msgspec.UnsetType = msgspec.UNSET
    input_top_logprobs: list[list[Triple] | None] | msgspec.UnsetType = msgspec.UNSET
    output_top_logprobs: list[list[Triple]] | msgspec.UnsetType = msgspec.UNSET
    input_token_ids_logprobs: list[list[Triple] | None] | msgspec.UnsetType = msgspec.UNSET
    output_token_ids_logprobs: list[list[Triple]] | msgspec.UnsetType = msgspec.UNSET
    reasoning_tokens: int = 0
    completion_tokens: int
    cached_tokens: int = 0
    e2e_latency: float | msgspec.UnsetType = msgspec.UNSET  # the final object only


class GenerateResponse(msgspec.Struct, kw_only=True):
    """One prompt's (and sample's) result; a batch or n > 1 answers a JSON array of them. In a
    batch stream each event carries `index`, its position in that array."""

    text: str
    output_ids: list[int]
    meta_info: MetaInfo
    index: int | msgspec.UnsetType = msgspec.UNSET


class ModelInfo(msgspec.Struct, kw_only=True):
    model_path: str
    tokenizer_path: str
    is_generation: bool = True
    preferred_sampling_params: None = None
    weight_version: str = "default"
    has_image_understanding: bool = False
    has_audio_understanding: bool = False
    model_type: str | None = None
    architectures: list[str] | None = None
    served_model_name: str


class ServerInfo(msgspec.Struct, kw_only=True):
    """The part of SGLang's /server_info that its clients read (tp_size, dp_size), and a little
    more; the rest of SGLang's ServerArgs has no meaning here."""

    model_path: str
    tokenizer_path: str
    served_model_name: str
    tp_size: int = 1
    dp_size: int = 1
    context_length: int
    max_req_input_len: int
    skip_tokenizer_init: bool = False
    weight_version: str = "default"
    incremental_streaming_output: bool = False
    status: Literal["ready", "loading"]
    startup_time: float
    version: str  # the SGLang version whose native API this gateway serves
    backend: str
