"""A round's requests sent from several client processes at once.

One asyncio loop making a round's requests with the openai SDK spends more CPU on each than the
gateway does (docs/performance.md has the measurement): at 64 streams its last request leaves
long after its first, and the client, not the server, bounds the round.
`ProcessClients` splits each round among worker processes, each with its own client (request i
goes to worker i mod N), so that a round measures the server. The workers start once and serve
every round; a round's time still runs in the caller, from its first request handed out to its
last answer back.
"""

from __future__ import annotations

import asyncio
import multiprocessing
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

from bench.generation_targets import Completion, OutputGrammar, send_round
from bench.native_generate import http_client

Work = tuple[list[str], int, list[OutputGrammar | None], int | None]


def _serve(connection: Connection, api: str, base_url: str, server: str) -> None:
    """A worker: rounds in from `connection`, their completions back, until None comes."""

    async def serve() -> None:
        client = http_client(api, base_url, server)
        try:
            while (work := await asyncio.to_thread(connection.recv)) is not None:
                prompts, max_tokens, grammars, logprobs = work
                try:
                    done: Any = await send_round(client.one, prompts, max_tokens, grammars, logprobs)
                except Exception as exc:  # the caller raises it: a worker outlives a failed round
                    done = RuntimeError(f"{type(exc).__name__}: {exc}")
                connection.send(done)
        finally:
            await client.close()

    asyncio.run(serve())


class ProcessClients:
    """A target's `api` (bench/native_generate.py's `http_client`), each round's requests sent
    from `count` processes."""

    def __init__(self, api: str, base_url: str, server: str, count: int) -> None:
        self.takes_grammars = api == "completions"
        context = multiprocessing.get_context("spawn")  # no copy of the caller's threads or CUDA state
        self.connections: list[Connection] = []
        self.workers = []
        for _ in range(count):
            mine, theirs = context.Pipe()
            worker = context.Process(target=_serve, args=(theirs, api, base_url, server), daemon=True)
            worker.start()
            theirs.close()
            self.connections.append(mine)
            self.workers.append(worker)

    async def round(
        self,
        prompts: Sequence[str],
        max_tokens: int,
        grammars: Sequence[OutputGrammar | None] = (),
        logprobs: int | None = 1,
    ) -> list[Completion]:
        count = len(self.connections)
        busy = range(min(count, len(prompts)))
        for c in busy:  # a worker's grammars line up with its prompts; send_round pads the rest
            work: Work = (list(prompts[c::count]), max_tokens, list(grammars[c::count]), logprobs)
            self.connections[c].send(work)
        answers = await asyncio.gather(*(asyncio.to_thread(self.connections[c].recv) for c in busy))
        for answer in answers:
            if isinstance(answer, Exception):
                raise answer
        done: list[Completion] = [None] * len(prompts)  # type: ignore[list-item]
        for c, answer in zip(busy, answers, strict=True):
            done[c::count] = answer
        return done

    def close(self) -> None:
        for connection, worker in zip(self.connections, self.workers, strict=True):
            try:
                connection.send(None)
            except OSError:  # the worker is gone already
                pass
            worker.join(timeout=30)
            if worker.is_alive():
                worker.kill()
                worker.join()
            connection.close()
