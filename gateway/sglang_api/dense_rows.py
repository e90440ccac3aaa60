"""SGLang's `/generate` asked for dense rows (`next_token_logprobs`): the one way to them through
a router that forwards only SGLang's and OpenAI's generation routes (SGLang's model gateway
answers 404 to `/v1/next_token_logprobs`). The prompts become the dense request's `input`, the
model (and `lora_path`) its model, and the answer is the one `/v1/next_token_logprobs` gives."""

from __future__ import annotations

from gateway.errors import InvalidRequestError
from gateway.schemas.logprobs import NextTokenLogprobsRequest
from gateway.schemas.sglang import GenerateRequest, SglangSamplingParams

# what /generate may carry beside dense rows: nothing that samples, streams or scores tokens
_NOTHING_SAMPLED = (None, SglangSamplingParams(), SglangSamplingParams(max_new_tokens=0))
_GENERATION_ONLY = ("return_logprob", "logprob_start_len", "top_logprobs_num", "token_ids_logprob", "stream")


def dense_request(body: GenerateRequest, model: str) -> NextTokenLogprobsRequest:
    """The dense request of a `/generate` body with `next_token_logprobs`, for `model` (a served
    model or `base:adapter`); InvalidRequestError where the body also asks for generation."""
    options = body.next_token_logprobs
    assert options is not None
    for field in _GENERATION_ONLY:
        if getattr(body, field) not in (None, False):
            raise InvalidRequestError(
                f"{field} is not taken with next_token_logprobs, which answers whole rows and generates nothing",
                param=field,
            )
    params = body.sampling_params if isinstance(body.sampling_params, list) else [body.sampling_params]
    if any(p not in _NOTHING_SAMPLED for p in params):
        raise InvalidRequestError(
            "with next_token_logprobs, sampling_params may only set max_new_tokens to 0: nothing is generated",
            param="sampling_params",
        )
    prompts = body.input_ids if body.input_ids is not None else body.text
    if prompts is None or (body.input_ids is not None and body.text is not None):
        raise InvalidRequestError(
            "next_token_logprobs needs input_ids or text (one of them)", param="input_ids"
        )
    return NextTokenLogprobsRequest(
        model=model,
        input=prompts,
        encoding_format=options.encoding_format,
        dtype=options.dtype,
        layout=options.layout,
        cache=options.cache,
    )
