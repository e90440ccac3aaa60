"""The stamps of bench/stages/sitecustomize.py: (stage, wall clock, the calling thread's CPU
time), in the order they were taken, written to $STAGE_OUT<pid> at the process's end."""

import functools
import os
import time

STAMPS: list[tuple[str, float, float]] = []
wall, cpu = time.perf_counter, time.thread_time


def clock() -> tuple[float, float]:
    return wall(), cpu()


def wrap(owner, name, before, after=None):
    function = getattr(owner, name)

    @functools.wraps(function)
    def stamped(*args, **kwargs):
        STAMPS.append((before, *clock()))
        result = function(*args, **kwargs)
        if after:
            STAMPS.append((after, *clock()))
        return result

    setattr(owner, name, stamped)


def wrap_async(owner, name, before, after):
    function = getattr(owner, name)

    @functools.wraps(function)
    async def stamped(*args, **kwargs):
        STAMPS.append((before, *clock()))
        result = await function(*args, **kwargs)
        STAMPS.append((after, *clock()))
        return result

    setattr(owner, name, stamped)


def dump(first: str) -> None:
    """The stamps, if any call began (its first stage: `first`)."""
    if any(stamp[0] == first for stamp in STAMPS):
        with open(f"{os.environ['STAGE_OUT']}{os.getpid()}", "w") as out:
            out.writelines(f"{name}\t{t}\t{c}\n" for name, t, c in STAMPS)
