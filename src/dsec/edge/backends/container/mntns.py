"""How ``crun run`` is launched on hybrid-cgroup hosts whose cgroup2 mount has controllers.

crun 1.8 refuses such hosts ("cgroups in hybrid mode not supported"), so ``crun run`` runs
in a private mount namespace in which ``/sys/fs/cgroup/unified`` is unmounted: crun then
sees a plain v1 host and applies every limit through the v1 controllers. Nothing on the
host changes. The namespace is created once, kept alive by a bind mount of its nsfs file
(``<run>/crun.mntns``), reused across edge restarts, and entered with
``nsenter --mount=<file> crun ...``. Other crun verbs run from the host namespace.

The sandbox rootfs is an overlay the edge mounts on the host after the namespace exists,
so the namespace must receive later host mounts. Mount propagation does that only from a
*shared* mount, and hosts without systemd (like this one) keep every mount private. So
the sandboxes directory is bind-mounted onto itself and marked shared before the
namespace is created with slave propagation: overlays mounted (and unmounted) below it on
the host appear (and disappear) inside; nothing flows back. The nsfs file must not live
below that shared mount (the kernel refuses the bind, as it would create a loop).

A rootfs outside the sandboxes directory still works: its ``crun run`` gets a fresh
namespace of its own (``unshare -m`` + ``umount`` + ``exec crun``), a few ms slower.
"""

from __future__ import annotations

import errno
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from dsec.core.errors import BackendUnavailable
from dsec.edge.backends.container import mounts

UNIFIED = "/sys/fs/cgroup/unified"


@dataclass(frozen=True, slots=True)
class Launcher:
    """The argv prefix that makes ``crun`` run where it works."""

    prefix: tuple[str, ...]
    how: str  # "direct", "nsenter" or "unshare"


DIRECT = Launcher(prefix=(), how="direct")
PER_CALL = Launcher(
    prefix=(
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "--",
        "/bin/sh",
        "-c",
        f'umount {UNIFIED} && exec "$0" "$@"',
    ),
    how="unshare",
)


class CrunNamespace:
    """The persistent private mount namespace for ``crun run`` (see module docstring)."""

    def __init__(self, ns_file: Path, shared_root: Path) -> None:
        self.ns_file = ns_file
        self.shared_root = shared_root
        self._ready = False

    @property
    def launcher(self) -> Launcher:
        return Launcher(prefix=("nsenter", f"--mount={self.ns_file}", "--"), how="nsenter")

    def launcher_for(self, rootfs: Path) -> Launcher:
        """The launcher for a container whose rootfs is ``rootfs``."""
        root = os.fspath(self.shared_root).rstrip("/") + "/"
        if self._ready and os.fspath(rootfs).startswith(root):
            return self.launcher
        return PER_CALL

    def ensure(self) -> None:
        """Create the namespace, or check the existing one is still right. Blocking.

        Raises:
            BackendUnavailable: the namespace cannot be created here.
        """
        ns = os.fspath(self.ns_file)
        if os.path.commonpath([ns, os.fspath(self.shared_root)]) == os.fspath(self.shared_root):
            raise BackendUnavailable(
                f"{self.ns_file} lies below the shared sandboxes dir {self.shared_root}"
            )
        group = self._ensure_shared_root()
        if self._ns_is_usable(group):
            self._ready = True
            return
        self._drop_ns_file()
        self._ensure_private_parent()
        self.ns_file.touch(mode=0o600, exist_ok=True)
        proc = subprocess.run(
            ["unshare", f"--mount={ns}", "--propagation", "slave", "--", "umount", UNIFIED],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            check=False,
            timeout=30,
        )
        if proc.returncode != 0:
            self._drop_ns_file()
            raise BackendUnavailable(
                f"cannot create crun's mount namespace at {ns}: {proc.stderr.strip()}"
            )
        if not self._ns_is_usable(group):
            self._drop_ns_file()
            raise BackendUnavailable(f"crun's mount namespace at {ns} does not see new mounts")
        self._ready = True

    def release(self) -> None:
        """Remove the namespace and the shared bind (tests; uninstall). Blocking.

        Mounts still below the sandboxes dir stay (the bind is detached lazily).
        """
        self._ready = False
        self._drop_ns_file()
        top = _top(mounts.mounts_at(self.shared_root))
        if top is not None and top.shared_group is not None:
            try:
                mounts.umount(self.shared_root, mounts.MNT_DETACH)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise

    def _ensure_shared_root(self) -> int:
        """Make the sandboxes dir a shared mount; return its peer group."""
        self.shared_root.mkdir(mode=0o711, parents=True, exist_ok=True)
        top = _top(mounts.mounts_at(self.shared_root))
        if top is not None and top.shared_group is not None:
            return top.shared_group
        try:
            mounts.mount(self.shared_root, self.shared_root, None, mounts.MS_BIND | mounts.MS_REC)
            mounts.mount(None, self.shared_root, None, mounts.MS_SHARED)
        except OSError as exc:
            raise BackendUnavailable(
                f"cannot make {self.shared_root} a shared mount for crun's namespace: {exc}"
            ) from None
        top = _top(mounts.mounts_at(self.shared_root))
        if top is None or top.shared_group is None:
            raise BackendUnavailable(f"{self.shared_root} did not become a shared mount")
        return top.shared_group

    def _ensure_private_parent(self) -> None:
        """Binding an nsfs file needs a non-shared mount under it (systemd hosts)."""
        parent = self.ns_file.parent
        parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        holder = mounts.containing_mount(parent)
        if holder is None or holder.shared_group is None:
            return
        mounts.mount(parent, parent, None, mounts.MS_BIND)
        mounts.mount(None, parent, None, mounts.MS_PRIVATE)

    def _ns_is_usable(self, group: int) -> bool:
        """True if the ns file is a live namespace without ``unified`` that sees new mounts."""
        here = _top(mounts.mounts_at(self.ns_file))
        if here is None or here.fstype != "nsfs":
            return False
        try:
            proc = subprocess.run(
                ["nsenter", f"--mount={self.ns_file}", "--", "cat", "/proc/self/mountinfo"],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                check=False,
                timeout=30,
            )
        except (OSError, subprocess.TimeoutExpired):
            return False
        if proc.returncode != 0:
            return False
        inside = mounts.parse_mountinfo(proc.stdout)
        if mounts.mounts_at(Path(UNIFIED), inside):
            return False
        top = _top(mounts.mounts_at(self.shared_root, inside))
        return top is not None and top.master_group == group

    def _drop_ns_file(self) -> None:
        while _top(mounts.mounts_at(self.ns_file)) is not None:
            try:
                mounts.umount(self.ns_file, mounts.MNT_DETACH)
            except OSError:
                break
        try:
            self.ns_file.unlink()
        except FileNotFoundError:
            pass


def _top(entries: list[mounts.MountEntry]) -> mounts.MountEntry | None:
    return entries[-1] if entries else None
