"""The OCI runtime config (config.json) of a sandbox container, built in-process.

PID 1 is ``/.dsec/init`` from the agent bundle, bind-mounted read-only at ``/.dsec``. The
container gets new pid, mount, uts, ipc and cgroup namespaces, a network namespace (the
one dsec.edge.net prepared, or a fresh one with only ``lo``),
a Docker-like reduced capability set, the seccomp profile of
:mod:`dsec.edge.backends.container.seccomp`, and memory, CPU and pids limits in a cgroup
under the platform's parent.
"""

from __future__ import annotations

import json
import os
import resource
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dsec.core.spec import SandboxSpec
from dsec.edge.backends.container import seccomp
from dsec.edge.images.store import Image

OCI_VERSION = "1.0.2"
INIT_PATH = "/.dsec/init"
AGENT_MOUNT = "/.dsec"
AGENT_RUN = "/.dsec/run"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
CPU_PERIOD_US = 100_000
NOFILE_LIMIT = 65536  # capped at the edge's own hard limit: crun cannot raise it
MiB = 1 << 20

# The capabilities root keeps inside a sandbox, and why. Everything else is dropped; in
# particular SYS_ADMIN (mounts, namespaces ...), NET_ADMIN (network config), SYS_PTRACE
# (tracing other users' processes), SYS_MODULE, SYS_RAWIO, SYS_TIME, SYS_BOOT, NET_RAW
# (raw packets: spoofing once the sandbox has a real interface), MKNOD (device nodes;
# /dev is managed by the runtime), DAC_READ_SEARCH (open_by_handle_at), IPC_LOCK,
# SYS_NICE, SYS_RESOURCE, BPF, PERFMON, SYSLOG and AUDIT_CONTROL.
CAPABILITIES: dict[str, str] = {
    "CAP_CHOWN": "chown files (package installs, tar, user home setup)",
    "CAP_DAC_OVERRIDE": "root reads and writes any file, as users expect of root",
    "CAP_FOWNER": "chmod/utime files root does not own (pip, tar, editors)",
    "CAP_FSETID": "keep setuid/setgid bits when root changes a file (dpkg)",
    "CAP_KILL": "signal processes of other users (process.signal, init's shutdown)",
    "CAP_SETGID": "run commands as another user (exec/process `user`, su, runuser)",
    "CAP_SETUID": "run commands as another user (exec/process `user`, su, runuser)",
    "CAP_SETPCAP": "let programs drop capabilities from their children (setpriv, capsh)",
    "CAP_SETFCAP": "packages that set file capabilities on install (setcap in postinst)",
    "CAP_NET_BIND_SERVICE": "servers on ports below 1024 inside the sandbox",
    "CAP_SYS_CHROOT": "chroot for build tools and package scripts",
    "CAP_AUDIT_WRITE": "PAM-based su/login write an audit record or fail",
}

# Like crun's default spec: hide files that leak host details or poke the kernel.
MASKED_PATHS = (
    "/proc/acpi",
    "/proc/asound",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/sys/firmware",
    "/sys/devices/virtual/powercap",
)
READONLY_PATHS = ("/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger")


