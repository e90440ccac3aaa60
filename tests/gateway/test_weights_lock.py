"""The lock between requests that read a model's weights and an update that replaces them."""

from __future__ import annotations

import asyncio

from gateway.weights import WeightsLock


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
