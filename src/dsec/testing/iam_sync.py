"""A :class:`dsec.iam.kv.KvIam` with :class:`dsec.iam.db.IamDb`'s blocking methods, so the
IamDb unit tests run unchanged against the StateStore layout (tests only).

The KvIam and its store live on a private event loop in a background thread; each method
call is run there and waited for.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from dsec.iam.kv import KvIam
from dsec.store.api import StateStore

_T = TypeVar("_T")


class SyncKvIam:
    """Call it like an IamDb; :meth:`close` stops the loop (and closes the store)."""

    def __init__(
        self, make_store: Callable[[], Awaitable[StateStore]], *, clock: Callable[[], float]
    ) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()

        async def make() -> KvIam:
            return KvIam(await make_store(), clock=clock)

        self.kv = self._call(make())

    def _call(self, coro: Awaitable[_T]) -> _T:
        async def run() -> _T:
            return await coro

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout=60)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self.kv, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            return self._call(method(*args, **kwargs))

        return call

    def close(self) -> None:
        self._call(self.kv.store.aclose())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()
