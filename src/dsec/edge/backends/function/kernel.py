"""The syscalls a function worker needs that Python's ``os`` lacks (through ctypes).

unshare(2), setns(2), pivot_root(2), prctl(2), bringing ``lo`` up with an
ioctl, and the container backend's seccomp profile (:mod:`..container.seccomp`) compiled
with libseccomp (the library crun links too) into the BPF program the zygote loads per call.
Everything here is blocking and only meant for the pool process and its workers.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import os
import platform
import socket
import struct
from typing import Any

from dsec.edge.backends.container import seccomp

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWNET = 0x40000000
# What a worker unshares once: a network namespace is slow to make and to tear down, and
# a call (as nobody) can change neither it nor the hostname.
WORKER_NAMESPACES = CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWNET

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}

_libc: ctypes.CDLL | None = None


def _lib() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.unshare.argtypes = [ctypes.c_int]
        lib.setns.argtypes = [ctypes.c_int, ctypes.c_int]
        lib.prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
        lib.syscall.restype = ctypes.c_long
        _libc = lib
    return _libc


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def unshare(flags: int) -> None:
    _check(_lib().unshare(flags), "unshare")


def setns(fd: int, nstype: int) -> None:
    _check(_lib().setns(fd, nstype), "setns")


def prctl(option: int, arg: int) -> None:
    _check(_lib().prctl(option, arg, 0, 0, 0), f"prctl({option})")


def set_name(name: bytes) -> None:
    """Name the calling thread (what ``ps`` and ``/proc/PID/comm`` show, 15 bytes)."""
    buf = ctypes.create_string_buffer(name[:15])
    _check(_lib().prctl(PR_SET_NAME, ctypes.addressof(buf), 0, 0, 0), "prctl(name)")


def pivot_root(new_root: str) -> None:
    """Make ``new_root`` the root and detach the old one (the ``pivot_root(".", ".")`` way)."""
    nr = _SYS_PIVOT_ROOT.get(platform.machine())
    if nr is None:
        raise OSError(errno.ENOSYS, f"pivot_root: unsupported machine {platform.machine()}")
    os.chdir(new_root)
    _check(int(_lib().syscall(nr, b".", b".")), "pivot_root")
    from dsec.edge.backends.container import mounts

    mounts.umount(".", mounts.MNT_DETACH)
    os.chdir("/")


_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1


def loopback_up() -> None:
    """Bring ``lo`` up in the current network namespace (it starts down)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s, _SIOCGIFFLAGS, req))[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | _IFF_UP))


# ---- seccomp ----------------------------------------------------------------------------

_SCMP_ACT_ALLOW = 0x7FFF0000
_SCMP_ACT_ERRNO = 0x00050000
_SCMP_CMP = {"SCMP_CMP_MASKED_EQ": 7, "SCMP_CMP_EQ": 4}
_SCMP_ARCH_NAMES = {
    "SCMP_ARCH_X86_64": b"x86_64",
    "SCMP_ARCH_X86": b"x86",
    "SCMP_ARCH_X32": b"x32",
    "SCMP_ARCH_AARCH64": b"aarch64",
    "SCMP_ARCH_ARM": b"arm",
}


class _ArgCmp(ctypes.Structure):
    _fields_ = (
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    )


class SeccompFilter:
    """The container profile compiled once (in the pool); :meth:`load` applies it."""

    def __init__(self, profile: dict[str, Any] | None = None) -> None:
        name = ctypes.util.find_library("seccomp")
        if name is None:
            raise OSError(errno.ENOENT, "libseccomp is not installed")
        lib = ctypes.CDLL(name, use_errno=True)
        lib.seccomp_init.restype = ctypes.c_void_p
        lib.seccomp_init.argtypes = [ctypes.c_uint32]
        lib.seccomp_arch_resolve_name.restype = ctypes.c_uint32
        lib.seccomp_arch_resolve_name.argtypes = [ctypes.c_char_p]
        lib.seccomp_arch_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
        lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
        lib.seccomp_rule_add_array.argtypes = [
            ctypes.c_void_p,
            ctypes.c_uint32,
            ctypes.c_int,
            ctypes.c_uint,
            ctypes.POINTER(_ArgCmp),
        ]
        lib.seccomp_load.argtypes = [ctypes.c_void_p]
        lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
        self._lib = lib
        profile = profile or seccomp.build_profile()
        ctx = lib.seccomp_init(_SCMP_ACT_ALLOW)
        if not ctx:
            raise OSError(errno.ENOMEM, "seccomp_init failed")
        self._ctx = ctx
        native = platform.machine().encode()
        for arch in profile.get("architectures", []):
            arch_name = _SCMP_ARCH_NAMES.get(arch)
            if arch_name is None or arch_name == native:
                continue
            token = lib.seccomp_arch_resolve_name(arch_name)
            rc = lib.seccomp_arch_add(ctx, token) if token else 0
            if rc not in (0, -errno.EEXIST):
                raise OSError(-rc, f"seccomp_arch_add({arch}): {os.strerror(-rc)}")
        for rule in profile["syscalls"]:
            action = _SCMP_ACT_ERRNO | (int(rule.get("errnoRet", errno.EPERM)) & 0xFFFF)
            conds = [
                _ArgCmp(a["index"], _SCMP_CMP[a["op"]], a["value"], a.get("valueTwo", 0))
                for a in rule.get("args", [])
            ]
            array = (_ArgCmp * max(len(conds), 1))(*conds)
            for syscall in rule["names"]:
                nr = lib.seccomp_syscall_resolve_name(syscall.encode())
                if nr == -1:  # not a syscall on this machine
                    continue
                rc = lib.seccomp_rule_add_array(ctx, action, nr, len(conds), array)
                if rc not in (0, -errno.EEXIST):
                    raise OSError(-rc, f"seccomp rule for {syscall}: {os.strerror(-rc)}")

        self._program = self._export()

    def _export(self) -> ctypes.Array[ctypes.c_char]:
        """The compiled BPF program (compiling it costs ~1.5 ms; a worker only loads it)."""
        r, w = os.pipe()
        try:
            rc = self._lib.seccomp_export_bpf(self._ctx, w)
            os.close(w)
            w = -1
            if rc != 0:
                raise OSError(-rc, f"seccomp_export_bpf: {os.strerror(-rc)}")
            chunks = []
            while chunk := os.read(r, 65536):
                chunks.append(chunk)
        finally:
            os.close(r)
            if w >= 0:
                os.close(w)
        data = b"".join(chunks)
        return ctypes.create_string_buffer(data, len(data))

    def program(self) -> bytes:
        """The BPF program (``struct sock_filter`` entries) for a zygote to load."""
        return bytes(self._program)
