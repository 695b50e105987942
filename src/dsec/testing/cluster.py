"""A multi-process cluster on this machine: one iam, one watcher, N apiservers, M edges.

Each component is its own process with its own home (PKI, state, logs) under one temp
directory, the way separate machines would be. The iam holds the cluster CA; the watcher
and the apiservers get leaves from it (an operator would copy them over); every edge joins
with its own one-time bootstrap token (``python -m dsec.edge join``), so its private key is
made in its own home and never copied. Used by ``tests/integration/test_cluster.py``.
Processes are stopped by the pids started here.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from dsec.paths import Paths
from dsec.rpc.tls import Identity, ensure_pki
from dsec.testing.ports import free_port


def _wait_port(port: int, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited early:\n{log.read_text()[-3000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port} after {timeout_s} s:\n{log.read_text()[-3000:]}")


@dataclass
class Proc:
    name: str
    home: Path
    address: str
    proc: subprocess.Popen[bytes]

    @property
    def log(self) -> Path:
        return self.home / "process.log"


@dataclass
class LocalCluster:
    root: Path
    iam: Proc
    join_address: str
    watcher: Proc
    apiservers: list[Proc]
    edges: list[Proc] = field(default_factory=list)

    @property
    def admin_key(self) -> str:
        return (self.iam.home / "admin.key").read_text().strip()

    def api_url(self, n: int = 0) -> str:
        return f"http://{self.apiservers[n].address}"

    def add_edge(
        self, token: str, *, backend: str = "fake", edge_id: str = "", extra: Sequence[str] = ()
    ) -> Proc:
        """Join a new node with ``token`` and start its edge (``extra``: more edge
        arguments); returns it once it listens."""
        home = self.root / f"edge{len(self.edges)}"
        home.mkdir()
        env = _env(home, self.root)
        join = [sys.executable, "-m", "dsec.edge", "join", "--home", str(home),
                "--bootstrap-token", token, "--cluster", self.join_address]  # fmt: skip
        if edge_id:
            join += ["--edge-id", edge_id]
        done = subprocess.run(join, env=env, capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            shutil.rmtree(home, ignore_errors=True)
            raise RuntimeError(f"join failed: {done.stdout}{done.stderr}")
        port = free_port()
        argv = [sys.executable, "-m", "dsec.edge", "--home", str(home),
                "--listen", f"127.0.0.1:{port}", "--iam", self.iam.address,
                "--watcher", self.watcher.address, "--backend", backend,
                "--stop-sandboxes-on-exit", *extra]  # fmt: skip
        p = _spawn("edge", home, f"127.0.0.1:{port}", argv, env)
        self.edges.append(p)
        _wait_port(port, p.proc, p.log)
        return p

    def restart(self, p: Proc) -> Proc:
        """Start an edge that ended again (same home, same address); returns it once it
        listens."""
        argv = [str(a) for a in p.proc.args]  # type: ignore[union-attr]
        again = _spawn(p.name, p.home, p.address, argv, _env(p.home, self.root))
        self.edges[self.edges.index(p)] = again
        _wait_port(int(p.address.rpartition(":")[2]), again.proc, again.log)
        return again

    def stop(self, p: Proc, sig: int = signal.SIGTERM) -> None:
        if p.proc.poll() is None:
            p.proc.send_signal(sig)


def _env(home: Path, root: Path) -> dict[str, str]:
    return {**os.environ, "DSEC_HOME": str(home), "DSEC_RUN": str(home / "run"),
            "DSEC_DATA": str(Paths.from_env().data), "PYTHONUNBUFFERED": "1"}  # fmt: skip


def _spawn(name: str, home: Path, address: str, argv: list[str], env: dict[str, str]) -> Proc:
    home.mkdir(parents=True, exist_ok=True)
    with open(home / "process.log", "ab") as log:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                                start_new_session=True)  # fmt: skip
    return Proc(name, home, address, proc)


def _provision(ca_dir: Path, home: Path, names: Sequence[str]) -> None:
    """Copy the CA certificate and the named leaves (an operator's scp) into ``home``."""
    pki = home / "pki"
    pki.mkdir(parents=True, exist_ok=True)
    os.chmod(pki, 0o700)
    shutil.copy2(ca_dir / "ca.crt", pki / "ca.crt")
    for n in names:
        for ext in ("crt", "key"):
            shutil.copy2(ca_dir / f"{n}.{ext}", pki / f"{n}.{ext}")


@contextmanager
def local_cluster(
    *, apiservers: int = 2, health_timeout_s: float = 6.0, iam_args: Sequence[str] = ()
) -> Iterator[LocalCluster]:
    root = Path(tempfile.mkdtemp(prefix="dsec-cl-", dir="/tmp"))
    procs: list[Proc] = []
    cluster: LocalCluster | None = None
    try:
        iam_home = root / "iam"
        ensure_pki(iam_home / "pki", [Identity.singleton(r) for r in
                                      ("iam", "watcher", "apiserver", "admin")])  # fmt: skip
        port, join_port, watcher_port = free_port(), free_port(), free_port()
        iam = _spawn("iam", iam_home, f"127.0.0.1:{port}", [
            sys.executable, "-m", "dsec.iam", "--home", str(iam_home),
            "--listen", f"127.0.0.1:{port}", "--metrics-listen", "",
            "--join-listen", f"127.0.0.1:{join_port}", *iam_args,
        ], _env(iam_home, root))  # fmt: skip
        procs.append(iam)
        _wait_port(join_port, iam.proc, iam.log)
        w_home = root / "watcher"
        _provision(iam_home / "pki", w_home, ["watcher"])
        watcher = _spawn("watcher", w_home, f"127.0.0.1:{watcher_port}", [
            sys.executable, "-m", "dsec.watcher", "--home", str(w_home),
            "--listen", f"127.0.0.1:{watcher_port}", "--metrics-listen", "",
            "--health-timeout", str(health_timeout_s), "--iam", iam.address,
        ], _env(w_home, root))  # fmt: skip
        procs.append(watcher)
        _wait_port(watcher_port, watcher.proc, watcher.log)
        apis = []
        for n in range(apiservers):
            a_home = root / f"apiserver{n}"
            _provision(iam_home / "pki", a_home, ["apiserver"])
            a_port = free_port()
            a = _spawn("apiserver", a_home, f"127.0.0.1:{a_port}", [
                sys.executable, "-m", "dsec.apiserver", "--home", str(a_home),
                "--listen", f"127.0.0.1:{a_port}", "--iam", iam.address,
                "--watcher", watcher.address,
            ], _env(a_home, root))  # fmt: skip
            procs.append(a)
            apis.append(a)
        for a in apis:
            _wait_port(int(a.address.rpartition(":")[2]), a.proc, a.log)
        cluster = LocalCluster(root, iam, f"127.0.0.1:{join_port}", watcher, apis)
        yield cluster
    finally:
        everyone = [*(cluster.edges if cluster else []), *reversed(procs)]
        for p in everyone:
            if p.proc.poll() is None:
                p.proc.send_signal(signal.SIGCONT)
                p.proc.terminate()
        for p in everyone:
            try:
                p.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.proc.kill()
                p.proc.wait()
        shutil.rmtree(root, ignore_errors=True)
