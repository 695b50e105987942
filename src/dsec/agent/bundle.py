"""Build the self-contained agent bundle that is mounted read-only at ``/.dsec``.

Layout (everything an image needs to run the agent, whatever libc or Python it has)::

    init                      static PID 1 (from init.c)
    lib/                      the interpreter's shared libraries, libc and the loader
    lib/ld.so -> ld-linux-*   the loader, under a fixed name for init
    python/bin/python3.11     the interpreter that runs this code (sys.base_prefix)
    python/lib/python3.11/    the part of its stdlib aether and chronus import, precompiled
    site/dsec/agent/*.py      the agent (stdlib-only modules)
    run/                      mount point of the per-sandbox tmpfs

init runs ``lib/ld.so --library-path lib python/bin/python3 -s -S -P -c ...`` with
``PYTHONHOME=<bundle>/python`` and ``PYTHONPATH=<bundle>/site``, so neither the image's
loader nor its libraries are used. A stamp holds a hash of every input; an unchanged
bundle is reused in milliseconds. A rebuild is made beside ``dest`` and swapped in by
rename; the previous bundle is kept as ``<dest>.prev`` because running sandboxes still
have it mounted.
"""

from __future__ import annotations

import compileall
import contextlib
import fcntl
import hashlib
import os
import py_compile
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path

from dsec.core.errors import Internal

BUNDLE_FORMAT = "1"
AGENT_DIR = Path(__file__).resolve().parent
STAMP = ".stamp"
PYVER = f"{sys.version_info.major}.{sys.version_info.minor}"
# Modules the agent runs; everything they import (statically) goes into the bundle.
ENTRY_MODULES = (
    "aether", "chronus", "execop", "fileops", "httpop", "tcpop", "relay", "procs", "shells",
)  # fmt: skip
HOST_ONLY = frozenset({"bundle.py", "local.py"})
# Never followed: big and unused (http.client and friends would pull in email, ssl...).
EXCLUDES = (
    "_hashlib", "_ssl", "argparse", "asyncio", "bz2", "concurrent", "ctypes", "decimal",
    "_decimal", "doctest", "email", "http", "idlelib", "inspect", "lib2to3", "logging",
    "lzma", "multiprocessing", "pdb", "pydoc", "sqlite3", "ssl", "tarfile", "test",
    "tkinter", "tracemalloc", "unittest", "urllib", "xml", "zipfile",
)  # fmt: skip
ALWAYS = ("encodings",)  # looked up by name at run time


