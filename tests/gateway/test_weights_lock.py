"""The lock between requests that read a model's weights and an update that replaces them, and
generation paused around an update."""

from __future__ import annotations

import asyncio

import pytest

from gateway.models.weights_lock import GenerationAborted, WeightsLock


async def test_an_update_waits_for_readers_and_holds_new_ones_back():
    lock = WeightsLock()
    events: list[str] = []
    release_reader = asyncio.Event()
    release_writer = asyncio.Event()

    async def reader(name: str, hold: asyncio.Event | None = None) -> None:
        async with lock.reading():
            events.append(f"{name} in")
            if hold is not None:
                await hold.wait()
            events.append(f"{name} out")

    async def writer() -> None:
        async with lock.writing():
            events.append("update in")
            await release_writer.wait()
            events.append("update out")

    first = asyncio.create_task(reader("old", release_reader))
    await asyncio.sleep(0)
    update = asyncio.create_task(writer())
    await asyncio.sleep(0)
    late = asyncio.create_task(reader("new"))
    await asyncio.sleep(0.01)
    assert events == ["old in"]  # the update waits for the reader; the late reader for the update
    release_reader.set()
    await asyncio.sleep(0.01)
    assert events == ["old in", "old out", "update in"]
    release_writer.set()
    await asyncio.gather(first, update, late)
    assert events == ["old in", "old out", "update in", "update out", "new in", "new out"]


async def test_readers_share_and_a_cancelled_update_lets_them_go_on():
    lock = WeightsLock()
    inside = 0
    most = 0
    gate = asyncio.Event()

    async def reader() -> None:
        nonlocal inside, most
        async with lock.reading():
            inside += 1
            most = max(most, inside)
            await gate.wait()
            inside -= 1

    readers = [asyncio.create_task(reader()) for _ in range(3)]
    await asyncio.sleep(0.01)
    assert most == 3

    async def waiting_update() -> None:
        async with lock.writing():
            raise AssertionError("never reached: cancelled while readers hold the lock")

    update = asyncio.create_task(waiting_update())
    await asyncio.sleep(0.01)
    update.cancel()
    await asyncio.sleep(0)
    late = asyncio.create_task(reader())  # not held back by an update that is gone
    await asyncio.sleep(0.01)
    assert most == 4
    gate.set()
    await asyncio.gather(*readers, late)
    assert update.cancelled()


async def test_a_reading_task_reads_on_while_an_update_waits_for_it():
    """One request's several engine calls: the second must not wait for the update that waits
    for the first to end."""
    lock = WeightsLock()
    inner_entered = asyncio.Event()
    update_waiting = asyncio.Event()

    async def request() -> None:
        async with lock.reading():
            await update_waiting.wait()
            async with lock.reading():
                inner_entered.set()

    async def update() -> None:
        async with lock.writing():
            assert inner_entered.is_set()

    reading = asyncio.create_task(request())
    await asyncio.sleep(0)
    writing = asyncio.create_task(update())
    await asyncio.sleep(0)
    update_waiting.set()
    await asyncio.wait_for(asyncio.gather(reading, writing), 5)


async def _choice(lock: WeightsLock, steps: int, log: list[str], name: str) -> None:
    """A generated choice: reads the weights, and passes `step()` before each engine step."""
    async with lock.reading():
        for i in range(steps):
            await lock.step()
            log.append(f"{name} {i}")
            await asyncio.sleep(0.01)


async def test_a_paused_choice_is_held_and_an_update_goes_ahead_meanwhile():
    lock = WeightsLock()
    log: list[str] = []
    choice = asyncio.create_task(_choice(lock, 4, log, "choice"))
    while not log:
        await asyncio.sleep(0.001)
    lock.pause("retract")
    while lock.running:  # held at its next step
        await asyncio.sleep(0.001)
    assert lock.waiting == 1 and len(log) <= 2
    held_at = len(log)
    async with lock.writing():  # does not wait for the held choice: no deadlock
        log.append("update")
        lock.resume()  # a continue that comes during the update: the choice waits for its end
        await asyncio.sleep(0.03)
        assert log[-1] == "update"
    await asyncio.wait_for(choice, 5)
    assert log[held_at] == "update" and len(log) == 5  # every step taken, after the update


async def test_abort_ends_choices_at_their_next_step_and_new_requests_wait_for_continue():
    lock = WeightsLock()
    log: list[str] = []
    running = asyncio.create_task(_choice(lock, 100, log, "running"))
    while not log:
        await asyncio.sleep(0.001)
    lock.pause("retract")
    while lock.running:
        await asyncio.sleep(0.001)
    lock.pause("abort")  # a held choice ends too
    with pytest.raises(GenerationAborted):
        await asyncio.wait_for(running, 5)
    late = asyncio.create_task(_choice(lock, 1, log, "late"))
    await asyncio.sleep(0.03)
    assert not late.done() and lock.waiting == 1 and lock.running == 0  # waits at the door
    lock.resume()
    await asyncio.wait_for(late, 5)
    assert log[-1] == "late 0"


async def test_unpaused_an_update_waits_for_a_choice_to_end():
    """Without a pause a choice is generated with one set of weights, whatever its length."""
    lock = WeightsLock()
    log: list[str] = []
    choice = asyncio.create_task(_choice(lock, 3, log, "choice"))
    await asyncio.sleep(0.005)

    async def update() -> None:
        async with lock.writing():
            log.append("update")

    await asyncio.wait_for(asyncio.gather(choice, update()), 5)
    assert log == ["choice 0", "choice 1", "choice 2", "update"]


async def test_requests_that_do_not_step_are_never_held():
    """Dense rows: a pause does not hold a request in flight, and an update waits for it."""
    lock = WeightsLock()
    log: list[str] = []
    gate = asyncio.Event()

    async def dense() -> None:
        async with lock.reading():
            await gate.wait()
            log.append("rows")

    async def update() -> None:
        async with lock.writing():
            log.append("update")

    request = asyncio.create_task(dense())
    await asyncio.sleep(0)
    lock.pause("in_place")
    updating = asyncio.create_task(update())
    await asyncio.sleep(0.01)
    assert lock.running == 1 and not log
    gate.set()
    await asyncio.wait_for(asyncio.gather(request, updating), 5)
    assert log == ["rows", "update"]


async def test_streams_of_an_engine_that_runs_ahead_are_not_held_and_an_update_waits_for_them():
    """vLLM and SGLang generate whether or not the stream is read: held, it would run on inside
    the engine while an update changed the weights under it."""
    lock = WeightsLock(hold_at_steps=False)
    log: list[str] = []
    choice = asyncio.create_task(_choice(lock, 3, log, "choice"))
    await asyncio.sleep(0.005)
    lock.pause("retract")
    assert lock.running == 1

    async def update() -> None:
        async with lock.writing():
            log.append("update")

    await asyncio.wait_for(asyncio.gather(choice, update()), 5)
    assert log == ["choice 0", "choice 1", "choice 2", "update"]
    lock.resume()
    aborted = asyncio.create_task(_choice(lock, 100, log, "aborted"))
    while log[-1] != "aborted 0":
        await asyncio.sleep(0.001)
    lock.pause("abort")  # abort still ends them, at the gateway
    with pytest.raises(GenerationAborted):
        await asyncio.wait_for(aborted, 5)
