"""Build the ``base`` image: Debian bookworm minbase with python3, offline from apt.

``mmdebstrap --variant=minbase --mode=root`` writes one tar (bash and coreutils come with
minbase; python3, ca-certificates and procps are added). Its sha256 is the layer's diff_id;
the tar is unpacked into the image store and the ref ``base`` written. The packages come
from the host's own apt sources: the sources files that carry the bookworm suites are
passed as mmdebstrap's MIRROR arguments, so no mirror host is named here.

    python -m dsec.edge.images.base [--data DIR] [--force] [--from-tar TAR]
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from dsec.core.errors import DsecError, Internal, Unavailable
from dsec.edge.images.store import Image, ImageConfig, ImageStore, sha256_file
from dsec.paths import Paths

BASE_IMAGE = "base"
SUITE = "bookworm"
PACKAGES = ("python3", "ca-certificates", "procps")
BASE_CONFIG = ImageConfig(
    env=("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",),
    cmd=("/bin/bash",),
    workdir="/",
    user="",
)
APT_SOURCES = (Path("/etc/apt/sources.list"), Path("/etc/apt/sources.list.d"))
# Shell run by mmdebstrap before it writes the tar (``$1`` is the new root), so the diff_id
# covers the cleaned tree. mmdebstrap copies the host's hostname and resolv.conf into the
# chroot: neither belongs in an image. Package lists and the .deb cache are large and
# useless in an image (mmdebstrap's own cleanup drops them today; this keeps it true).
_CUSTOMIZE = (
    'rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin "$1"/var/cache/apt/archives/*.deb',
    'echo localhost > "$1"/etc/hostname',
    ': > "$1"/etc/resolv.conf',
    'printf "127.0.0.1\\tlocalhost\\n::1\\tlocalhost ip6-localhost\\n" > "$1"/etc/hosts',
)

Progress = Callable[[str], None]


def find_apt_sources(suite: str = SUITE, places: Sequence[Path] = APT_SOURCES) -> list[Path]:
    """Return the host's active apt sources files that mention ``suite``.

    ``*.list`` (one-line format) and ``*.sources`` (deb822) files are considered;
    commented-out lines and disabled files (other suffixes) are ignored.
    """
    files: list[Path] = []
    for place in places:
        if place.is_dir():
            files.extend(sorted(p for p in place.iterdir() if p.suffix in (".list", ".sources")))
        elif place.is_file():
            files.append(place)
    word = re.compile(rf"(^|\s){re.escape(suite)}(-[a-z]+)?(\s|$)")
    out: list[Path] = []
    for f in files:
        try:
            lines = f.read_text().splitlines()
        except OSError:
            continue
        if any(word.search(line) for line in lines if not line.lstrip().startswith("#")):
            out.append(f)
    return out


def mmdebstrap_command(target: Path, sources: Sequence[Path]) -> list[str]:
    """The mmdebstrap invocation that writes the base image tar to ``target``."""
    return [
        "mmdebstrap",
        "--variant=minbase",
        "--mode=root",
        "--format=tar",
        f"--include={','.join(PACKAGES)}",
        *(f"--customize-hook={hook}" for hook in _CUSTOMIZE),
        SUITE,
        str(target),
        *(str(s) for s in sources),
    ]


@contextlib.contextmanager
def _build_lock(store: ImageStore) -> Iterator[None]:
    store.root.mkdir(parents=True, exist_ok=True)
    with (store.root / ".base.lock").open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build_base_image(
    store: ImageStore, *, progress: Progress | None = None, force: bool = False
) -> Image:
    """Build the ``base`` image into ``store`` unless it is already there.

    Args:
        store: the edge's image store.
        progress: called with one line of text per step (mmdebstrap's own lines too).
        force: build again even if ``base`` exists (the ref is replaced at the end).

    Returns:
        The resolved ``base`` image.

    Raises:
        Unavailable: mmdebstrap is missing or no apt sources for bookworm were found.
        Internal: the build failed (the message carries mmdebstrap's last lines).
    """
    say = progress or (lambda _line: None)
    if not force and store.has(BASE_IMAGE):
        return store.resolve(BASE_IMAGE)
    with _build_lock(store):
        if not force and store.has(BASE_IMAGE):  # built by someone else meanwhile
            return store.resolve(BASE_IMAGE)
        if shutil.which("mmdebstrap") is None:
            raise Unavailable("mmdebstrap is not installed (apt-get install mmdebstrap)")
        sources = find_apt_sources()
        if not sources:
            raise Unavailable(f"no apt sources file under /etc/apt mentions {SUITE}")
        start = time.monotonic()
        with store.scratch_dir() as scratch:
            tar = scratch / "base.tar"
            cmd = mmdebstrap_command(tar, sources)
            say(f"building {BASE_IMAGE}: {' '.join(cmd)}")
            run_mmdebstrap(cmd, say)
            say("hashing the layer")
            diff_id = sha256_file(tar)
            say(f"unpacking layer sha256:{diff_id[:12]}")
            store.import_trusted_tar(tar, diff_id=diff_id)
        image = store.write_ref(BASE_IMAGE, [diff_id], BASE_CONFIG)
        say(f"image {BASE_IMAGE} ready in {time.monotonic() - start:.1f} s")
        return image


def install_base_from_tar(
    store: ImageStore, tar: Path, *, progress: Progress | None = None
) -> Image:
    """Install an already built base tar (e.g. from another machine, or test fixtures).

    The tar must be trusted: it is unpacked with owners and modes kept.
    """
    say = progress or (lambda _line: None)
    with _build_lock(store):
        say(f"hashing {tar}")
        diff_id = sha256_file(tar)
        say(f"unpacking layer sha256:{diff_id[:12]}")
        store.import_trusted_tar(tar, diff_id=diff_id)
        return store.write_ref(BASE_IMAGE, [diff_id], BASE_CONFIG)


def run_mmdebstrap(cmd: list[str], say: Progress) -> None:
    """Run an mmdebstrap command line, each output line to ``say``; the tail on failure."""
    tail: list[str] = []
    with subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            say(line)
            tail = [*tail[-9:], line]
        rc = proc.wait()
    if rc != 0:
        raise Internal(f"mmdebstrap failed (exit {rc}): " + " | ".join(tail))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m dsec.edge.images.base``."""
    ap = argparse.ArgumentParser(prog="python -m dsec.edge.images.base", description=__doc__)
    ap.add_argument("--data", type=Path, help="data dir (default: $DSEC_DATA or /var/lib/dsec)")
    ap.add_argument("--force", action="store_true", help="rebuild even if base exists")
    ap.add_argument("--from-tar", type=Path, help="install this prebuilt (trusted) tar instead")
    args = ap.parse_args(argv)
    paths = Paths.from_env()
    images = (args.data / "images") if args.data else paths.images
    if os.geteuid() != 0:
        print("error: building the base image needs root (mmdebstrap --mode=root)", file=sys.stderr)
        return 1
    try:
        store = ImageStore(images)
        if args.from_tar:
            image = install_base_from_tar(store, args.from_tar, progress=print)
        else:
            image = build_base_image(store, progress=print, force=args.force)
    except DsecError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 1
    print(f"{image.name}: layer {image.diff_ids[-1][:12]} at {image.layer_dirs[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
