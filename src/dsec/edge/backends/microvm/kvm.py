"""Does KVM really run guests here? A timed probe boot, done once per process.

Opening ``/dev/kvm`` proves little: on some hosts (nested virtualisation without the
right CPU features, a broken host kernel) the device opens and ``KVM_CREATE_VM`` works,
but a vCPU refuses the setup a VMM gives it, aborts, or never returns from ``KVM_RUN``.
So the probe sets a vCPU up the way VMMs do (CPUID, feature MSRs) and runs a real guest:
a few real-mode instructions (``mov al, 42; out 0x10, al; hlt``) in one page of guest
memory, and checks that the vCPU exits first with that port write and then with ``hlt``.
The guest runs in a child process (``python -m dsec.edge.backends.microvm.kvm``) under a
timeout, in its own process group, so a hanging or crashing probe costs the edge nothing.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import json
import mmap
import os
import signal
import struct
import subprocess
import sys
import time
from dataclasses import dataclass

KVM_DEV = "/dev/kvm"
PROBE_TIMEOUT_S = 5.0
KVM_API_VERSION = 12  # the only stable KVM API version there has ever been

# ioctl request numbers, the Linux _IOC encoding: dir << 30 | size << 16 | type << 8 | nr
_IOC_NONE, _IOC_WRITE, _IOC_READ, _IOC_RW = 0, 1, 2, 3
KVMIO = 0xAE


def _ioc(direction: int, nr: int, size: int) -> int:
    return (direction << 30) | (size << 16) | (KVMIO << 8) | nr


REGS_SIZE = 18 * 8  # struct kvm_regs: rax..r15, rip, rflags
SEGMENT_SIZE = 24  # struct kvm_segment
SREGS_SIZE = 8 * SEGMENT_SIZE + 2 * 16 + 7 * 8 + 4 * 8  # segments, gdt/idt, cr*, bitmap
REGION_SIZE = 32  # struct kvm_userspace_memory_region

KVM_GET_API_VERSION = _ioc(_IOC_NONE, 0x00, 0)
KVM_CREATE_VM = _ioc(_IOC_NONE, 0x01, 0)
KVM_GET_VCPU_MMAP_SIZE = _ioc(_IOC_NONE, 0x04, 0)
KVM_GET_SUPPORTED_CPUID = _ioc(_IOC_RW, 0x05, 8)  # struct kvm_cpuid2 header
KVM_CREATE_VCPU = _ioc(_IOC_NONE, 0x41, 0)
KVM_SET_USER_MEMORY_REGION = _ioc(_IOC_WRITE, 0x46, REGION_SIZE)
KVM_RUN = _ioc(_IOC_NONE, 0x80, 0)
KVM_GET_REGS = _ioc(_IOC_READ, 0x81, REGS_SIZE)
KVM_SET_REGS = _ioc(_IOC_WRITE, 0x82, REGS_SIZE)
KVM_GET_SREGS = _ioc(_IOC_READ, 0x83, SREGS_SIZE)
KVM_SET_SREGS = _ioc(_IOC_WRITE, 0x84, SREGS_SIZE)
KVM_GET_MSRS = _ioc(_IOC_RW, 0x88, 8)  # struct kvm_msrs header (nmsrs, pad)
KVM_SET_MSRS = _ioc(_IOC_WRITE, 0x89, 8)
KVM_SET_CPUID2 = _ioc(_IOC_WRITE, 0x90, 8)

CPUID_ENTRY_SIZE = 40  # struct kvm_cpuid_entry2
MAX_CPUID_ENTRIES = 256
MSR_IA32_ARCH_CAPABILITIES = 0x10A

KVM_EXIT_IO, KVM_EXIT_HLT = 2, 5
KVM_EXIT_IO_OUT = 1
EXIT_NAMES = {0: "UNKNOWN", 1: "EXCEPTION", 2: "IO", 5: "HLT", 8: "SHUTDOWN",
              9: "FAIL_ENTRY", 17: "INTERNAL_ERROR"}  # fmt: skip

GUEST_ADDR = 0x1000  # guest-physical address of the code page (real mode, cs = 0)
PROBE_PORT = 0x10
PROBE_BYTE = 42
# mov al, 42 ; out 0x10, al ; hlt
GUEST_CODE = bytes([0xB0, PROBE_BYTE, 0xE6, PROBE_PORT, 0xF4])


@dataclass(frozen=True, slots=True)
class Exit:
    """Why ``KVM_RUN`` returned, decoded from the vCPU's ``struct kvm_run``."""

    reason: int
    io_direction: int = 0
    io_size: int = 0
    io_port: int = 0
    io_count: int = 0
    io_data: bytes = b""

    @property
    def name(self) -> str:
        return EXIT_NAMES.get(self.reason, str(self.reason))


