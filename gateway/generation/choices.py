"""Generation shared by /v1/completions, /v1/chat/completions and SGLang's /generate.

Runs one choice, its sampling checked (sampling.py), as a stream of text pieces: incremental
UTF-8 decoding from exact token bytes, stop strings (text after a stop string never leaves the
server; text that may still become one is held back), finish reasons.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Collection, Sequence
from dataclasses import dataclass, field

from backends.errors import GrammarError
from backends.types import SamplingParams, TokenStep
from backends.vocab import IncrementalText
from gateway.errors import InvalidRequestError
from gateway.models.served import ServedModel
from gateway.models.weights_lock import GenerationAborted


@dataclass
class Piece:
    """Text produced by some tokens of one choice; `finish_reason` ("stop", "length", "abort") is
    set on the last piece."""

    text: str
    steps: list[TokenStep] = field(default_factory=list)
    finish_reason: str | None = None


def check_stream_options(stream: bool | None, stream_options: object | None) -> None:
    """OpenAI's rule: `stream_options` only with `stream: true`."""
    if stream_options is not None and not stream:
        raise InvalidRequestError(
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.", param="stream_options"
        )


def _held_back(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest


async def run_choice(
    served: ServedModel,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    stops: Sequence[str],
    adapter: str | None = None,
    shown_ids: Collection[int] = (),
    trim_stop_tokens: bool = False,
    keep_stop_strings: bool = False,
) -> AsyncIterator[Piece]:
    """One choice's text pieces; the engine ends it at end-of-sequence or a stop token
    (`params.stop_token_ids`), kept in the steps, its text too unless it is a special token or
    `trim_stop_tokens`, which leaves out the text of whatever token ended the choice; special tokens in `shown_ids` keep their text (a
    tool call's opening token, which the call's reader looks for). A stop string ends the text
    before it (after it with `keep_stop_strings`), once `params.min_tokens` tokens are out. Paused
    generation holds it before its next engine step, or ends it there (finish reason "abort"):
    gateway/models/weights_lock.py."""
    engine = served.require_engine()
    async with served.reading(adapter):  # a choice is generated with one set of weights
        hidden = served.special_ids - frozenset(shown_ids) if shown_ids else served.special_ids
        ending = _Ending(stops, trim_stop_tokens, keep_stop_strings, params.min_tokens)
        pieces = _pieces(engine.generate(prompt_ids, params, adapter), served, ending, hidden)
        try:
            async for piece in pieces:
                yield piece
        except GrammarError as exc:  # the request's own grammar, past a limit at some token: a 400
            raise InvalidRequestError(f"the grammar failed while generating: {exc}", param=None) from None
        finally:
            await pieces.aclose()  # the engine frees the stream's state now, not when collected


@dataclass(frozen=True)
class _Ending:
    """What ends a choice's text, and what of it stays (run_choice)."""

    stops: Sequence[str]
    trim_stop_tokens: bool
    keep_stop_strings: bool
    min_tokens: int


async def _pieces(
    generator: AsyncIterator[TokenStep],
    served: ServedModel,
    ending: _Ending,
    hidden_ids: Collection[int],
) -> AsyncIterator[Piece]:
    text = IncrementalText(served.token_bytes, hidden_ids)
    pending = ""
    steps: list[TokenStep] = []
    generated = 0
    first_token = served.metrics.time_to_first_token.labels(served.name)
    between_tokens = served.metrics.inter_token_latency.labels(served.name)
    last = started = time.perf_counter()
    try:
        while True:
            try:
                await served.weights.step()  # held here while generation is paused
            except GenerationAborted:
                yield Piece(pending + text.flush(), steps, "abort")
                return
            try:
                step = await anext(generator)
            except StopAsyncIteration:
                break
            now = time.perf_counter()
            (between_tokens if last > started else first_token).observe(now - last)
            last = now
            steps.append(step)
            generated += 1
            finish = step.finish_reason
            if not (finish == "stop" and ending.trim_stop_tokens):
                pending += text.add(step.token_id)
            if finish is not None:
                pending += text.flush()
            # as vLLM, stop strings count only in the text after the minimum length
            stops = ending.stops if generated >= ending.min_tokens else ()
            cut, stop = min(((pending.find(s), s) for s in stops if s in pending), default=(-1, ""))
            if cut >= 0:
                yield Piece(pending[: cut + len(stop) if ending.keep_stop_strings else cut], steps, "stop")
                return
            if finish is not None:
                yield Piece(pending, steps, finish)
                return
            emit = len(pending) - _held_back(pending, stops)
            yield Piece(pending[:emit], steps)
            pending, steps = pending[emit:], []
    finally:
        await generator.aclose()
    yield Piece(pending, steps, "length")  # max_tokens == 0: the engine generated nothing


async def collect(pieces: AsyncIterator[Piece]) -> Piece:
    whole = Piece("")
    async for piece in pieces:
        whole.text += piece.text
        whole.steps.extend(piece.steps)
        whole.finish_reason = piece.finish_reason
    return whole


async def merge(streams: Sequence[AsyncIterator[Piece]]) -> AsyncIterator[tuple[int, Piece]]:
    """Interleave several choices' pieces as they come; cancels the rest if the consumer stops."""
    queue: asyncio.Queue[tuple[int, Piece | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[Piece]) -> None:
        try:
            async for piece in stream:
                await queue.put((index, piece))
            await queue.put((index, None))
        except Exception as exc:  # re-raised in the consumer
            await queue.put((index, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
