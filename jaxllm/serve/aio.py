"""Async plumbing of the HTTP handlers: a generation's deltas with the first one already read,
several generations' deltas merged as they come, and work abandoned when its client leaves."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from starlette.requests import Request

from jaxllm.serve.generation import Delta

T = TypeVar("T")


async def chain(first: Delta | None, rest: AsyncIterator[Delta]) -> AsyncIterator[Delta]:
    if first is not None:
        yield first
    async for delta in rest:
        yield delta


async def merged(streams: list[AsyncIterator[Delta]]) -> AsyncIterator[tuple[int, Delta]]:
    """The deltas of several generations as they come, each with its generation's index; what
    any of them raises (a reader's timeout, say) is raised here."""
    queue: asyncio.Queue[tuple[int, Delta | Exception | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[Delta]) -> None:
        try:
            async for delta in stream:
                queue.put_nowait((index, delta))
        except Exception as e:
            queue.put_nowait((index, e))
        else:
            queue.put_nowait((index, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        unfinished = len(tasks)
        while unfinished:
            index, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item is None:
                unfinished -= 1
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


class ClientGone(Exception):
    """The client closed its connection while its request waited or ran."""


async def unless_gone(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result; if the client disconnects first, `work` is cancelled and `ClientGone` raised."""
    task = asyncio.ensure_future(work)
    while not (await asyncio.wait({task}, timeout=0.25))[0]:
        if await request.is_disconnected():
            task.cancel()
            raise ClientGone
    return task.result()


async def drain(streams: list[AsyncIterator[Delta]]) -> None:
    for deltas in streams:
        async for _ in deltas:
            pass
