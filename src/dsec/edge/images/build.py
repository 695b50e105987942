"""Build an image from a Dockerfile on this edge (``dsec image build``).

The build context arrives as a tar and is unpacked (``tarfile``'s data filter: no absolute
paths, no ``..``, no devices) into a scratch dir. Each instruction then either changes the
config (ENV, USER, CMD, ENTRYPOINT, ARG, LABEL, EXPOSE) or adds a layer:

- RUN creates a real sandbox from the current state (a temporary ref without the
  Entrypoint, so nothing else starts), runs the command with ``/bin/sh -c`` as the
  current USER in the current WORKDIR with the ARG values in its environment, freezes it
  and packs its overlay upper dir with the ``sbx.pack`` machinery; the sandbox is killed
  whatever happens;
- COPY and ADD (local files only; ADD does not fetch URLs or unpack archives) stage the
  sources in a directory laid out like the root and pack that directory;
- WORKDIR adds a layer holding the directory when no layer has it yet.

Every state has a key: sha256 of the parent's key and the step (its normalised text, the
content digest of COPY sources, the ARG values in scope). A layer step whose key has a
ref ``dsec-build/<key>`` reuses that ref's top layer ("CACHED") unless ``no_cache``; the
refs are ordinary images (listed, kept by gc, removable with ``dsec image rm``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import posixpath
import shutil
import stat
import tarfile
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath

from dsec.core.errors import ClientError, ImageNotFound, InvalidArgument
from dsec.edge.images import dockerfile as df
from dsec.edge.images.pack import LAYER_GZIP, pack_upper
from dsec.edge.images.store import Image, ImageConfig, ImageStore, LayerBlob, validate_name

CACHE_PREFIX = "dsec-build/"
RUN_PREFIX = "dsec-build/run-"
DOCKERFILE_IN_CONTEXT = ".dsec-build.Dockerfile"  # where a client puts an outside -f file
OUTPUT_TAIL = 4096
MAX_CONTEXT_BYTES = 4 << 30


@dataclass(frozen=True, slots=True)
class BuildOptions:
    tag: str
    dockerfile: str = "Dockerfile"  # path inside the context
    build_args: Mapping[str, str] = field(default_factory=dict)
    no_cache: bool = False
    memory_mb: int = 2048
    timeout_s: int = 3600  # per RUN step


@dataclass(frozen=True, slots=True)
class BuildEvent:
    """A step starting (``step``), a line of RUN output (``log``), or a step cached."""

    kind: str  # step | log | cached
    text: str
    index: int = 0
    total: int = 0
    line: int = 0


@dataclass(frozen=True, slots=True)
class RunResult:
    exit_code: int
    output_tail: bytes


# Runs argv in a sandbox of image ``image``; returns the result and, on success, the path
# of its (frozen) upper dir inside the context manager.
RunStep = Callable[
    [str, list[str], dict[str, str], str, Callable[[bytes], None]],
    contextlib.AbstractAsyncContextManager[tuple[RunResult, Path]],
]


@dataclass(slots=True)
class _State:
    diff_ids: list[str]
    layer_blobs: list[LayerBlob]
    blobs: list[str]
    config: ImageConfig
    key: str
    source: str


def _hash(*parts: str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()


def unpack_context(tar_path: Path, dest: Path) -> None:
    """Unpack a build context tar into ``dest`` (nothing outside it, no devices).

    Raises:
        InvalidArgument: the tar is malformed or holds unsafe members.
    """
    try:
        with tarfile.open(tar_path) as tar:
            tar.extractall(dest, filter="data")
    except (tarfile.TarError, OSError) as exc:
        raise InvalidArgument(f"the build context is not a usable tar: {exc}") from None


def context_digest(paths: list[Path], root: Path) -> str:
    """sha256 over the names, types, modes and contents of ``paths`` (recursively)."""
    h = hashlib.sha256()
    for top in paths:
        walk = [top] if not top.is_dir() or top.is_symlink() else [top, *sorted(top.rglob("*"))]
        for p in walk:
            st = p.lstat()
            h.update(f"{p.relative_to(root)}\0{st.st_mode:o}\0".encode())
            if stat.S_ISLNK(st.st_mode):
                h.update(os.readlink(p).encode())
            elif stat.S_ISREG(st.st_mode):
                with p.open("rb") as f:
                    while chunk := f.read(1 << 20):
                        h.update(chunk)
            h.update(b"\0")
    return h.hexdigest()


def _lower_entry(image_dirs: list[Path], rel: str) -> os.stat_result | None:
    """The stat of ``rel`` in the topmost layer that has it (whiteouts not followed)."""
    for d in image_dirs:
        with contextlib.suppress(OSError):
            return (d / rel).lstat()
    return None


def _passwd_lookup(image_dirs: list[Path], spec: str) -> tuple[int, int]:
    """``user[:group]`` (names or numbers) -> (uid, gid) from the image's passwd/group."""
    user, _, group = spec.partition(":")

    def table(name: str) -> list[list[str]]:
        for d in image_dirs:
            p = d / "etc" / name
            if p.is_file() and not p.is_symlink():
                return [ln.split(":") for ln in p.read_text(errors="replace").splitlines()]
        return []

    def find(rows: list[list[str]], key: str, col: int) -> int | None:
        if key.isdigit():
            return int(key)
        for r in rows:
            if len(r) > col and r[0] == key and r[col].isdigit():
                return int(r[col])
        return None

    passwd = table("passwd")
    uid = find(passwd, user, 2)
    if uid is None:
        raise InvalidArgument(f"--chown: no user {user!r} in the image's /etc/passwd")
    if group:
        gid = find(table("group"), group, 2)
        if gid is None:
            raise InvalidArgument(f"--chown: no group {group!r} in the image's /etc/group")
    else:
        gid = next((int(r[3]) for r in passwd if len(r) > 3 and r[2] == str(uid)), uid)
        if user.isdigit():
            gid = uid
    return uid, gid


