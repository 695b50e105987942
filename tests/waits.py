"""Waiting in tests for what must come, however loaded the machine is: poll a condition
until it holds or a generous time is up, instead of sleeping a fixed time before a check.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable


def until(
    check: Callable[[], object],
    what: str = "the condition",
    timeout_s: float = 10.0,
    every_s: float = 0.05,
) -> float:
    """Poll ``check`` every ``every_s`` until it is true; the seconds it took
    (AssertionError after ``timeout_s``)."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        time.sleep(every_s)
    return time.monotonic() - start


async def auntil(
    check: Callable[[], object], what: str = "the condition", timeout_s: float = 10.0
) -> float:
    """:func:`until` on the event loop; ``check`` may answer an awaitable."""
    start = time.monotonic()
    while True:
        got = check()
        if inspect.isawaitable(got):
            got = await got
        if got:
            return time.monotonic() - start
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        await asyncio.sleep(0.01)
