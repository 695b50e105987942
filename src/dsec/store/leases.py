"""Keeping a lease alive in the background, on any state store."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from dsec.core.errors import LeaseNotFound, StoreUnavailable

from .api import StateStore

log = logging.getLogger(__name__)


@contextlib.asynccontextmanager
async def kept_alive(store: StateStore, ttl_s: int) -> AsyncIterator[int]:
    """Grant a lease, renew it every ``ttl_s / 3`` while the block runs, revoke it after.

    Yields the lease id. If the lease is lost (expired while the store was unreachable), the
    renewals stop and the keys on it are gone: callers that depend on it watch their keys.
    """
    lease = await store.lease_grant(ttl_s)

    async def renew() -> None:
        while True:
            await asyncio.sleep(ttl_s / 3)
            try:
                await store.lease_keepalive(lease)
            except LeaseNotFound:
                log.warning("lease %x expired; not renewing it any more", lease)
                return
            except StoreUnavailable as exc:
                log.warning("could not renew lease %x: %s", lease, exc)

    task = asyncio.create_task(renew())
    try:
        yield lease
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        with contextlib.suppress(LeaseNotFound, StoreUnavailable):
            await store.lease_revoke(lease)
