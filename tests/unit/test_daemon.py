"""The shared daemon runner: signals, exit codes, flags, and a real daemon process."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from dsec.core.errors import InvalidArgument, Unavailable
from dsec.daemon import daemon_arg_parser, parse_hostport, run_daemon
from dsec.testing.ports import free_port


@pytest.fixture
def keep_logging() -> Iterator[None]:
    """run_daemon installs its own root handler; put pytest's back afterwards."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.mark.usefixtures("keep_logging")
def test_signal_sets_stop_and_exit_is_zero() -> None:
    seen: list[str] = []

    async def main(stop: asyncio.Event) -> None:
        signal.raise_signal(signal.SIGINT)
        await asyncio.wait_for(stop.wait(), 5)
        seen.append("stopped cleanly")

    assert run_daemon("test", main) == 0
    assert seen == ["stopped cleanly"]
    # The handlers are gone again: SIGINT is back to KeyboardInterrupt.
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.usefixtures("keep_logging")
def test_failing_main_exits_one() -> None:
    async def broken(stop: asyncio.Event) -> None:
        raise RuntimeError("boom")

    async def refused(stop: asyncio.Event) -> None:
        raise Unavailable("cannot listen")

    assert run_daemon("test", broken) == 1
    assert run_daemon("test", refused) == 1


def test_parse_hostport() -> None:
    assert parse_hostport("127.0.0.1:8421") == ("127.0.0.1", 8421)
    assert parse_hostport("[::1]:0") == ("::1", 0)
    for bad in ("8421", ":80", "host:", "host:http", "h:70000"):
        with pytest.raises(InvalidArgument):
            parse_hostport(bad)


def test_common_flags() -> None:
    p = daemon_arg_parser("x", default_listen="127.0.0.1:1", default_metrics="127.0.0.1:2")
    args = p.parse_args(["--home", "/tmp/h", "--metrics-listen", "", "--log-level", "debug"])
    assert (args.home, args.listen, args.metrics_listen, args.log_level) == (
        Path("/tmp/h"),
        "127.0.0.1:1",
        "",
        "debug",
    )


def test_watcher_process_serves_health_and_stops_on_sigterm(tmp_path: Path) -> None:
    mport = free_port()
    cmd = [sys.executable, "-m", "dsec.watcher", "--home", str(tmp_path), "--listen",
           "127.0.0.1:0", "--metrics-listen", f"127.0.0.1:{mport}"]  # fmt: skip
    env = {**os.environ, "GRPC_VERBOSITY": "ERROR"}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, env=env)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, "watcher exited early"
            try:
                if httpx.get(f"http://127.0.0.1:{mport}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "watcher never became healthy"
            time.sleep(0.05)
        metrics = httpx.get(f"http://127.0.0.1:{mport}/metrics", timeout=1).text
        assert "dsec_watcher_edges 0" in metrics
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
        assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = [json.loads(x) for x in err.decode().splitlines() if x.startswith("{")]
    msgs = [x["msg"] for x in lines]
    assert "listening" in msgs
    assert msgs[-1] == "stopped"
    assert all(x["component"] == "watcher" for x in lines)