def nofile_limit() -> int:
    """The sandbox's RLIMIT_NOFILE: NOFILE_LIMIT, or less if the edge's hard limit is lower."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return NOFILE_LIMIT if hard == resource.RLIM_INFINITY else min(NOFILE_LIMIT, hard)


def capability_mask(names: list[str] | None = None) -> int:
    """The CapEff bit mask (as in /proc/<pid>/status) of a capability list."""
    numbers = {
        "CAP_CHOWN": 0,
        "CAP_DAC_OVERRIDE": 1,
        "CAP_FOWNER": 3,
        "CAP_FSETID": 4,
        "CAP_KILL": 5,
        "CAP_SETGID": 6,
        "CAP_SETUID": 7,
        "CAP_SETPCAP": 8,
        "CAP_NET_BIND_SERVICE": 10,
        "CAP_SYS_CHROOT": 18,
        "CAP_AUDIT_WRITE": 29,
        "CAP_SETFCAP": 31,
    }
    mask = 0
    for name in CAPABILITIES if names is None else names:
        mask |= 1 << numbers[name]
    return mask


def build_env(
    sandbox_id: str,
    image_env: tuple[str, ...],
    spec_env: Mapping[str, str],
    *,
    image_user: str = "",
    image_workdir: str = "",
) -> list[str]:
    """The init's environment: defaults, then the image's, then the user's.

    Later sources override earlier ones; ``DSEC_SANDBOX_ID`` and ``HOSTNAME`` always name
    the sandbox. The image's ``User`` and ``WorkingDir`` reach the agent as
    ``DSEC_IMAGE_USER``/``DSEC_IMAGE_WORKDIR`` (its defaults for every command; the agent
    does not pass them on).
    """
    env: dict[str, str] = {
        "PATH": DEFAULT_PATH,
        "HOME": "/root",
        "HOSTNAME": sandbox_id,
        "TERM": "xterm-256color",
        "LANG": "C.UTF-8",
        "DSEC_SANDBOX_ID": sandbox_id,
    }
    for item in image_env:
        key, sep, value = item.partition("=")
        if sep and key:
            env[key] = value
    env.update(spec_env)
    env["DSEC_SANDBOX_ID"] = sandbox_id
    env["HOSTNAME"] = sandbox_id
    if image_user:
        env["DSEC_IMAGE_USER"] = image_user
    if image_workdir:
        env["DSEC_IMAGE_WORKDIR"] = image_workdir
    return [f"{k}={v}" for k, v in env.items()]


def resources(spec: SandboxSpec) -> dict[str, Any]:
    """``linux.resources``: memory without swap, a CFS quota, a pids limit, no devices."""
    memory = spec.memory_mb * MiB
    return {
        "memory": {"limit": memory, "swap": memory},  # swap = memory+swap: no swap
        "cpu": {"quota": max(1000, round(spec.cpu * CPU_PERIOD_US)), "period": CPU_PERIOD_US},
        "pids": {"limit": spec.pids},
        # Deny every device node; crun still allows the standard ones it creates in /dev.
        "devices": [{"allow": False, "access": "rwm"}],
    }


ETC_NAMES = ("hostname", "hosts", "resolv.conf")


def etc_files(sandbox_id: str, resolv_conf: str | None = None) -> dict[str, str]:
    """Files every sandbox gets in /etc (bind-mounted, so they never end up in its layer).

    ``resolv.conf`` only when the sandbox has a network (it names the edge's resolver).
    """
    files = {
        "hostname": f"{sandbox_id}\n",
        "hosts": (
            "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
            f"127.0.1.1\t{sandbox_id}\n"
        ),
    }
    if resolv_conf is not None:
        files["resolv.conf"] = resolv_conf
    return files


def mounts(agent_bundle: Path, etc_dir: Path | None = None) -> list[dict[str, Any]]:
    """The container's mounts, in mount order; ``etc_dir`` holds :func:`etc_files`."""
    nosuid_noexec_nodev = ["nosuid", "noexec", "nodev"]
    etc = [
        {
            "destination": f"/etc/{name}",
            "type": "bind",
            "source": os.fspath(etc_dir / name),
            "options": ["bind", "ro", "nosuid", "nodev", "noexec"],
        }
        for name in ETC_NAMES
        if etc_dir is not None and (name != "resolv.conf" or (etc_dir / name).exists())
    ]
    return [
        *etc,
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {
            "destination": "/dev",
            "type": "tmpfs",
            "source": "tmpfs",
            "options": ["nosuid", "strictatime", "mode=755", "size=65536k"],
        },
        {
            "destination": "/dev/pts",
            "type": "devpts",
            "source": "devpts",
            "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"],
        },
        {
            "destination": "/dev/shm",
            "type": "tmpfs",
            "source": "shm",
            "options": [*nosuid_noexec_nodev, "mode=1777", "size=65536k"],
        },
        {
            "destination": "/dev/mqueue",
            "type": "mqueue",
            "source": "mqueue",
            "options": nosuid_noexec_nodev,
        },
        {
            "destination": "/sys",
            "type": "sysfs",
            "source": "sysfs",
            "options": [*nosuid_noexec_nodev, "ro"],
        },
        {
            "destination": "/sys/fs/cgroup",
            "type": "cgroup",
            "source": "cgroup",
            "options": [*nosuid_noexec_nodev, "relatime", "ro"],
        },
        {
            "destination": AGENT_MOUNT,
            "type": "bind",
            "source": os.fspath(agent_bundle),
            "options": ["rbind", "ro", "nosuid", "nodev"],
        },
        {
            "destination": AGENT_RUN,
            "type": "tmpfs",
            "source": "tmpfs",
            "options": ["nosuid", "nodev", "noexec", "mode=700", "size=16m"],
        },
    ]


def build_config(
    *,
    sandbox_id: str,
    spec: SandboxSpec,
    image: Image,
    rootfs: Path,
    agent_bundle: Path,
    cgroups_path: str,
    etc_dir: Path | None = None,
    netns_path: Path | None = None,
) -> dict[str, Any]:
    """Return the complete OCI runtime config of one sandbox.

    Args:
        sandbox_id: becomes the hostname and ``DSEC_SANDBOX_ID``.
        spec: limits and user environment.
        image: the resolved image (its env is applied before the user's).
        rootfs: the mounted overlay.
        agent_bundle: host directory mounted read-only at ``/.dsec``.
        cgroups_path: e.g. ``/dsec/<sandbox_id>``.
        etc_dir: a host directory holding the sandbox's :func:`etc_files`, if any.
        netns_path: a prepared network namespace to join (see dsec.edge.net); without
            it the sandbox gets a fresh one with only ``lo``.
    """
    namespaces: list[dict[str, str]] = [
        {"type": t} for t in ("pid", "mount", "uts", "ipc", "network", "cgroup")
    ]
    if netns_path is not None:
        namespaces[4] = {"type": "network", "path": os.fspath(netns_path)}
    caps = list(CAPABILITIES)
    nofile = nofile_limit()
    return {
        "ociVersion": OCI_VERSION,
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": [INIT_PATH],
            "env": build_env(
                sandbox_id,
                image.env,
                spec.env,
                image_user=image.user,
                image_workdir=image.workdir,
            ),
            "cwd": image.workdir or "/",
            "capabilities": {
                "bounding": caps,
                "effective": caps,
                "permitted": caps,
                "inheritable": [],
                "ambient": [],
            },
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": nofile, "soft": nofile}],
            # setuid tools (su, sudo, ping ...) must keep working inside.
            "noNewPrivileges": False,
        },
        "root": {"path": os.fspath(rootfs), "readonly": False},
        "hostname": sandbox_id,
        "mounts": mounts(agent_bundle, etc_dir),
        "linux": {
            "namespaces": namespaces,
            "cgroupsPath": cgroups_path,
            "resources": resources(spec),
            "seccomp": seccomp.build_profile(),
            "maskedPaths": list(MASKED_PATHS),
            "readonlyPaths": list(READONLY_PATHS),
            "rootfsPropagation": "rprivate",
        },
    }


def write_config(bundle_dir: Path, config: dict[str, Any]) -> Path:
    """Write ``config.json`` into ``bundle_dir`` (mode 0600) and return its path."""
    path = bundle_dir / "config.json"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(config, f, separators=(",", ":"))
    return path
