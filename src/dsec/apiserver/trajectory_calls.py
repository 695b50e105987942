"""Runtime calls of a sandbox bound to a trajectory: replayed from the log or recorded.

Every unary runtime call, file read and file write of the runtime routes passes through
here. For an unbound sandbox it is the plain relay (no store read once this apiserver has
seen the sandbox: ``trajectory_bindings.py``). For a bound one:

- replay mode: the call's canonical form (``dsec.trajectory.canon``) is compared with the
  step at the cursor; equal -> the recorded result is answered and no sandbox is touched;
  different -> the mismatch is logged, kept on the record and answered in the
  ``X-Dsec-Trajectory-*`` headers, then either the call fails with 409
  (``on_mismatch="fail"``) or the log is cut there and the call runs for real (``diverge``);
  the end of the log ends replay the same way.
- record mode: the call runs; its result is appended to the log (durably: the store's
  transaction committed) before it is answered. The next call of the sandbox runs and
  appends from the record that append wrote, reading nothing (``trajectory_bindings.py``).
  Errors the sandbox answered (4xx) are results too; platform failures (5xx) are not
  recorded and may be retried.
"""

from __future__ import annotations

import base64
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

from aiohttp import web

from dsec.apiserver import relay
from dsec.apiserver.auth import Principal
from dsec.apiserver.context import Ctx
from dsec.apiserver.trajectory_sandbox import checkpoint
from dsec.core.errors import (
    DsecError,
    InvalidState,
    TrajectoryBound,
    TrajectoryMismatch,
    error_from_wire,
)
from dsec.obs import log
from dsec.store.api import KeyValue
from dsec.trajectory.canon import canonical, field_at, first_difference
from dsec.trajectory.log import Step, Trajectory, TrajectoryLog

_log = logging.getLogger("dsec.apiserver.trajectory")

# Headers the response gets (app.py adds them when the response is prepared).
HEADERS: web.RequestKey[dict[str, str]] = web.RequestKey("trajectory_headers", dict[str, str])


def idempotent(request: web.Request) -> bool:
    return request.headers.get("X-Dsec-Idempotent", "").lower() in ("1", "true", "yes")


def _set_headers(request: web.Request, t: Trajectory, mode: str, step: int) -> None:
    request[HEADERS] = {
        "X-Dsec-Trajectory": t.name,
        "X-Dsec-Trajectory-Mode": mode,
        "X-Dsec-Trajectory-Step": str(step),
    }


@dataclass
class Bound:
    """A sandbox's trajectory and its record as read for this call (so the append's
    transaction usually needs no second read)."""

    t: Trajectory
    meta: KeyValue


async def bound(c: Ctx, sandbox_id: str) -> Bound | None:
    """The sandbox's trajectory, read from the store (see ``trajectory_bindings.py``)."""
    if c.trajectories is None:
        return None
    found = await c.trajectories.lookup(sandbox_id, c.bindings.tid(sandbox_id))
    c.bindings.saw(sandbox_id, found[0].id if found else "")
    return Bound(*found) if found else None


async def mark_unrecorded(request: web.Request, c: Ctx, sandbox_id: str) -> None:
    """Streams over the runtime WebSocket are not recorded: say so to a bound sandbox's
    client (``X-Dsec-Trajectory-Mode: unrecorded`` on the upgrade answer) and count it."""
    b = None if c.bindings.unbound(sandbox_id) else await bound(c, sandbox_id)
    if b is not None:
        c.metrics.inc("trajectory_unrecorded_calls")
        request[HEADERS] = {"X-Dsec-Trajectory": b.t.name, "X-Dsec-Trajectory-Mode": "unrecorded"}


