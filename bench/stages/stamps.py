"""The stamps of a measured process: (stage, wall clock, the calling thread's CPU time), in the
order they were taken, and the wrapper that takes them around a function of the gateway or the
client.

The functions are passed by reference, with the object their callers look them up on: a rename
fails here, at the start of the bench, with an AttributeError or a LookupError, rather than
leaving a stage out of the tables."""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable, Sequence
from typing import Any

STAMPS: list[tuple[str, float, float]] = []
wall, cpu = time.perf_counter, time.thread_time


def clock() -> tuple[float, float]:
    return wall(), cpu()


def stamp(
    owner: Any,
    function: Callable[..., Any],
    before: str,
    after: str | None = None,
    rows: Callable[[Sequence[Any]], int] | None = None,
) -> None:
    """Replace `function` on `owner` (a class or a module) by one that stamps `before` as it is
    called and `after` as it returns (awaited, for a coroutine function), and first the call's
    rows (`rows=N`, from its positional arguments) when `rows` is given."""
    name = function.__name__
    if inspect.getattr_static(owner, name, None) is not function:
        raise LookupError(
            f"{owner.__name__}.{name} is not {function.__module__}.{function.__qualname__}: "
            "its callers would not reach the stamped one"
        )

    def begin(args: Sequence[Any]) -> None:
        if rows is not None:
            STAMPS.append((f"rows={rows(args)}", 0.0, 0.0))
        STAMPS.append((before, *clock()))

    def end() -> None:
        if after:
            STAMPS.append((after, *clock()))

    if inspect.iscoroutinefunction(function):

        @functools.wraps(function)
        async def stamped(*args: Any, **kwargs: Any) -> Any:
            begin(args)
            result = await function(*args, **kwargs)
            end()
            return result

    else:

        @functools.wraps(function)
        def stamped(*args: Any, **kwargs: Any) -> Any:
            begin(args)
            result = function(*args, **kwargs)
            end()
            return result

    setattr(owner, name, stamped)


def dump(first: str, path: str) -> None:
    """The stamps into `path`, if any call began (its first stage: `first`)."""
    if any(taken[0] == first for taken in STAMPS):
        with open(path, "w") as out:
            out.writelines(f"{name}\t{t}\t{c}\n" for name, t, c in STAMPS)
