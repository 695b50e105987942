"""The KVM probe: ioctl numbers and struct layouts match the kernel's headers, exits decode,
and the probe answers (never hangs, never raises) however its child fails."""

from __future__ import annotations

import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dsec.edge.backends.microvm import kvm

NAMES = [
    "KVM_GET_API_VERSION", "KVM_CREATE_VM", "KVM_GET_VCPU_MMAP_SIZE", "KVM_GET_SUPPORTED_CPUID",
    "KVM_CREATE_VCPU", "KVM_SET_USER_MEMORY_REGION", "KVM_RUN", "KVM_GET_REGS", "KVM_SET_REGS",
    "KVM_GET_SREGS", "KVM_SET_SREGS", "KVM_GET_MSRS", "KVM_SET_MSRS", "KVM_SET_CPUID2",
]  # fmt: skip


def test_ioctl_numbers_known_values() -> None:
    assert kvm.KVM_GET_API_VERSION == 0xAE00
    assert kvm.KVM_CREATE_VM == 0xAE01
    assert kvm.KVM_RUN == 0xAE80
    assert kvm.KVM_SET_USER_MEMORY_REGION == 0x4020AE46
    assert kvm.KVM_GET_SREGS == 0x8138AE83
    assert kvm.KVM_SET_REGS == 0x4090AE82
    assert kvm.KVM_GET_MSRS == 0xC008AE88


def test_ioctl_numbers_and_sizes_match_linux_headers(tmp_path: Path) -> None:
    if shutil.which("gcc") is None or not Path("/usr/include/linux/kvm.h").exists():
        pytest.skip("gcc or /usr/include/linux/kvm.h missing: cannot compile the cross-check")
    lines = "".join(f'printf("{n} %lu\\n", (unsigned long){n});' for n in NAMES)
    sizes = (
        'printf("regs %zu\\nsregs %zu\\nsegment %zu\\nregion %zu\\ncpuid_entry %zu\\n",'
        " sizeof(struct kvm_regs), sizeof(struct kvm_sregs), sizeof(struct kvm_segment),"
        " sizeof(struct kvm_userspace_memory_region), sizeof(struct kvm_cpuid_entry2));"
        'printf("exit_reason %zu\\nio %zu\\n", offsetof(struct kvm_run, exit_reason),'
        " offsetof(struct kvm_run, io));"
    )
    src = tmp_path / "k.c"
    src.write_text(
        "#include <stdio.h>\n#include <stddef.h>\n#include <linux/kvm.h>\n"
        f"int main(void) {{ {lines} {sizes} return 0; }}\n"
    )
    subprocess.run(["gcc", "-o", str(tmp_path / "k"), str(src)], check=True)
    out = subprocess.run([str(tmp_path / "k")], check=True, capture_output=True, text=True)
    got = dict(line.split() for line in out.stdout.splitlines())
    for n in NAMES:
        assert int(got[n]) == getattr(kvm, n), n
    assert int(got["regs"]) == kvm.REGS_SIZE
    assert int(got["sregs"]) == kvm.SREGS_SIZE
    assert int(got["segment"]) == kvm.SEGMENT_SIZE
    assert int(got["region"]) == kvm.REGION_SIZE
    assert int(got["cpuid_entry"]) == kvm.CPUID_ENTRY_SIZE
    assert (int(got["exit_reason"]), int(got["io"])) == (8, 32)


def test_parse_exit_io_and_hlt() -> None:
    run = bytearray(4096)
    struct.pack_into("<I", run, 8, kvm.KVM_EXIT_IO)
    struct.pack_into("<BBHIQ", run, 32, kvm.KVM_EXIT_IO_OUT, 1, 0x10, 1, 4000)
    run[4000] = 42
    e = kvm.parse_exit(bytes(run))
    assert (e.name, e.io_direction, e.io_port, e.io_data) == ("IO", 1, 0x10, b"\x2a")
    struct.pack_into("<I", run, 8, kvm.KVM_EXIT_HLT)
    assert kvm.parse_exit(bytes(run)).name == "HLT"
    struct.pack_into("<I", run, 8, 17)
    assert kvm.parse_exit(bytes(run)).name == "INTERNAL_ERROR"


def test_parse_exit_rejects_bad_buffers() -> None:
    with pytest.raises(ValueError, match="at least 48"):
        kvm.parse_exit(b"\0" * 20)
    run = bytearray(64)
    struct.pack_into("<I", run, 8, kvm.KVM_EXIT_IO)
    struct.pack_into("<BBHIQ", run, 32, 1, 1, 0x10, 1, 4000)
    with pytest.raises(ValueError, match="outside kvm_run"):
        kvm.parse_exit(bytes(run))


def test_structs() -> None:
    buf = kvm.msrs_buffer([(0x10A, 7), (0x10, 9)])
    assert len(buf) == 8 + 2 * 16
    assert struct.unpack_from("<I", buf, 0)[0] == 2
    assert (kvm.msr_value(buf, 0), kvm.msr_value(buf, 1)) == (7, 9)
    cpuid = kvm.cpuid_buffer(3)
    assert (kvm.cpuid_count(cpuid), len(cpuid)) == (3, 8 + 3 * 40)
    regs = kvm.start_regs(0x1000)
    assert struct.unpack("<18Q", regs)[16:] == (0x1000, 2)
    sregs = bytearray(b"\xff" * kvm.SREGS_SIZE)
    kvm.real_mode_sregs(sregs)
    assert struct.unpack_from("<QIH", sregs, 0) == (0, 0xFFFFFFFF, 0)


def test_probe_here_answers_with_a_reason() -> None:
    start = time.monotonic()
    ok, reason = kvm.usable()
    assert time.monotonic() - start < kvm.PROBE_TIMEOUT_S + 2
    assert reason
    if ok:
        assert "probe guest ran" in reason
    else:  # this development machine: /dev/kvm opens but refuses a VMM's vCPU setup
        assert any(w in reason for w in ("KVM", "/dev/kvm")), reason
    assert kvm.usable() is kvm.usable()  # computed once


def test_probe_kills_a_hanging_child() -> None:
    start = time.monotonic()
    ok, reason = kvm.probe(0.5, [sys.executable, "-c", "import time; time.sleep(60)"])
    assert not ok
    assert "did not finish within 0.5s" in reason
    assert time.monotonic() - start < 5


def test_probe_reports_a_crashing_child() -> None:
    ok, reason = kvm.probe(10, [sys.executable, "-c", "import os; os.abort()"])
    assert (ok, "killed by signal 6" in reason) == (False, True), reason
    code = "import sys; print('boom', file=sys.stderr); sys.exit(3)"
    ok, reason = kvm.probe(10, [sys.executable, "-c", code])
    assert not ok
    assert "exited with status 3: boom" in reason


def test_probe_reports_garbage_and_the_child_verdict() -> None:
    ok, reason = kvm.probe(10, [sys.executable, "-c", "print('hello')"])
    assert (ok, "garbage" in reason) == (False, True)
    code = 'print(\'{"ok": false, "detail": "KVM_RUN failed: nope"}\')'
    ok, reason = kvm.probe(10, [sys.executable, "-c", code])
    assert (ok, reason.startswith("KVM_RUN failed: nope")) == (False, True)
