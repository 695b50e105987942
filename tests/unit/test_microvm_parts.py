"""microVM pieces that need no VM: snapshot manifests, config disk, initramfs, QEMU argv."""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import pytest

from dsec.core.errors import InvalidArgument, SandboxFailed
from dsec.edge.backends.microvm import disks, kernel, qemu, snapshots
from dsec.edge.backends.microvm.backend import VMM_OVERHEAD_MIB
from dsec.edge.backends.microvm.vmm import Drive, NetIface, Snapshot, VmConfig


def _snap(tmp_path: Path) -> Snapshot:
    d = tmp_path / "snap"
    d.mkdir()
    (d / "state").write_bytes(os.urandom(5000))
    (d / "qemu.json").write_text(json.dumps({"ignore_shared": True}))
    ram = tmp_path / "ram"
    with open(ram, "wb") as f:  # sparse: data, a hole, data
        f.write(b"a" * 8192)
        f.seek(1 << 20)
        f.write(b"b" * 4096)
    return Snapshot(dir=d, mem_file=ram, state=d / "state")


def test_snapshot_manifest_accepts_an_intact_snapshot(tmp_path: Path) -> None:
    snap = _snap(tmp_path)
    snapshots.write_manifest(snap)
    snapshots.verify(snap)
    manifest = json.loads((snap.dir / "manifest.json").read_text())
    assert manifest["ram"]["size"] == (1 << 20) + 4096
    assert len(manifest["files"]["state"]["sha256"]) == 64


@pytest.mark.parametrize("damage", ["truncate_state", "flip_state", "flip_ram", "no_manifest"])
def test_snapshot_manifest_refuses_damage(tmp_path: Path, damage: str) -> None:
    snap = _snap(tmp_path)
    snapshots.write_manifest(snap)
    _tick()
    if damage == "truncate_state":
        snap.state.write_bytes(snap.state.read_bytes()[:100])
    elif damage == "flip_state":
        data = bytearray(snap.state.read_bytes())
        data[10] ^= 1
        snap.state.write_bytes(bytes(data))
    elif damage == "flip_ram":
        with open(snap.mem_file, "r+b") as f:
            f.seek((1 << 20) + 5)
            f.write(b"c")
    else:
        (snap.dir / "manifest.json").unlink()
    with pytest.raises(snapshots.SnapshotCorrupt):
        snapshots.verify(snap)


