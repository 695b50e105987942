"""The seccomp profile of every container: allow by default, deny a short, explained list.

A sandbox runs arbitrary code as root (in its own namespaces, with a reduced capability
set). Most dangerous syscalls already fail there for lack of a capability; the filter is
the second wall, and it also closes the paths that need no capability at all (user
namespaces, io_uring, userfaultfd, keyrings). Denied calls return EPERM, so programs see an
ordinary "operation not permitted" instead of being killed.

Decisions:

* ``ptrace`` stays **allowed**: debuggers and ``strace`` are normal tools in a code
  sandbox. Without CAP_SYS_PTRACE a process can only trace its own uid's processes, the
  pid namespace hides everything outside the sandbox, and kernels since 4.8 re-check
  seccomp after a tracer changes a syscall, so it cannot be used to skip this filter.
* ``clone3`` returns ENOSYS instead of EPERM: its flags live in a struct seccomp cannot
  read, so it is refused as "not implemented" and libc falls back to ``clone``, whose
  flags are checked.
* ``personality``, ``chroot`` and the NUMA calls are left to the capability checks.
"""

from __future__ import annotations

import errno
import platform
from typing import Any

# Groups of denied syscalls, each with the reason it is denied.
DENY_GROUPS: dict[str, tuple[str, tuple[str, ...]]] = {
    "mounts": (
        "changing the mount table would let root reshape or escape its root filesystem",
        (
            "mount",
            "umount",
            "umount2",
            "pivot_root",
            "fsopen",
            "fsconfig",
            "fsmount",
            "fspick",
            "move_mount",
            "open_tree",
            "mount_setattr",
        ),
    ),
    "namespaces": (
        "new namespaces (user namespaces above all) expose kernel code that is otherwise "
        "root-only; joining one could leave the sandbox",
        ("unshare", "setns"),
    ),
    "keyrings": (
        "kernel keyrings are not namespaced: keys could leak between sandboxes",
        ("keyctl", "add_key", "request_key"),
    ),
    "kernel_extension": (
        "loading code or programs into the kernel",
        (
            "bpf",
            "init_module",
            "finit_module",
            "delete_module",
            "create_module",
            "kexec_load",
            "kexec_file_load",
        ),
    ),
    "observability": (
        "perf events and the kernel log reveal host activity and addresses",
        ("perf_event_open", "syslog", "lookup_dcookie"),
    ),
    "host_state": (
        "rebooting, swap, process accounting, quotas and the host clock are host-wide",
        (
            "reboot",
            "swapon",
            "swapoff",
            "acct",
            "quotactl",
            "settimeofday",
            "clock_settime",
            "clock_adjtime",
            "adjtimex",
            "stime",
            "vhangup",
            "nfsservctl",
        ),
    ),
    "file_handles": (
        "open_by_handle_at opens files by inode handle, bypassing the mount namespace",
        ("open_by_handle_at", "name_to_handle_at"),
    ),
    "io_ports": ("raw access to I/O ports", ("iopl", "ioperm")),
    "kernel_attack_surface": (
        "userfaultfd and io_uring are frequent sources of kernel exploits and are not "
        "needed by ordinary programs",
        ("userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register"),
    ),
    "obsolete": (
        "obsolete calls nothing modern needs",
        ("uselib", "ustat", "sysfs", "_sysctl", "get_kernel_syms", "query_module", "vm86"),
    ),
}

# clone(2) flags that create namespaces. CLONE_NEWTIME (0x80) is not listed: clone(2)
# cannot take it (those bits carry the exit signal), only unshare/clone3 can.
CLONE_NAMESPACE_FLAGS: dict[str, int] = {
    "CLONE_NEWNS": 0x00020000,
    "CLONE_NEWCGROUP": 0x02000000,
    "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000,
    "CLONE_NEWUSER": 0x10000000,
    "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
}

_ARCHES: dict[str, list[str]] = {
    "x86_64": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"],
    "aarch64": ["SCMP_ARCH_AARCH64", "SCMP_ARCH_ARM"],
}


def denied_syscalls() -> list[str]:
    """Every syscall the profile refuses outright (not counting ``clone`` flags)."""
    return [name for _, names in DENY_GROUPS.values() for name in names]


def build_profile(machine: str | None = None) -> dict[str, Any]:
    """Return the OCI ``linux.seccomp`` object.

    Args:
        machine: ``platform.machine()`` value choosing the architectures the filter
            covers (the native one and its compat ABIs, so 32-bit syscalls are filtered
            as well); defaults to this host's.
    """
    arch = _ARCHES.get(machine or platform.machine(), [])
    rules: list[dict[str, Any]] = [
        {"names": denied_syscalls(), "action": "SCMP_ACT_ERRNO", "errnoRet": errno.EPERM},
        {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.ENOSYS},
    ]
    # One rule per flag: the conditions of one rule are ANDed, separate rules are ORed.
    rules.extend(
        {
            "names": ["clone"],
            "action": "SCMP_ACT_ERRNO",
            "errnoRet": errno.EPERM,
            "args": [{"index": 0, "value": flag, "valueTwo": flag, "op": "SCMP_CMP_MASKED_EQ"}],
        }
        for flag in CLONE_NAMESPACE_FLAGS.values()
    )
    return {"defaultAction": "SCMP_ACT_ALLOW", "architectures": arch, "syscalls": rules}
