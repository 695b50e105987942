"""The sandbox manager: the edge's lifecycle engine.

Theory of operation:

* Every state change goes through :meth:`SandboxManager._move`, which applies the
  lifecycle table (``dsec.core.lifecycle``) and persists the record *before* the side
  effect that follows it. After a crash, :meth:`adopt` reads the records and finishes what
  was half done: ``creating`` is undone, ``stopping`` is completed, ``running`` and
  ``paused`` are checked against the backend and re-watched, never killed.
* A running sandbox's init is watched through a pidfd, so a sandbox that dies (OOM of its
  init, killed from outside) becomes ``failed`` at once and its resources are released.
* Lifetimes are enforced by :meth:`reap_expired`, called periodically by the daemon.
* Admission is decided here, synchronously against the in-memory live set, so two
  concurrent creates can never both take the last slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from dsec.core import admission, projects
from dsec.core.errors import (
    BackendUnavailable,
    DsecError,
    InvalidArgument,
    InvalidState,
    PermissionDenied,
    SandboxFailed,
    SandboxNotFound,
    TrajectoryBound,
)
from dsec.core.ids import RANDOM_BYTES, edge_of, is_sandbox_id, new_sandbox_id
from dsec.core.lifecycle import Event, State
from dsec.core.netpolicy import NetworkPolicy
from dsec.core.spec import MAX_TIMEOUT_S, MOVE_GRACE_S, SandboxSpec
from dsec.edge import agent_client
from dsec.edge.backend_report import CreateTimes
from dsec.edge.backends.api import Backend, RuntimeState, SandboxPaths, Started, capabilities_of
from dsec.edge.records import RecordStore, SandboxRecord
from dsec.obs import Metrics, log

_log = logging.getLogger("dsec.edge")

AGENT_READY_TIMEOUT_S = 15.0
TERMINAL_RETENTION_S = 3600.0
# A paused sandbox of ``on_timeout="pause"`` is kept this long (then ended), not its timeout.
PAUSED_KEEP_S = float(MAX_TIMEOUT_S)
TRAJECTORY_MARK = "dsec.trajectory"  # spec metadata: the trajectory the sandbox is bound to
TRAJECTORY_EPOCH = "dsec.trajectory.epoch"  # ... and the epoch of that binding


@dataclass(frozen=True, slots=True)
class Caller:
    """Who is asking: the apiserver forwards the authenticated principal."""

    project: str
    subject: str
    admin: bool
    # Projects (subtree roots, "*": all) where the caller holds the role this call needs,
    # and those it may see; None: just its own project.
    scopes: tuple[str, ...] | None = None
    visible: tuple[str, ...] = ()

    def covers(self, project: str) -> bool:
        """Whether this caller acts on ``project`` (its own project and everything beneath)."""
        roots = (self.project,) if self.scopes is None else self.scopes
        return self.admin or any(r == "*" or projects.contains(r, project) for r in roots)

    def check(self, rec: SandboxRecord) -> None:
        if not self.covers(rec.project):
            if any(r == "*" or projects.contains(r, rec.project) for r in self.visible):
                raise PermissionDenied(f"your role on project {rec.project!r} does not allow this")
            # Do not reveal that the sandbox exists in another project.
            raise SandboxNotFound(f"no sandbox {rec.id}")


class SandboxManager:
    def __init__(
        self,
        *,
        edge_id: str,
        state_root: Path,
        socket_root: Path,
        backends: dict[str, Backend],
        records: RecordStore,
        capacity: admission.NodeCapacity,
        metrics: Metrics,
        on_ended: Callable[[str], Awaitable[None]] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.edge_id = edge_id
        self._state_root = state_root
        self.snapshots_dir = state_root.parent / "snapshots"  # named snapshots' records
        self._socket_root = socket_root
        self._backends = backends
        self._records = records
        self._capacity = capacity
        self._metrics = metrics
        self._on_ended = on_ended
        self._clock = clock
        self._live: dict[str, SandboxRecord] = {}
        self._watch_fds: dict[str, int] = {}
        self._creating: dict[str, asyncio.Event] = {}
        self._resuming: set[str] = set()  # a move must not end one being resumed here
        self.create_times = CreateTimes()  # fresh creates only: the backends' create hint
        self._tasks: set[asyncio.Task[None]] = set()
        socket_root.mkdir(parents=True, exist_ok=True)
        state_root.mkdir(parents=True, exist_ok=True)

    # ---- queries -----------------------------------------------------------------

    def paths(self, sandbox_id: str) -> SandboxPaths:
        return SandboxPaths(
            state_dir=self._state_root / sandbox_id,
            agent_socket=self._socket_root / f"{sandbox_id}.sock",
        )

    def backend(self, name: str) -> Backend:
        """The backend named ``name`` (for image packing and other backend-level work)."""
        b = self._backends.get(name)
        if b is None:
            raise InvalidState(f"backend {name!r} is not available on this edge")
        return b

    def get(self, sandbox_id: str, caller: Caller) -> SandboxRecord:
        rec = self._live.get(sandbox_id) or self._records.get(sandbox_id)
        if rec is None:
            raise SandboxNotFound(f"no sandbox {sandbox_id}")
        caller.check(rec)
        if not rec.live and rec.moved_to:  # the tombstone of a move
            raise SandboxNotFound(
                f"sandbox {sandbox_id} was moved to another edge as {rec.moved_to}: use that id"
            )
        return rec

    def query(
        self, caller: Caller, *, project: str = "", include_terminated: bool = False
    ) -> list[SandboxRecord]:
        recs = self._records.all() if include_terminated else list(self._live.values())
        recs = [r for r in recs if caller.covers(r.project)]
        return [r for r in recs if not project or projects.contains(project, r.project)]

    def live_records(self) -> list[SandboxRecord]:
        return list(self._live.values())

    def load(self) -> admission.NodeLoad:
        live = list(self._live.values())
        return admission.NodeLoad(
            sandboxes=len(live),
            cpu=sum(r.spec.cpu for r in live),
            memory_mb=sum(r.spec.memory_mb for r in live),
        )

    def agent_socket(self, sandbox_id: str, caller: Caller) -> Path:
        """The socket of a running sandbox's aether, for runtime calls."""
        rec = self.get(sandbox_id, caller)
        if rec.state is not State.RUNNING:
            raise InvalidState(f"sandbox {sandbox_id} is {rec.state.value}, not running")
        return self.paths(sandbox_id).agent_socket

    # ---- lifecycle -----------------------------------------------------------------

    async def create(
        self,
        sandbox_id: str,
        spec: SandboxSpec,
        *,
        project: str,
        owner: str,
        caller: Caller,
        start: Callable[[SandboxPaths], Awaitable[Started]] | None = None,
        moved_from: str = "",
    ) -> SandboxRecord:
        """Admit and start one sandbox; ``start`` replaces the backend's boot (a sandbox
        made from a named snapshot); ``moved_from``: the paused sandbox on another edge this
        one continues (a move, see :meth:`settle`)."""
        if moved_from and not is_sandbox_id(moved_from):
            raise InvalidArgument(f"moved_from {moved_from!r} is not a sandbox id")
        if not caller.covers(project):
            raise PermissionDenied(f"cannot create sandboxes in project {project!r}")
        if edge_of(sandbox_id) != self.edge_id:
            raise SandboxNotFound(f"sandbox id {sandbox_id} does not belong to edge {self.edge_id}")
        backend = self._backends.get(spec.backend)
        if backend is None:
            raise BackendUnavailable(
                f"backend {spec.backend!r} is not available on edge {self.edge_id} "
                f"(available: {', '.join(sorted(self._backends))})"
            )
        if sandbox_id in self._live or self._records.get(sandbox_id) is not None:
            raise InvalidState(f"sandbox {sandbox_id} already exists")
        if spec.on_timeout == "pause" and not capabilities_of(backend).pause:
            raise InvalidArgument(
                f"on_timeout='pause': the {spec.backend} backend cannot pause sandboxes "
                "(container, microvm and vm can)"
            )
        admission.admit(self._capacity, self.load(), spec)
        now = self._clock()
        rec = SandboxRecord(
            id=sandbox_id,
            project=project,
            owner=owner,
            state=State.CREATING,
            spec=spec,
            created_at=now,
            expires_at=now + spec.timeout_s,
            moved_from=moved_from,
        )
        self._save(rec)
        paths = self.paths(sandbox_id)
        started_at = time.perf_counter()
        done = self._creating[sandbox_id] = asyncio.Event()
        try:
            try:
                if start is not None:
                    started = await start(paths)
                else:
                    started = await backend.create(sandbox_id, spec, paths)
                backend_s = time.perf_counter() - started_at
                await agent_client.call(
                    paths.agent_socket, {"op": "ping"}, timeout=AGENT_READY_TIMEOUT_S
                )
                if started.main:
                    await _start_main(paths.agent_socket, started.main)
            except BaseException as exc:
                if self._stop_requested(sandbox_id):
                    await self._finish_stop(self._live[sandbox_id], "killed while creating")
                else:
                    await self._fail_create(rec, backend, paths, exc)
                raise self._as_create_error(exc) from exc
            if self._stop_requested(sandbox_id):
                await self._finish_stop(self._live[sandbox_id], "killed while creating")
                raise InvalidState(f"sandbox {sandbox_id} was killed while it was being created")
            rec = self._move(rec, Event.STARTED, started_at=self._clock(), pid=started.pid)
        finally:
            del self._creating[sandbox_id]
            done.set()
        self._watch(rec)
        self._metrics.observe("sandbox_create", time.perf_counter() - started_at)
        self._metrics.inc("sandboxes_created", backend=spec.backend)
        total_s = time.perf_counter() - started_at
        if start is None:
            self.create_times.note(spec.backend, total_s)
        log(
            _log,
            "sandbox running",
            sandbox=sandbox_id,
            project=project,
            pid=started.pid,
            backend_ms=round(backend_s * 1000, 1),
            agent_ms=round((total_s - backend_s) * 1000, 1),
        )
        return rec

    async def kill(
        self, sandbox_id: str, caller: Caller, *, reason: str = "killed"
    ) -> SandboxRecord:
        rec = self.get(sandbox_id, caller)
        if not rec.live:
            return rec
        creating = self._creating.get(sandbox_id)
        if creating is not None:
            # The create in flight sees STOPPING and tears the sandbox down itself.
            if rec.state is State.CREATING:
                self._move(rec, Event.STOP)
            await creating.wait()
            return self._records.get(sandbox_id) or rec
        if rec.state is State.STOPPING:
            return await self._finish_stop(rec, reason)
        rec = self._move(rec, Event.STOP)
        return await self._finish_stop(rec, reason)

    async def pause(self, sandbox_id: str, caller: Caller) -> SandboxRecord:
        """Freeze every process of a running sandbox. Its lifetime keeps counting, unless it
        was created with ``on_timeout="pause"``: then it is kept paused for PAUSED_KEEP_S."""
        rec = self.get(sandbox_id, caller)
        if rec.state is State.PAUSED:
            return rec
        rec.moved(Event.PAUSE)  # raises InvalidState unless running
        await self._backends[rec.spec.backend].pause(sandbox_id)
        if rec.spec.on_timeout == "pause":
            return self._move(rec, Event.PAUSE, expires_at=self._clock() + PAUSED_KEEP_S)
        return self._move(rec, Event.PAUSE)

    async def resume(self, sandbox_id: str, caller: Caller) -> SandboxRecord:
        """Thaw a paused sandbox; one of ``on_timeout="pause"`` gets a new timeout.

        Raises:
            NodeFull: it no longer fits beside the running ones (the edge came back with
                less capacity): the apiserver may resume a microVM on another edge.
        """
        rec = self.get(sandbox_id, caller)
        if rec.state is State.RUNNING:
            return rec
        rec.moved(Event.RESUME)  # raises InvalidState unless paused
        running = [r for r in self._live.values() if r.state is State.RUNNING]
        admission.admit(self._capacity, admission.NodeLoad(
            sandboxes=len(running), cpu=sum(r.spec.cpu for r in running),
            memory_mb=sum(r.spec.memory_mb for r in running)), rec.spec)  # fmt: skip
        self._resuming.add(sandbox_id)
        try:
            await self._backends[rec.spec.backend].resume(sandbox_id)
        finally:
            self._resuming.discard(sandbox_id)
        if rec.spec.on_timeout == "pause":
            return self._move(rec, Event.RESUME, expires_at=self._clock() + rec.spec.timeout_s)
        return self._move(rec, Event.RESUME)

    async def end_moved(self, sandbox_id: str, moved_to: str, caller: Caller) -> SandboxRecord:
        """End paused ``sandbox_id``, which now runs on another edge as ``moved_to``; its
        record stays (TERMINAL_RETENTION_S) as a tombstone: :meth:`get` names the new id.

        Raises:
            InvalidState: it is not paused any more (resumed here meanwhile): not ended.
        """
        done = self._records.get(sandbox_id)
        if done and not done.live and done.moved_to == moved_to and caller.covers(done.project):
            return done  # ended by an earlier call (a retry, or the reconcile of the move)
        rec = self.get(sandbox_id, caller)
        if rec.state is not State.PAUSED or sandbox_id in self._resuming:
            what = "resuming" if rec.state is State.PAUSED else rec.state.value
            raise InvalidState(f"sandbox {sandbox_id} is {what}, not paused: "
                               "it stays on this edge")  # fmt: skip
        rec = self._move(rec, Event.STOP, moved_to=moved_to)
        rec = await self._finish_stop(rec, f"moved to another edge as {moved_to}")
        self._metrics.inc("sandboxes_moved_away")
        return rec

    async def settle(self, moved: Sequence[tuple[str, str]], unallocated: Sequence[str]) -> None:
        """Finish what a move left half done when its apiserver died, from the iam's reconcile
        answer: a paused sandbox whose allocation went to ``new`` ends as moved there; a
        sandbox started here for a move (``moved_from``) that holds no allocation
        :data:`MOVE_GRACE_S` after it started is killed (the move did not happen: the
        sandbox is still paused on its own edge)."""
        system = Caller(project="", subject="edge", admin=True)
        for old, new in moved:
            rec = self._live.get(old)
            if rec is None or rec.state is not State.PAUSED:
                continue
            try:
                await self.end_moved(old, new, system)
            except DsecError as exc:  # resumed here meanwhile: it stays
                log(_log, "moved sandbox not ended", logging.WARNING, sandbox=old, moved_to=new,
                    error=exc.message)  # fmt: skip
            else:
                log(_log, "ended a sandbox its move left behind", sandbox=old, moved_to=new)
        cutoff = self._clock() - MOVE_GRACE_S
        for sid in unallocated:
            rec = self._live.get(sid)
            if rec is None or not rec.moved_from or not 0 < rec.started_at <= cutoff:
                continue
            if rec.state not in (State.RUNNING, State.PAUSED):
                continue
            try:
                await self.kill(sid, system, reason=f"its move from {rec.moved_from} did not "
                                "complete (that sandbox stays paused on its edge)")  # fmt: skip
            except DsecError as exc:
                log(_log, "unfinished move target not killed", logging.WARNING, sandbox=sid,
                    error=exc.message)  # fmt: skip
            else:
                self._metrics.inc("moves_abandoned")
                log(_log, "killed the target of an unfinished move", logging.WARNING,
                    sandbox=sid, moved_from=rec.moved_from)  # fmt: skip
        self._metrics.set("sandboxes_unallocated", float(len(unallocated)))

    async def fork(
        self, sandbox_id: str, count: int, caller: Caller, child_ids: Sequence[str] = ()
    ) -> list[SandboxRecord]:
        """Start ``count`` children of a running sandbox from one memory snapshot.

        Each child is a new sandbox of the same project, owner and spec on this edge, named
        ``child_ids`` when given (the apiserver's ids, admitted by iam first).

        Raises:
            InvalidState: the sandbox is not running.
            InvalidArgument: its backend cannot fork, or ``count`` is out of range.
            NodeFull: the children do not fit on this edge.
        """
        rec = self.get(sandbox_id, caller)
        if rec.state is not State.RUNNING:
            raise InvalidState(
                f"sandbox {sandbox_id} is {rec.state.value}: only a running one forks"
            )
        forker = getattr(self._backends.get(rec.spec.backend), "fork", None)
        if forker is None:
            raise InvalidArgument(f"the {rec.spec.backend} backend cannot fork sandboxes")
        if not 1 <= count <= 64:
            raise InvalidArgument("fork count must be between 1 and 64")
        ids = list(child_ids) or [
            new_sandbox_id(self.edge_id, os.urandom(RANDOM_BYTES)) for _ in range(count)
        ]
        if len(ids) != count or len(set(ids)) != count:
            raise InvalidArgument(f"fork needs {count} distinct child ids, got {len(ids)}")
        for cid in ids:
            if edge_of(cid) != self.edge_id:
                raise InvalidArgument(f"sandbox id {cid} does not belong to edge {self.edge_id}")
            if cid in self._live or self._records.get(cid) is not None:
                raise InvalidState(f"sandbox {cid} already exists")
        now = self._clock()
        children: list[SandboxRecord] = []
        try:
            for cid in ids:
                admission.admit(self._capacity, self.load(), rec.spec)
                child = SandboxRecord(
                    id=cid,
                    project=rec.project,
                    owner=rec.owner,
                    state=State.CREATING,
                    spec=rec.spec,
                    created_at=now,
                    expires_at=now + rec.spec.timeout_s,
                )
                self._save(child)
                children.append(child)
            started = await forker(sandbox_id, [(c.id, self.paths(c.id)) for c in children])
        except BaseException as exc:
            for c in children:
                self._move(c, Event.FAILED, error=f"fork failed: {exc}")
                await self._ended(c.id)
            raise
        out = []
        for c, st in zip(children, started, strict=True):
            c = self._move(c, Event.STARTED, started_at=self._clock(), pid=st.pid)
            self._watch(c)
            self._metrics.inc("sandboxes_created", backend=rec.spec.backend)
            out.append(c)
        log(_log, "sandbox forked", sandbox=sandbox_id, children=[c.id for c in out])
        return out

    async def set_timeout(self, sandbox_id: str, timeout_s: int, caller: Caller) -> SandboxRecord:
        rec = self.get(sandbox_id, caller)
        if not rec.live or rec.state is State.STOPPING:
            raise InvalidState(f"sandbox {sandbox_id} is {rec.state.value}")
        SandboxSpec(timeout_s=timeout_s)  # validates the range
        rec = replace(rec, expires_at=self._clock() + timeout_s)
        self._save(rec)
        return rec

    def mark_trajectory(
        self, sandbox_id: str, trajectory_id: str, caller: Caller, epoch: str = ""
    ) -> SandboxRecord:
        """Mark a live sandbox as bound to a trajectory ("": unmark it) at a binding
        ``epoch``. Its calls sent as for an unbound sandbox are then refused
        (``check_unbound``), so an apiserver that cached "not bound" cannot run one
        unrecorded; and so are calls sent from a cached record of another epoch
        (``check_epoch``), so one that cached "recording" cannot run a call a re-opened
        trajectory should replay."""
        rec = self.get(sandbox_id, caller)
        if not rec.live:
            raise InvalidState(f"sandbox {sandbox_id} is {rec.state.value}")
        marks = (TRAJECTORY_MARK, TRAJECTORY_EPOCH)
        meta = {k: v for k, v in rec.spec.metadata.items() if k not in marks}
        if trajectory_id:
            meta[TRAJECTORY_MARK] = trajectory_id
            if epoch:
                meta[TRAJECTORY_EPOCH] = epoch
        rec = replace(rec, spec=replace(rec.spec, metadata=meta))
        self._save(rec)
        return rec

    def check_unbound(self, sandbox_id: str, caller: Caller) -> None:
        rec = self.get(sandbox_id, caller)
        if rec.spec.metadata.get(TRAJECTORY_MARK):
            raise TrajectoryBound(f"sandbox {sandbox_id} is bound to a trajectory")

    def check_epoch(self, sandbox_id: str, epoch: str, caller: Caller) -> None:
        rec = self.get(sandbox_id, caller)
        if rec.spec.metadata.get(TRAJECTORY_EPOCH) != epoch:
            raise TrajectoryBound(f"sandbox {sandbox_id}: its trajectory binding changed")

    async def set_network(
        self, sandbox_id: str, policy: NetworkPolicy, caller: Caller
    ) -> SandboxRecord:
        """Replace a live sandbox's network policy (the backend applies it at once).

        Raises:
            InvalidState: the sandbox is not running or paused.
            InvalidArgument: its backend has no sandbox networking.
        """
        rec = self.get(sandbox_id, caller)
        if rec.state not in (State.RUNNING, State.PAUSED):
            raise InvalidState(f"sandbox {sandbox_id} is {rec.state.value}")
        setter = getattr(self._backends.get(rec.spec.backend), "set_network", None)
        if setter is None:
            raise InvalidArgument(f"the {rec.spec.backend} backend has no sandbox networking")
        await setter(sandbox_id, policy)
        rec = replace(rec, spec=replace(rec.spec, network=policy))
        self._save(rec)
        return rec

    async def network_stats(self, rec: SandboxRecord) -> dict[str, int]:
        """Allowed/denied traffic counters of a live sandbox (empty if none)."""
        stats = getattr(self._backends.get(rec.spec.backend), "network_stats", None)
        if stats is None or not rec.live:
            return {}
        try:
            result: dict[str, int] = await stats(rec.id)
        except DsecError:
            return {}
        return result

    async def reap_expired(self) -> None:
        now = self._clock()
        system = Caller(project="", subject="edge", admin=True)
        for rec in list(self._live.values()):
            if rec.state not in (State.RUNNING, State.PAUSED) or rec.expires_at > now:
                continue
            if rec.state is State.RUNNING and rec.spec.on_timeout == "pause":
                try:
                    await self.pause(rec.id, system)
                except DsecError as exc:  # cannot pause: it ends, as any expired sandbox
                    log(_log, "sandbox auto-pause failed", logging.WARNING, sandbox=rec.id,
                        error=exc.message)  # fmt: skip
                else:
                    log(_log, "sandbox timed out: paused", sandbox=rec.id)
                    self._metrics.inc("sandboxes_auto_paused")
                    continue
            log(_log, "sandbox expired", sandbox=rec.id)
            self._metrics.inc("sandboxes_expired")
            with contextlib.suppress(DsecError):
                await self.kill(rec.id, system, reason="timeout")
        self._records.delete_ended_before(now - TERMINAL_RETENTION_S)

    async def adopt(self) -> None:
        """Re-adopt what survived an edge restart; undo or finish anything half done."""
        for rec in self._records.all():
            if not rec.live:
                continue
            backend = self._backends.get(rec.spec.backend)
            paths = self.paths(rec.id)
            if backend is None:
                self._live[rec.id] = rec
                self._save(rec.moved(Event.FAILED if rec.state is State.CREATING else Event.STOP))
                continue
            if rec.state is State.CREATING:
                self._live[rec.id] = rec
                await self._fail_create(rec, backend, paths, RuntimeError("edge restarted"))
                continue
            if rec.state is State.STOPPING:
                self._live[rec.id] = rec
                await self._finish_stop(rec, "stopped while the edge was down")
                continue
            runtime, pid = await backend.state(rec.id)
            if runtime in (RuntimeState.RUNNING, RuntimeState.PAUSED) and pid > 0:
                state = State.PAUSED if runtime is RuntimeState.PAUSED else State.RUNNING
                rec = replace(rec, pid=pid, state=state)
                self._live[rec.id] = rec
                self._save(rec)
                self._watch(rec)
                log(_log, "sandbox re-adopted", sandbox=rec.id, pid=pid)
                self._metrics.inc("sandboxes_adopted")
            else:
                self._live[rec.id] = rec
                await self._on_died(rec.id, "sandbox died while the edge was down")

    async def stop_all(self, reason: str) -> None:
        system = Caller(project="", subject="edge", admin=True)
        await asyncio.gather(
            *(self.kill(r.id, system, reason=reason) for r in list(self._live.values())),
            return_exceptions=True,
        )

    def close(self) -> None:
        loop = asyncio.get_running_loop()
        for fd in self._watch_fds.values():
            loop.remove_reader(fd)
            os.close(fd)
        self._watch_fds.clear()

    # ---- internals -----------------------------------------------------------------

    def _stop_requested(self, sandbox_id: str) -> bool:
        rec = self._live.get(sandbox_id)
        return rec is not None and rec.state is State.STOPPING

    def _save(self, rec: SandboxRecord) -> None:
        self._records.put(rec)
        if rec.live:
            self._live[rec.id] = rec
        else:
            self._live.pop(rec.id, None)
        self._metrics.set("sandboxes", float(len(self._live)))

    def _move(self, rec: SandboxRecord, event: Event, **changes: object) -> SandboxRecord:
        current = self._live.get(rec.id, rec)
        new = current.moved(event, **changes)
        if not new.live:
            new = replace(new, ended_at=self._clock())
        self._save(new)
        return new

    async def _finish_stop(self, rec: SandboxRecord, reason: str) -> SandboxRecord:
        self._unwatch(rec.id)
        backend = self._backends[rec.spec.backend]
        try:
            await backend.destroy(rec.id, self.paths(rec.id))
        except DsecError as exc:
            rec = self._move(rec, Event.FAILED, error=f"teardown failed: {exc.message}")
            log(_log, "sandbox teardown failed", logging.ERROR, sandbox=rec.id, error=exc.message)
        else:
            quiet = reason == "killed" or rec.moved_to  # a move's tombstone names it: moved_to
            rec = self._move(rec, Event.STOPPED, error="" if quiet else reason)
            log(_log, "sandbox stopped", sandbox=rec.id, reason=reason)
        await self._ended(rec.id)
        return rec

    async def _fail_create(
        self, rec: SandboxRecord, backend: Backend, paths: SandboxPaths, exc: BaseException
    ) -> None:
        with contextlib.suppress(Exception):
            await asyncio.shield(backend.destroy(rec.id, paths))
        msg = exc.message if isinstance(exc, DsecError) else f"{type(exc).__name__}: {exc}"
        self._move(rec, Event.FAILED, error=f"create failed: {msg}")
        self._metrics.inc("sandbox_create_failures")
        log(_log, "sandbox create failed", logging.WARNING, sandbox=rec.id, error=msg)
        await self._ended(rec.id)

    @staticmethod
    def _as_create_error(exc: BaseException) -> BaseException:
        if isinstance(exc, DsecError) or not isinstance(exc, Exception):
            return exc
        return SandboxFailed(f"sandbox did not start: {type(exc).__name__}: {exc}")

    async def _ended(self, sandbox_id: str) -> None:
        if self._on_ended is not None:
            try:
                await self._on_ended(sandbox_id)
            except Exception as exc:  # the periodic reconcile will release it later
                log(_log, "release failed", logging.WARNING, sandbox=sandbox_id, error=str(exc))

    def _watch(self, rec: SandboxRecord) -> None:
        if rec.pid <= 0 or rec.id in self._watch_fds:
            return
        try:
            fd = os.pidfd_open(rec.pid)
        except ProcessLookupError:
            self._spawn(self._on_died(rec.id, "sandbox init exited"))
            return
        self._watch_fds[rec.id] = fd
        asyncio.get_running_loop().add_reader(fd, self._pid_exited, rec.id)

    def _unwatch(self, sandbox_id: str) -> None:
        fd = self._watch_fds.pop(sandbox_id, None)
        if fd is not None:
            asyncio.get_running_loop().remove_reader(fd)
            os.close(fd)

    def _pid_exited(self, sandbox_id: str) -> None:
        self._unwatch(sandbox_id)
        self._spawn(self._on_died(sandbox_id, "sandbox init exited"))

    async def _on_died(self, sandbox_id: str, why: str) -> None:
        rec = self._live.get(sandbox_id)
        if rec is None or rec.state not in (State.RUNNING, State.PAUSED):
            return
        rec = self._move(rec, Event.DIED, error=why)
        self._metrics.inc("sandboxes_died")
        log(_log, "sandbox died", logging.WARNING, sandbox=sandbox_id, error=why)
        backend = self._backends.get(rec.spec.backend)
        if backend is not None:
            with contextlib.suppress(DsecError):
                await backend.destroy(sandbox_id, self.paths(sandbox_id))
        await self._ended(sandbox_id)

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


async def _start_main(socket: Path, argv: tuple[str, ...]) -> None:
    """Start the image's Entrypoint + Cmd as the background process tagged ``main``.

    Raises:
        SandboxFailed: the agent could not start it (the create fails and is undone).
    """
    res = await agent_client.call(
        socket,
        {"op": "process.start", "cmd": list(argv), "tag": "main"},
        timeout=AGENT_READY_TIMEOUT_S,
    )
    if res.final.get("error"):
        err = res.final["error"]
        msg = err.get("message", err) if isinstance(err, dict) else err
        raise SandboxFailed(f"the image's entrypoint {list(argv)} did not start: {msg}")
