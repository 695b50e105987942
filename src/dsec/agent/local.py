"""Run aether on this host, outside any container, and talk to it synchronously.

For tests and tools: :class:`LocalAgent` creates the listening socket the way the edge
does, starts aether with it (with this interpreter, or through a built bundle's loader)
and with its own run dir, and stops aether and chronus by pid. :func:`call` and
:class:`SyncStream` are a blocking client of the runtime protocol. Host-side only: this
module is not copied into the bundle.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsec.agent import protocol
from dsec.agent.protocol import KIND_CLOSE, KIND_ERR, KIND_IN, KIND_JSON, KIND_OUT

SRC_DIR = Path(__file__).resolve().parents[2]
AETHER_MAIN = "from dsec.agent.aether import main; main()"


@dataclass(frozen=True, slots=True)
class Reply:
    """Everything one call answered."""

    final: dict[str, Any]
    stdout: bytes = b""
    stderr: bytes = b""
    events: tuple[dict[str, Any], ...] = field(default_factory=tuple)

    @property
    def result(self) -> dict[str, Any]:
        res = self.final.get("result")
        if not isinstance(res, dict):
            raise AssertionError(f"expected a result, got {self.final}")
        return res

    @property
    def error_code(self) -> str | None:
        err = self.final.get("error")
        return str(err.get("code")) if isinstance(err, dict) else None


class SyncStream:
    """A blocking connection carrying one call."""

    def __init__(self, path: str | Path, request: dict[str, Any], timeout: float = 30.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        deadline = time.monotonic() + 5.0
        while True:
            try:
                self.sock.connect(str(path))
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
        self.sock.sendall(protocol.encode_json(request))
        self.final: dict[str, Any] | None = None

    def send(self, kind: int, payload: bytes = b"") -> None:
        for start in range(0, max(len(payload), 1), protocol.CHUNK):
            self.sock.sendall(protocol.encode(kind, payload[start : start + protocol.CHUNK]))

    def send_json(self, obj: dict[str, Any]) -> None:
        self.sock.sendall(protocol.encode_json(obj))

    def _exact(self, n: int) -> bytes | None:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                if buf:
                    raise protocol.ProtocolError("connection closed inside a frame")
                return None
            buf += chunk
        return bytes(buf)

    def recv(self) -> tuple[int, bytes] | None:
        """The next frame, or ``None`` at end of stream or after the final frame."""
        if self.final is not None:
            return None
        head = self._exact(protocol.HEADER.size)
        if head is None:
            return None
        length, kind = protocol.parse_header(head)
        payload = self._exact(length) if length else b""
        if payload is None:
            raise protocol.ProtocolError("connection closed inside a frame")
        if kind == KIND_JSON:
            obj = protocol.decode_json(payload)
            if protocol.is_final(obj):
                self.final = obj
        return kind, payload

    def collect(self) -> Reply:
        """Read to the final frame, gathering output and events."""
        out, err, events = bytearray(), bytearray(), []
        while (frame := self.recv()) is not None:
            kind, payload = frame
            if kind == KIND_OUT:
                out += payload
            elif kind == KIND_ERR:
                err += payload
            elif kind == KIND_JSON and self.final is None:
                events.append(protocol.decode_json(payload))
        if self.final is None:
            raise protocol.ProtocolError("closed without a final frame")
        return Reply(self.final, bytes(out), bytes(err), tuple(events))

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> SyncStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def call(
    path: str | Path, request: dict[str, Any], stdin: bytes | None = None, timeout: float = 30.0
) -> Reply:
    """One call: send ``request`` (and ``stdin`` as ``I`` frames + ``C``), collect the reply."""
    with SyncStream(path, request, timeout) as stream:
        if stdin is not None:
            try:
                if stdin:
                    stream.send(KIND_IN, stdin)
                stream.send(KIND_CLOSE)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the call ended before taking all input; its answer says why
        return stream.collect()


class LocalAgent:
    """aether (and, once used, chronus) running on this host in a private run dir."""

    def __init__(self, workdir: Path, bundle: Path | None = None) -> None:
        self.workdir = workdir
        self.bundle = bundle
        self.run_dir = workdir / "run"
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.socket_path = workdir / "aether.sock"
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(self.socket_path))
        self.listener.listen(128)
        self.proc: subprocess.Popen[bytes] | None = None

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
        env.update(
            DSEC_LISTEN_FD=str(self.listener.fileno()),
            DSEC_AGENT_RUN_DIR=str(self.run_dir),
            DSEC_AGENT_LAZY_CHRONUS="1",  # started on first use: stop() then always finds it
            PYTHONDONTWRITEBYTECODE="1",
        )
        if self.bundle is None:
            env["PYTHONPATH"] = str(SRC_DIR)
        else:
            env.update(PYTHONHOME=str(self.bundle / "python"), PYTHONPATH=str(self.bundle / "site"))
        return env

    def argv(self) -> list[str]:
        if self.bundle is None:
            return [sys.executable, "-s", "-S", "-P", "-c", AETHER_MAIN]
        lib = str(self.bundle / "lib")
        py = str(self.bundle / "python" / "bin" / "python3")
        return [f"{lib}/ld.so", "--library-path", lib, py, "-s", "-S", "-P", "-c", AETHER_MAIN]

    def start(self) -> LocalAgent:
        """Start aether (again); the listening socket stays the same."""
        fds = (self.listener.fileno(),)
        self.proc = subprocess.Popen(
            self.argv(), env=self.env(), pass_fds=fds, stdin=subprocess.DEVNULL
        )
        return self

    def call(
        self, request: dict[str, Any], stdin: bytes | None = None, timeout: float = 30.0
    ) -> Reply:
        return call(self.socket_path, request, stdin, timeout)

    def stream(self, request: dict[str, Any], timeout: float = 30.0) -> SyncStream:
        return SyncStream(self.socket_path, request, timeout)

    def chronus_pid(self) -> int | None:
        try:
            return int((self.run_dir / "chronus.pid").read_text())
        except (OSError, ValueError):
            return None

    def kill_aether(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        """Stop aether and chronus (chronus kills what it started); close the socket."""
        self.kill_aether()
        pid = self.chronus_pid()
        if pid is not None and _is_chronus(pid):
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 5
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.02)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        self.listener.close()

    def __enter__(self) -> LocalAgent:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class NamespacedInit:
    """The bundle's init as PID 1 of a new pid namespace (``unshare``), maybe chrooted.

    ``root=None`` runs ``<bundle>/init`` from the host file system (chronus then keeps its
    socket in ``<workdir>/run``); with ``root`` the bundle must be at ``<root>/.dsec``.
    Needs root.
    """

    def __init__(self, workdir: Path, bundle: Path | None = None, root: Path | None = None):
        self.workdir = workdir
        self.root = root
        self.init = "/.dsec/init" if root is not None else str(Path(bundle or "") / "init")
        self.socket_path = workdir / "aether.sock"
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(self.socket_path))
        self.listener.listen(128)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> NamespacedInit:
        fd = self.listener.fileno()
        env = {"DSEC_LISTEN_FD": str(fd), "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
        argv = ["unshare", "--fork", "--pid"]
        if self.root is None:
            (self.workdir / "run").mkdir(exist_ok=True)
            env["DSEC_AGENT_RUN_DIR"] = str(self.workdir / "run")
            argv += ["--mount-proc", self.init]
        else:
            argv += [f"--mount-proc={self.root}/proc", "chroot", str(self.root), self.init]
        self.proc = subprocess.Popen(argv, env=env, pass_fds=(fd,), stdin=subprocess.DEVNULL)
        return self

    def call(
        self, request: dict[str, Any], stdin: bytes | None = None, timeout: float = 30.0
    ) -> Reply:
        return call(self.socket_path, request, stdin, timeout)

    def init_pid(self, timeout: float = 5.0) -> int:
        """The host pid of init (the child of unshare)."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while True:
            kids = children(self.proc.pid)
            if kids:
                return kids[0]
            if time.monotonic() > deadline:
                raise TimeoutError("unshare has no child")
            time.sleep(0.01)

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM init and wait for the namespace to end; return unshare's exit status."""
        if self.proc is None:
            return None
        rc = None
        if self.proc.poll() is None:
            try:
                os.kill(self.init_pid(0.5), signal.SIGTERM)
                rc = self.proc.wait(timeout)
            except (TimeoutError, subprocess.TimeoutExpired, ProcessLookupError):
                for pid in children(self.proc.pid):  # killing PID 1 ends the namespace
                    os.kill(pid, signal.SIGKILL)
                rc = self.proc.wait(timeout)
        self.listener.close()
        return rc if rc is not None else self.proc.returncode


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from ``/proc``)."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


@contextlib.contextmanager
def local_agent(bundle: Path | None = None) -> Iterator[LocalAgent]:
    """A started :class:`LocalAgent` in a fresh short temp dir, stopped and removed after."""
    workdir = Path(tempfile.mkdtemp(prefix="dsa-", dir="/tmp"))  # short: socket paths <108
    try:
        with LocalAgent(workdir, bundle) as agent:
            yield agent
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] != b"Z"
    except OSError:
        return False


def _is_chronus(pid: int) -> bool:
    """Whether ``pid`` is a chronus (it names itself so; a forked one has aether's cmdline)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() == "chronus"
    except OSError:
        return False
