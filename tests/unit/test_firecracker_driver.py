"""The Firecracker driver against a fake Firecracker that checks every request against the
published API spec (Swagger 2.0) and keeps Firecracker's state rules. The same cycle runs
against the real binary in tests/integration/test_firecracker_real.py where KVM works."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from dsec.core.errors import DeadlineExceeded, InvalidArgument, InvalidState, SandboxFailed
from dsec.edge.backends.microvm import fc_api
from dsec.edge.backends.microvm.fc_api import FirecrackerApi, FirecrackerApiError
from dsec.edge.backends.microvm.firecracker import FirecrackerVmm, pid_alive
from dsec.edge.backends.microvm.vmm import Drive, NetIface, Snapshot, VmConfig
from tests.fakes.swagger import Spec, find_spec

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def spec_path() -> Path:
    path = find_spec()
    if path is None:
        pytest.skip("shared/specs/firecracker-api.yaml not found beside the checkout")
    return path


@pytest.fixture(scope="module")
def spec(spec_path: Path) -> Spec:
    return Spec.load(spec_path)


@pytest.fixture
def fake(tmp_path: Path, spec_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """Executables ``firecracker`` and ``jailer`` that run the fake; the record file."""
    bins = tmp_path / "bin"
    bins.mkdir()
    for name, extra in (("firecracker", ""), ("jailer", "--jailer ")):
        exe = bins / name
        exe.write_text(
            f"#!/bin/sh\nPYTHONPATH={REPO} exec {sys.executable} -m tests.fakes.firecracker "
            f'{extra}"$@"\n'
        )
        exe.chmod(0o755)
    record = tmp_path / "requests.jsonl"
    monkeypatch.setenv("FAKE_FC_SPEC", str(spec_path))
    monkeypatch.setenv("FAKE_FC_RECORD", str(record))
    return {"firecracker": bins / "firecracker", "jailer": bins / "jailer", "record": record}


def requests(record: Path) -> list[dict[str, Any]]:
    if not record.exists():
        return []
    return [json.loads(line) for line in record.read_text().splitlines()]


def make_config(tmp_path: Path, name: str = "vm1") -> VmConfig:
    images = tmp_path / "images"
    images.mkdir(exist_ok=True)
    for f in ("vmlinux", "base.erofs", "scratch.ext4"):
        (images / f).write_bytes(b"x" * 16)
    return VmConfig(
        vcpus=2,
        memory_mib=256,
        kernel=images / "vmlinux",
        cmdline="console=ttyS0 reboot=k panic=1",
        run_dir=tmp_path / name,
        mem_file=tmp_path / name / "mem",
        drives=(
            Drive("rootfs-layer-0", images / "base.erofs", read_only=True),
            Drive("scratch", images / "scratch.ext4", read_only=False),
        ),
        net=(NetIface("eth0", "tap-vm1", "06:00:ac:10:00:02"),),
        agent_socket=tmp_path / name / "v.sock",
        extra={"vm_id": name},
    )


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def vsock_echo(path: Path, payload: bytes) -> bytes:
    """Host-initiated hybrid vsock: CONNECT, OK, then the stream."""
    reader, writer = await asyncio.open_unix_connection(str(path))
    writer.write(b"CONNECT 52\n" + payload)
    assert (await reader.readline()).startswith(b"OK ")
    data = await reader.readexactly(len(payload))
    writer.close()
    return data


# -- the validator itself must be able to fail ----------------------------------------------


def test_validator_accepts_good_requests(spec: Spec) -> None:
    assert spec.version.startswith("1.")
    assert (
        spec.check_request("PUT", "/machine-config", {"vcpu_count": 2, "mem_size_mib": 256}) == []
    )
    assert spec.check_request("PUT", "/drives/root", {"drive_id": "root", "is_root_device": True,
                              "path_on_host": "/x", "is_read_only": True}) == []  # fmt: skip
    load = {"snapshot_path": "/s", "mem_backend": {"backend_type": "Uffd", "backend_path": "/u"},
            "network_overrides": [{"iface_id": "eth0", "host_dev_name": "tap0"}]}  # fmt: skip
    assert spec.check_request("PUT", "/snapshot/load", load) == []
    assert spec.check_request("GET", "/", None) == []


@pytest.mark.parametrize(
    ("method", "path", "body", "error"),
    [
        ("PUT", "/machine-config", {"vcpu_count": 2}, "missing required 'mem_size_mib'"),
        ("PUT", "/machine-config", {"vcpu_count": "2", "mem_size_mib": 1}, "expected integer"),
        ("PUT", "/machine-config", {"vcpu_count": 33, "mem_size_mib": 1}, "above the maximum"),
        ("PUT", "/machine-config", {"vcpu_count": 0, "mem_size_mib": 1}, "below the minimum"),
        ("PUT", "/machine-config", {"vcpu_count": True, "mem_size_mib": 1}, "expected integer"),
        ("PUT", "/machine-config", {"vcpu_count": 1, "mem_size_mib": 1, "vcpus": 1},
         "unknown property 'vcpus'"),
        ("PATCH", "/vm", {"state": "Stopped"}, "is not one of"),
        ("PUT", "/actions", {"action_type": "InstanceStop"}, "is not one of"),
        ("PUT", "/snapshot/load", {"snapshot_path": "/s", "mem_backend": {"backend_type": "File"}},
         "body.mem_backend: missing required 'backend_path'"),
        ("PUT", "/snapshot/load", {"snapshot_path": "/s", "network_overrides": [{"iface_id": 1}]},
         "body.network_overrides[0]"),
        ("PUT", "/vsock", {"guest_cid": 2, "uds_path": "/v"}, "below the minimum 3"),
        ("PUT", "/vsock", None, "is required"),
        ("GET", "/", {"x": 1}, "takes no body"),
        ("PUT", "/nope", {}, "no such path"),
        ("DELETE", "/vm", None, "no such operation"),
    ],
)  # fmt: skip
def test_validator_rejects_bad_requests(
    spec: Spec, method: str, path: str, body: object, error: str
) -> None:
    errors = spec.check_request(method, path, body)
    assert any(error in e for e in errors), errors


# -- the HTTP client ------------------------------------------------------------------------


def test_http_encoding_and_parsing() -> None:
    raw = fc_api.encode_request("PUT", "/vm", {"state": "Paused"})
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"PUT /vm HTTP/1.1\r\n")
    assert b"Content-Length: 18" in head
    assert json.loads(body) == {"state": "Paused"}
    assert b"Content-Length" not in fc_api.encode_request("GET", "/")
    assert fc_api.parse_head(b"HTTP/1.1 204 No Content\r\nServer: F") == (204, {"server": "F"})
    with pytest.raises(ValueError, match="status line"):
        fc_api.parse_head(b"SSH-2.0-OpenSSH")
    assert fc_api.fault_of(b'{"fault_message": "bad vcpu"}') == "bad vcpu"
    assert fc_api.fault_of(b"plain") == "plain"


@pytest.mark.asyncio
async def test_api_errors_carry_firecrackers_fault(fake: dict[str, Path], tmp_path: Path) -> None:
    sock = tmp_path / "api.sock"
    proc = await asyncio.create_subprocess_exec(
        str(fake["firecracker"]), "--api-sock", str(sock), start_new_session=True
    )
    try:
        api = FirecrackerApi(sock, timeout_s=10)
        for _ in range(500):
            if sock.exists():
                break
            await asyncio.sleep(0.01)
        with pytest.raises(FirecrackerApiError, match=r"400 .*below the minimum 1"):
            await api.put("/machine-config", {"vcpu_count": 0, "mem_size_mib": 128})
        with pytest.raises(FirecrackerApiError, match="not started"):
            await api.patch("/vm", {"state": "Paused"})
        assert (await api.get("/"))["state"] == "Not started"
    finally:
        proc.kill()
        await proc.wait()
    with pytest.raises(FirecrackerApiError, match="GET /"):
        await FirecrackerApi(sock, timeout_s=2).get("/")


# -- the driver through a whole life --------------------------------------------------------

BOOT = [
    ("PUT", "/machine-config"),
    ("PUT", "/boot-source"),
    ("PUT", "/drives/rootfs-layer-0"),
    ("PUT", "/drives/scratch"),
    ("PUT", "/network-interfaces/eth0"),
    ("PUT", "/vsock"),
    ("PUT", "/balloon"),
    ("PUT", "/actions"),
    ("GET", "/"),
]


@pytest.mark.asyncio
async def test_boot_pause_resume_snapshot_restore_kill(
    fake: dict[str, Path], tmp_path: Path
) -> None:
    config = make_config(tmp_path)
    vmm = FirecrackerVmm(fake["firecracker"], use_jailer=False)
    await vmm.boot(config, timeout_s=30)
    pid = vmm.pid
    assert pid > 0
    assert alive(pid)
    assert await vsock_echo(config.agent_socket, b"ping") == b"ping"
    await vmm.pause()
    assert (await vmm.describe())["state"] == "Paused"
    await vmm.resume()
    await vmm.set_balloon(64)
    snap = await vmm.snapshot(tmp_path / "snap")
    assert snap == Snapshot(
        tmp_path / "snap", tmp_path / "snap" / "mem", tmp_path / "snap" / "vmstate"
    )
    assert snap.mem_file.read_bytes() == b"guest ram"
    await vmm.kill()
    assert vmm.pid == 0
    assert not alive(pid)
    assert not (config.run_dir / "firecracker.sock").exists()
    assert not config.agent_socket.exists()
    await vmm.kill()  # idempotent

    child_config = make_config(tmp_path, "child")
    child = FirecrackerVmm(fake["firecracker"], use_jailer=False)
    await child.restore(child_config, snap, private=True, timeout_s=30)
    assert await vsock_echo(child_config.agent_socket, b"pong") == b"pong"
    assert (await child.describe())["state"] == "Running"
    await child.kill()

    seen = requests(fake["record"])
    assert [e for r in seen for e in r["errors"]] == []
    calls = [(r["method"], r["path"]) for r in seen]
    assert calls == [
        *BOOT,
        ("PATCH", "/vm"), ("GET", "/"), ("PATCH", "/vm"), ("PATCH", "/balloon"),
        ("PATCH", "/vm"), ("PUT", "/snapshot/create"),
        # unjailed, the restored VM is pointed at its own drive files before it runs
        ("PUT", "/snapshot/load"), ("PATCH", "/drives/rootfs-layer-0"),
        ("PATCH", "/drives/scratch"), ("PATCH", "/vm"), ("GET", "/"), ("GET", "/"),
    ]  # fmt: skip
    body = {(r["method"], r["path"]): r["body"] for r in seen}
    assert body[("PUT", "/machine-config")] == {"vcpu_count": 2, "mem_size_mib": 256}
    assert body[("PUT", "/boot-source")] == {
        "kernel_image_path": str(config.kernel),
        "boot_args": config.cmdline + " dsec.disks=rootfs-layer-0,scratch",
    }  # fmt: skip
    assert body[("PUT", "/drives/scratch")] == {
        "drive_id": "scratch", "path_on_host": str(config.drives[1].path),
        "is_root_device": False, "is_read_only": False,
    }  # fmt: skip
    assert body[("PUT", "/network-interfaces/eth0")]["host_dev_name"] == "tap-vm1"
    assert body[("PUT", "/vsock")] == {"guest_cid": 3, "uds_path": str(config.agent_socket)}
    assert body[("PUT", "/actions")] == {"action_type": "InstanceStart"}
    vm_states = [r["body"]["state"] for r in seen if r["path"] == "/vm"]
    assert vm_states == ["Paused", "Resumed", "Paused", "Resumed"]
    assert body[("PUT", "/snapshot/create")] == {
        "snapshot_type": "Full",
        "snapshot_path": str(snap.state),
        "mem_file_path": str(snap.mem_file),
    }
    assert body[("PUT", "/snapshot/load")] == {
        "snapshot_path": str(snap.state),
        "mem_backend": {"backend_type": "File", "backend_path": str(snap.mem_file)},
        "resume_vm": False,
        "network_overrides": [{"iface_id": "eth0", "host_dev_name": "tap-vm1"}],
        "vsock_override": {"uds_path": str(child_config.agent_socket)},
    }
    assert len({r["pid"] for r in seen}) == 2  # the restore ran in a fresh process


@pytest.mark.asyncio
async def test_restore_from_a_served_memory_file(fake: dict[str, Path], tmp_path: Path) -> None:
    config = make_config(tmp_path)
    vmm = FirecrackerVmm(fake["firecracker"], use_jailer=False)
    await vmm.boot(config, timeout_s=30)
    snap = await vmm.snapshot(tmp_path / "snap")
    await vmm.kill()
    uffd = replace(make_config(tmp_path, "uffd"), extra={"uffd_socket": str(tmp_path / "u.sock")})
    child = FirecrackerVmm(fake["firecracker"], use_jailer=False)
    await child.restore(uffd, snap, private=True, timeout_s=30)
    await child.kill()
    load = next(r for r in requests(fake["record"]) if r["path"] == "/snapshot/load")
    assert load["errors"] == []
    assert load["body"]["mem_backend"] == {
        "backend_type": "Uffd", "backend_path": str(tmp_path / "u.sock"),
    }  # fmt: skip


@pytest.mark.asyncio
async def test_jailed_boot_snapshot_restore(fake: dict[str, Path]) -> None:
    # the fake does not chroot, so its socket paths are the long host ones: keep them short
    tmp_path = Path(tempfile.mkdtemp(prefix="fcj"))
    try:
        await jailed_cycle(fake, tmp_path)
    finally:
        shutil.rmtree(tmp_path)


async def jailed_cycle(fake: dict[str, Path], tmp_path: Path) -> None:
    config = make_config(tmp_path)
    vmm = FirecrackerVmm(fake["firecracker"], jailer=fake["jailer"], use_jailer=True)
    assert vmm.command(config)[-3:] == ["--", "--api-sock", "/run/firecracker.sock"]
    await vmm.boot(config, timeout_s=30)
    root = config.run_dir / "jail" / "firecracker" / "vm1" / "root"
    assert (root / "files" / "scratch.ext4").stat().st_ino == config.drives[1].path.stat().st_ino
    assert await vsock_echo(config.agent_socket, b"jailed") == b"jailed"
    assert vmm.guest_listen_path(1024) == Path(f"{root}/v.sock_1024")
    snap = await vmm.snapshot(tmp_path / "snap")
    assert snap.state.is_file()
    await vmm.kill()
    assert not (config.run_dir / "jail" / "firecracker" / "vm1").exists()
    assert not config.agent_socket.exists()
    child_config = make_config(tmp_path, "child")
    child = FirecrackerVmm(fake["firecracker"], jailer=fake["jailer"], use_jailer=True)
    await child.restore(child_config, snap, private=True, timeout_s=30)
    await child.kill()
    seen = requests(fake["record"])
    jailer_argv = [r["jailer"] for r in seen if "jailer" in r]
    assert len(jailer_argv) == 2
    assert jailer_argv[0][:2] == ["--id", "vm1"]
    assert "--uid" in jailer_argv[0]
    api = [r for r in seen if "method" in r]
    assert [e for r in api for e in r["errors"]] == []
    body = {(r["method"], r["path"]): r["body"] for r in api}
    assert body[("PUT", "/boot-source")]["kernel_image_path"] == "/files/vmlinux"
    assert body[("PUT", "/vsock")]["uds_path"] == "/v.sock"
    assert body[("PUT", "/snapshot/create")]["mem_file_path"] == "/snapshot/mem"
    assert body[("PUT", "/snapshot/load")]["mem_backend"]["backend_path"] == "/files/mem"


# -- faults ---------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_boot_watchdog_kills_a_hung_vmm(
    fake: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_FC_MODE", "hang")
    config = make_config(tmp_path)
    vmm = FirecrackerVmm(fake["firecracker"], use_jailer=False)
    spawned: list[int] = []
    real_wait = vmm._wait_socket

    async def wait_socket(socket: Path) -> None:
        spawned.append(vmm.pid)
        await real_wait(socket)

    monkeypatch.setattr(vmm, "_wait_socket", wait_socket)
    with pytest.raises(DeadlineExceeded, match="boot did not finish within 1s"):
        await vmm.boot(config, timeout_s=1)
    assert spawned
    assert spawned[0] > 0
    assert not alive(spawned[0])
    assert vmm.pid == 0
    assert sorted(p.name for p in config.run_dir.iterdir()) == ["firecracker.log"]


@pytest.mark.asyncio
async def test_a_vmm_that_dies_at_start_is_a_clear_error(
    fake: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_FC_MODE", "crash")
    vmm = FirecrackerVmm(fake["firecracker"], use_jailer=False)
    with pytest.raises(SandboxFailed, match=r"exited with status 1 .*crashing as asked"):
        await vmm.boot(make_config(tmp_path), timeout_s=30)
    assert vmm.pid == 0


@pytest.mark.asyncio
async def test_a_guest_that_dies_after_start_fails_the_boot(
    fake: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_FC_MODE", "die-on-start")
    config = make_config(tmp_path)
    vmm = FirecrackerVmm(fake["firecracker"], use_jailer=False)
    with pytest.raises(SandboxFailed, match="boot failed"):
        await vmm.boot(config, timeout_s=30)
    assert vmm.pid == 0
    assert not config.agent_socket.exists()


@pytest.mark.asyncio
async def test_restore_refuses_a_deleted_snapshot(fake: dict[str, Path], tmp_path: Path) -> None:
    snap = Snapshot(tmp_path / "gone", tmp_path / "gone" / "mem", tmp_path / "gone" / "vmstate")
    vmm = FirecrackerVmm(fake["firecracker"], use_jailer=False)
    with pytest.raises(InvalidState, match="mem is missing"):
        await vmm.restore(make_config(tmp_path), snap, private=True, timeout_s=30)
    assert vmm.pid == 0
    assert requests(fake["record"]) == []


@pytest.mark.asyncio
async def test_calls_before_boot_are_refused(tmp_path: Path) -> None:
    vmm = FirecrackerVmm(tmp_path / "firecracker", use_jailer=False)
    with pytest.raises(InvalidState, match="has not booted"):
        await vmm.pause()
    with pytest.raises(InvalidState, match="no jailer"):
        FirecrackerVmm(tmp_path / "firecracker", jailer=None, use_jailer=True)


@pytest.mark.asyncio
async def test_a_cancelled_boot_leaves_no_vmm(
    fake: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_FC_MODE", "hang")
    vmm = FirecrackerVmm(fake["firecracker"], use_jailer=False)
    task = asyncio.create_task(vmm.boot(make_config(tmp_path), timeout_s=60))
    for _ in range(500):
        if vmm.pid:
            break
        await asyncio.sleep(0.01)
    pid = vmm.pid
    assert pid > 0
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert vmm.pid == 0
    assert not alive(pid)


@pytest.mark.asyncio
async def test_a_new_edge_adopts_the_running_vmm(fake: dict[str, Path], tmp_path: Path) -> None:
    config = make_config(tmp_path)
    first = FirecrackerVmm(fake["firecracker"], use_jailer=False)
    await first.boot(config, timeout_s=30)
    pid = first.pid
    assert not await FirecrackerVmm(use_jailer=False).adopt(tmp_path / "elsewhere")

    later = FirecrackerVmm(fake["firecracker"], use_jailer=False)  # the edge restarted
    assert await later.adopt(config.run_dir)
    assert later.pid == pid
    with pytest.raises(InvalidState, match="already runs"):
        await later.boot(config, timeout_s=5)
    await later.pause()
    snap = await later.snapshot(tmp_path / "snap")
    assert snap.state.is_file()
    assert await vsock_echo(config.agent_socket, b"still here") == b"still here"
    await later.kill()
    assert not pid_alive(pid)  # gone, or a zombie until the first edge's watcher reaps it
    assert later.pid == 0
    assert not (config.run_dir / "firecracker.sock").exists()
    assert not (config.run_dir / "firecracker.json").exists()
    assert not config.agent_socket.exists()
    assert not await FirecrackerVmm(use_jailer=False).adopt(config.run_dir)
    await first.kill()  # reaps its child; nothing else to do
    seen = requests(fake["record"])
    assert [e for r in seen for e in r["errors"]] == []
    assert [(r["method"], r["path"]) for r in seen][len(BOOT):] == [
        ("GET", "/"), ("PATCH", "/vm"), ("PUT", "/snapshot/create"),
    ]  # fmt: skip


@pytest.mark.asyncio
async def test_bad_driver_knobs_are_refused_and_leave_nothing(
    fake: dict[str, Path], tmp_path: Path
) -> None:
    config = replace(make_config(tmp_path), extra={"balloon_mib": "lots"})
    vmm = FirecrackerVmm(fake["firecracker"], use_jailer=False)
    with pytest.raises(InvalidArgument, match="balloon_mib"):
        await vmm.boot(config, timeout_s=30)
    assert vmm.pid == 0
    assert sorted(p.name for p in config.run_dir.iterdir()) == ["firecracker.log"]


def test_validator_understands_every_schema_in_the_spec(spec: Spec) -> None:
    """No construct in the spec is beyond the validator (it would raise, not pass)."""
    checked = 0
    for path, ops in spec.doc["paths"].items():
        for method, op in ops.items():
            for param in op.get("parameters", []):
                if param.get("in") == "body":
                    assert isinstance(spec.check(param["schema"], {}, f"{method} {path}"), list)
                    checked += 1
    for name, schema in spec.doc["definitions"].items():
        assert isinstance(spec.check(schema, {"__unknown__": 1}, name), list)
    assert checked >= 20