def _make_parents(stage: Path, dest: PurePosixPath, image_dirs: list[Path]) -> None:
    """Create ``dest``'s directories in ``stage``, with the image's modes and owners."""
    cur = stage
    rel = PurePosixPath()
    for part in dest.parts[1:]:
        cur, rel = cur / part, rel / part
        if cur.is_dir():
            continue
        cur.mkdir()
        st = _lower_entry(image_dirs, str(rel))
        if st is not None and stat.S_ISDIR(st.st_mode):
            os.chmod(cur, stat.S_IMODE(st.st_mode))
            os.lchown(cur, st.st_uid, st.st_gid)
        else:
            os.chmod(cur, 0o755)


def stage_copy(
    ins: df.Instruction,
    sources: list[Path],
    context: Path,
    dest: str,
    stage: Path,
    image_dirs: list[Path],
    owner: tuple[int, int],
) -> None:
    """Lay ``sources`` out in ``stage`` as COPY puts them at ``dest`` in the root."""
    to_dir = dest.endswith("/") or len(sources) > 1 or any(s.is_dir() for s in sources)
    target = PurePosixPath(os.path.normpath(dest))
    copied: list[Path] = []
    for src in sources:
        if src.is_dir() and not src.is_symlink():
            out = stage / str(target).lstrip("/")
            new_dir = not out.exists() and _lower_entry(image_dirs, str(target)[1:]) is None
            _make_parents(stage, target, image_dirs)
            if new_dir and str(target) != "/":
                os.lchown(out, *owner)  # a directory COPY creates belongs to --chown
            for child in sorted(src.iterdir()):
                dst = out / child.name
                if child.is_dir() and not child.is_symlink():
                    shutil.copytree(child, dst, symlinks=True, dirs_exist_ok=True)
                else:
                    shutil.copy2(child, dst, follow_symlinks=False)
                copied.append(dst)
        else:
            final = target / src.name if to_dir else target
            _make_parents(stage, final.parent, image_dirs)
            dst = stage / str(final).lstrip("/")
            if dst.is_dir() and not dst.is_symlink():
                raise ins.error(f"cannot copy file {src.name} over directory {final}")
            shutil.copy2(src, dst, follow_symlinks=False)
            copied.append(dst)
    for top in copied:
        entries = [top] if not top.is_dir() or top.is_symlink() else [top, *top.rglob("*")]
        for p in entries:
            os.lchown(p, *owner)