def input_hash() -> str:
    """A hash of everything the bundle is built from."""
    h = hashlib.sha256(BUNDLE_FORMAT.encode())
    for path in [*sorted(AGENT_DIR.glob("*.py")), AGENT_DIR / "init.c"]:
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    binary = python_binary()
    st = binary.stat()
    h.update(f"{sys.version}|{binary}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()


def python_binary() -> Path:
    """The real interpreter binary behind ``sys.executable`` (never a venv link or shim)."""
    return Path(sys.base_prefix, "bin", f"python{PYVER}").resolve()


def build_bundle(dest: Path, *, progress: Callable[[str], None] | None = None) -> Path:
    """Build the bundle at ``dest`` unless it is already up to date; return ``dest``.

    Raises:
        Internal: a build step (gcc, ldd) failed.
    """
    say = progress or (lambda _msg: None)
    dest = Path(os.path.abspath(dest))
    dest.parent.mkdir(parents=True, exist_ok=True)
    digest = input_hash()
    with _locked(dest.parent / f".{dest.name}.lock"):
        if _stamp(dest) == digest:
            return dest
        say(f"building the agent bundle in {dest}")
        tmp = dest.parent / f".{dest.name}.build-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            _build(tmp, say)
            (tmp / STAMP).write_text(digest + "\n")
            _swap(tmp, dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    say("agent bundle ready")
    return dest


def _stamp(dest: Path) -> str | None:
    try:
        stamp = (dest / STAMP).read_text().strip()
    except OSError:
        return None
    return stamp if (dest / "init").is_file() and (dest / "lib" / "ld.so").exists() else None


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _swap(new: Path, dest: Path) -> None:
    prev = dest.with_name(dest.name + ".prev")
    if dest.exists():
        shutil.rmtree(prev, ignore_errors=True)
        os.rename(dest, prev)
    os.rename(new, dest)


def _run(argv: list[str]) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise Internal(f"cannot run {argv[0]}: {exc}") from None
    if done.returncode != 0:
        raise Internal(f"{' '.join(argv)} failed: {done.stderr.strip()[-2000:]}")
    return done.stdout


def _build(root: Path, say: Callable[[str], None]) -> None:
    for sub in ("lib", "python/bin", "site/dsec/agent", "run"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    say("compiling init (gcc -static)")
    _run(["gcc", "-static", "-O2", "-s", "-o", str(root / "init"), str(AGENT_DIR / "init.c")])
    say("copying the interpreter and its stdlib")
    py = root / "python" / "bin" / f"python{PYVER}"
    shutil.copy2(python_binary(), py)
    (root / "python" / "bin" / "python3").symlink_to(py.name)
    extensions = _copy_stdlib(root / "python" / "lib" / f"python{PYVER}")
    say("copying shared libraries")
    _copy_libs([python_binary(), *extensions], root / "lib")
    _strip([py, *root.glob("lib/libpython*"), *root.glob("python/lib/*/lib-dynload/*.so")])
    say("copying the agent")
    (root / "site" / "dsec" / "__init__.py").write_text('"""OpenDsec (agent bundle)."""\n')
    for path in AGENT_DIR.glob("*.py"):
        if path.name not in HOST_ONLY:
            shutil.copy2(path, root / "site" / "dsec" / "agent" / path.name)
    mode = py_compile.PycInvalidationMode.UNCHECKED_HASH
    for tree in (root / "python" / "lib", root / "site"):
        compileall.compile_dir(tree, quiet=2, invalidation_mode=mode, workers=1)
    _fix_modes(root)


def agent_modules() -> dict[str, str]:
    """Every stdlib module the agent imports: name -> file (found statically)."""
    import modulefinder

    stdlib = sysconfig.get_paths()["stdlib"]
    dynload = sysconfig.get_config_var("DESTSHARED") or os.path.join(stdlib, "lib-dynload")
    finder = modulefinder.ModuleFinder(
        path=[str(AGENT_DIR.parent.parent), stdlib, dynload], excludes=list(EXCLUDES)
    )
    for name in ENTRY_MODULES:
        finder.import_hook(f"dsec.agent.{name}")
    for name in ALWAYS:
        finder.import_hook(name)
    out = {}
    for name, mod in finder.modules.items():
        file: str | None = getattr(mod, "__file__", None)
        if file and not name.startswith("dsec") and file.startswith(stdlib):
            out[name] = file
    return out


def _copy_stdlib(dest: Path) -> list[Path]:
    """Copy the modules the agent needs (all of ``encodings``); return the extensions."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    extensions = []
    files = {Path(f) for f in agent_modules().values()}
    files |= set((stdlib / "encodings").glob("*.py"))
    for src in sorted(files):
        rel = src.relative_to(stdlib)
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)
        if src.suffix == ".so":
            extensions.append(src)
    return extensions


def _copy_libs(binaries: list[Path], dest: Path) -> None:
    """Copy every shared library the binaries load (per ``ldd``), and the loader as ld.so."""
    libs: dict[str, Path] = {}
    loader: Path | None = None
    for binary in binaries:
        for line in _run(["ldd", str(binary)]).splitlines():
            parts = line.split()
            if "=>" in parts and len(parts) >= 3 and parts[2].startswith("/"):
                libs[parts[0]] = Path(parts[2])
            elif parts and parts[0].startswith("/") and "ld-" in parts[0]:
                loader = Path(parts[0])
    if loader is None:
        raise Internal(f"ldd names no dynamic loader for {binaries[0]}")
    libs[loader.name] = loader
    for name, src in libs.items():
        shutil.copy2(src.resolve(), dest / name)
    (dest / "ld.so").symlink_to(loader.name)


def _strip(files: list[Path]) -> None:
    """Drop debug sections of Python's own binaries (libpython shrinks from ~23 to ~5 MB)."""
    strip = shutil.which("strip")
    if strip and files:
        subprocess.run([strip, "--strip-debug", *map(str, files)], capture_output=True, check=False)


def _fix_modes(root: Path) -> None:
    """World-readable: user-namespaced sandboxes see the files as owned by nobody."""
    for dirpath, _dirnames, filenames in os.walk(root):
        os.chmod(dirpath, 0o755)
        for name in filenames:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                executable = os.stat(path).st_mode & 0o111
                os.chmod(path, 0o755 if executable else 0o644)


def main(argv: list[str] | None = None) -> int:
    """``python -m dsec.agent.bundle DEST``: build (or reuse) the bundle at DEST."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m dsec.agent.bundle DEST", file=sys.stderr)
        return 2
    print(build_bundle(Path(args[0]), progress=lambda m: print(m, file=sys.stderr)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
