"""One forward pass for whatever concurrent requests need next: continuous batching.

Every dense-row call and every generation step of an engine is a submission: a list of items
(for the transformers engine a token-id prefix, its adapter and what the caller needs of its
row; for MLX a stream's state and its next token) whose next-token rows it needs, answered with
one result (rows, or a token chosen from them). Submissions queue while the
engine computes; each pass takes everything queued, so a stream that starts joins the running
batch at its next step, and one that stops (its caller gone, its future cancelled) is dropped
before the pass. The engine makes a pass cheap for rows that extend earlier ones (prefix K/V
reuse), which is what a generation step is: its prompt and the tokens so far.

The callers of a pass come back one after another, each having sampled its token on the event
loop first; a pass that started with the first of them would leave the rest to the next one. So
after a pass of several callers the next one waits for as many to come back, at most a quarter
of a pass's time (`max_wait_s` at most).

A caller that needs no turn of its own between steps (a stream whose tokens are handed out in
bursts) `run`s them: the scheduler calls it back after each pass and queues its next step itself,
so the pass after starts without waiting for the caller to come back.

When a pass fails, its submissions are retried one by one, so only the one that causes the failure
gets the error.

This is the one batching layer of the engines that use it: the gateway hands each request's rows
to the engine as they come (at most the model's `max_batch_rows` distinct rows a call), and
concurrent requests meet here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np

from backends.types import PassStats

log = logging.getLogger(__name__)

Item = TypeVar("Item")
Result = TypeVar("Result")


def split_rows(logprobs: np.ndarray, groups: Sequence[Sequence[object]]) -> list[np.ndarray]:
    """The rows of `logprobs` of all groups' items, in order, as one view per group."""
    ends = np.cumsum([len(group) for group in groups])
    return [logprobs] if len(groups) == 1 else np.split(logprobs, ends[:-1])


@dataclass
class _Submission(Generic[Item, Result]):
    items: Sequence[Item]
    future: asyncio.Future[Result]
    # `run`'s callback: the items of the caller's next step, or None when it is done
    proceed: Callable[[Result], Sequence[Item] | None] | None = None


class StepScheduler(Generic[Item, Result]):
    def __init__(
        self,
        run_pass: Callable[[list[Sequence[Item]]], Awaitable[Sequence[Result]]],
        *,
        max_rows: int = 1024,
        max_wait_s: float = 0.05,
        stats: PassStats | None = None,
    ) -> None:
        # one pass over every submission's items: a result per submission, in order
        self._run_pass = run_pass
        self.max_rows = max_rows  # items per pass, beyond one submission's own
        self.max_wait_s = max_wait_s
        self._queue: asyncio.Queue[_Submission[Item, Result]] = asyncio.Queue()
        self._worker: asyncio.Task[None] | None = None
        self._last_callers = 0  # submissions served by the last pass
        self._last_pass_s = 0.0
        # passes, submissions and the largest pass counted here; rows by `run_pass`, which knows them
        self.stats = stats if stats is not None else PassStats()

    async def submit(self, items: Sequence[Item]) -> Result:
        """The items' result, computed in a pass shared with whatever else is waiting."""
        return await self._enqueue(items, None)

    async def run(self, items: Sequence[Item], proceed: Callable[[Result], Sequence[Item] | None]) -> None:
        """Steps of one caller, one per pass, with no turn of the caller's own between them:
        after each pass the scheduler calls `proceed` with the step's result, and the items it
        returns join the next pass; returns once `proceed` returns None."""
        await self._enqueue(items, proceed)

    async def _enqueue(
        self, items: Sequence[Item], proceed: Callable[[Result], Sequence[Item] | None] | None
    ) -> Any:
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._run(), name="step-scheduler")
        submission: _Submission[Item, Result] = _Submission(
            items, asyncio.get_running_loop().create_future(), proceed
        )
        self._queue.put_nowait(submission)  # unbounded
        return await submission.future

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._gather(loop)
            batch = [s for s in batch if not s.future.done()]  # callers that have gone
            if batch:
                started = loop.time()
                await self._serve(batch)
                self._last_callers, self._last_pass_s = len(batch), loop.time() - started

    async def _gather(self, loop: asyncio.AbstractEventLoop) -> list[_Submission[Item, Result]]:
        batch = [await self._queue.get()]
        count = len(batch[0].items)
        deadline = loop.time() + min(self.max_wait_s, self._last_pass_s / 4)
        while count < self.max_rows:
            try:
                submission = self._queue.get_nowait()
            except asyncio.QueueEmpty:
                remaining = deadline - loop.time()
                if len(batch) >= self._last_callers or remaining <= 0:
                    break
                try:
                    submission = await asyncio.wait_for(self._queue.get(), remaining)
                except TimeoutError:
                    break
            batch.append(submission)
            count += len(submission.items)
        return batch

    async def _serve(self, batch: list[_Submission[Item, Result]]) -> None:
        try:
            results = await self._run_pass([s.items for s in batch])
        except Exception as exc:
            if len(batch) > 1:
                log.warning(
                    "a pass of %d submissions failed (%s: %s); retrying them one by one",
                    len(batch),
                    type(exc).__name__,
                    exc,
                )
                for submission in batch:
                    if not submission.future.done():
                        await self._serve([submission])
                return
            if not batch[0].future.done():
                batch[0].future.set_exception(exc)
            return
        stats = self.stats
        stats.passes += 1
        stats.submissions += len(batch)
        stats.largest = max(stats.largest, len(batch))
        for submission, result in zip(batch, results, strict=True):
            if submission.future.done():
                continue
            if submission.proceed is None:
                submission.future.set_result(result)
                continue
            try:
                items = submission.proceed(result)
            except Exception as exc:  # the caller's own, raised where it waits
                submission.future.set_exception(exc)
                continue
            if items is None:
                submission.future.set_result(None)  # type: ignore[arg-type]
            else:  # in the queue before the next pass gathers
                self._queue.put_nowait(_Submission(items, submission.future, submission.proceed))

    async def aclose(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
