"""The asyncio SDK: :class:`AsyncClient` and :class:`AsyncSandbox`, the twins of ``sandbox.py``.

Same names, same parameters, same defaults (a unit test compares the two surfaces); every
method awaits instead of blocking, and iterators are ``async for`` iterators. Local file
work in ``upload``/``download``/``write`` runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import builtins
import os
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from dsec.core.errors import NotFound
from dsec.sdk import build, images, streams, wire
from dsec.sdk import runtime_calls as rc
from dsec.sdk import trajectory_calls as tc
from dsec.sdk.async_io import AsyncStdin, AsyncTransport
from dsec.sdk.async_sandbox_runtime import AsyncFiles, AsyncProcesses, AsyncPtys, AsyncShell
from dsec.sdk.config import ClientConfig, resolve_config
from dsec.sdk.models import (
    AccessToken,
    AuditEntry,
    BatchResult,
    ExecEvent,
    ExecResult,
    HttpResponse,
    Identity,
    KeyInfo,
    NewKey,
    SandboxInfo,
    ShellSession,
    SnapshotInfo,
)
from dsec.sdk.tcp import AsyncTcpStream


class AsyncClient:
    """A keep-alive connection to the apiserver, shareable by many sandboxes (asyncio).

    Args:
        api_url: The apiserver URL (else ``DSEC_API_URL``, else the client file).
        api_key: The API key (else ``DSEC_API_KEY``, else the client file).
        config: An already resolved configuration (overrides the two above).
        http_transport: An httpx transport to use instead of the network (tests).
    """

    def __init__(
        self,
        api_url: str | None = None,
        api_key: str | None = None,
        *,
        config: ClientConfig | None = None,
        http_transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.config = config or resolve_config(api_url, api_key)
        self.transport = AsyncTransport(self.config, http_transport=http_transport)

    def sandbox(self, sandbox_id: str) -> AsyncSandbox:
        """A handle on an existing sandbox, without a request (see ``AsyncSandbox.connect``)."""
        wire.sandbox_path(sandbox_id)
        return AsyncSandbox(sandbox_id, self)

    async def list_sandboxes(self, all: bool = False) -> builtins.list[SandboxInfo]:
        return await self.transport.call(wire.list_sandboxes(all))

    async def get_sandbox(self, sandbox_id: str) -> SandboxInfo:
        return await self.transport.call(wire.get_sandbox(sandbox_id))

    async def kill_sandbox(self, sandbox_id: str) -> SandboxInfo:
        return await self.transport.call(wire.kill_sandbox(sandbox_id))

    async def list_snapshots(
        self, project: str = "", sandbox_id: str = "", name: str = ""
    ) -> builtins.list[SnapshotInfo]:
        """Named snapshots the caller sees (of ``project`` and beneath, of one sandbox, or
        with one name), oldest first."""
        return await self.transport.call(wire.list_snapshots(project, sandbox_id, name))

    async def get_snapshot(self, snapshot_id: str) -> SnapshotInfo:
        return await self.transport.call(wire.get_snapshot(snapshot_id))

    async def delete_snapshot(self, snapshot_id: str) -> SnapshotInfo:
        """Remove a snapshot (sandboxes made from it keep running)."""
        return await self.transport.call(wire.delete_snapshot(snapshot_id))

    async def batch_sandboxes(
        self,
        action: str,
        ids: Sequence[str] | None = None,
        project: str | None = None,
    ) -> builtins.list[BatchResult]:
        """Pause, resume or kill many sandboxes in one call: the ``ids`` given, or every
        live sandbox of ``project``. One :class:`BatchResult` per sandbox; a sandbox that
        is missing or not yours fails alone (its ``error``), the others go on."""
        return await self.transport.call(wire.batch_sandboxes(action, ids, project))

    async def whoami(self) -> Identity:
        return await self.transport.call(wire.whoami())

    async def create_key(
        self, subject: str, project: str, role: str = "member", name: str = ""
    ) -> NewKey:
        return await self.transport.call(
            wire.create_key(subject=subject, project=project, role=role, name=name)
        )

    async def list_keys(self) -> builtins.list[KeyInfo]:
        return await self.transport.call(wire.list_keys())

    async def revoke_key(self, key_id: str) -> None:
        await self.transport.call(wire.revoke_key(key_id))

    async def audit(
        self,
        *,
        since: str = "",
        until: str = "",
        project: str = "",
        actor: str = "",
        action: str = "",
        limit: int = 1000,
    ) -> builtins.list[AuditEntry]:
        """Audit entries, oldest first (admin); times are epoch, ISO-8601 or ages (``1h``)."""
        return await self.transport.call(
            wire.query_audit(
                since=since, until=until, project=project, actor=actor, action=action, limit=limit
            )
        )

    async def put_project(
        self, name: str, *, max_sandboxes: int = 0, max_cpu: float = 0, max_memory_mb: int = 0
    ) -> dict[str, Any]:
        """Create project ``name`` (a path, its parent must exist) or set its quota (0: none)."""
        return await self.transport.call(
            wire.put_project(name, max_sandboxes, max_cpu, max_memory_mb)
        )

    async def list_projects(self) -> builtins.list[dict[str, Any]]:
        return await self.transport.call(wire.list_projects())

    async def delete_project(self, name: str) -> None:
        await self.transport.call(wire.delete_project(name))

    async def usage(self, project: str = "") -> dict[str, Any]:
        """What ``project`` (default: the key's) and everything beneath it use."""
        return await self.transport.call(wire.usage(project))

    async def grant_role(self, project: str, subject: str, role: str) -> None:
        """Give ``subject`` ``role`` (admin, member, viewer; "" removes) on ``project`` and
        everything beneath it."""
        await self.transport.call(wire.grant_role(project, subject, role))

    async def list_grants(
        self, project: str = "", subject: str = ""
    ) -> builtins.list[dict[str, Any]]:
        return await self.transport.call(wire.list_grants(project, subject))

    async def create_join_token(self, ttl_s: int = 3600) -> dict[str, Any]:
        """A one-time bootstrap token for ``dsec edge join`` (platform admin)."""
        return await self.transport.call(wire.create_join_token(ttl_s))

    async def create_token(self, ttl_s: int = 600) -> AccessToken:
        """Exchange this client's API key for a short-lived access token."""
        return await self.transport.call(wire.create_token(ttl_s))

    async def revoke(self, kind: str, value: str) -> None:
        """Revoke a ``token`` (by id), a ``key`` (by id) or a ``subject`` (all of it)."""
        await self.transport.call(wire.revoke(kind, value))

    async def verify_audit(self) -> dict[str, Any]:
        """Check the audit log's hash chain: ``{entries, intact, broken_at, head_hash}``."""
        return await self.transport.call(wire.verify_audit())

    async def list_edges(self) -> builtins.list[dict[str, object]]:
        return await self.transport.call(wire.list_edges())

    async def pull_image(
        self,
        reference: str,
        *,
        platform: str = "",
        insecure: bool = False,
        username: str = "",
        password: str = "",
        edge_id: str = "",
        progress: images.PullProgress | None = None,
    ) -> builtins.list[dict[str, Any]]:
        """Pull an image onto every edge (or ``edge_id``); ``progress`` gets layer reports."""
        req = images.pull_request(
            reference,
            platform=platform,
            insecure=insecure,
            username=username,
            password=password,
            edge_id=edge_id,
        )
        reader = images.PullReader(progress)
        async with self.transport.download(req) as chunks:
            async for chunk in chunks:
                reader.feed(chunk)
        return reader.result()

    async def build_image(
        self,
        context: str | Path,
        tag: str,
        *,
        dockerfile: str | Path | None = None,
        build_args: dict[str, str] | None = None,
        no_cache: bool = False,
        edge_id: str = "",
        progress: build.BuildProgress | None = None,
    ) -> dict[str, Any]:
        """Build ``tag`` from a Dockerfile on one edge (``dsec image build``).

        ``progress`` gets ``{"step": {index, total, instruction, line}}``,
        ``{"cached": True}`` and ``{"log": text}`` (RUN output) reports.

        Raises:
            InvalidArgument: a bad Dockerfile or a failed RUN (the message names the line).
        """
        tar, df_name = await asyncio.to_thread(build.context_tar, context, dockerfile)
        req = build.build_request(
            tar,
            tag,
            dockerfile=df_name,
            build_args=build_args,
            no_cache=no_cache,
            edge_id=edge_id,
        )
        reader = build.BuildReader(progress)
        async with self.transport.download(req) as chunks:
            async for chunk in chunks:
                reader.feed(chunk)
        return reader.result()

    async def save_image(
        self,
        name: str,
        path: str | Path,
        *,
        edge_id: str = "",
        progress: Callable[[int], None] | None = None,
    ) -> int:
        """Write image ``name`` to ``path`` as an OCI image-layout tar; returns its size."""
        req = images.save_request(name, edge_id=edge_id)
        dest = Path(path)
        tmp = dest.with_name(f".{dest.name}.part")
        size = 0
        out = await asyncio.to_thread(tmp.open, "wb")
        try:
            async with self.transport.download(req) as chunks:
                async for chunk in chunks:
                    await asyncio.to_thread(out.write, chunk)
                    size += len(chunk)
                    if progress is not None:
                        progress(size)
            await asyncio.to_thread(out.close)
            await asyncio.to_thread(os.replace, tmp, dest)
        except BaseException:
            out.close()
            tmp.unlink(missing_ok=True)
            raise
        return size

    async def load_image(
        self,
        path: str | Path,
        *,
        name: str = "",
        edge_id: str = "",
        progress: images.PullProgress | None = None,
    ) -> builtins.list[dict[str, Any]]:
        """Import the OCI image-layout tar ``path`` on one edge (``name`` renames a
        single image); ``progress`` gets blob reports. Returns the images loaded."""
        req = images.load_request(name=name, edge_id=edge_id)
        return await self._upload_image(path, req, progress, count=False)

    async def import_vm_image(
        self,
        path: str | Path,
        name: str,
        *,
        edge_id: str = "",
        progress: images.PullProgress | None = None,
    ) -> dict[str, Any]:
        """Import the bootable disk ``path`` (raw or qcow2, with its own kernel and systemd)
        as vm system image ``name`` on one edge; ``Sandbox.create(backend="vm", image=name)``
        boots it. ``progress`` gets the upload's bytes, then the edge's import steps."""
        req = images.load_request(name=name, edge_id=edge_id, kind="vm")
        return images.one_image(await self._upload_image(path, req, progress, count=True))

    async def _upload_image(
        self,
        path: str | Path,
        req: wire.Request,
        progress: images.PullProgress | None,
        *,
        count: bool,
    ) -> builtins.list[dict[str, Any]]:
        """Stream the file ``path`` as the body of the load request ``req``; ``progress``
        gets the edge's reports (and the bytes sent, with ``count``). Returns the images."""
        reader = images.PullReader(progress)
        f = await asyncio.to_thread(Path(path).open, "rb")
        sent = images.upload_progress(progress, os.fstat(f.fileno()).st_size)

        async def body() -> AsyncIterator[bytes]:
            done = 0
            while chunk := await asyncio.to_thread(f.read, 1 << 20):
                done += len(chunk)
                if count:
                    sent(done)
                yield chunk

        try:
            async with self.transport.download(req, content=body()) as chunks:
                async for chunk in chunks:
                    reader.feed(chunk)
        finally:
            f.close()
        return reader.result()

    async def backends(self) -> builtins.list[dict[str, Any]]:
        """Each edge's backends: ``{edge_id, healthy, backends: [{name, available, reason,
        capabilities}]}`` (``error`` instead when an edge does not answer)."""
        return await self.transport.call(wire.list_backends())

    async def list_images(self) -> builtins.list[dict[str, Any]]:
        """Images on every edge (one entry per edge and image)."""
        return await self.transport.call(images.list_images())

    async def remove_image(self, name: str) -> dict[str, Any]:
        """Forget an image on every edge (admin); its layers go at the next gc."""
        return await self.transport.call(images.remove_image(name))

    async def list_trajectories(
        self, project: str | None = None, name: str | None = None
    ) -> builtins.list[dict[str, Any]]:
        return await self.transport.call(tc.list_trajectories(project, name))

    async def get_trajectory(self, trajectory_id: str) -> dict[str, Any]:
        return await self.transport.call(tc.get(trajectory_id))

    async def export_trajectory(self, trajectory_id: str) -> builtins.list[dict[str, Any]]:
        """Every step (request, result, payloads as base64), as JSON Lines records."""
        return await self.transport.call(tc.export(trajectory_id))

    async def remove_trajectory(self, trajectory_id: str) -> dict[str, Any]:
        return await self.transport.call(tc.remove(trajectory_id))

    async def trajectory_quota(self, project: str | None = None) -> dict[str, Any]:
        return await self.transport.call(tc.quota(project))

    async def set_trajectory_quota(self, project: str, limit_bytes: int) -> dict[str, Any]:
        return await self.transport.call(tc.set_quota(project, limit_bytes))

    async def gc_images(self) -> dict[str, Any]:
        """Remove unreferenced layers and blobs on every edge (admin)."""
        return await self.transport.call(images.gc_images())

    async def aclose(self) -> None:
        """Close the pooled HTTP connections."""
        await self.transport.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


class AsyncSandbox:
    """One sandbox. ``async with`` it to kill it (and close its client) on exit."""

    def __init__(self, sandbox_id: str, client: AsyncClient, *, owns_client: bool = False) -> None:
        self._id = sandbox_id
        self._client = client
        self._t = client.transport
        self._owns_client = owns_client
        self._bind(sandbox_id)

    def _bind(self, sandbox_id: str) -> None:
        """Address ``sandbox_id`` from now on (a sandbox moved to another edge)."""
        self._id = sandbox_id
        self.files = AsyncFiles(sandbox_id, self._t)
        self.processes = AsyncProcesses(sandbox_id, self._t)
        self.pty = AsyncPtys(sandbox_id, self._t)

    @classmethod
    async def create(
        cls,
        backend: str = "container",
        image: str = "base",
        cpu: float = 1.0,
        memory_mb: int = 512,
        pids: int | None = None,
        timeout: int = 300,  # noqa: ASYNC109 -- the sandbox's lifetime, not a call deadline
        env: Mapping[str, str] | None = None,
        metadata: Mapping[str, str] | None = None,
        network: Mapping[str, Any] | None = None,
        *,
        on_timeout: str | None = None,
        project: str | None = None,
        trajectory: str | None = None,
        on_mismatch: str = "diverge",
        checkpoint_every: int = 0,
        api_key: str | None = None,
        api_url: str | None = None,
        client: AsyncClient | None = None,
    ) -> AsyncSandbox:
        """Create a sandbox and wait until it runs; ``timeout`` is its lifetime in seconds.

        With ``trajectory``, every runtime call is recorded in that trajectory's log. If the
        trajectory already has steps (a preempted task starting again), this re-attaches to
        its sandbox (or restores one) and the calls replay the recorded results until one
        differs; then ``on_mismatch`` decides: ``"diverge"`` runs it for real from there,
        ``"fail"`` raises ``TrajectoryMismatch``. ``checkpoint_every=N`` packs the sandbox
        every N steps so it can be restored if it is lost. ``on_timeout="pause"`` pauses the
        sandbox when its timeout passes instead of ending it (backends that pause); a
        ``resume()`` then gives it a new ``timeout``.
        """
        call = wire.create_sandbox(
            backend=backend,
            image=image,
            cpu=cpu,
            memory_mb=memory_mb,
            pids=pids,
            timeout_s=timeout,
            env=env,
            metadata=metadata,
            project=project,
            network=network,
            on_timeout=on_timeout,
            extra=tc.policy_body(trajectory, on_mismatch, checkpoint_every),
        )
        return await cls._start(call, client, api_url, api_key)

    @classmethod
    async def _start(
        cls,
        call: wire.Call[SandboxInfo],
        client: AsyncClient | None,
        api_url: str | None,
        api_key: str | None,
    ) -> AsyncSandbox:
        """Send a create ``call`` (on ``client``, or a client of our own, closed on failure)."""
        owned = client is None
        c = client or AsyncClient(api_url, api_key)
        try:
            info = await c.transport.call(call)
        except BaseException:
            if owned:
                await c.aclose()
            raise
        return cls(info.id, c, owns_client=owned)

    @classmethod
    async def from_snapshot(
        cls,
        snapshot_id: str,
        timeout: int = 300,  # noqa: ASYNC109 -- the sandbox's lifetime
        metadata: Mapping[str, str] | None = None,
        *,
        project: str | None = None,
        edge: str | None = None,
        api_key: str | None = None,
        api_url: str | None = None,
        client: AsyncClient | None = None,
    ) -> AsyncSandbox:
        """A new sandbox from named snapshot ``snapshot_id`` (see :meth:`snapshot`), on the
        snapshot's edge: a ``full`` snapshot resumes its processes and memory, a
        ``filesystem`` one boots with its files. ``timeout`` is the new sandbox's lifetime.
        ``edge``: start it on that edge instead (a full snapshot is copied there first,
        streamed and checked by digest)."""
        call = wire.create_from_snapshot(snapshot_id, timeout, metadata, project, edge)
        return await cls._start(call, client, api_url, api_key)

    @classmethod
    async def connect(
        cls,
        sandbox_id: str,
        *,
        api_key: str | None = None,
        api_url: str | None = None,
        client: AsyncClient | None = None,
    ) -> AsyncSandbox:
        """Attach to an existing sandbox (checks that it exists)."""
        owned = client is None
        c = client or AsyncClient(api_url, api_key)
        try:
            info = await c.get_sandbox(sandbox_id)
        except BaseException:
            if owned:
                await c.aclose()
            raise
        return cls(info.id, c, owns_client=owned)

    @classmethod
    async def list(
        cls,
        all: bool = False,
        *,
        api_key: str | None = None,
        api_url: str | None = None,
        client: AsyncClient | None = None,
    ) -> builtins.list[SandboxInfo]:
        """The caller's sandboxes (running ones, or every one with ``all=True``)."""
        if client is not None:
            return await client.list_sandboxes(all)
        async with AsyncClient(api_url, api_key) as c:
            return await c.list_sandboxes(all)

    @property
    def id(self) -> str:
        return self._id

    @property
    def client(self) -> AsyncClient:
        return self._client

    async def info(self) -> SandboxInfo:
        return await self._t.call(wire.get_sandbox(self._id))

    async def set_network(self, network: Mapping[str, Any]) -> SandboxInfo:
        """Replace the network policy: ``{"allow": [...], "deny": [...]}`` (rules as in
        ``create``); established connections that stay allowed keep going."""
        return await self._t.call(wire.set_network(self._id, network))

    async def set_timeout(self, seconds: int) -> SandboxInfo:
        """Let the sandbox live ``seconds`` from now."""
        return await self._t.call(wire.set_timeout(self._id, seconds))

    async def kill(self) -> SandboxInfo:
        return await self._t.call(wire.kill_sandbox(self._id))

    async def pause(self) -> SandboxInfo:
        """Freeze every process in the sandbox; runtime calls fail until :meth:`resume`."""
        return await self._t.call(wire.pause_sandbox(self._id))

    async def resume(self, *, edge: str | None = None) -> SandboxInfo:
        """Resume this paused sandbox. ``edge``: on that edge (microvm; also done when its
        own edge is full): it moves there under a new id, which this object takes on; the
        old id answers 404 naming the new one."""
        info = await self._t.call(wire.resume_sandbox(self._id, edge))
        if info.id != self._id:
            self._bind(info.id)
        return info

    async def bind_trajectory(
        self, trajectory: str, *, on_mismatch: str = "diverge", checkpoint_every: int = 0
    ) -> dict[str, Any]:
        """Record this sandbox's runtime calls into ``trajectory`` from now on."""
        return await self._t.call(tc.bind(self._id, trajectory, on_mismatch, checkpoint_every))

    async def trajectory_status(self) -> dict[str, Any]:
        """The bound trajectory: steps, ``mode`` (record/replay), ``cursor``, ``replayed``,
        ``checkpoints`` and the last ``divergence`` (step, field, recorded, actual)."""
        return await self._t.call(tc.status(self._id))

    async def checkpoint(self) -> dict[str, Any]:
        """Pack the sandbox as the bound trajectory's latest checkpoint."""
        return await self._t.call(tc.checkpoint(self._id))

    async def snapshot(self, name: str = "", mode: str | None = None) -> SnapshotInfo:
        """Take a named snapshot of this running sandbox, which keeps running. ``mode``:
        ``"full"`` (memory, processes and disk; microvm) or ``"filesystem"`` (files only;
        container); default: what the backend can. Start sandboxes from it with
        :meth:`from_snapshot`."""
        return await self._t.call(wire.create_snapshot(self._id, name, mode))

    async def fork(self, count: int = 1, *, edge: str | None = None) -> builtins.list[AsyncSandbox]:
        """Start ``count`` copies of this running sandbox from one memory snapshot (microvm):
        processes, shells and files carry on in each child, which has its own id.
        ``edge``: start the children on that edge (a full snapshot is copied there)."""
        infos = await self._t.call(wire.fork_sandbox(self._id, count, edge=edge))
        return [AsyncSandbox(i.id, self._client) for i in infos]

    async def pack(
        self,
        name: str,
        *,
        push: bool = False,
        insecure: bool = False,
        username: str = "",
        password: str = "",
    ) -> dict[str, Any]:
        """Record this sandbox's changes as a new image ``name`` on top of its image."""
        return await self._t.call(
            images.pack_sandbox(
                self._id, name, push=push, insecure=insecure, username=username, password=password
            )
        )

    async def exec(
        self,
        cmd: rc.Command,
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | int | None = None,
        timeout: float | None = 60,  # noqa: ASYNC109 -- enforced inside the sandbox
        stdin: str | bytes | None = None,
        files: Mapping[str, str | bytes] | None = None,
        outputs: Sequence[str] | None = None,
        memory_mb: int | None = None,
        idempotent: bool = False,
    ) -> ExecResult:
        """Run ``cmd`` to completion; raises ``CommandTimeout`` (with ``.result``) on timeout.

        ``files`` (path -> content) are written before the command runs and ``outputs``
        (paths) come back in ``result.files``; ``memory_mb`` lowers the memory limit for
        this call alone (the function backend; others share the sandbox's limit).

        ``idempotent=True`` tells a trajectory log that this call may run again when the
        sandbox has to be rebuilt from a checkpoint.
        """
        call = rc.exec_command(
            self._id,
            cmd,
            env=env,
            cwd=cwd,
            user=user,
            timeout=timeout,
            stdin=stdin,
            files=files,
            outputs=outputs,
            memory_mb=memory_mb,
        )
        return await self._t.call(tc.idempotent(call, idempotent))

    def exec_stream(
        self,
        cmd: rc.Command,
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | int | None = None,
        timeout: float | None = 60,
        stdin: AsyncStdin | None = None,
    ) -> AsyncGenerator[ExecEvent, None]:
        """Run ``cmd`` yielding output chunks as they come, then one ``exit`` event."""
        first = streams.exec_request(
            cmd, env=env, cwd=cwd, user=user, timeout=timeout, stdin=stdin is not None
        )
        return self._t.events(self._id, first, stdin)

    def shell(self, name: str = "default") -> AsyncShell:
        """The named persistent shell session (started on first use)."""
        rc.check_shell_name(name)
        return AsyncShell(self._id, self._t, name)

    async def shells(self) -> builtins.list[ShellSession]:
        return await self._t.call(rc.list_shells(self._id))

    async def http(
        self,
        port: int,
        method: str = "GET",
        path: str = "/",
        headers: Mapping[str, str] | None = None,
        body: bytes | str | None = None,
        *,
        timeout: float | None = 60,  # noqa: ASYNC109 -- enforced inside the sandbox
    ) -> HttpResponse:
        """Send an HTTP request to ``port`` inside the sandbox: ``(status, headers, body)``."""
        req = rc.port_request(self._id, port, method, path, headers, body, timeout)
        return await self._t.port(req)

    async def connect_tcp(self, port: int) -> AsyncTcpStream:
        """Open a raw TCP stream to ``port`` inside the sandbox (no network rule needed)."""
        return await AsyncTcpStream.open(self._t, self._id, port)

    async def aclose(self) -> None:
        """Close the HTTP client if this sandbox created it (the sandbox keeps running)."""
        if self._owns_client:
            await self._client.aclose()

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            await self.kill()
        except NotFound:
            pass
        finally:
            await self.aclose()

    def __repr__(self) -> str:
        return f"AsyncSandbox({self._id!r})"
