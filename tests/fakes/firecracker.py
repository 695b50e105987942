"""A stand-in ``firecracker`` for tests: serves the API on ``--api-sock``, checks every
request against the published spec, records it, and keeps Firecracker's state rules
(pre-boot-only resources, snapshot only when paused, load only on a fresh process).

Run as ``python -m tests.fakes.firecracker --api-sock PATH --id ID`` with
``FAKE_FC_SPEC`` (the spec), ``FAKE_FC_RECORD`` (a JSON-lines file every request is
appended to) and optionally ``FAKE_FC_MODE``: ``hang`` (never opens the API),
``crash`` (exits at once), ``die-on-start`` (exits during InstanceStart, like a guest
that fails at once), ``refuse:<METHOD> <path>`` (answers that request with a fault).
The vsock socket answers ``CONNECT <port>`` with ``OK``; on the agent port it then plays
the guest's channel multiplexer (HELLO -> READY, the identity recorded; every channel
echoes, but the ``sync`` the edge sends before a snapshot is answered as aether does), on
any other port it echoes bytes.

``python -m tests.fakes.firecracker --jailer <jailer args> -- <firecracker args>`` plays
the jailer: it makes the chroot directory, then runs the fake Firecracker with paths
resolved under it (``FAKE_FC_ROOT``) instead of calling chroot(2), and records its own
argv to ``FAKE_FC_RECORD``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from aiohttp import web

from dsec.agent import protocol
from dsec.edge.backends.microvm import frames
from tests.fakes.swagger import Spec

SYNC_REQUEST = protocol.encode_json({"op": "sync"})

PRE_BOOT = ("/machine-config", "/boot-source", "/drives/", "/network-interfaces/", "/vsock",
            "/balloon")  # fmt: skip


def host(path: str) -> Path:
    """Where a path Firecracker was given is on the host (inside the fake chroot)."""
    root = os.environ.get("FAKE_FC_ROOT", "")
    return Path(root + path) if root and path.startswith("/") else Path(path)


class FakeFirecracker:
    def __init__(self, spec: Spec, record: Path, vm_id: str, mode: str) -> None:
        self.spec, self.record, self.vm_id, self.mode = spec, record, vm_id, mode
        self.state = "Not started"
        self.config: dict[str, Any] = {}
        self.vsock: asyncio.Server | None = None

    def _note(self, method: str, path: str, body: object, errors: list[str]) -> None:
        with self.record.open("a") as f:
            f.write(json.dumps({"method": method, "path": path, "body": body,
                                "errors": errors, "pid": os.getpid()}) + "\n")  # fmt: skip

    async def handle(self, request: web.Request) -> web.Response:
        raw = await request.read()
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode(errors="replace")
        errors = self.spec.check_request(request.method, request.path, body)
        self._note(request.method, request.path, body, errors)
        if errors:
            return fault("; ".join(errors))
        if self.mode == f"refuse:{request.method} {request.path}":
            return fault(f"{request.method} {request.path} refused as asked")
        try:
            return await self.apply(request.method, request.path, body)
        except FakeError as exc:
            return fault(str(exc))

    async def apply(self, method: str, path: str, body: Any) -> web.Response:
        if method == "GET" and path == "/":
            return web.json_response({"app_name": "Firecracker", "id": self.vm_id,
                                      "state": self.state, "vmm_version": "fake"})  # fmt: skip
        started = self.state != "Not started"
        if method == "PUT" and path.startswith(PRE_BOOT):
            if started:
                raise FakeError(f"{path} is pre-boot only")
            self.config[path] = body
        elif (method, path) == ("PUT", "/actions"):
            if body["action_type"] == "InstanceStart":
                await self.start()
        elif (method, path) == ("PATCH", "/vm"):
            if not started:
                raise FakeError("the microVM is not started")
            self.state = "Paused" if body["state"] == "Paused" else "Running"
        elif method == "PATCH" and path.startswith("/drives/"):
            if not started:
                raise FakeError("drive updates are post-boot only")
            if f"/drives/{body['drive_id']}" not in self.config:
                raise FakeError(f"no drive {body['drive_id']}")
            if not host(body.get("path_on_host", "/")).is_file():
                raise FakeError(f"no file {body.get('path_on_host')}")
        elif (method, path) == ("PATCH", "/balloon"):
            if "/balloon" not in self.config:
                raise FakeError("no balloon device")
        elif (method, path) == ("PUT", "/snapshot/create"):
            if self.state != "Paused":
                raise FakeError("the microVM must be paused to snapshot it")
            host(body["mem_file_path"]).write_bytes(b"guest ram")
            host(body["snapshot_path"]).write_text(json.dumps(self.config))
        elif (method, path) == ("PUT", "/snapshot/load"):
            await self.load(body)
        else:
            raise FakeError(f"the fake does not implement {method} {path}")
        return web.Response(status=204)

    async def start(self) -> None:
        if self.state != "Not started":
            raise FakeError("already started")
        for need in ("/machine-config", "/boot-source"):
            if need not in self.config:
                raise FakeError(f"{need} is not configured")
        self.state = "Running"
        await self.bind_vsock(self.config.get("/vsock", {}).get("uds_path"))
        if self.mode == "die-on-start":
            os._exit(0)

    async def load(self, body: dict[str, Any]) -> None:
        if self.config or self.state != "Not started":
            raise FakeError("snapshot load is only allowed on a fresh process")
        backend = body.get("mem_backend") or {}
        if backend.get("backend_type") == "File" and not host(backend["backend_path"]).is_file():
            raise FakeError(f"no memory file {backend['backend_path']}")
        try:
            self.config = json.loads(host(body["snapshot_path"]).read_text())
        except (OSError, ValueError) as exc:
            raise FakeError(f"cannot load the snapshot state: {exc}") from None
        self.state = "Running" if body.get("resume_vm") else "Paused"
        uds = (body.get("vsock_override") or {}).get("uds_path")
        await self.bind_vsock(uds or self.config.get("/vsock", {}).get("uds_path"))

    async def bind_vsock(self, uds: str | None) -> None:
        if uds:
            self.vsock = await asyncio.start_unix_server(self.vsock_client, host(uds))

    async def vsock_client(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        line = await reader.readline()
        if not line.startswith(b"CONNECT ") or not line[8:].strip().isdigit():
            writer.close()
            return
        writer.write(b"OK 1073741824\n")
        if int(line[8:]) == frames.VSOCK_PORT:
            await self.guest_mux(reader, writer)
        else:
            while data := await reader.read(4096):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def guest_mux(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """The guest's end of the agent channel, each channel an echo."""
        buf = bytearray()
        while data := await reader.read(4096):
            buf += data
            for kind, chan, payload in frames.parse(buf):
                if kind == frames.HELLO:
                    with self.record.open("a") as f:
                        f.write(json.dumps({"hello": json.loads(payload or b"{}"),
                                            "pid": os.getpid()}) + "\n")  # fmt: skip
                    writer.write(frames.frame(frames.READY, 0))
                elif kind == frames.DATA and payload == SYNC_REQUEST:  # as aether answers
                    writer.write(frames.frame(frames.DATA, chan, protocol.result({})))
                    writer.write(frames.frame(frames.CLOSE, chan))
                elif kind == frames.DATA:
                    writer.write(frames.frame(frames.DATA, chan, payload))
                elif kind == frames.CLOSE:
                    writer.write(frames.frame(frames.CLOSE, chan))
            await writer.drain()


