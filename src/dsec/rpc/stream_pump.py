"""The serving end of a kept stream (:mod:`dsec.rpc.kept_stream` is the calling end): the
requests of one stream are taken as they come and answered concurrently, each reply sent
as soon as it is ready.

The handler's ``take`` looks at each request: it answers at once (:meth:`Pump.reply`) or
starts working out the answer (:meth:`Pump.start`). Once the caller has half-closed and
every answer is sent the stream ends OK; the exception that ended the requests (e.g. a
message no longer authorized) ends it with its status; the stream ending early (the caller
went away) cancels the answers still running, unanswered.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine
from typing import Any, Generic, TypeVar

import grpc

Msg = TypeVar("Msg")
Reply = TypeVar("Reply")


class Pump(Generic[Reply]):
    """The replies of one served stream, and the answers still being worked out."""

    def __init__(self) -> None:
        # replies, then None when done, or the exception that ended the requests
        self._replies: asyncio.Queue[Reply | BaseException | None] = asyncio.Queue()
        self._running: dict[object, asyncio.Task[Reply]] = {}  # by request id, or by itself

    def reply(self, reply: Reply) -> None:
        self._replies.put_nowait(reply)

    def start(self, answer: Coroutine[Any, Any, Reply], rid: object = None) -> None:
        """Run ``answer`` concurrently, as request ``rid`` if given (not one :meth:`running`);
        what it returns is sent (nothing if cancelled)."""
        task = asyncio.create_task(answer)
        key = task if rid is None else rid
        self._running[key] = task
        task.add_done_callback(functools.partial(self._done, key))

    def running(self, rid: object) -> bool:
        return rid in self._running

    def cancel(self, rid: object) -> None:
        """Stop request ``rid`` unanswered (if it still runs)."""
        if (task := self._running.get(rid)) is not None:
            task.cancel()

    def _done(self, key: object, task: asyncio.Task[Reply]) -> None:
        del self._running[key]
        if not task.cancelled():
            self._replies.put_nowait(task.result())

    async def serve(
        self, requests: AsyncIterator[Msg], context: grpc.aio.ServicerContext[Any, Any],
        take: Callable[[Msg], object],
    ) -> AsyncGenerator[Reply, None]:  # fmt: skip
        """The replies to ``requests``, to be yielded by the stream's handler."""

        async def pump() -> None:
            try:
                async for msg in requests:
                    take(msg)
                while self._running:
                    await asyncio.wait(list(self._running.values()))
                self._replies.put_nowait(None)
            except Exception as exc:
                self._replies.put_nowait(exc)

        await context.send_initial_metadata(())  # "served" (a peer without it: UNIMPLEMENTED)
        pumping = asyncio.create_task(pump())
        try:
            while (item := await self._replies.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            pumping.cancel()
            running = list(self._running.values())
            for task in running:
                task.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.gather(pumping, *running, return_exceptions=True)