def parse_exit(run: bytes) -> Exit:
    """Decode ``struct kvm_run``: exit_reason at offset 8, the exit union at offset 32
    (for I/O: u8 direction, u8 size, u16 port, u32 count, u64 data_offset into ``run``)."""
    if len(run) < 48:
        raise ValueError(f"kvm_run is {len(run)} bytes, need at least 48")
    (reason,) = struct.unpack_from("<I", run, 8)
    if reason != KVM_EXIT_IO:
        return Exit(reason)
    direction, size, port, count, offset = struct.unpack_from("<BBHIQ", run, 32)
    end = offset + size * count
    if end > len(run):
        raise ValueError(f"I/O data at {offset}+{size * count} is outside kvm_run")
    return Exit(reason, direction, size, port, count, bytes(run[offset:end]))


def real_mode_sregs(sregs: bytearray) -> None:
    """Point the code segment at 0 (base and selector): the code page runs at cs:ip = 0:ip."""
    cs = 0  # struct kvm_sregs starts with cs
    struct.pack_into("<Q", sregs, cs, 0)  # base
    struct.pack_into("<H", sregs, cs + 12, 0)  # selector


def start_regs(rip: int) -> bytes:
    regs = [0] * 18
    regs[16] = rip
    regs[17] = 0x2  # rflags: bit 1 is reserved and always set
    return struct.pack("<18Q", *regs)


def _ioctl(step: str, fd: int, request: int, arg: int | bytearray = 0) -> int:
    """One ioctl and its return value; a bytearray argument is read and written in place."""
    try:
        if isinstance(arg, bytearray):
            return int(fcntl.ioctl(fd, request, arg, True))
        return int(fcntl.ioctl(fd, request, arg))
    except OSError as exc:
        raise ProbeFailed(f"{step} failed: {exc.strerror or exc}") from None


def msrs_buffer(entries: list[tuple[int, int]]) -> bytearray:
    """``struct kvm_msrs`` with its ``kvm_msr_entry`` array: (index, data) pairs."""
    buf = bytearray(struct.pack("<II", len(entries), 0))
    for index, data in entries:
        buf += struct.pack("<IIQ", index, 0, data)
    return buf


def msr_value(buf: bytes | bytearray, i: int = 0) -> int:
    (value,) = struct.unpack_from("<Q", buf, 8 + 16 * i + 8)
    return int(value)


def cpuid_buffer(nent: int = MAX_CPUID_ENTRIES) -> bytearray:
    """An empty ``struct kvm_cpuid2`` with room for ``nent`` entries."""
    return bytearray(struct.pack("<II", nent, 0)) + bytearray(nent * CPUID_ENTRY_SIZE)


def cpuid_count(buf: bytes | bytearray) -> int:
    (nent,) = struct.unpack_from("<I", buf, 0)
    return int(nent)


def _set_cpu_like_a_vmm(kvm: int, vcpu: int) -> None:
    """What QEMU and Firecracker do to every vCPU before it runs: give it the CPUID KVM
    supports, and copy the feature MSRs KVM reports (ARCH_CAPABILITIES) into it. Hosts
    with broken nested KVM refuse the MSR KVM itself advertised."""
    cpuid = cpuid_buffer()
    _ioctl("KVM_GET_SUPPORTED_CPUID", kvm, KVM_GET_SUPPORTED_CPUID, cpuid)
    n = cpuid_count(cpuid)
    _ioctl("KVM_SET_CPUID2", vcpu, KVM_SET_CPUID2, cpuid[: 8 + n * CPUID_ENTRY_SIZE])
    feature = msrs_buffer([(MSR_IA32_ARCH_CAPABILITIES, 0)])
    try:
        known = fcntl.ioctl(kvm, KVM_GET_MSRS, feature, True)
    except OSError:
        known = 0  # no feature-MSR support: nothing a VMM would copy
    if known == 1:
        value = msr_value(feature)
        done = _ioctl("KVM_SET_MSRS", vcpu, KVM_SET_MSRS,
                      msrs_buffer([(MSR_IA32_ARCH_CAPABILITIES, value)]))  # fmt: skip
        if done != 1:
            raise ProbeFailed(
                f"KVM refuses MSR 0x{MSR_IA32_ARCH_CAPABILITIES:x} (ARCH_CAPABILITIES) = "
                f"0x{value:x}, the value it reports as supported (broken nested KVM?)"
            )


class ProbeFailed(Exception):
    pass


