"""Unit tests of the full-VM backend's pieces that need no QEMU: command line, image build."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from dsec.core.errors import InvalidArgument
from dsec.edge.backends.microvm.qemu import QemuVmm
from dsec.edge.backends.microvm.vmm import Drive, VmConfig
from dsec.edge.backends.vm import image
from dsec.edge.backends.vm.backend import guest_cmdline


def test_cmdline_carries_hostname_and_env() -> None:
    line = guest_cmdline("sbx1", {"A": "1", "GREETING": "hello vm"})
    assert line.startswith("root=/dev/vda rw ")
    assert "systemd.hostname=sbx1" in line.split()
    assert "systemd.setenv=A=1" in line.split()
    assert '"systemd.setenv=GREETING=hello vm"' in line


@pytest.mark.parametrize("value", ['a"b', "a\nb", "a\\b"])
def test_cmdline_refuses_what_systemd_cannot_parse(value: str) -> None:
    with pytest.raises(InvalidArgument, match="quotes"):
        guest_cmdline("sbx1", {"A": value})


def test_cmdline_refuses_a_huge_environment() -> None:
    with pytest.raises(InvalidArgument, match="too large"):
        guest_cmdline("sbx1", {f"K{i}": "x" * 100 for i in range(30)})


def test_q35_knob_uses_pci_devices(tmp_path: Path) -> None:
    cfg = VmConfig(
        vcpus=1,
        memory_mib=256,
        kernel=tmp_path / "vmlinuz",
        cmdline="root=/dev/vda",
        run_dir=tmp_path,
        mem_file=tmp_path / "mem",
        drives=(Drive("root", tmp_path / "disk.qcow2", read_only=False),),
        agent_socket=tmp_path / "serial.sock",
        extra={"machine": "q35", "initrd": str(tmp_path / "initrd.img")},
    )
    argv = QemuVmm(accel="tcg").argv(cfg, mem_path=cfg.mem_file, share=True, incoming=False)
    assert argv[argv.index("-M") + 1] == "q35,memory-backend=mem"
    devices = [argv[i + 1] for i, a in enumerate(argv) if a == "-device"]
    assert "virtio-serial-pci" in devices
    assert any(d.startswith("virtio-blk-pci,") for d in devices)
    assert not any(d.startswith("virtio-") and "-device" in d for d in devices)
    assert argv[argv.index("-initrd") + 1] == str(tmp_path / "initrd.img")
    micro_cfg = dataclasses.replace(cfg, extra={})
    micro = QemuVmm(accel="tcg").argv(micro_cfg, mem_path=cfg.mem_file, share=True, incoming=False)
    assert micro[micro.index("-M") + 1].startswith("microvm,")


def test_mmdebstrap_command_installs_units_and_initramfs_config(tmp_path: Path) -> None:
    cmd = image.mmdebstrap_command(tmp_path / "root", [Path("/etc/apt/sources.list")])
    assert cmd[:2] == ["mmdebstrap", "--variant=minbase"]
    assert any(a.startswith("--include=") and "linux-image-amd64" in a for a in cmd)
    hooks = " ".join(cmd)
    for unit in image.UNITS:
        assert f"/etc/systemd/system/{unit}" in hooks
    assert "MODULES=list" in hooks
    assert cmd[-2:] == [str(tmp_path / "root"), "/etc/apt/sources.list"]


def test_rootfs_key_follows_the_unit_texts(monkeypatch: pytest.MonkeyPatch) -> None:
    before = image.rootfs_key()
    monkeypatch.setitem(image.UNITS, "extra.service", "[Service]\n")
    assert image.rootfs_key() != before


def test_the_channel_unit_runs_the_c_multiplexer() -> None:
    unit = image.UNITS["dsec-vmport.service"]
    assert f"ExecStart={image.VMPORT_BIN}\n" in unit
    assert "python" not in unit


def test_a_new_vmport_c_rebuilds_the_disk_not_the_system(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key, name = image.rootfs_key(), image.build_name("k", "b")
    changed = tmp_path / "vmport.c"
    changed.write_bytes(image.VMPORT_C.read_bytes() + b"/* changed */\n")
    monkeypatch.setattr(image, "VMPORT_C", changed)
    assert image.build_name("k", "b") != name
    assert image.rootfs_key() == key


def test_current_image_needs_every_file(tmp_path: Path) -> None:
    d = tmp_path / "vm-image" / "k-b"
    d.mkdir(parents=True)
    (tmp_path / "vm-image" / "current").symlink_to("k-b")
    assert image.current_image(tmp_path) is None
    for name in ("disk.qcow2", "vmlinuz", "initrd.img"):
        (d / name).write_bytes(b"x")
    assert image.current_image(tmp_path) is None  # no version file yet
    (d / "version").write_text("6.1.0-test\n")
    img = image.current_image(tmp_path)
    assert img is not None
    assert img.kernel_version == "6.1.0-test"
    assert image.built_before(tmp_path)


def test_module_order_puts_dependencies_first() -> None:
    dep = (
        "kernel/fs/ext4/ext4.ko: kernel/lib/crc16.ko kernel/fs/jbd2/jbd2.ko\n"
        "kernel/lib/crc16.ko:\n"
        "kernel/fs/jbd2/jbd2.ko:\n"
        "kernel/crypto/crc32c_generic.ko:\n"
        "kernel/drivers/virtio/virtio_pci.ko: kernel/drivers/virtio/virtio.ko\n"
        "kernel/drivers/virtio/virtio.ko:\n"
    )
    order = image.module_order(dep, ["crc32c_generic", "virtio_pci", "ext4"])
    assert order == [
        "kernel/crypto/crc32c_generic.ko",
        "kernel/drivers/virtio/virtio.ko",
        "kernel/drivers/virtio/virtio_pci.ko",
        "kernel/fs/jbd2/jbd2.ko",
        "kernel/lib/crc16.ko",
        "kernel/fs/ext4/ext4.ko",
    ]
    with pytest.raises(Exception, match="not found"):
        image.module_order(dep, ["nosuchmod"])