class FakeError(Exception):
    pass


def fault(message: str) -> web.Response:
    return web.json_response({"fault_message": message}, status=400)


async def serve(args: argparse.Namespace) -> None:
    mode = os.environ.get("FAKE_FC_MODE", "")
    if mode == "crash":
        print("fake firecracker: crashing as asked", file=sys.stderr)
        sys.exit(1)
    if mode == "hang":
        await asyncio.Event().wait()
    spec = Spec.load(Path(os.environ["FAKE_FC_SPEC"]))
    fake = FakeFirecracker(spec, Path(os.environ["FAKE_FC_RECORD"]), args.id, mode)
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", fake.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.UnixSite(runner, str(host(args.api_sock))).start()
    print(f"fake firecracker {args.id} listening on {args.api_sock}", flush=True)
    await asyncio.Event().wait()


def jailer(argv: list[str]) -> None:
    split = argv.index("--")
    ap = argparse.ArgumentParser()
    for flag in ("--id", "--exec-file", "--uid", "--gid", "--chroot-base-dir"):
        ap.add_argument(flag, required=True)
    ap.add_argument("--netns")
    args = ap.parse_args(argv[:split])
    root = Path(args.chroot_base_dir) / Path(args.exec_file).name / args.id / "root"
    (root / "run").mkdir(parents=True, exist_ok=True)
    with Path(os.environ["FAKE_FC_RECORD"]).open("a") as f:
        f.write(json.dumps({"jailer": argv}) + "\n")
    os.environ["FAKE_FC_ROOT"] = str(root)
    os.execv(args.exec_file, [args.exec_file, *argv[split + 1 :], "--id", args.id])


def main() -> None:
    if sys.argv[1:2] == ["--jailer"]:
        jailer(sys.argv[2:])
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--api-sock", required=True)
    ap.add_argument("--id", default="anonymous-instance")
    asyncio.run(serve(ap.parse_args()))


if __name__ == "__main__":
    main()
