"""The agent bundle: layout, idempotent rebuilds, running where there is no libc or Python,
and aether's startup time and idle memory when run from it."""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec.agent import bundle as bundle_mod
from dsec.agent.bundle import build_bundle
from dsec.agent.local import LocalAgent, NamespacedInit

pytestmark = pytest.mark.skipif(not shutil.which("gcc"), reason="needs gcc to build init")


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_bundle(tmp_path_factory.mktemp("bundle") / "agent")


def smaps(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("Rss", "Pss", "Private_Dirty", "Anonymous"):
                out[key] = int(rest.split()[0])
    return out


def test_layout(bundle: Path):
    for rel in ("init", "lib/ld.so", "python/bin/python3", "site/dsec/agent/aether.py",
                "site/dsec/agent/chronus.py", "site/dsec/__init__.py"):  # fmt: skip
        assert (bundle / rel).exists(), rel
    assert list((bundle / "run").iterdir()) == []
    assert not (bundle / "site/dsec/agent/bundle.py").exists()
    assert not (bundle / "site/dsec/agent/local.py").exists()
    stdlib = bundle / "python" / "lib" / bundle_mod.PYVER.join(["python", ""])
    for unwanted in ("test", "idlelib", "tkinter", "ensurepip", "lib2to3", "site-packages"):
        assert not (stdlib / unwanted).exists(), unwanted
    assert (stdlib / "encodings" / "utf_8.py").exists()
    assert any((stdlib / "json" / "__pycache__").iterdir())
    headers = subprocess.run(["readelf", "-l", str(bundle / "init")], capture_output=True)
    if headers.returncode == 0:
        assert b"INTERP" not in headers.stdout  # static: no dynamic loader needed
    for path in bundle.rglob("*"):  # user-namespaced sandboxes see these as "other"
        if not path.is_symlink():
            needed = 0o005 if path.is_dir() else 0o004
            assert path.stat().st_mode & needed == needed, f"{path} is not world-readable"
    total = sum(p.stat().st_size for p in bundle.rglob("*") if p.is_file())
    print(f"\nbundle size {total / 2**20:.1f} MiB")


def test_rebuild_is_idempotent_and_follows_agent_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    src = tmp_path / "src" / "dsec"
    shutil.copytree(bundle_mod.AGENT_DIR, src / "agent", ignore=shutil.ignore_patterns("__py*"))
    shutil.copy(bundle_mod.AGENT_DIR.parent / "__init__.py", src / "__init__.py")
    monkeypatch.setattr(bundle_mod, "AGENT_DIR", src / "agent")
    dest = tmp_path / "agent"
    messages: list[str] = []
    assert build_bundle(dest, progress=messages.append) == dest
    assert any("compiling init" in m for m in messages)
    stamp = (dest / ".stamp").read_text()
    start = time.monotonic()
    messages.clear()
    assert build_bundle(dest, progress=messages.append) == dest
    assert time.monotonic() - start < 0.5
    assert messages == []  # nothing rebuilt
    with open(src / "agent" / "aether.py", "a") as f:
        f.write("\n# changed\n")
    build_bundle(dest)
    assert (dest / ".stamp").read_text() != stamp
    assert (dest / "site/dsec/agent/aether.py").read_text().endswith("# changed\n")
    assert (tmp_path / "agent.prev" / "init").exists()  # still mounted by older sandboxes


def test_module_entry_point(bundle: Path):
    out = subprocess.run(
        [sys.executable, "-m", "dsec.agent.bundle", str(bundle)],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert out.stdout.strip() == str(bundle)


@pytest.fixture
def empty_root(bundle: Path) -> Iterator[Path]:
    """A root file system holding nothing but the bundle (no libc, no Python, no shell)."""
    root = Path(tempfile.mkdtemp(prefix="dsr-", dir="/tmp"))
    try:
        shutil.copytree(bundle, root / ".dsec", symlinks=True)
        (root / "dev").mkdir()
        (root / "proc").mkdir()
        os.mknod(root / "dev" / "null", 0o666 | 0o020000, os.makedev(1, 3))
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="chroot and pid namespaces need root")
@pytest.mark.skipif(not shutil.which("unshare"), reason="needs util-linux unshare")
def test_runs_in_a_root_with_only_the_bundle(empty_root: Path):
    assert sorted(p.name for p in empty_root.iterdir()) == [".dsec", "dev", "proc"]
    workdir = Path(tempfile.mkdtemp(prefix="dsw-", dir="/tmp"))
    init = NamespacedInit(workdir, root=empty_root).start()
    try:
        assert init.call({"op": "ping"}).result["pid"] == 2
        reply = init.call({"op": "exec", "cmd": ["/.dsec/lib/ld.so", "--version"]})
        assert reply.result["exit_code"] == 0
        assert reply.stdout  # the loader's version text: exec works without any libc
        assert init.call({"op": "exec", "cmd": "true"}).result["exit_code"] == 127  # no /bin/sh
        w = init.call({"op": "files.write", "path": "/data/x.txt", "parents": True}, stdin=b"hi")
        assert w.result == {"path": "/data/x.txt", "size": 2}
        assert (empty_root / "data" / "x.txt").read_bytes() == b"hi"
        assert init.call({"op": "files.read", "path": "/data/x.txt"}).stdout == b"hi"
        pid = init.call(
            {"op": "process.start", "cmd": ["/.dsec/lib/ld.so", "--list", "/.dsec/init"]}
        ).result["pid"]
        deadline = time.monotonic() + 10
        while True:
            reply = init.call({"op": "process.connect", "pid": pid})
            if reply.final.get("result") or time.monotonic() > deadline:
                break
        assert reply.result["exit_code"] is not None
        assert (empty_root / ".dsec" / "run" / "chronus.sock").exists()
    finally:
        assert init.stop() == 0
        shutil.rmtree(workdir, ignore_errors=True)


def test_startup_time_and_idle_memory(bundle: Path):
    workdir = Path(tempfile.mkdtemp(prefix="dsm-", dir="/tmp"))
    agent = LocalAgent(workdir, bundle)
    try:
        times = []
        for _ in range(20):
            start = time.perf_counter()
            agent.start()
            pong = agent.call({"op": "ping"}).result
            assert agent.proc is not None
            assert pong["pid"] == agent.proc.pid
            times.append((time.perf_counter() - start) * 1000)
            agent.kill_aether()
        os.sync()  # freshly written bundle pages would otherwise count as dirty
        agent.start()
        agent.call({"op": "ping"})
        time.sleep(0.2)
        assert agent.proc is not None
        idle = smaps(agent.proc.pid)
        median = statistics.median(times)
        print(
            f"\nstartup to first ping: median {median:.1f} ms (min {min(times):.1f}, "
            f"max {max(times):.1f}) over 20; idle aether {idle} KiB"
        )
        assert idle["Private_Dirty"] < 6 * 1024
        assert median < 1000
    finally:
        agent.stop()
        shutil.rmtree(workdir, ignore_errors=True)


SYSTEM_PYTHON = Path("/usr/bin/python3")


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="chroot and pid namespaces need root")
@pytest.mark.skipif(not SYSTEM_PYTHON.exists(), reason="no Debian system python3 here")
@pytest.mark.timeout(300)
def test_bundle_from_the_system_python_runs_in_an_empty_root(tmp_path: Path):
    """A newcomer's venv uses Debian's python3 (CI's may not): its bundle must work too."""
    src = Path(bundle_mod.__file__).resolve().parents[2]
    dest = tmp_path / "agent"
    subprocess.run(
        [str(SYSTEM_PYTHON), "-m", "dsec.agent.bundle", str(dest)],
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(src)},
        check=True, capture_output=True, timeout=240,
    )  # fmt: skip
    root = Path(tempfile.mkdtemp(prefix="dsr-", dir="/tmp"))
    workdir = Path(tempfile.mkdtemp(prefix="dsw-", dir="/tmp"))
    try:
        shutil.copytree(dest, root / ".dsec", symlinks=True)
        (root / "dev").mkdir()
        (root / "proc").mkdir()
        os.mknod(root / "dev" / "null", 0o666 | 0o020000, os.makedev(1, 3))
        init = NamespacedInit(workdir, root=root).start()
        try:
            assert init.call({"op": "ping"}).result["pid"] == 2
            reply = init.call({"op": "exec", "cmd": ["/.dsec/lib/ld.so", "--version"]})
            assert reply.result["exit_code"] == 0
            started = init.call({"op": "process.start", "cmd": ["/.dsec/lib/ld.so", "--help"]})
            assert started.result["pid"] > 0  # chronus runs from this bundle too
        finally:
            assert init.stop() == 0
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