async def replay(
    request: web.Request, tlog: TrajectoryLog, b: Bound, canon: dict[str, Any]
) -> Step | None:
    """The recorded step this call replays, or None (it runs for real and is recorded)."""
    t = b.t
    if t.mode != "replay":
        return None
    step = await tlog.step(t.id, t.cursor)
    if step is None:
        await tlog.update(t.id, lambda x: replace(x, mode="record", cursor=x.steps))
        return None
    diff = first_difference(step.request, canon)
    if diff is None:
        n = step.n

        def advance(x: Trajectory) -> Trajectory:
            if x.cursor != n:
                raise InvalidState(
                    f"trajectory {x.name!r} is replaying step {x.cursor}, not {n}: "
                    "replay its calls one at a time"
                )
            return replace(
                x,
                cursor=n + 1,
                replayed=x.replayed + 1,
                mode="replay" if n + 1 < x.steps else "record",
            )

        await tlog.update(t.id, advance, known=(t, b.meta))
        _set_headers(request, t, "replayed", n)
        return step
    div = {
        "step": step.n,
        "field": diff,
        "recorded": field_at(step.request, diff),
        "actual": field_at(canon, diff),
        "policy": t.on_mismatch,
        "at": time.time(),
        "sandbox_ahead_by": t.steps - step.n,
    }
    log(
        _log,
        "trajectory mismatch",
        level=logging.WARNING,
        trajectory=t.name,
        project=t.project,
        step=step.n,
        field=diff,
        policy=t.on_mismatch,
    )
    request[HEADERS] = {
        "X-Dsec-Trajectory": t.name,
        "X-Dsec-Trajectory-Mode": "mismatch",
        "X-Dsec-Trajectory-Step": str(step.n),
        "X-Dsec-Trajectory-Mismatch": diff,
    }
    if t.on_mismatch == "fail":
        await tlog.update(t.id, lambda x: replace(x, divergence=div))
        raise TrajectoryMismatch(
            f"call differs from step {step.n} of trajectory {t.name!r} at {diff!r}: "
            f"recorded {div['recorded']!r}, got {div['actual']!r} (on_mismatch='fail')"
        )
    cut = step.n

    def diverge(x: Trajectory) -> Trajectory:
        # Checkpoints after the cut hold state of steps that are no longer in the log.
        kept = [k for k in x.checkpoints if int(k["step"]) <= cut]
        return replace(x, mode="record", cursor=cut, divergence=div, checkpoints=kept)

    await tlog.truncate(t.id, cut, diverge)
    return None


async def record(
    request: web.Request,
    c: Ctx,
    p: Principal,
    b: Bound,
    sandbox_id: str,
    req: dict[str, Any],
    canon: dict[str, Any],
    status: int,
    result: dict[str, Any],
    *,
    data: bytes | None = None,
    payload: bytes | None = None,
) -> Step:
    assert c.trajectories is not None
    idem = idempotent(request)
    mode = request.get(HEADERS, {}).get("X-Dsec-Trajectory-Mode", "recorded")

    def make(n: int) -> Step:
        return Step(
            n=n,
            op=str(req.get("op", "")),
            request=canon,
            status=status,
            result=result,
            at=time.time(),
            sandbox_id=sandbox_id,
            idempotent=idem,
            data=data,
            payload=payload,
            raw_request=req,
        )

    t = b.t
    start = time.perf_counter()
    # (every caller checked the quota before the call ran: a call that ran is recorded)
    step, now, kv = await c.trajectories.append_known(
        t.id, make, known=(t, b.meta), quota_checked=True
    )
    c.metrics.observe("trajectory_append", time.perf_counter() - start)
    c.bindings.wrote(sandbox_id, now, kv)
    _set_headers(request, t, "diverged" if mode == "mismatch" else "recorded", step.n)
    c.metrics.inc("trajectory_steps_recorded")
    if t.checkpoint_every and (step.n + 1) % t.checkpoint_every == 0:
        await checkpoint(c, p, t.id, sandbox_id)
    return step


# -- unary calls ------------------------------------------------------------------------


def _pack(reply: relay.Reply) -> dict[str, Any]:
    return {
        "result": reply.result,
        "stdout": base64.b64encode(reply.stdout).decode(),
        "stderr": base64.b64encode(reply.stderr).decode(),
        "events": reply.events,
        "truncated": reply.truncated,
    }


def _unpack(step: Step) -> relay.Reply:
    if "error" in step.result:
        err = step.result["error"]
        raise error_from_wire(str(err.get("code", "internal")), str(err.get("message", "")))
    r = step.result
    return relay.Reply(
        result=dict(r.get("result") or {}),
        stdout=base64.b64decode(r.get("stdout", "")),
        stderr=base64.b64decode(r.get("stderr", "")),
        events=list(r.get("events") or []),
        truncated=bool(r.get("truncated")),
    )


