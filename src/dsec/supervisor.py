"""Runs the single-node platform: iam, watcher, edge, apiserver and gateway as children.

``dsec up`` runs this in the foreground (or detached with ``--detach``). Children are
started in dependency order, each waited for until healthy, restarted with backoff if they
die (a restarted edge re-adopts its sandboxes), and stopped in reverse order on SIGTERM.
The platform's addresses and pids are written to ``<home>/platform.json`` for
``dsec status`` and ``dsec down``; ``<home>/client.json`` lets the SDK and CLI on this
machine find the API and the admin key with no configuration.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dsec.paths import Paths

EDGE_ARGS_ENV = "DSEC_EDGE_EXTRA_ARGS"
COMPONENTS = ("iam", "watcher", "edge", "apiserver", "gateway")
PORTS = 8  # addresses from the port base: see Layout.from_port_base
HEALTH_TIMEOUT_S = 60.0


@dataclass
class Layout:
    """Addresses of every component; metrics/health endpoints sit beside the gRPC ones."""

    apiserver: str
    iam: str
    watcher: str
    edge: str
    iam_metrics: str
    watcher_metrics: str
    edge_metrics: str
    gateway: str = ""  # the E2B-compatible gateway (absent from older layouts)
    edge_id: str = ""
    pids: dict[str, int] = field(default_factory=dict)
    supervisor_pid: int = 0

    @classmethod
    def from_port_base(cls, base: int, host: str = "127.0.0.1") -> Layout:
        a = [f"{host}:{base + i}" for i in range(PORTS)]
        return cls(
            apiserver=a[0],
            iam=a[1],
            watcher=a[2],
            edge=a[3],
            iam_metrics=a[4],
            watcher_metrics=a[5],
            edge_metrics=a[6],
            gateway=a[7],
        )

    def health_url(self, component: str) -> str:
        addr = {
            "apiserver": self.apiserver,
            "iam": self.iam_metrics,
            "watcher": self.watcher_metrics,
            "edge": self.edge_metrics,
            "gateway": self.gateway,
        }[component]
        return f"http://{addr}/healthz"

    def address(self, component: str) -> str:
        return str(getattr(self, component))

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> Layout:
        return cls(**json.loads(path.read_text()))


def layout_path(paths: Paths) -> Path:
    return paths.home / "platform.json"


def healthy(url: str, timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException):
        # HTTPException: e.g. a probe of a port nobody listens on yet that connected to
        # itself (a TCP self-connect in the ephemeral range) reads back its own request
        return False


class Supervisor:
    def __init__(
        self,
        paths: Paths,
        layout: Layout,
        *,
        keep_sandboxes: bool = False,
        echo: Callable[[str], None] = print,
        api_args: Sequence[str] = (),
    ) -> None:
        self.paths = paths
        self.layout = layout
        self.keep_sandboxes = keep_sandboxes
        self.api_args = list(api_args)  # passed to the apiserver (e.g. --domain D)
        self.echo = echo
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._stopping = False
        self._restarts: dict[str, list[float]] = {c: [] for c in COMPONENTS}

    def _argv(self, component: str) -> list[str]:
        lay, home = self.layout, str(self.paths.home)
        common = [sys.executable, "-m", f"dsec.{component}", "--home", home]
        if component == "iam":
            return [*common, "--listen", lay.iam, "--metrics-listen", lay.iam_metrics]
        if component == "watcher":
            watcher = [*common, "--listen", lay.watcher, "--metrics-listen", lay.watcher_metrics]
            return [*watcher, "--iam", lay.iam]  # renews its certificate there (CA rotation)
        if component == "edge":
            argv = [
                *common,
                "--listen",
                lay.edge,
                "--metrics-listen",
                lay.edge_metrics,
                "--iam",
                lay.iam,
                "--watcher",
                lay.watcher,
                "--edge-id",
                lay.edge_id,
                # e.g. sandbox networking flags (--net-upstream-dns ...), one per line
                *os.environ.get(EDGE_ARGS_ENV, "").split("\n"),
            ]
            argv = [a for a in argv if a]
            return argv if self.keep_sandboxes else [*argv, "--stop-sandboxes-on-exit"]
        if component == "gateway":
            api = f"http://{lay.apiserver}"
            return [*common, "--listen", lay.gateway, "--api-url", api]
        return [
            *common,
            "--listen",
            lay.apiserver,
            "--iam",
            lay.iam,
            "--watcher",
            lay.watcher,
            *self.api_args,
        ]

    def spawn(self, component: str) -> None:
        self.paths.logs.mkdir(parents=True, exist_ok=True)
        with open(self.paths.logs / f"{component}.log", "ab") as logf:
            proc = subprocess.Popen(
                self._argv(component),
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=logf,
                env={
                    **os.environ,
                    "DSEC_HOME": str(self.paths.home),
                    "DSEC_RUN": str(self.paths.run),
                },
            )
        self.procs[component] = proc
        self.layout.pids[component] = proc.pid
        self.layout.save(layout_path(self.paths))

    def wait_healthy(self, component: str) -> None:
        deadline = time.monotonic() + HEALTH_TIMEOUT_S
        proc = self.procs[component]
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"{component} exited with code {proc.returncode}; "
                    f"see {self.paths.logs / (component + '.log')}"
                )
            if healthy(self.layout.health_url(component)):
                return
            time.sleep(0.05)
        raise RuntimeError(f"{component} did not become healthy within {HEALTH_TIMEOUT_S:.0f} s")

    def start(self) -> None:
        from dsec.rpc.tls import default_identities, ensure_edge_id, ensure_pki

        for d in (self.paths.home, self.paths.run, self.paths.logs):
            d.mkdir(parents=True, exist_ok=True)
        self.layout.edge_id = self.layout.edge_id or ensure_edge_id(self.paths.home)
        ensure_pki(self.paths.pki, default_identities(self.layout.edge_id))
        self.layout.supervisor_pid = os.getpid()
        for component in COMPONENTS:
            self.echo(f"starting {component} on {self.layout.address(component)}")
            self.spawn(component)
            self.wait_healthy(component)
        self._write_client_config()

    def _write_client_config(self) -> None:
        cfg = {
            "api_url": f"http://{self.layout.apiserver}",
            "api_key_file": str(self.paths.home / "admin.key"),
        }
        path = self.paths.client_config
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(cfg, indent=2))
        os.chmod(tmp, 0o600)
        tmp.replace(path)

    def watch(self) -> None:
        """Block until told to stop; restart children that die, at most 5 times a minute."""
        while not self._stopping:
            for component, proc in list(self.procs.items()):
                if proc.poll() is None or self._stopping:
                    continue
                now = time.monotonic()
                recent = [t for t in self._restarts[component] if now - t < 60]
                self._restarts[component] = [*recent, now]
                if len(recent) >= 5:
                    self.echo(f"{component} keeps dying; giving up (see its log)")
                    self.stop()
                    return
                self.echo(f"{component} exited ({proc.returncode}); restarting")
                time.sleep(min(2.0, 0.2 * 2 ** len(recent)))
                self.spawn(component)
            time.sleep(0.2)

    def stop(self) -> None:
        self._stopping = True
        for component in reversed(COMPONENTS):
            proc = self.procs.get(component)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60 if component == "edge" else 15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        layout_path(self.paths).unlink(missing_ok=True)


def run_foreground(
    paths: Paths,
    layout: Layout,
    *,
    keep_sandboxes: bool,
    echo: Callable[[str], None] = print,
    ready: Callable[[Layout], None] | None = None,
    api_args: Sequence[str] = (),
) -> int:
    sup = Supervisor(paths, layout, keep_sandboxes=keep_sandboxes, echo=echo, api_args=api_args)

    def on_signal(signum: int, frame: object) -> None:
        sup._stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        sup.start()
        paths.supervisor_pid.write_text(str(os.getpid()))
        if ready is not None:
            ready(sup.layout)
        sup.watch()
    except RuntimeError as exc:
        echo(f"error: {exc}")
        sup.stop()
        return 1
    finally:
        sup.stop()
        paths.supervisor_pid.unlink(missing_ok=True)
    return 0


def api_args(domain: str = "", tls_listen: str = "") -> list[str]:
    """The apiserver flags `dsec up` passes through (only those the user gave)."""
    return [*(["--domain", domain] if domain else []),
            *(["--tls-listen", tls_listen] if tls_listen else [])]  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    """Entry for the detached supervisor:
    ``python -m dsec.supervisor HOME PORT_BASE [--keep-sandboxes] [--domain D] [--tls-listen A]``.
    """
    ap = argparse.ArgumentParser(prog="dsec.supervisor")
    ap.add_argument("home")
    ap.add_argument("port_base", type=int)
    ap.add_argument("--keep-sandboxes", action="store_true")
    ap.add_argument("--domain", default="")
    ap.add_argument("--tls-listen", default="")
    args = ap.parse_args(argv)
    paths = Paths.from_env(args.home)
    sys.exit(
        run_foreground(
            paths,
            Layout.from_port_base(args.port_base),
            keep_sandboxes=args.keep_sandboxes,
            echo=lambda s: print(s, flush=True),
            api_args=api_args(args.domain, args.tls_listen),
        )
    )


if __name__ == "__main__":
    main()
