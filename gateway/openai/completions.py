"""POST /v1/completions: OpenAI's legacy completions, including echo + logprobs scoring."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from litestar import Request, Response, post

from backends.types import PromptLogprobs, SamplingParams, TokenStep
from backends.vocab import decode_text, token_display
from gateway.contract.operation import OPENAPI, SSE, Operation
from gateway.errors import InvalidRequestError
from gateway.generation import choices as gen
from gateway.generation import sampling
from gateway.models.served import ServedModel
from gateway.openai.serving import Admitted, admit
from gateway.prompts import token_inputs
from gateway.responses import json_response, new_id, now, sse_event, sse_response
from gateway.schemas.common import Usage
from gateway.schemas.completions import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from gateway.settings import Limits


@dataclass
class _Prompt:
    ids: list[int]
    text: str


def _prompts(
    served: ServedModel, prompt: str | list, limits: Limits, truncated: Callable[[list[int]], list[int]]
) -> list[_Prompt]:
    """Tokenizes, or decodes token ids to text, each prompt `truncated`: called off the event loop."""
    inputs = token_inputs(
        served, prompt, add_special_tokens=True, limits=limits, max_items=limits.max_prompts, param="prompt"
    )
    prompts = []
    for given in inputs:
        ids = truncated(given.ids)
        text = given.text if given.text is not None and len(ids) == len(given.ids) else None
        prompts.append(_Prompt(ids, text if text is not None else decode_text(served.token_bytes, ids)))
    return prompts


def _top_dict(
    served: ServedModel, ids: Sequence[int], values: Sequence[float], chosen: int, logprob: float
) -> dict:
    top = {}
    for token_id, value in zip(ids, values, strict=True):
        top.setdefault(token_display(served.token_bytes[int(token_id)]), float(value))
    top.setdefault(token_display(served.token_bytes[chosen]), logprob)  # as vLLM: the chosen token too
    return top


class _LogprobsBuilder:
    """Accumulates OpenAI's completion logprobs; text offsets run over prompt + completion text."""

    def __init__(self, served: ServedModel, offset: int) -> None:
        self.served = served
        self.offset = offset

    def empty(self) -> CompletionLogprobs:
        return CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])

    def _add(self, out: CompletionLogprobs, token_id: int, logprob: float | None, top: dict | None) -> None:
        token = token_display(self.served.token_bytes[token_id])
        out.tokens.append(token)
        out.token_logprobs.append(logprob)
        out.top_logprobs.append(top)
        out.text_offset.append(self.offset)
        self.offset += len(token)

    def prompt(self, ids: Sequence[int], scores: PromptLogprobs) -> CompletionLogprobs:
        out = self.empty()
        self._add(out, ids[0], None, None)
        for i, token_id in enumerate(ids[1:]):
            value = float(scores.token_logprobs[i])
            self._add(
                out,
                token_id,
                value,
                _top_dict(self.served, scores.top_ids[i], scores.top_logprobs[i], token_id, value),
            )
        return out

    def steps(self, steps: Sequence[TokenStep]) -> CompletionLogprobs:
        out = self.empty()
        for s in steps:
            self._add(
                out,
                s.token_id,
                s.logprob,
                _top_dict(self.served, s.top_ids, s.top_logprobs, s.token_id, s.logprob),
            )
        return out


