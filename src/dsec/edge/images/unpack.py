"""Unpack an untrusted layer tar into a layer dir, in overlay format, confined by chroot.

A child process ``chroot``s into the (empty) target directory and extracts the tar stream
there, so no path, symlink or hard link in the tar can reach outside it: ``tarfile``
filters alone do not check hard-link targets (a ``LNKTYPE`` member pointing at
``/etc/passwd`` links the host's file). Inside the child:

- ``DIR/.wh.NAME`` becomes a char device 0/0 ``DIR/NAME`` (an overlayfs whiteout);
- ``DIR/.wh..wh..opq`` sets ``trusted.overlay.opaque=y`` on ``DIR``;
- device nodes and FIFOs are skipped; names with ``..`` segments reject the layer;
- owners (numeric), modes (setuid too), mtimes and ``SCHILY.xattr.*`` xattrs are kept
  (``trusted.overlay.*`` xattrs in the tar are dropped).

The child is a fresh interpreter (exec'd, so it inherits no threads of the caller). The
decompressor (``gzip -dc`` / ``zstd -dc``) runs as its own process feeding the child
through a pipe; the child hashes the uncompressed stream, whose sha256 is the diff_id.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import posixpath
import shutil
import stat
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import IO

from dsec.core.errors import Internal, InvalidArgument

WHITEOUT_PREFIX = ".wh."
OPAQUE_MARKER = ".wh..wh..opq"
OPAQUE_XATTR = "trusted.overlay.opaque"
XATTR_PAX = "SCHILY.xattr."
DEFAULT_MAX_BYTES = 64 << 30  # uncompressed bytes per layer: beyond this it is a tar bomb
DEFAULT_MAX_ENTRIES = 2_000_000
UNPACK_TIMEOUT_S = 3600.0

_DECOMPRESSORS: dict[str, list[str] | None] = {
    "gzip": ["gzip", "-dc"],
    "zstd": ["zstd", "-dcq"],
    "tar": None,
}


class LayerRejected(Exception):
    """Raised inside the child for a layer that must not be stored."""


class _HashingReader:
    """A read-only file object that hashes and counts what passes through it."""

    def __init__(self, raw: IO[bytes], max_bytes: int) -> None:
        self.raw = raw
        self.hash = hashlib.sha256()
        self.count = 0
        self.max_bytes = max_bytes

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n)
        self.hash.update(data)
        self.count += len(data)
        if self.count > self.max_bytes:
            raise LayerRejected(f"layer is larger than {self.max_bytes} bytes uncompressed")
        return data

    def drain(self) -> None:
        while self.read(1 << 20):
            pass


def compression_of(media_type: str) -> str:
    """``gzip``, ``zstd`` or ``tar`` for a layer media type.

    Raises:
        InvalidArgument: not a layer type this store can unpack (e.g. foreign layers).
    """
    if "nondistributable" in media_type or "foreign" in media_type:
        raise InvalidArgument(f"foreign (non-distributable) layer {media_type!r} is not supported")
    if media_type.endswith(("+gzip", ".tar.gzip", ".tar.gz")):
        return "gzip"
    if media_type.endswith("+zstd"):
        return "zstd"
    if media_type.endswith((".tar", "layer.v1.tar")):
        return "tar"
    raise InvalidArgument(f"unsupported layer media type {media_type!r}")


def _clean(name: str) -> str:
    """A member name relative to the layer root ('' for the root); rejects ``..``."""
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if any(p == ".." for p in parts):
        raise LayerRejected(f"member {name!r} has a '..' segment")
    return "/".join(parts)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def _ensure_parent(name: str) -> None:
    parent = posixpath.dirname(name)
    if parent:  # through symlinks (even dangling ones): inside the chroot they stay inside
        os.makedirs(os.path.realpath("/" + parent), exist_ok=True)


def _apply_xattrs(member: tarfile.TarInfo, path: str) -> None:
    for key, value in member.pax_headers.items():
        if not key.startswith(XATTR_PAX):
            continue
        attr = key[len(XATTR_PAX) :]
        if attr.startswith("trusted.overlay."):
            continue
        try:
            os.setxattr(path, attr, value.encode("utf-8", "surrogateescape"), follow_symlinks=False)
        except OSError:
            pass  # e.g. user.* on a symlink, or a namespace the filesystem refuses


def extract_stream(tar: tarfile.TarFile, max_entries: int) -> None:
    """Extract every member of ``tar`` under ``/`` (call only inside the chroot)."""
    for count, member in enumerate(tar, 1):
        if count > max_entries:
            raise LayerRejected(f"layer has more than {max_entries} entries")
        name = _clean(member.name)
        base = posixpath.basename(name)
        parent = posixpath.dirname(name)
        if not name:
            continue
        if base == OPAQUE_MARKER:
            _ensure_parent(name)
            os.setxattr("/" + parent, OPAQUE_XATTR, b"y", follow_symlinks=False)
            continue
        if base.startswith(WHITEOUT_PREFIX):
            real = "/" + posixpath.join(parent, base[len(WHITEOUT_PREFIX) :])
            if not base[len(WHITEOUT_PREFIX) :]:
                raise LayerRejected(f"malformed whiteout {member.name!r}")
            _ensure_parent(name)
            _remove(real)
            os.mknod(real, stat.S_IFCHR | 0o000, os.makedev(0, 0))
            continue
        if member.ischr() or member.isblk() or member.isfifo():
            continue  # device nodes never come from an image; the runtime provides /dev
        if not (member.isreg() or member.isdir() or member.issym() or member.islnk()):
            continue
        path = "/" + name
        if member.islnk():
            member.linkname = "/" + _clean(member.linkname)
            if not os.path.lexists(member.linkname):
                raise LayerRejected(
                    f"hard link {member.name!r} -> {member.linkname!r}: the target is not in "
                    "this layer"
                )
        if os.path.lexists(path) and not (
            member.isdir() and os.path.isdir(path) and not os.path.islink(path)
        ):
            _remove(path)
        _ensure_parent(name)
        member.name = name
        tar.extract(member, "/", set_attrs=True, numeric_owner=True, filter="fully_trusted")
        _apply_xattrs(member, path)


def _child(target: Path, fd: int, result_fd: int, max_bytes: int, max_entries: int) -> int:
    """The unpacking child: chroot into ``target``, extract the tar read from ``fd``."""
    try:
        os.chroot(target)
        os.chdir("/")
        os.umask(0o022)
        with os.fdopen(fd, "rb", buffering=1 << 20) as raw:
            reader = _HashingReader(raw, max_bytes)
            with tarfile.open(fileobj=reader, mode="r|", errorlevel=1) as tar:  # type: ignore[call-overload]
                extract_stream(tar, max_entries)
            reader.drain()
        os.write(result_fd, f"ok {reader.hash.hexdigest()}".encode())
        return 0
    except BaseException as exc:
        msg = f"err {type(exc).__name__}: {exc}"
        with contextlib.suppress(OSError):
            os.write(result_fd, msg.encode(errors="replace")[:4000])
        return 1


def unpack_layer(
    blob: Path,
    compression: str,
    target: Path,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_entries: int = DEFAULT_MAX_ENTRIES,
) -> str:
    """Unpack ``blob`` into the empty directory ``target``; return the tar's sha256 (hex).

    The child is a fresh interpreter (``python -m dsec.edge.images.unpack``), not a bare
    ``fork()`` of the caller: the edge runs gRPC threads, which a forked child must not
    inherit.

    Raises:
        InvalidArgument: the layer is malformed or malicious (the caller removes ``target``).
        Internal: the decompressor or the child failed for another reason.
    """
    if os.geteuid() != 0:
        raise Internal("unpacking image layers needs root (chroot, mknod, trusted xattrs)")
    if compression not in _DECOMPRESSORS:
        raise InvalidArgument(f"unknown layer compression {compression!r}")
    argv = _DECOMPRESSORS[compression]
    child_argv = [
        sys.executable,
        "-m",
        "dsec.edge.images.unpack",
        str(target),
        str(max_bytes),
        str(max_entries),
    ]
    decomp: subprocess.Popen[bytes] | None = None
    with blob.open("rb") as src:
        if argv is None:
            child = subprocess.Popen(
                child_argv, stdin=src, stdout=subprocess.PIPE, stderr=subprocess.PIPE
            )
        else:
            decomp = subprocess.Popen(
                argv, stdin=src, stdout=subprocess.PIPE, stderr=subprocess.PIPE
            )
            assert decomp.stdout is not None
            try:
                child = subprocess.Popen(
                    child_argv, stdin=decomp.stdout, stdout=subprocess.PIPE, stderr=subprocess.PIPE
                )
            finally:
                decomp.stdout.close()
    try:
        out, err = child.communicate(timeout=UNPACK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        child.kill()
        out, err = child.communicate()
        raise Internal(f"unpacking {blob.name} took over {UNPACK_TIMEOUT_S:.0f} s") from None
    finally:
        if decomp is not None:
            try:
                _, derr = decomp.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                decomp.kill()
                _, derr = decomp.communicate()
    result = out.decode(errors="replace")
    if decomp is not None and decomp.returncode not in (0, -13):  # -13: child stopped early
        msg = derr.decode(errors="replace").strip()
        raise InvalidArgument(f"cannot decompress layer {blob.name} ({compression}): {msg}")
    if result.startswith("ok ") and child.returncode == 0:
        return result[3:].strip()
    if result.startswith("err "):
        raise InvalidArgument(f"layer {blob.name} rejected: {result[4:]}")
    tail = err.decode(errors="replace").strip()[-500:]
    raise Internal(f"layer unpack child failed (exit {child.returncode}): {tail}")


def main(argv: list[str]) -> int:
    """``python -m dsec.edge.images.unpack TARGET MAX_BYTES MAX_ENTRIES`` (tar on stdin)."""
    target, max_bytes, max_entries = Path(argv[0]), int(argv[1]), int(argv[2])
    return _child(target, 0, 1, max_bytes, max_entries)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