def run_guest() -> str:
    """Run the probe guest in this process; return what happened, raise ProbeFailed."""
    try:
        kvm = os.open(KVM_DEV, os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        raise ProbeFailed(f"cannot open {KVM_DEV}: {exc.strerror}") from None
    version = _ioctl("KVM_GET_API_VERSION", kvm, KVM_GET_API_VERSION, 0)
    if version != KVM_API_VERSION:
        raise ProbeFailed(f"KVM API version {version}, expected {KVM_API_VERSION}")
    vm = _ioctl("KVM_CREATE_VM", kvm, KVM_CREATE_VM, 0)
    mem = mmap.mmap(-1, 2 * mmap.PAGESIZE)
    mem[GUEST_ADDR : GUEST_ADDR + len(GUEST_CODE)] = GUEST_CODE
    host_addr = ctypes.addressof(ctypes.c_char.from_buffer(mem))
    region = struct.pack("<IIQQQ", 0, 0, 0, len(mem), host_addr)
    _ioctl("KVM_SET_USER_MEMORY_REGION", vm, KVM_SET_USER_MEMORY_REGION, bytearray(region))
    vcpu = _ioctl("KVM_CREATE_VCPU", vm, KVM_CREATE_VCPU, 0)
    run_size = _ioctl("KVM_GET_VCPU_MMAP_SIZE", kvm, KVM_GET_VCPU_MMAP_SIZE, 0)
    run = mmap.mmap(vcpu, run_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    _set_cpu_like_a_vmm(kvm, vcpu)
    sregs = bytearray(SREGS_SIZE)
    _ioctl("KVM_GET_SREGS", vcpu, KVM_GET_SREGS, sregs)
    real_mode_sregs(sregs)
    _ioctl("KVM_SET_SREGS", vcpu, KVM_SET_SREGS, sregs)
    _ioctl("KVM_SET_REGS", vcpu, KVM_SET_REGS, bytearray(start_regs(GUEST_ADDR)))
    _ioctl("KVM_RUN", vcpu, KVM_RUN, 0)
    first = parse_exit(run[:])
    if first.reason != KVM_EXIT_IO or (first.io_direction, first.io_port, first.io_data) != (
        KVM_EXIT_IO_OUT,
        PROBE_PORT,
        bytes([PROBE_BYTE]),
    ):
        raise ProbeFailed(f"probe guest exited with {first.name}, expected an out to port 0x10")
    _ioctl("KVM_RUN", vcpu, KVM_RUN, 0)
    second = parse_exit(run[:])
    if second.reason != KVM_EXIT_HLT:
        raise ProbeFailed(f"probe guest exited with {second.name}, expected HLT")
    return f"KVM API {version}: a probe guest ran (CPUID and MSRs set, port write, hlt)"


def _child() -> None:
    """Entry point of the probe child: one JSON line on stdout."""
    try:
        print(json.dumps({"ok": True, "detail": run_guest()}), flush=True)
    except ProbeFailed as exc:
        print(json.dumps({"ok": False, "detail": str(exc)}), flush=True)


def probe(timeout_s: float = PROBE_TIMEOUT_S, command: list[str] | None = None) -> tuple[bool, str]:
    """Run the probe guest in a child process; never raise, never take longer than timeout.
    (``command`` replaces the child, for tests of the ways a child can fail.)"""
    if command is None and not os.path.exists(KVM_DEV):
        return False, f"{KVM_DEV} does not exist"
    if command is None and not os.access(KVM_DEV, os.R_OK | os.W_OK):
        return False, f"{KVM_DEV} is not readable and writable by this user"
    start = time.monotonic()
    try:
        child = subprocess.Popen(
            command or [sys.executable, "-m", __name__],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    except OSError as exc:
        return False, f"cannot start the KVM probe: {exc}"
    try:
        out, err = child.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.communicate()
        return False, f"the KVM probe guest did not finish within {timeout_s:g}s (KVM_RUN hangs)"
    took = time.monotonic() - start
    line = out.decode(errors="replace").strip().splitlines()
    if child.returncode != 0 or not line:
        how = (
            f"was killed by signal {-child.returncode}"
            if child.returncode < 0
            else f"exited with status {child.returncode}"
        )
        tail = err.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        return False, f"the KVM probe {how}: {tail[0][:200]}"
    try:
        result = json.loads(line[-1])
        return bool(result["ok"]), f"{result['detail']} ({took * 1000:.0f} ms)"
    except (ValueError, KeyError, TypeError):
        return False, f"the KVM probe answered garbage: {line[-1][:200]!r}"


@functools.cache
def usable() -> tuple[bool, str]:
    """``(True, detail)`` when KVM runs guests on this host, else ``(False, reason)``.

    Computed once per process (the first call takes up to ``PROBE_TIMEOUT_S``)."""
    return probe()


if __name__ == "__main__":
    _child()