def _count_digests(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    seen: list[str] = []
    real = snapshots.file_digest

    def counting(path: Path, sparse: bool) -> str:
        seen.append(path.name)
        return real(path, sparse)

    monkeypatch.setattr(snapshots, "file_digest", counting)
    return seen


def _tick() -> None:
    """Let the kernel's file-time clock (coarse, a few ms) move on before a write, so the
    write changes the stamp as any later tampering would."""
    time.sleep(0.05)


def test_unchanged_stamps_skip_hashing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    snap = _snap(tmp_path)
    snapshots.write_manifest(snap)
    seen = _count_digests(monkeypatch)
    snapshots.verify(snap)
    assert seen == []
    snapshots.verify(snap, trust_stamps=False)  # a snapshot from another edge: every file
    assert sorted(seen) == ["qemu.json", "ram", "state"]


def test_touched_file_is_hashed_and_accepted_when_equal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    snap = _snap(tmp_path)
    snapshots.write_manifest(snap)
    _tick()
    snap.state.write_bytes(snap.state.read_bytes())  # same bytes, new stamp
    seen = _count_digests(monkeypatch)
    snapshots.verify(snap)
    assert seen == ["state"]
    snapshots.restamp(snap)
    seen.clear()
    snapshots.verify(snap)
    assert seen == []
    snapshots.restamp(snap, keep=False)  # a VMM may write into the RAM: hash all next time
    snapshots.verify(snap)
    assert sorted(seen) == ["qemu.json", "ram", "state"]


def test_manifest_without_digests_refuses_any_change(tmp_path: Path) -> None:
    snap = _snap(tmp_path)
    snapshots.write_manifest(snap, digests=False)
    snapshots.verify(snap)
    _tick()
    with open(snap.mem_file, "r+b") as f:
        f.write(b"a")  # the same byte: still refused, nothing to compare it with
    with pytest.raises(snapshots.SnapshotCorrupt, match="changed since"):
        snapshots.verify(snap)


def test_ram_in_the_state_stream_is_not_listed(tmp_path: Path) -> None:
    snap = replace(_snap(tmp_path), ram_in_file=False)
    snapshots.write_manifest(snap)
    assert json.loads((snap.dir / "manifest.json").read_text())["ram"] is None
    snap.mem_file.unlink()  # another VM's template file: not part of this snapshot
    snapshots.verify(snap)


def test_sparse_digest_sees_offsets(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    for p, off in ((a, 0), (b, 1 << 20)):
        with open(p, "wb") as f:
            f.seek(off)
            f.write(b"x" * 4096)
            f.truncate(2 << 20)
    assert snapshots.sparse_digest(a) != snapshots.sparse_digest(b)


def test_config_disk_layout(tmp_path: Path) -> None:
    out = disks.write_config(tmp_path / "c.img", {"A": "1", "dsec.layers": "2"})
    data = out.read_bytes()
    assert data.startswith(b"DSECCFG\0A=1\0dsec.layers=2\0\0")
    assert len(data) % 512 == 0
    with pytest.raises(InvalidArgument):
        disks.write_config(tmp_path / "d.img", {"B": "x\0y"})


def test_newc_archive_is_well_formed() -> None:
    data = disks.newc_archive([("init", 0o100755, b"#!/bin/sh\n")])
    assert data.startswith(b"070701")
    assert b"TRAILER!!!\0" in data
    assert len(data) % 512 == 0


def test_fragment_lines_and_missing_symbols() -> None:
    lines = kernel.fragment_lines()
    assert "CONFIG_X86_MPPARSE=y" in lines
    assert "CONFIG_VIRTIO_CONSOLE=y" in lines
    assert "CONFIG_EROFS_FS_XATTR=y" in lines  # overlay opaque dirs, file capabilities
    assert kernel.missing_symbols("CONFIG_A=y\n", ["CONFIG_A=y", "CONFIG_B=y"]) == ["CONFIG_B=y"]


def test_qemu_argv(tmp_path: Path) -> None:
    cfg = VmConfig(
        vcpus=2,
        memory_mib=256,
        kernel=tmp_path / "vmlinux",
        cmdline="quiet",
        run_dir=tmp_path,
        mem_file=tmp_path / "ram",
        drives=(Drive("scratch", tmp_path / "s.qcow2", False), Drive("l0", tmp_path / "l0", True)),
        agent_socket=tmp_path / "serial.sock",
    )
    tcg = qemu.QemuVmm(accel="tcg").argv(cfg, mem_path=cfg.mem_file, share=True, incoming=False)
    joined = " ".join(tcg)
    assert "microvm" in joined
    assert "rtc=on" in joined
    assert "share=on" in joined
    assert "tsc_early_khz=" in joined
    # the TCG code buffer is bounded, so QEMU stays inside its cgroup's memory limit
    assert tcg[tcg.index("-accel") + 1] == f"tcg,tb-size={qemu.TCG_TB_MIB}"
    assert qemu.TCG_TB_MIB + 64 <= VMM_OVERHEAD_MIB
    assert "format=qcow2" in joined
    assert "serial=l0" in joined
    assert "readonly=on" in joined
    assert "-incoming" not in tcg
    assert "-S" not in tcg
    # QEMU binds the sockets itself unless it is handed listening fds
    assert f"socket,id=qmp,path={tmp_path / 'qmp.sock'},server=on,wait=off" in tcg
    assert f"socket,id=agent,path={tmp_path / 'serial.sock'},server=on,wait=off" in tcg
    # a snapshot does not carry its stopped source's run state: a restore runs at once
    assert tcg[tcg.index("-global") + 1] == "migration.store-global-state=off"
    kvm = qemu.QemuVmm(accel="kvm").argv(
        cfg, mem_path=cfg.mem_file, share=False, incoming=True, fds=(7, 9), start=False
    )
    assert "tsc_early_khz" not in " ".join(
        qemu.QemuVmm(accel="kvm").argv(cfg, mem_path=cfg.mem_file, share=True, incoming=False)
    )
    assert "share=off" in " ".join(kvm)
    # a microvm restore takes its RAM from the snapshot: no kernel to read and parse
    assert "-kernel" in tcg
    assert not {"-kernel", "-append", "-initrd"} & set(kvm)
    full = replace(cfg, extra={"machine": "q35", "initrd": str(tmp_path / "initrd.img")})
    # a q35 machine loads them as option ROMs, RAM blocks the migration stream carries
    q35 = qemu.QemuVmm(accel="tcg").argv(full, mem_path=cfg.mem_file, share=True, incoming=True)
    assert {"-kernel", "-append", "-initrd"} <= set(q35)
    assert "socket,id=qmp,fd=7,server=on,wait=off" in kvm
    assert "socket,id=agent,fd=9,server=on,wait=off" in kvm
    assert "path=" not in " ".join(a for a in kvm if a.startswith("socket"))
    assert kvm[-3:] == ["-S", "-incoming", "defer"]


@pytest.mark.parametrize(
    ("accel", "machine", "installed", "binary"),
    [
        ("kvm", "microvm", True, qemu.QEMU_KVM_MICROVM),  # the small KVM-only build
        ("kvm", "microvm", False, qemu.QEMU),
        ("tcg", "microvm", True, qemu.QEMU),  # it has no TCG
        ("kvm", "q35", True, qemu.QEMU),  # full VMs keep the full build
    ],
)
def test_qemu_binary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, accel: str, machine: str, installed: bool,
    binary: str,
) -> None:  # fmt: skip
    monkeypatch.setattr(qemu, "installed", lambda b: installed)
    cfg = VmConfig(
        vcpus=1, memory_mib=64, kernel=tmp_path / "vmlinux", cmdline="", run_dir=tmp_path,
        mem_file=tmp_path / "ram", agent_socket=tmp_path / "serial.sock",
        extra={"machine": machine},
    )  # fmt: skip
    argv = qemu.QemuVmm(accel=accel).argv(cfg, mem_path=cfg.mem_file, share=True, incoming=False)
    assert argv[0] == binary


def test_sparse_digest_treats_zero_pages_as_holes(tmp_path: Path) -> None:
    """A fork child reading a hole of the template allocates a zero page there."""
    p = tmp_path / "ram"
    with open(p, "wb") as f:
        f.write(b"y" * 4096)
        f.truncate(1 << 20)
    before = snapshots.sparse_digest(p)
    with open(p, "r+b") as f:
        f.seek(65536)
        f.write(bytes(4096))
    assert snapshots.sparse_digest(p) == before


def test_overlays_on_a_template_disk_run_qemu_img_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if qemu.available():
        pytest.skip(f"needs qemu-img: {qemu.available()}")
    from dsec.edge.backends.microvm import backend

    base = tmp_path / "scratch.qcow2"
    raw = tmp_path / "base.raw"
    with open(raw, "wb") as f:
        f.truncate(1 << 20)
    disks.make_overlay(raw, base)  # a template's frozen disk
    made: list[Path] = []
    real = disks.make_overlay

    def counting(b: Path, dest: Path, fmt: str = "raw") -> Path:
        made.append(dest)
        return real(b, dest, fmt)

    monkeypatch.setattr(disks, "make_overlay", counting)
    kids = [tmp_path / f"k{i}.qcow2" for i in range(3)]
    for k in kids:
        backend._writable_disk(base, k, "qcow2", "qemu")
    assert len(made) == 1
    assert kids[0].read_bytes() == kids[2].read_bytes()
    info = subprocess.run(
        ["qemu-img", "info", "--output=json", str(kids[1])], capture_output=True, text=True
    )
    assert json.loads(info.stdout)["backing-filename"] == str(base.resolve())


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["true"], "reset before its first console line"),
        (["sh", "-c", "kill -9 $$"], "killed by signal 9 (the memory limit?)"),
        (["sh", "-c", "echo 'qemu: bad option' >&2; exit 1"], "qemu exited: qemu: bad option"),
    ],
)
def test_a_qemu_that_exits_says_how(tmp_path: Path, argv: list[str], expected: str) -> None:
    vmm = qemu.QemuVmm(accel="tcg")
    vmm.run_dir = tmp_path
    with open(tmp_path / "qemu.log", "wb") as log:
        vmm._proc = subprocess.Popen(argv, stderr=log)
        vmm._proc.wait()
    assert expected in str(vmm.failure("qemu exited"))


