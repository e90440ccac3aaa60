"""The prologue /v1/completions and /v1/chat/completions share, as vLLM's `OpenAIServing`: the
body decoded, its model and adapter resolved, the fields both take checked, a stream's slot
reserved before any costly work, the SamplingParams built (gateway/generation/sampling.py) and the
choices started. Each route adds its own checks, makes its prompts and shapes its answer."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from litestar import Request

from backends.types import Grammar, SamplingParams
from gateway.errors import InvalidRequestError
from gateway.generation import choices as gen
from gateway.generation import sampling
from gateway.generation.structured import requested_grammar
from gateway.models.served import ServedModel
from gateway.openai import unhonoured
from gateway.requests import decode_json, reserve_stream, resolve_model, settings, with_lora_path
from gateway.schemas.common import GenerationRequest
from gateway.settings import Limits

Body = TypeVar("Body", bound=GenerationRequest)
Prompts = TypeVar("Prompts")


@dataclass(frozen=True)
class Admitted(Generic[Body]):
    """A request past the checks that need no prompt: its body, the model and adapter it names,
    the server's limits, its number of choices and its stop strings."""

    request: Request
    body: Body
    served: ServedModel
    adapter: str | None
    limits: Limits
    n: int
    stops: list[str]

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a chunk of the usage."""
        return self.body.stream_options is not None and self.body.stream_options.include_usage

    async def prompts(self, make: Callable[[], Prompts]) -> Prompts:
        """`make` (templating, tokenizing: blocking work) run off the event loop, once a stream
        holds its slot: a stream refused for want of one (429) costs nothing."""
        if self.body.stream:
            reserve_stream(self.request)
        return await asyncio.to_thread(make)

    async def sampling_params(
        self,
        prompt_lengths: Sequence[int],
        max_tokens: int | None,
        *,
        top_logprobs: int,
        top_logprobs_field: str,
        logprobs: bool,
        grammar: tuple[Grammar | None, str] | None = None,
    ) -> SamplingParams:
        """The request's SamplingParams, checked: each prompt (one at least) and `max_tokens` within
        the model's context (None: what it leaves after the longest prompt, within the limit), then
        the grammar compiled (`grammar`: the one the route asks and the field it names; None: the
        body's response_format or structured_outputs), then `top_logprobs` within the limit (errors
        name `top_logprobs_field`) and logit_bias. `logprobs`: the answer reports them."""
        allowed = [
            sampling.check_context(self.served, length, max_tokens, self.limits) for length in prompt_lengths
        ]
        body = self.body
        wanted = requested_grammar(body) if grammar is None else grammar
        checked_grammar = await sampling.checked_grammar(self.served, self.limits, *wanted)
        params = sampling.sampling_params(
            self.served,
            self.limits,
            max_tokens=min(allowed),
            temperature=body.temperature,
            top_p=body.top_p,
            seed=body.seed,
            top_logprobs=top_logprobs,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            logit_bias=body.logit_bias,
            grammar=checked_grammar,
            top_logprobs_field=top_logprobs_field,
            controls=sampling.ControlFields(
                top_k=body.top_k,
                min_p=body.min_p,
                repetition_penalty=body.repetition_penalty,
                min_tokens=body.min_tokens,
                ignore_eos=body.ignore_eos,
                stop_token_ids=body.stop_token_ids,
                bad_words=body.bad_words,
                allowed_token_ids=body.allowed_token_ids,
            ),
        )
        return sampling.delivered(params, logprobs=logprobs, streamed=bool(body.stream), stops=self.stops)

    def truncated(self, ids: list[int]) -> list[int]:
        """vLLM's `truncate_prompt_tokens`: the prompt's last k tokens (-1: the model's context)."""
        keep = self.body.truncate_prompt_tokens
        if keep is None:
            return ids
        if keep == 0:
            raise InvalidRequestError(
                "truncate_prompt_tokens must be -1 (the model's context) or at least 1",
                param="truncate_prompt_tokens",
            )
        return ids[-(self.served.require_engine().info.max_model_len if keep == -1 else keep) :]

    def choices(
        self, prompt_ids: Sequence[int], params: SamplingParams, shown_ids: Collection[int] = ()
    ) -> list[AsyncIterator[gen.Piece]]:
        """The request's n choices of one prompt, each with its own seed (gateway/generation/).
        As vLLM: a stop token's text is left out unless `include_stop_str_in_output`, which keeps
        a stop string's too; `skip_special_tokens: false` keeps every special token's text."""
        body = self.body
        if body.skip_special_tokens is False:
            shown_ids = self.served.special_ids
        keep_stops = bool(body.include_stop_str_in_output)
        return [
            gen.run_choice(
                self.served,
                prompt_ids,
                sampling.choice_params(params, index),
                self.stops,
                self.adapter,
                shown_ids=shown_ids,
                trim_stop_tokens=not keep_stops,
                keep_stop_strings=keep_stops,
            )
            for index in range(self.n)
        ]


async def admit(request: Request, body_type: type[Body]) -> Admitted[Body]:
    """The body decoded as `body_type`, then checked in this order: stream_options only with
    stream, the model and adapter it names (and an engine loaded), n and the stop strings within
    the limits. Raises the gateway's errors (gateway/errors.py)."""
    return admit_body(request, await decode_json(request, body_type))


def admit_body(request: Request, body: Body) -> Admitted[Body]:
    """`admit` of a body already decoded (/v1/responses builds a chat request of its own)."""
    gen.check_stream_options(body.stream, body.stream_options)
    limits = settings(request).limits
    served, adapter = with_lora_path(request, resolve_model(request, body.model), body.model, body.lora_path)
    served.require_engine()
    unhonoured.refuse_unhonoured(body)
    n = sampling.check_choices(body.n or 1, limits)
    stops = sampling.check_stop(body.stop, limits)
    return Admitted(request, body, served, adapter, limits, n, stops)
