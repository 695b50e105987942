"""The bundle's init as PID 1 of a pid namespace: restarts aether, reaps zombies, stops all."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec.agent.bundle import build_bundle
from dsec.agent.local import NamespacedInit, children

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="pid namespaces need root"),
    pytest.mark.skipif(not shutil.which("unshare"), reason="needs util-linux unshare"),
    pytest.mark.skipif(not shutil.which("gcc"), reason="needs gcc to build init"),
]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_bundle(tmp_path_factory.mktemp("bundle") / "agent")


@pytest.fixture
def ns_init(bundle: Path) -> Iterator[NamespacedInit]:
    workdir = Path(tempfile.mkdtemp(prefix="dsi-", dir="/tmp"))
    init = NamespacedInit(workdir, bundle).start()
    try:
        yield init
    finally:
        init.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def stat_of(pid: int) -> tuple[str, str, int] | None:
    """(comm, state, ppid) of a host pid."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    head, _, rest = raw.rpartition(b")")
    fields = rest.split()
    return head.split(b"(", 1)[1].decode(), fields[0].decode(), int(fields[1])


def aether_host_pid(init_pid: int) -> int:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        for pid in children(init_pid):
            # chronus, forked from aether, has its cmdline too, but names itself
            if b"dsec.agent.aether" in Path(f"/proc/{pid}/cmdline").read_bytes() and (
                Path(f"/proc/{pid}/comm").read_text().strip() != "chronus"
            ):
                return pid
        time.sleep(0.01)
    raise AssertionError("no aether under init")


def test_init_serves_and_restarts_aether(ns_init: NamespacedInit):
    first = ns_init.call({"op": "ping"}).result
    assert first["pid"] == 2  # pid 1 is init itself
    init_pid = ns_init.init_pid()
    assert stat_of(init_pid) is not None
    seen = {first["pid"]}
    for _ in range(3):  # quick successive crashes: restarted with backoff each time
        victim = aether_host_pid(init_pid)
        os.kill(victim, signal.SIGKILL)
        # Until it is gone, the dying aether may still accept (and then reset) a connection.
        deadline = time.monotonic() + 10
        while stat_of(victim) is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        again = ns_init.call({"op": "ping"}, timeout=10).result
        assert again["pid"] not in seen
        assert again["uptime_s"] < 5
        seen.add(again["pid"])


def test_init_reaps_orphans(ns_init: NamespacedInit):
    init_pid = ns_init.init_pid()
    reply = ns_init.call({"op": "exec", "cmd": "sleep 3 >/dev/null 2>&1 & echo $!"})
    assert reply.result["exit_code"] == 0
    orphans = [p for p in children(init_pid) if (stat_of(p) or ("",))[0] == "sleep"]
    assert orphans, "the orphaned sleep should have been reparented to init"
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(stat_of(p) for p in orphans):
        time.sleep(0.05)
    assert not any(stat_of(p) for p in orphans), "init left a zombie"
    zombies = [p for p in children(init_pid) if (stat_of(p) or ("", ""))[1] == "Z"]
    assert zombies == []


def test_chronus_is_a_child_of_init_and_sigterm_stops_everything(ns_init: NamespacedInit):
    init_pid = ns_init.init_pid()
    pid = ns_init.call({"op": "process.start", "cmd": ["sleep", "60"]}).result["pid"]
    assert ns_init.call({"op": "process.list"}).result["processes"][0]["pid"] == pid
    kids = {p: stat_of(p) for p in children(init_pid)}
    chronus = [p for p in kids if Path(f"/proc/{p}/comm").read_text().strip() == "chronus"]
    assert len(chronus) == 1
    everything = [init_pid, *children(init_pid), *children(chronus[0])]
    start = time.monotonic()
    assert ns_init.stop() == 0
    assert time.monotonic() - start < 5
    assert not [p for p in everything if stat_of(p) is not None]