@pytest.mark.asyncio
async def test_a_restore_without_its_state_file_starts_no_qemu(tmp_path: Path) -> None:
    """The state file is opened before QEMU starts (QEMU inherits it): a missing one is a
    clear error, the snapshot check's own when there is a check, and no QEMU runs."""
    cfg = VmConfig(
        vcpus=1,
        memory_mib=64,
        kernel=tmp_path / "vmlinux",
        cmdline="",
        run_dir=tmp_path / "run",
        mem_file=tmp_path / "ram",
        agent_socket=tmp_path / "run" / "serial.sock",
    )
    snap = Snapshot(dir=tmp_path, mem_file=tmp_path / "ram", state=tmp_path / "state")
    vmm = qemu.QemuVmm(accel="tcg")
    with pytest.raises(SandboxFailed, match="state: No such file"):
        await vmm.restore(cfg, snap, private=False, timeout_s=5)

    def check() -> None:
        raise snapshots.SnapshotCorrupt("snapshot: state is missing")

    with pytest.raises(snapshots.SnapshotCorrupt, match="state is missing"):
        await vmm.restore(cfg, snap, private=False, timeout_s=5, check=check)
    assert vmm.pid == 0
    assert not cfg.run_dir.exists()


def _offered(binary: str, kind: str) -> set[str]:
    """The names ``binary -<kind> help`` lists (devices, netdev/chardev backends, ...)."""
    out = subprocess.run([binary, f"-{kind}", "help"], capture_output=True, text=True).stdout
    return set(re.findall(r'name "([^"]+)"', out)) if kind == "device" else set(out.split())


