"""The sandbox root filesystem: an overlay of the image's layers plus a private upper dir.

Layout inside a sandbox's state dir::

    <state_dir>/upper    the sandbox's changes (later packed into a new layer)
    <state_dir>/work     overlayfs scratch space
    <state_dir>/rootfs   the mounted overlay, handed to crun as ``root.path``

The layers are shared read-only lower dirs: nothing is copied. The options turn off the
overlay features that write extended metadata or inode indexes into the upper dir
(``redirect_dir``, ``metacopy``, ``index``, ``xino``), so the upper dir stays a plain tree
that can be packed as an OCI layer.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dsec.core.errors import InvalidArgument
from dsec.edge.backends.container import mounts

OVERLAY_OPTIONS = "redirect_dir=off,metacopy=off,index=off,xino=off"
# mount(2) copies at most one page of option data.
MAX_OPTIONS_LEN = 4095
_FORBIDDEN = (",", ":", "\\", "\n")


@dataclass(frozen=True, slots=True)
class RootfsDirs:
    """The three directories of one sandbox's overlay."""

    upper: Path
    work: Path
    rootfs: Path

    @classmethod
    def in_state_dir(cls, state_dir: Path) -> RootfsDirs:
        return cls(upper=state_dir / "upper", work=state_dir / "work", rootfs=state_dir / "rootfs")

    def make(self) -> None:
        """Create the three directories.

        The overlay's root directory takes its owner and mode from ``upper``, so ``upper``
        gets the usual 0755 of ``/``; the state dir around them is what keeps other host
        users out.
        """
        for d, mode in ((self.upper, 0o755), (self.work, 0o700), (self.rootfs, 0o755)):
            d.mkdir(parents=True, exist_ok=True)
            os.chmod(d, mode)


def overlay_options(lower_top_first: Sequence[Path], upper: Path, work: Path) -> str:
    """Return the mount data string for an overlay.

    Args:
        lower_top_first: layer directories, the top-most layer first (overlay's order).
        upper: the writable upper directory.
        work: the overlay work directory (same filesystem as ``upper``).

    Raises:
        InvalidArgument: no layers, a path overlayfs cannot express, or too many layers
            for one page of mount options.
    """
    if not lower_top_first:
        raise InvalidArgument("an overlay needs at least one lower layer")
    paths = [*lower_top_first, upper, work]
    for p in paths:
        s = os.fspath(p)
        if not os.path.isabs(s) or any(c in s for c in _FORBIDDEN):
            raise InvalidArgument(f"path cannot be used in overlay options: {s!r}")
    lower = ":".join(os.fspath(p) for p in lower_top_first)
    data = f"lowerdir={lower},upperdir={upper},workdir={work},{OVERLAY_OPTIONS}"
    if len(data.encode()) > MAX_OPTIONS_LEN:
        raise InvalidArgument(
            f"too many layers for one overlay mount ({len(lower_top_first)} layers, "
            f"{len(data)} bytes of options; the kernel takes one page)"
        )
    return data


def mount_rootfs(dirs: RootfsDirs, lower_top_first: Sequence[Path]) -> None:
    """Mount the overlay at ``dirs.rootfs`` (nodev: /dev is a tmpfs crun fills itself).

    Raises:
        InvalidArgument: see :func:`overlay_options`.
        OSError: the mount failed.
    """
    data = overlay_options(lower_top_first, dirs.upper, dirs.work)
    mounts.mount("overlay", dirs.rootfs, "overlay", mounts.MS_NODEV, data)


def unmount_rootfs(rootfs: Path) -> bool:
    """Unmount the overlay (lazily if busy); True if something was mounted there.

    Safe to call when nothing is mounted or the directory is gone.
    """
    try:
        return mounts.umount_all(rootfs)
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            return False
        raise


def is_mounted(path: Path) -> bool:
    """Return True if ``path`` is a mount point in this mount namespace."""
    return bool(mounts.mounts_at(path))
