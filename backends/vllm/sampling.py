"""A stream's SamplingParams in vLLM's terms: every control of ours is one of vLLM's own."""

from __future__ import annotations

from vllm import SamplingParams as VllmSamplingParams
from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

from backends.grammar.constraint import ascii_digits
from backends.types import Grammar, SamplingParams


def generation_params(params: SamplingParams, eos_token_ids: frozenset[int]) -> VllmSamplingParams:
    """vLLM's parameters for a stream of token ids (no text: the gateway decodes), ended by the
    model's end-of-sequence tokens (unless `ignore_eos`) and the request's stop tokens."""
    request = VllmSamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        seed=params.seed,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        logit_bias=dict(params.logit_bias) or None,
        top_k=params.top_k,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
        min_tokens=params.min_tokens,
        ignore_eos=params.ignore_eos,
        allowed_token_ids=None if params.allowed_token_ids is None else list(params.allowed_token_ids),
        # vLLM adds the chosen token's own logprob; None computes none
        logprobs=params.top_logprobs if params.logprobs else None,
        stop_token_ids=sorted(params.ending_tokens(eos_token_ids)),
        detokenize=False,
        output_kind=RequestOutputKind.DELTA,
        structured_outputs=_structured(params.grammar),
    )
    # The words come as token sequences, tokenized as vLLM tokenizes its `bad_words`
    # (gateway/generation/sampling.py); given so, vLLM skips its own tokenizing.
    request._bad_words_token_ids = [list(word) for word in params.bad_words] or None
    return request


def _structured(grammar: Grammar | None) -> StructuredOutputsParams | None:
    """vLLM's spelling of a grammar (its `grammar` takes GBNF or Lark, as llguidance reads them)."""
    if grammar is None:
        return None
    if grammar.kind == "json_schema":
        return StructuredOutputsParams(json=grammar.source)
    if grammar.kind == "regex":
        return StructuredOutputsParams(regex=ascii_digits(grammar.source))
    return StructuredOutputsParams(grammar=grammar.source)