def _join(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(
        tokens=a.tokens + b.tokens,
        token_logprobs=a.token_logprobs + b.token_logprobs,
        top_logprobs=a.top_logprobs + b.top_logprobs,
        text_offset=a.text_offset + b.text_offset,
    )


_SMALLER = "ask fewer logprobs, prompts, n or max_tokens, or ask /v1/next_token_logprobs for whole rows"


@post(
    "/v1/completions",
    status_code=200,
    summary="Create a completion",
    description="OpenAI's (legacy) completions. `prompt` is a string, a list of strings, a list of token ids, "
    "or a list of token-id lists. `echo` + `logprobs` + `max_tokens: 0` scores the prompt (the first token "
    "has no score). With `stream: true` the response is server-sent events of `CompletionResponse` chunks.",
    tags=["OpenAI"],
    opt={
        OPENAPI: Operation(
            request=CompletionRequest,
            content={"application/json": CompletionResponse, "text/event-stream": SSE},
            example={
                "model": "smollm2-135m",
                "prompt": "The capital of France is",
                "max_tokens": 8,
                "temperature": 0,
                "logprobs": 2,
            },
        )
    },
)
async def create_completion(request: Request) -> Response:
    admitted = await admit(request, CompletionRequest)
    body, served, limits = admitted.body, admitted.served, admitted.limits
    if body.suffix:
        raise InvalidRequestError("suffix is not supported", param="suffix")
    prompts = await admitted.prompts(lambda: _prompts(served, body.prompt, limits, admitted.truncated))
    max_tokens = 16 if body.max_tokens is None else body.max_tokens
    params = await admitted.sampling_params(
        [len(p.ids) for p in prompts],
        max_tokens,
        top_logprobs=body.logprobs or 0,
        top_logprobs_field="logprobs",
        logprobs=body.logprobs is not None,
    )
    if body.logprobs is not None:  # per position: its logprob, the top dict (the chosen token + logprobs)
        positions = sum((len(p.ids) if body.echo else 0) + max_tokens for p in prompts) * admitted.n
        sampling.check_logprob_entries(positions * (2 + params.top_logprobs), limits, _SMALLER, "logprobs")
    run = _Run(admitted, prompts, params)
    if body.stream:
        return sse_response(run.stream())
    return json_response(await run.complete())


class _Run:
    """One validated completion request: its prompts times n choices."""

    def __init__(
        self, admitted: Admitted[CompletionRequest], prompts: list[_Prompt], params: SamplingParams
    ) -> None:
        self.admitted, self.prompts, self.params = admitted, prompts, params
        self.served, self.adapter, self.body = admitted.served, admitted.adapter, admitted.body
        self.id, self.created = new_id("cmpl"), now()
        self.want_logprobs = self.body.logprobs is not None
        self.prompt_tokens = sum(len(p.ids) for p in prompts)

    def _choices(self) -> list[tuple[_Prompt, AsyncIterator[gen.Piece]]]:
        return [(p, stream) for p in self.prompts for stream in self.admitted.choices(p.ids, self.params)]

    async def _echo(self, prompt: _Prompt) -> tuple[str, CompletionLogprobs | None]:
        """The prompt's text and, with logprobs, its tokens scored (the first one has no score)."""
        if not self.want_logprobs:
            return prompt.text, None
        async with self.served.reading(self.adapter):
            scores = await self.served.require_engine().prompt_logprobs(
                prompt.ids, self.params.top_logprobs, self.adapter
            )
        return prompt.text, _LogprobsBuilder(self.served, 0).prompt(prompt.ids, scores)

    def _response(self, choices: list[CompletionChoice], usage: Usage | None) -> CompletionResponse:
        return CompletionResponse(
            id=self.id, created=self.created, model=self.body.model, choices=choices, usage=usage
        )

    async def complete(self) -> CompletionResponse:
        choices = self._choices()
        pieces = await asyncio.gather(*(gen.collect(stream) for _, stream in choices))
        echoes = {}
        if self.body.echo:
            echoes = dict(
                zip(
                    map(id, self.prompts),
                    await asyncio.gather(*(self._echo(p) for p in self.prompts)),
                    strict=True,
                )
            )
        out, completion_tokens = [], 0
        for index, ((prompt, _), piece) in enumerate(zip(choices, pieces, strict=True)):
            completion_tokens += len(piece.steps)
            text, logprobs = piece.text, None
            echo_text, echo_logprobs = echoes.get(id(prompt), ("", None))
            if self.want_logprobs:
                offset = len(echo_text) if self.body.echo else len(prompt.text)
                logprobs = _LogprobsBuilder(self.served, offset).steps(piece.steps)
                if echo_logprobs is not None:
                    logprobs = _join(echo_logprobs, logprobs)
            out.append(
                CompletionChoice(
                    index=index, text=echo_text + text, logprobs=logprobs, finish_reason=piece.finish_reason
                )
            )  # type: ignore[arg-type]
        usage = Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=self.prompt_tokens + completion_tokens,
        )
        self._count(completion_tokens)
        return self._response(out, usage)

    def _count(self, completion_tokens: int) -> None:
        metrics, labels = self.served.metrics, (self.served.name, self.adapter or "", "completions")
        metrics.prompt_tokens.labels(*labels).inc(self.prompt_tokens)
        metrics.generation_tokens.labels(*labels).inc(completion_tokens)

    async def stream(self) -> AsyncIterator[bytes]:
        choices = self._choices()
        builders = [_LogprobsBuilder(self.served, len(p.text)) for p, _ in choices]
        if self.body.echo:
            for index, (prompt, _) in enumerate(choices):
                text, logprobs = await self._echo(prompt)
                builders[index].offset = len(text)
                yield sse_event(
                    self._response(
                        [CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=None)],
                        None,
                    )
                )
        completion_tokens = 0
        async for index, piece in gen.merge([stream for _, stream in choices]):
            completion_tokens += len(piece.steps)
            if not (piece.text or piece.finish_reason or (self.want_logprobs and piece.steps)):
                continue
            logprobs = builders[index].steps(piece.steps) if self.want_logprobs else None
            choice = CompletionChoice(
                index=index, text=piece.text, logprobs=logprobs, finish_reason=piece.finish_reason
            )  # type: ignore[arg-type]
            yield sse_event(self._response([choice], None))
        self._count(completion_tokens)
        if self.admitted.include_usage:
            usage = Usage(
                prompt_tokens=self.prompt_tokens,
                completion_tokens=completion_tokens,
                total_tokens=self.prompt_tokens + completion_tokens,
            )
            yield sse_event(self._response([], usage))
