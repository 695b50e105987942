"""The guest kernel: Debian's ``linux-source-6.1`` + ``allnoconfig`` + our fragment.

Built once by ``dsec setup`` (about 11 minutes on 2 cores) and cached under
``<data>/vm/vmlinux-<key>``, where the key hashes the fragment and the source package
version; ``<data>/vm/vmlinux`` points at the current build. The unpacked source tree with
its objects stays in ``<data>/vm/linux-<version hash>`` (about 2 GB), so a changed
fragment rebuilds in seconds to a minute. Both drivers boot the same
uncompressed ``vmlinux`` (it carries a PVH entry note).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from dsec.core.errors import Internal

FRAGMENT = Path(__file__).parent / "guest" / "kernel.config"
SOURCE_PACKAGE = "linux-source-6.1"
SOURCE_TAR = Path("/usr/src/linux-source-6.1.tar.xz")


class KernelBuildError(Internal):
    pass


def vm_dir(data: Path) -> Path:
    return data / "vm"


def current_kernel(data: Path) -> Path | None:
    """The kernel ``dsec setup`` built last, or None."""
    link = vm_dir(data) / "vmlinux"
    return link.resolve() if link.exists() else None


def fragment_lines() -> list[str]:
    return [
        ln.strip()
        for ln in FRAGMENT.read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]


def _source_version() -> str:
    try:
        out = subprocess.run(
            ["dpkg-query", "-W", "-f=${Version}", SOURCE_PACKAGE],
            capture_output=True,
            text=True,
            check=True,
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        st = SOURCE_TAR.stat()
        return f"{st.st_size}-{int(st.st_mtime)}"


def kernel_key() -> str:
    h = hashlib.sha256()
    h.update(FRAGMENT.read_bytes())
    h.update(_source_version().encode())
    return h.hexdigest()[:16]


def missing_symbols(dot_config: str, wanted: list[str]) -> list[str]:
    """Fragment lines that Kconfig dropped (unmet dependencies drop them silently)."""
    have = set(dot_config.splitlines())
    return [w for w in wanted if w not in have]


def build_kernel(data: Path, progress: Callable[[str], None] = lambda _: None) -> Path:
    """Return the cached kernel for the current key, building it first if needed."""
    out_dir = vm_dir(data)
    key = kernel_key()
    target = out_dir / f"vmlinux-{key}"
    link = out_dir / "vmlinux"
    if target.exists():
        if not link.exists() or link.resolve() != target:
            _point(link, target)
        return target
    if not SOURCE_TAR.exists():
        raise KernelBuildError(f"{SOURCE_TAR} is missing: apt-get install {SOURCE_PACKAGE}")
    out_dir.mkdir(parents=True, exist_ok=True)
    src = _source_tree(out_dir, progress)
    wanted = fragment_lines()
    (src / "dsec.config").write_text("\n".join(wanted) + "\n")
    env = dict(os.environ, ARCH="x86_64", KCONFIG_ALLCONFIG="dsec.config")
    progress("guest kernel: allnoconfig + fragment")
    _run(["make", "allnoconfig"], src, env)
    lost = missing_symbols((src / ".config").read_text(), wanted)
    if lost:
        raise KernelBuildError(f"kernel config lost fragment lines: {', '.join(lost)}")
    jobs = str(os.cpu_count() or 1)
    t0 = time.monotonic()
    progress(f"guest kernel: make -j{jobs} vmlinux (about 11 min on 2 cores the first time)")
    proc = subprocess.Popen(
        ["nice", "-n", "10", "make", f"-j{jobs}", "vmlinux"],
        cwd=src,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    tail: list[str] = []
    done = 0
    last = 0.0
    for line in proc.stdout:
        tail = [*tail[-29:], line]
        if line.lstrip().startswith(("CC", "AS", "LD", "AR")):
            done += 1
        now = time.monotonic()
        if now - last > 5:
            last = now
            progress(f"guest kernel: {done} objects built, {now - t0:.0f} s")
    if proc.wait() != 0:
        raise KernelBuildError("kernel build failed:\n" + "".join(tail))
    tmp = out_dir / f".vmlinux-{key}.tmp"
    shutil.copyfile(src / "vmlinux", tmp)
    tmp.rename(target)
    progress(f"guest kernel: built in {time.monotonic() - t0:.0f} s -> {target}")
    _point(link, target)
    return target


def _source_tree(out_dir: Path, progress: Callable[[str], None]) -> Path:
    """The unpacked source of the installed package version, kept for incremental rebuilds
    (a fragment change recompiles only what its symbols touch); older trees are removed."""
    ver = hashlib.sha256(_source_version().encode()).hexdigest()[:12]
    root = out_dir / f"linux-{ver}"
    for old in [*out_dir.glob("linux-*"), *out_dir.glob("build-*")]:
        if old.is_symlink():
            old.unlink()
        elif old != root and old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
    if not (root / ".unpacked").exists():
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir()
        progress(f"guest kernel: unpacking {SOURCE_TAR.name}")
        _run(["tar", "-xf", str(SOURCE_TAR), "-C", str(root)], root, dict(os.environ))
        (root / ".unpacked").touch()
    (src,) = [p for p in root.iterdir() if p.is_dir()]
    return src


def _point(link: Path, target: Path) -> None:
    tmp = link.with_name(".vmlinux.link")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target.name)
    tmp.rename(link)


def _run(argv: list[str], cwd: Path, env: dict[str, str]) -> None:
    r = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise KernelBuildError(f"{' '.join(argv)} failed:\n{(r.stdout + r.stderr)[-3000:]}")


def main() -> int:
    """``python3 -m dsec.edge.backends.microvm.kernel``: build (or find) the kernel for
    ``$DSEC_DATA``, a progress line at a time. Needs only the standard library and the
    source tree, so scripts/install starts it in the background before the virtualenv
    exists (``dsec setup --no-kernel`` does the rest meanwhile)."""
    from dsec.paths import Paths

    def say(msg: str) -> None:
        print(time.strftime("%H:%M:%S"), msg, flush=True)

    try:
        built = build_kernel(Paths.from_env().data, say)
    except KernelBuildError as exc:
        print(f"error: {exc.message}", file=sys.stderr, flush=True)
        return 1
    say(f"guest kernel ready: {built}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