async def call(
    request: web.Request,
    c: Ctx,
    p: Principal,
    sandbox_id: str,
    req: dict[str, Any],
    stdin: bytes | None = None,
    *,
    deadline_s: float = 3600,
) -> relay.Reply:
    """:func:`relay.call`, replayed or recorded when the sandbox is bound to a trajectory."""
    if c.trajectories is None:
        return await relay.call(c, p, sandbox_id, req, stdin, deadline_s=deadline_s)
    if c.bindings.unbound(sandbox_id):
        try:
            return await relay.call(
                c, p, sandbox_id, req, stdin, deadline_s=deadline_s, unbound=True
            )
        except TrajectoryBound:  # bound since this apiserver looked: look again
            c.bindings.refused(sandbox_id)
            c.metrics.inc("trajectory_binding_cache_refused")
    cached = c.bindings.recording(sandbox_id)
    if cached is not None:  # recording: no store read (``trajectory_bindings.py``)
        was = Bound(*cached)
        await c.trajectories.check_quota(was.t.project)
        try:
            return await _recorded(
                request, c, p, was, sandbox_id, req, stdin, canonical(req, stdin), deadline_s
            )
        except TrajectoryBound:  # re-opened, rebound or removed elsewhere: look again
            c.bindings.stale(sandbox_id)
            c.metrics.inc("trajectory_record_cache_refused")
    b = await bound(c, sandbox_id)
    if b is None:
        return await relay.call(c, p, sandbox_id, req, stdin, deadline_s=deadline_s)
    canon = canonical(req, stdin)
    step = await replay(request, c.trajectories, b, canon)
    if step is not None:
        c.metrics.inc("trajectory_steps_replayed")
        return _unpack(step)
    b = await _for_recording(c.trajectories, b)
    return await _recorded(request, c, p, b, sandbox_id, req, stdin, canon, deadline_s, epoch="")


async def _recorded(
    request: web.Request,
    c: Ctx,
    p: Principal,
    b: Bound,
    sandbox_id: str,
    req: dict[str, Any],
    stdin: bytes | None,
    canon: dict[str, Any],
    deadline_s: float,
    *,
    epoch: str | None = None,
) -> relay.Reply:
    """Run the call and record it before answering. ``epoch`` (default: the record's): the
    edge runs it only if the sandbox is still bound at that epoch, else refuses it
    (TrajectoryBound) before it runs; "": no such check (the record was just read).
    Not shielded: a client that goes away mid-call does not cancel its handler
    (``app.runner``), so a call that ran is recorded."""
    epoch = b.t.epoch if epoch is None else epoch
    try:
        reply = await relay.call(
            c, p, sandbox_id, req, stdin, deadline_s=deadline_s, trajectory_epoch=epoch
        )
    except TrajectoryBound:
        raise  # refused before it ran: nothing to record
    except DsecError as exc:
        if exc.http_status >= 500:
            raise
        error = {"error": exc.to_wire()}
        await record(
            request, c, p, b, sandbox_id, req, canon, exc.http_status, error, payload=stdin
        )
        raise
    await record(request, c, p, b, sandbox_id, req, canon, 200, _pack(reply), payload=stdin)
    return reply


# -- file transfers -----------------------------------------------------------------------


async def transfer(
    request: web.Request,
    c: Ctx,
    p: Principal,
    b: Bound,
    sandbox_id: str,
    req: dict[str, Any],
    body: bytes | None,
    run: Callable[[], Awaitable[tuple[dict[str, Any], bytes | None]]],
) -> tuple[dict[str, Any], bytes | None]:
    """A file read (``body`` None) or write of a bound sandbox: (result, bytes read)."""
    assert c.trajectories is not None
    canon = canonical(req, body)
    step = await replay(request, c.trajectories, b, canon)
    if step is not None:
        c.metrics.inc("trajectory_steps_replayed")
        if "error" in step.result:
            _unpack(step)
        return step.result, step.data
    b = await _for_recording(c.trajectories, b)
    return await _run_and_record(request, c, p, b, sandbox_id, req, canon, body, run)


async def _for_recording(tlog: TrajectoryLog, b: Bound) -> Bound:
    """Check the quota before the call runs; re-read the record if replay just moved it."""
    await tlog.check_quota(b.t.project)
    if b.t.mode == "replay":  # replay ended at this call: the record changed under us
        found = await tlog.lookup(b.t.sandbox_id, b.t.id)
        if found is not None:
            return Bound(*found)
    return b


async def _run_and_record(
    request: web.Request,
    c: Ctx,
    p: Principal,
    b: Bound,
    sandbox_id: str,
    req: dict[str, Any],
    canon: dict[str, Any],
    body: bytes | None,
    run: Callable[[], Awaitable[tuple[dict[str, Any], bytes | None]]],
) -> tuple[dict[str, Any], bytes | None]:
    try:
        result, data = await run()
    except DsecError as exc:
        if exc.http_status >= 500:
            raise
        await record(
            request,
            c,
            p,
            b,
            sandbox_id,
            req,
            canon,
            exc.http_status,
            {"error": exc.to_wire()},
            payload=body,
        )
        raise
    await record(request, c, p, b, sandbox_id, req, canon, 200, result, data=data, payload=body)
    return result, data
