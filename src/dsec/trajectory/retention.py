"""Retention of the trajectory log: a sweep removes trajectories untouched for longer than
``max_age_s``, then the least recently used ones while the whole log is over ``max_bytes``,
then blobs no step references any more (older than ``blob_grace_s``, so a blob written for
a step whose transaction is still in flight is never taken)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

from dsec.obs import log

from .log import TrajectoryLog

_log = logging.getLogger("dsec.trajectory.retention")


@dataclass(frozen=True)
class Retention:
    max_age_s: float = 0  # 0: no age limit
    max_bytes: int = 0  # 0: no size limit
    blob_grace_s: float = 3600
    interval_s: float = 600


@dataclass(frozen=True)
class SweepResult:
    removed: tuple[str, ...]
    blobs_removed: int


async def sweep(tlog: TrajectoryLog, policy: Retention, now: float) -> SweepResult:
    removed: list[str] = []
    items = sorted(await tlog.list(), key=lambda t: t.updated_at)
    keep = []
    for t in items:
        if policy.max_age_s and t.updated_at < now - policy.max_age_s:
            await tlog.remove(t.id)
            removed.append(t.id)
        else:
            keep.append(t)
    total = sum(t.bytes for t in keep)
    for t in keep:
        if not policy.max_bytes or total <= policy.max_bytes:
            break
        await tlog.remove(t.id)
        removed.append(t.id)
        total -= t.bytes
    referenced = await tlog.referenced_blobs()
    blobs = 0
    for digest, mtime in list(tlog.blobs.digests()):
        if digest not in referenced and mtime < now - policy.blob_grace_s:
            await tlog.blobs.delete(digest)
            blobs += 1
    if removed or blobs:
        log(_log, "trajectory sweep", removed=len(removed), blobs_removed=blobs)
    return SweepResult(tuple(removed), blobs)


async def run_sweeper(tlog: TrajectoryLog, policy: Retention, stop: asyncio.Event) -> None:
    """Sweep every ``interval_s`` until ``stop`` is set (errors are logged, not fatal)."""
    while not stop.is_set():
        try:
            await sweep(tlog, policy, tlog.clock())
        except Exception:
            _log.exception("trajectory sweep failed")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), policy.interval_s)