def resolve_sources(ins: df.Instruction, context: Path, patterns: list[str]) -> list[Path]:
    """The context paths ``patterns`` name (globs allowed); never outside the context."""
    out: list[Path] = []
    root = context.resolve()
    for pattern in patterns:
        rel = os.path.normpath(pattern.lstrip("/")) if pattern not in (".", "/") else "."
        if rel == ".." or rel.startswith("../") or "://" in pattern:
            raise ins.error(f"{ins.keyword} source {pattern!r} is outside the build context")
        matches = sorted(root.glob(rel)) if any(c in rel for c in "*?[") else [root / rel]
        matches = [m for m in matches if m.exists() or m.is_symlink()]
        if not matches:
            raise ins.error(f"{ins.keyword} source {pattern!r} is not in the build context")
        for m in matches:
            if not m.resolve().is_relative_to(root) and not m.is_symlink():
                raise ins.error(f"{ins.keyword} source {pattern!r} is outside the build context")
            if m.name == DOCKERFILE_IN_CONTEXT:
                continue
            out.append(m)
    return out


def read_dockerfile(context: Path, opts: BuildOptions) -> str:
    path = (context / opts.dockerfile).resolve()
    if not path.is_relative_to(context.resolve()) or not path.is_file():
        raise InvalidArgument(f"no Dockerfile {opts.dockerfile!r} in the build context")
    return path.read_text(errors="replace")


