"""An aiohttp server on a free loopback port, for tests that speak raw HTTP to it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiohttp import web


@asynccontextmanager
async def serving(runner: web.AppRunner) -> AsyncIterator[int]:
    """``runner``'s application listening on 127.0.0.1 (its port yielded), cleaned up after."""
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()
