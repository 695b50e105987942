"""The blocking SDK: :class:`Client` and :class:`Sandbox` with its files, processes, PTYs, shells.

Every method is one line of glue: build a call with ``wire``/``runtime_calls``/``streams``,
send it with :class:`~dsec.sdk.sync_io.SyncTransport`. ``async_sandbox.py`` mirrors this
module name for name (a unit test checks the two surfaces match).
"""

from __future__ import annotations

import builtins
import os
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from dsec.core.errors import NotFound
from dsec.sdk import build, images, streams, wire
from dsec.sdk import runtime_calls as rc
from dsec.sdk import trajectory_calls as tc
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
from dsec.sdk.sandbox_runtime import Files, Processes, Ptys, Shell
from dsec.sdk.sync_io import SyncTransport
from dsec.sdk.tcp import TcpStream

Stdin = bytes | Iterable[bytes]


class Client:
    """A keep-alive connection to the apiserver, shareable by many sandboxes.

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
        http_transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.config = config or resolve_config(api_url, api_key)
        self.transport = SyncTransport(self.config, http_transport=http_transport)

    def sandbox(self, sandbox_id: str) -> Sandbox:
        """A handle on an existing sandbox, without a request (see ``Sandbox.connect``)."""
        wire.sandbox_path(sandbox_id)
        return Sandbox(sandbox_id, self)

    def list_sandboxes(self, all: bool = False) -> builtins.list[SandboxInfo]:
        return self.transport.call(wire.list_sandboxes(all))

    def get_sandbox(self, sandbox_id: str) -> SandboxInfo:
        return self.transport.call(wire.get_sandbox(sandbox_id))

    def kill_sandbox(self, sandbox_id: str) -> SandboxInfo:
        return self.transport.call(wire.kill_sandbox(sandbox_id))

    def list_snapshots(
        self, project: str = "", sandbox_id: str = "", name: str = ""
    ) -> builtins.list[SnapshotInfo]:
        """Named snapshots the caller sees (of ``project`` and beneath, of one sandbox, or
        with one name), oldest first."""
        return self.transport.call(wire.list_snapshots(project, sandbox_id, name))

    def get_snapshot(self, snapshot_id: str) -> SnapshotInfo:
        return self.transport.call(wire.get_snapshot(snapshot_id))

    def delete_snapshot(self, snapshot_id: str) -> SnapshotInfo:
        """Remove a snapshot (sandboxes made from it keep running)."""
        return self.transport.call(wire.delete_snapshot(snapshot_id))

    def batch_sandboxes(
        self,
        action: str,
        ids: Sequence[str] | None = None,
        project: str | None = None,
    ) -> builtins.list[BatchResult]:
        """Pause, resume or kill many sandboxes in one call: the ``ids`` given, or every
        live sandbox of ``project``. One :class:`BatchResult` per sandbox; a sandbox that
        is missing or not yours fails alone (its ``error``), the others go on."""
        return self.transport.call(wire.batch_sandboxes(action, ids, project))

    def whoami(self) -> Identity:
        return self.transport.call(wire.whoami())

    def create_key(
        self, subject: str, project: str, role: str = "member", name: str = ""
    ) -> NewKey:
        return self.transport.call(
            wire.create_key(subject=subject, project=project, role=role, name=name)
        )

    def list_keys(self) -> builtins.list[KeyInfo]:
        return self.transport.call(wire.list_keys())

    def revoke_key(self, key_id: str) -> None:
        self.transport.call(wire.revoke_key(key_id))

    def audit(
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
        return self.transport.call(
            wire.query_audit(
                since=since, until=until, project=project, actor=actor, action=action, limit=limit
            )
        )

    def put_project(
        self, name: str, *, max_sandboxes: int = 0, max_cpu: float = 0, max_memory_mb: int = 0
    ) -> dict[str, Any]:
        """Create project ``name`` (a path, its parent must exist) or set its quota (0: none)."""
        return self.transport.call(wire.put_project(name, max_sandboxes, max_cpu, max_memory_mb))

    def list_projects(self) -> builtins.list[dict[str, Any]]:
        return self.transport.call(wire.list_projects())

    def delete_project(self, name: str) -> None:
        self.transport.call(wire.delete_project(name))

    def usage(self, project: str = "") -> dict[str, Any]:
        """What ``project`` (default: the key's) and everything beneath it use."""
        return self.transport.call(wire.usage(project))

    def grant_role(self, project: str, subject: str, role: str) -> None:
        """Give ``subject`` ``role`` (admin, member, viewer; "" removes) on ``project`` and
        everything beneath it."""
        self.transport.call(wire.grant_role(project, subject, role))

    def list_grants(self, project: str = "", subject: str = "") -> builtins.list[dict[str, Any]]:
        return self.transport.call(wire.list_grants(project, subject))

    def create_join_token(self, ttl_s: int = 3600) -> dict[str, Any]:
        """A one-time bootstrap token for ``dsec edge join`` (platform admin)."""
        return self.transport.call(wire.create_join_token(ttl_s))

    def create_token(self, ttl_s: int = 600) -> AccessToken:
        """Exchange this client's API key for a short-lived access token."""
        return self.transport.call(wire.create_token(ttl_s))

    def revoke(self, kind: str, value: str) -> None:
        """Revoke a ``token`` (by id), a ``key`` (by id) or a ``subject`` (all of it)."""
        self.transport.call(wire.revoke(kind, value))

    def verify_audit(self) -> dict[str, Any]:
        """Check the audit log's hash chain: ``{entries, intact, broken_at, head_hash}``."""
        return self.transport.call(wire.verify_audit())

    def list_edges(self) -> builtins.list[dict[str, object]]:
        return self.transport.call(wire.list_edges())

    def pull_image(
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
        """Pull an image onto every edge (or ``edge_id``); ``progress`` gets layer reports.

        Returns one image description per edge.
        """
        req = images.pull_request(
            reference,
            platform=platform,
            insecure=insecure,
            username=username,
            password=password,
            edge_id=edge_id,
        )
        reader = images.PullReader(progress)
        with self.transport.download(req) as chunks:
            for chunk in chunks:
                reader.feed(chunk)
        return reader.result()

    def build_image(
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
        tar, df_name = build.context_tar(context, dockerfile)
        req = build.build_request(
            tar,
            tag,
            dockerfile=df_name,
            build_args=build_args,
            no_cache=no_cache,
            edge_id=edge_id,
        )
        reader = build.BuildReader(progress)
        with self.transport.download(req) as chunks:
            for chunk in chunks:
                reader.feed(chunk)
        return reader.result()

    def save_image(
        self,
        name: str,
        path: str | Path,
        *,
        edge_id: str = "",
        progress: Callable[[int], None] | None = None,
    ) -> int:
        """Write image ``name`` to ``path`` as an OCI image-layout tar; returns its size.

        ``progress`` gets the bytes written so far. The file appears only when complete.
        """
        req = images.save_request(name, edge_id=edge_id)
        dest = Path(path)
        tmp = dest.with_name(f".{dest.name}.part")
        size = 0
        try:
            with tmp.open("wb") as out, self.transport.download(req) as chunks:
                for chunk in chunks:
                    out.write(chunk)
                    size += len(chunk)
                    if progress is not None:
                        progress(size)
            os.replace(tmp, dest)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return size

    def load_image(
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
        return self._upload_image(path, req, progress, count=False)

    def import_vm_image(
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
        return images.one_image(self._upload_image(path, req, progress, count=True))

    def _upload_image(
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
        sent = images.upload_progress(progress, Path(path).stat().st_size)
        with Path(path).open("rb") as f:

            def body() -> Iterator[bytes]:
                done = 0
                while chunk := f.read(1 << 20):
                    done += len(chunk)
                    if count:
                        sent(done)
                    yield chunk

            with self.transport.download(req, content=body()) as chunks:
                for chunk in chunks:
                    reader.feed(chunk)
        return reader.result()

    def backends(self) -> builtins.list[dict[str, Any]]:
        """Each edge's backends: ``{edge_id, healthy, backends: [{name, available, reason,
        capabilities}]}`` (``error`` instead when an edge does not answer)."""
        return self.transport.call(wire.list_backends())

    def list_images(self) -> builtins.list[dict[str, Any]]:
        """Images on every edge (one entry per edge and image)."""
        return self.transport.call(images.list_images())

    def remove_image(self, name: str) -> dict[str, Any]:
        """Forget an image on every edge (admin); its layers go at the next gc."""
        return self.transport.call(images.remove_image(name))

    def list_trajectories(
        self, project: str | None = None, name: str | None = None
    ) -> builtins.list[dict[str, Any]]:
        return self.transport.call(tc.list_trajectories(project, name))

    def get_trajectory(self, trajectory_id: str) -> dict[str, Any]:
        return self.transport.call(tc.get(trajectory_id))

    def export_trajectory(self, trajectory_id: str) -> builtins.list[dict[str, Any]]:
        """Every step (request, result, payloads as base64), as JSON Lines records."""
        return self.transport.call(tc.export(trajectory_id))

    def remove_trajectory(self, trajectory_id: str) -> dict[str, Any]:
        return self.transport.call(tc.remove(trajectory_id))

    def trajectory_quota(self, project: str | None = None) -> dict[str, Any]:
        return self.transport.call(tc.quota(project))

    def set_trajectory_quota(self, project: str, limit_bytes: int) -> dict[str, Any]:
        return self.transport.call(tc.set_quota(project, limit_bytes))

    def gc_images(self) -> dict[str, Any]:
        """Remove unreferenced layers and blobs on every edge (admin)."""
        return self.transport.call(images.gc_images())

    def close(self) -> None:
        """Close the pooled HTTP connections."""
        self.transport.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class Sandbox:
    """One sandbox. Use as a context manager to kill it (and close its client) on exit."""

    def __init__(self, sandbox_id: str, client: Client, *, owns_client: bool = False) -> None:
        self._id = sandbox_id
        self._client = client
        self._t = client.transport
        self._owns_client = owns_client
        self._bind(sandbox_id)

    def _bind(self, sandbox_id: str) -> None:
        """Address ``sandbox_id`` from now on (a sandbox moved to another edge)."""
        self._id = sandbox_id
        self.files = Files(sandbox_id, self._t)
        self.processes = Processes(sandbox_id, self._t)
        self.pty = Ptys(sandbox_id, self._t)

    @classmethod
    def create(
        cls,
        backend: str = "container",
        image: str = "base",
        cpu: float = 1.0,
        memory_mb: int = 512,
        pids: int | None = None,
        timeout: int = 300,
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
        client: Client | None = None,
    ) -> Sandbox:
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
        return cls._start(call, client, api_url, api_key)

    @classmethod
    def _start(
        cls,
        call: wire.Call[SandboxInfo],
        client: Client | None,
        api_url: str | None,
        api_key: str | None,
    ) -> Sandbox:
        """Send a create ``call`` (on ``client``, or a client of our own, closed on failure)."""
        owned = client is None
        c = client or Client(api_url, api_key)
        try:
            info = c.transport.call(call)
        except BaseException:
            if owned:
                c.close()
            raise
        return cls(info.id, c, owns_client=owned)

    @classmethod
    def from_snapshot(
        cls,
        snapshot_id: str,
        timeout: int = 300,
        metadata: Mapping[str, str] | None = None,
        *,
        project: str | None = None,
        edge: str | None = None,
        api_key: str | None = None,
        api_url: str | None = None,
        client: Client | None = None,
    ) -> Sandbox:
        """A new sandbox from named snapshot ``snapshot_id`` (see :meth:`snapshot`), on the
        snapshot's edge: a ``full`` snapshot resumes its processes and memory, a
        ``filesystem`` one boots with its files. ``timeout`` is the new sandbox's lifetime.
        ``edge``: start it on that edge instead (a full snapshot is copied there first,
        streamed and checked by digest)."""
        call = wire.create_from_snapshot(snapshot_id, timeout, metadata, project, edge)
        return cls._start(call, client, api_url, api_key)

    @classmethod
    def connect(
        cls,
        sandbox_id: str,
        *,
        api_key: str | None = None,
        api_url: str | None = None,
        client: Client | None = None,
    ) -> Sandbox:
        """Attach to an existing sandbox (checks that it exists)."""
        owned = client is None
        c = client or Client(api_url, api_key)
        try:
            info = c.get_sandbox(sandbox_id)
        except BaseException:
            if owned:
                c.close()
            raise
        return cls(info.id, c, owns_client=owned)

    @classmethod
    def list(
        cls,
        all: bool = False,
        *,
        api_key: str | None = None,
        api_url: str | None = None,
        client: Client | None = None,
    ) -> builtins.list[SandboxInfo]:
        """The caller's sandboxes (running ones, or every one with ``all=True``)."""
        if client is not None:
            return client.list_sandboxes(all)
        with Client(api_url, api_key) as c:
            return c.list_sandboxes(all)

    @property
    def id(self) -> str:
        return self._id

    @property
    def client(self) -> Client:
        return self._client

    def info(self) -> SandboxInfo:
        return self._t.call(wire.get_sandbox(self._id))

    def set_network(self, network: Mapping[str, Any]) -> SandboxInfo:
        """Replace the network policy: ``{"allow": [...], "deny": [...]}`` (rules as in
        ``create``); established connections that stay allowed keep going."""
        return self._t.call(wire.set_network(self._id, network))

    def set_timeout(self, seconds: int) -> SandboxInfo:
        """Let the sandbox live ``seconds`` from now."""
        return self._t.call(wire.set_timeout(self._id, seconds))

    def kill(self) -> SandboxInfo:
        return self._t.call(wire.kill_sandbox(self._id))

    def pause(self) -> SandboxInfo:
        """Freeze every process in the sandbox; runtime calls fail until :meth:`resume`."""
        return self._t.call(wire.pause_sandbox(self._id))

    def resume(self, *, edge: str | None = None) -> SandboxInfo:
        """Resume this paused sandbox. ``edge``: on that edge (microvm; also done when its
        own edge is full): it moves there under a new id, which this object takes on; the
        old id answers 404 naming the new one."""
        info = self._t.call(wire.resume_sandbox(self._id, edge))
        if info.id != self._id:
            self._bind(info.id)
        return info

    def bind_trajectory(
        self, trajectory: str, *, on_mismatch: str = "diverge", checkpoint_every: int = 0
    ) -> dict[str, Any]:
        """Record this sandbox's runtime calls into ``trajectory`` from now on."""
        return self._t.call(tc.bind(self._id, trajectory, on_mismatch, checkpoint_every))

    def trajectory_status(self) -> dict[str, Any]:
        """The bound trajectory: steps, ``mode`` (record/replay), ``cursor``, ``replayed``,
        ``checkpoints`` and the last ``divergence`` (step, field, recorded, actual)."""
        return self._t.call(tc.status(self._id))

    def checkpoint(self) -> dict[str, Any]:
        """Pack the sandbox as the bound trajectory's latest checkpoint."""
        return self._t.call(tc.checkpoint(self._id))

    def snapshot(self, name: str = "", mode: str | None = None) -> SnapshotInfo:
        """Take a named snapshot of this running sandbox, which keeps running. ``mode``:
        ``"full"`` (memory, processes and disk; microvm) or ``"filesystem"`` (files only;
        container); default: what the backend can. Start sandboxes from it with
        :meth:`from_snapshot`."""
        return self._t.call(wire.create_snapshot(self._id, name, mode))

    def fork(self, count: int = 1, *, edge: str | None = None) -> builtins.list[Sandbox]:
        """Start ``count`` copies of this running sandbox from one memory snapshot (microvm):
        processes, shells and files carry on in each child, which has its own id.
        ``edge``: start the children on that edge (a full snapshot is copied there)."""
        infos = self._t.call(wire.fork_sandbox(self._id, count, edge=edge))
        return [Sandbox(i.id, self._client) for i in infos]

    def pack(
        self,
        name: str,
        *,
        push: bool = False,
        insecure: bool = False,
        username: str = "",
        password: str = "",
    ) -> dict[str, Any]:
        """Record this sandbox's changes as a new image ``name`` on top of its image.

        The sandbox is frozen while its changes are read; a sandbox created from ``name``
        sees exactly this state. With ``push``, ``name`` must be a registry reference
        (``host/repo:tag``) and the image is pushed there. Returns its description.
        """
        return self._t.call(
            images.pack_sandbox(
                self._id, name, push=push, insecure=insecure, username=username, password=password
            )
        )

    def exec(
        self,
        cmd: rc.Command,
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | int | None = None,
        timeout: float | None = 60,
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
        return self._t.call(tc.idempotent(call, idempotent))

    def exec_stream(
        self,
        cmd: rc.Command,
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | int | None = None,
        timeout: float | None = 60,
        stdin: Stdin | None = None,
    ) -> Generator[ExecEvent, None, None]:
        """Run ``cmd`` yielding output chunks as they come, then one ``exit`` event."""
        first = streams.exec_request(
            cmd, env=env, cwd=cwd, user=user, timeout=timeout, stdin=stdin is not None
        )
        return self._t.events(self._id, first, stdin)

    def shell(self, name: str = "default") -> Shell:
        """The named persistent shell session (started on first use)."""
        rc.check_shell_name(name)
        return Shell(self._id, self._t, name)

    def shells(self) -> builtins.list[ShellSession]:
        return self._t.call(rc.list_shells(self._id))

    def http(
        self,
        port: int,
        method: str = "GET",
        path: str = "/",
        headers: Mapping[str, str] | None = None,
        body: bytes | str | None = None,
        *,
        timeout: float | None = 60,
    ) -> HttpResponse:
        """Send an HTTP request to ``port`` inside the sandbox: ``(status, headers, body)``."""
        return self._t.port(rc.port_request(self._id, port, method, path, headers, body, timeout))

    def connect_tcp(self, port: int) -> TcpStream:
        """Open a raw TCP stream to ``port`` inside the sandbox (no network rule needed)."""
        return TcpStream.open(self._t, self._id, port)

    def close(self) -> None:
        """Close the HTTP client if this sandbox created it (the sandbox keeps running)."""
        if self._owns_client:
            self._client.close()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            self.kill()
        except NotFound:
            pass
        finally:
            self.close()

    def __repr__(self) -> str:
        return f"Sandbox({self._id!r})"