class Builder:
    """Runs one build against an image store, with ``run_step`` making RUN sandboxes."""

    def __init__(self, store: ImageStore, run_step: RunStep) -> None:
        self.store = store
        self.run_step = run_step

    async def build(self, context: Path, opts: BuildOptions) -> AsyncIterator[BuildEvent | Image]:
        """Yield progress events, then the built image."""
        validate_name(opts.tag)
        instructions = df.parse(await asyncio.to_thread(read_dockerfile, context, opts))
        total = len(instructions)
        global_args: dict[str, str] = {}
        scope: dict[str, str] = {}  # ARG values visible to RUN (after FROM)
        state: _State | None = None
        for index, ins in enumerate(instructions, 1):
            yield BuildEvent("step", f"{ins.keyword} {ins.text}", index, total, ins.line)
            if ins.keyword == "ARG":
                name, default = df.arg_decl(ins)
                value = opts.build_args.get(name, default)
                target = global_args if state is None else scope
                if value is not None:
                    target[name] = value
                elif state is not None and name in global_args:
                    scope[name] = global_args[name]
                if state is not None:
                    state.key = _hash(state.key, ins.source, json.dumps([name, value]))
                continue
            if ins.keyword == "FROM":
                state = self._from(ins, global_args)
                continue
            assert state is not None
            values = {**scope, **dict(e.partition("=")[::2] for e in state.config.env)}
            async for ev in self._step(ins, state, values, scope, context, opts):
                yield ev
        assert state is not None
        image = await asyncio.to_thread(self._write, opts.tag, state)
        yield image

    def _from(self, ins: df.Instruction, global_args: Mapping[str, str]) -> _State:
        parts = df.expand(ins.text, global_args).split()
        if len(parts) not in (1, 3) or (len(parts) == 3 and parts[1].upper() != "AS"):
            raise ins.error("expected FROM IMAGE [AS NAME]")
        if parts[0] == "scratch":
            raise ins.error("FROM scratch is not supported (start from an image)")
        try:
            base = self.store.resolve(parts[0])
        except ImageNotFound as exc:
            raise ins.error(f"{exc} (pull it first: dsec image pull)") from None
        key = _hash("FROM", json.dumps(base.diff_ids), json.dumps(base.config.to_dict()))
        return _State(
            list(base.diff_ids),
            list(base.layer_blobs),
            list(base.blobs),
            base.config,
            key,
            base.source or base.name,
        )

    async def _step(
        self,
        ins: df.Instruction,
        state: _State,
        values: dict[str, str],
        scope: Mapping[str, str],
        context: Path,
        opts: BuildOptions,
    ) -> AsyncIterator[BuildEvent]:
        cfg = state.config
        kw = ins.keyword
        if kw == "ENV":
            env = dict(e.partition("=")[::2] for e in cfg.env)
            env.update(df.key_values(ins, values))
            state.config = replace(cfg, env=tuple(f"{k}={v}" for k, v in env.items()))
        elif kw == "USER":
            user = df.expand(ins.text, values).strip()
            if not user or " " in user:
                raise ins.error("USER takes one user[:group]")
            state.config = replace(cfg, user=user)
        elif kw in ("CMD", "ENTRYPOINT"):
            argv = tuple(df.command(ins))
            state.config = replace(cfg, cmd=argv) if kw == "CMD" else replace(cfg, entrypoint=argv)
            if kw == "ENTRYPOINT":
                state.config = replace(state.config, cmd=())  # as Docker: it resets CMD
        elif kw in ("LABEL", "EXPOSE"):
            if kw == "LABEL":
                df.key_values(ins, values)  # checked; not recorded
        elif kw == "WORKDIR":
            workdir = df.expand(ins.text, values).strip()
            if not workdir.startswith("/"):
                workdir = posixpath.normpath(posixpath.join(cfg.workdir or "/", workdir))
            state.config = replace(cfg, workdir=workdir)
            state.key = _hash(state.key, ins.source, workdir)
            dirs = [*self._image_dirs(state)]
            if workdir != "/" and _lower_entry(dirs, workdir.lstrip("/")) is None:
                async for ev in self._layer(ins, state, opts, self._mkdir_layer(workdir, dirs)):
                    yield ev
            return
        elif kw in ("COPY", "ADD"):
            patterns, dest = df.copy_args(ins, values)
            sources = resolve_sources(ins, context, patterns)
            if not dest.startswith("/"):
                dest = posixpath.join(cfg.workdir or "/", dest)
            dirs = self._image_dirs(state)
            owner = _passwd_lookup(dirs, ins.flags["chown"]) if "chown" in ins.flags else (0, 0)
            digest = await asyncio.to_thread(context_digest, sources, context)
            state.key = _hash(state.key, ins.source, digest, dest, json.dumps(owner))

            def make(stage: Path) -> None:
                stage_copy(ins, sources, context, dest, stage, dirs, owner)

            async for ev in self._layer(ins, state, opts, make):
                yield ev
            return
        elif kw == "RUN":
            env_names = {e.partition("=")[0] for e in cfg.env}
            env = {k: v for k, v in scope.items() if k not in env_names}
            state.key = _hash(state.key, ins.source, json.dumps(sorted(env.items())))
            async for ev in self._run(ins, state, env, opts):
                yield ev
            return
        state.key = _hash(state.key, ins.source, json.dumps(state.config.to_dict()))

    def _image_dirs(self, state: _State) -> list[Path]:
        return [self.store.layer_dir(d) for d in reversed(state.diff_ids)]

    @staticmethod
    def _mkdir_layer(workdir: str, dirs: list[Path]) -> Callable[[Path], None]:
        def make(stage: Path) -> None:
            _make_parents(stage, PurePosixPath(workdir), dirs)

        return make

    def _cached(self, state: _State, opts: BuildOptions) -> Image | None:
        name = CACHE_PREFIX + state.key
        if opts.no_cache or not self.store.has(name):
            return None
        try:
            return self.store.resolve(name)
        except ImageNotFound:
            return None

    def _apply(self, state: _State, image: Image) -> None:
        top = image.diff_ids[-1]
        state.diff_ids.append(top)
        blob = image.blob_of(top)
        if blob is not None:
            state.layer_blobs.append(blob)
            state.blobs.append(blob.digest)

    def _record(self, state: _State, diff_id: str, digest: str, size: int) -> None:
        state.diff_ids.append(diff_id)
        state.layer_blobs.append(LayerBlob(diff_id, digest, LAYER_GZIP, size))
        state.blobs.append(digest)
        self.store.write_ref(
            CACHE_PREFIX + state.key,
            state.diff_ids,
            state.config,
            blobs=state.blobs,
            source=state.source,
            layer_blobs=state.layer_blobs,
        )

    async def _layer(
        self,
        ins: df.Instruction,
        state: _State,
        opts: BuildOptions,
        make: Callable[[Path], None],
    ) -> AsyncIterator[BuildEvent]:
        cached = self._cached(state, opts)
        if cached is not None:
            self._apply(state, cached)
            yield BuildEvent("cached", "CACHED", line=ins.line)
            return

        def work() -> None:
            with self.store.scratch_dir() as scratch:
                stage = scratch / "stage"
                stage.mkdir(mode=0o755)
                make(stage)
                layer = pack_upper(self.store, stage)
                self._record(state, layer.diff_id, layer.digest, layer.size)

        await asyncio.to_thread(work)

    async def _run(
        self, ins: df.Instruction, state: _State, env: dict[str, str], opts: BuildOptions
    ) -> AsyncIterator[BuildEvent]:
        cached = self._cached(state, opts)
        if cached is not None:
            self._apply(state, cached)
            yield BuildEvent("cached", "CACHED", line=ins.line)
            return
        run_ref = RUN_PREFIX + state.key[:32]
        self.store.write_ref(run_ref, state.diff_ids, replace(state.config, entrypoint=(), cmd=()))
        queue: asyncio.Queue[bytes] = asyncio.Queue()
        argv = df.command(ins)
        cwd = state.config.workdir or "/"
        runner = self.run_step(run_ref, argv, env, cwd, queue.put_nowait)
        task = asyncio.ensure_future(self._finish_run(runner, ins, state))
        try:
            while not task.done() or not queue.empty():
                getter = asyncio.ensure_future(queue.get())
                await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                if getter.done():
                    yield BuildEvent("log", getter.result().decode(errors="replace"))
                else:
                    getter.cancel()
            await task
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
            with contextlib.suppress(ImageNotFound):
                self.store.remove(run_ref)

    async def _finish_run(
        self,
        runner: contextlib.AbstractAsyncContextManager[tuple[RunResult, Path]],
        ins: df.Instruction,
        state: _State,
    ) -> None:
        try:
            await self._run_in(runner, ins, state)
        except df.DockerfileError:
            raise
        except ClientError as exc:  # e.g. USER names nobody in /etc/passwd
            raise ins.error(f"RUN could not run: {exc}") from None

    async def _run_in(
        self,
        runner: contextlib.AbstractAsyncContextManager[tuple[RunResult, Path]],
        ins: df.Instruction,
        state: _State,
    ) -> None:
        async with runner as (result, upper):
            if result.exit_code != 0:
                tail = result.output_tail.decode(errors="replace").rstrip()
                raise ins.error(
                    f"RUN failed with exit code {result.exit_code}"
                    + (f"; last output:\n{tail}" if tail else " (no output)")
                )

            def pack() -> None:
                layer = pack_upper(self.store, upper)
                self._record(state, layer.diff_id, layer.digest, layer.size)

            await asyncio.to_thread(pack)

    def _write(self, tag: str, state: _State) -> Image:
        return self.store.write_ref(
            tag,
            state.diff_ids,
            state.config,
            blobs=state.blobs,
            source=state.source,
            layer_blobs=state.layer_blobs,
        )


async def collect(events: AsyncIterator[BuildEvent | Image]) -> Image:
    """Run a build to its end (tests); return the image."""
    image: Image | None = None
    async for ev in events:
        if isinstance(ev, Image):
            image = ev
    assert image is not None
    return image