@pytest.mark.skipif(
    shutil.which(qemu.QEMU_KVM_MICROVM) is None,
    reason=f"{qemu.QEMU_KVM_MICROVM} is not installed (Debian's qemu-system-x86 ships it)",
)
def test_the_kvm_only_build_has_everything_a_microvm_argv_names(tmp_path: Path) -> None:
    """KVM cannot run guests here, so the KVM-only build is checked against the argv: every
    machine, accelerator, device, backend and object the driver asks for must be in it."""
    cfg = VmConfig(
        vcpus=1, memory_mib=64, kernel=tmp_path / "vmlinux", cmdline="", run_dir=tmp_path,
        mem_file=tmp_path / "ram", agent_socket=tmp_path / "serial.sock",
        drives=(Drive("scratch", tmp_path / "s.qcow2", False),),
        net=(NetIface("eth0", "tap0", "02:00:00:00:00:01"),),
    )  # fmt: skip
    vmm = qemu.QemuVmm(accel="kvm")
    asked: dict[str, set[str]] = {k: set() for k in ("machine", "accel", "device", "netdev",
                                                     "chardev", "object")}  # fmt: skip
    for incoming in (False, True):
        argv = vmm.argv(cfg, mem_path=cfg.mem_file, share=not incoming, incoming=incoming)
        assert argv[0] == qemu.QEMU_KVM_MICROVM
        for flag, value in itertools.pairwise(argv):
            kind = "machine" if flag == "-M" else flag.lstrip("-")
            if kind in asked:
                asked[kind].add(value.split(",")[0])
    assert {"virtio-serial-device", "virtio-blk-device", "virtio-net-device"} <= asked["device"]
    for kind, names in asked.items():
        missing = names - _offered(qemu.QEMU_KVM_MICROVM, kind)
        assert not missing, f"{qemu.QEMU_KVM_MICROVM} has no {kind} {sorted(missing)}"
