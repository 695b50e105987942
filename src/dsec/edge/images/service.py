"""The edge's image calls (gRPC): pull with streamed progress, list, remove, gc.

Pulls run in a worker thread (the registry client and the unpacker are blocking); their
progress reaches the gRPC stream through an asyncio queue, at most a few reports a second
per layer plus every change of state. Pulls, packs and pushes run concurrently (layers are
locked one by one inside the puller); a gc waits for them and has the store to itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from pathlib import Path
from typing import IO, TypeVar, cast

from dsec.core.errors import AlreadyExists, DsecError, InvalidArgument, Unavailable
from dsec.edge.images.credentials import RegistryCredentials, default_docker_configs
from dsec.edge.images.pull import DEFAULT_PLATFORM, LayerProgress, Puller, PullOptions
from dsec.edge.images.store import GcResult, Image, ImageStore
from dsec.rpc._gen import dsec_pb2 as pb

TYPE_CHECKING = False
if TYPE_CHECKING:
    from dsec.edge.backends.vm.imports import VmImport
    from dsec.edge.manager import Caller, SandboxManager
    from dsec.paths import Paths

PROGRESS_INTERVAL_S = 0.25

T = TypeVar("T")
Report = Callable[[LayerProgress], None]


async def thread_progress(
    work: Callable[[Report], T], out: list[T], stop: Callable[[], None] | None = None
) -> AsyncGenerator[pb.PullImageEvent, None]:
    """Run ``work(report)`` in a thread; yield what it reports as progress events, then put
    its result in ``out``. A thread cannot be cancelled, so a consumer that stops early
    calls ``stop`` (to unblock it) and waits for it to end; use it under ``aclosing``."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[LayerProgress | None] = asyncio.Queue()

    def report(p: LayerProgress) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, p)

    def body() -> T:
        try:
            return work(report)
        finally:
            loop.call_soon_threadsafe(queue.put_nowait, None)

    task = asyncio.ensure_future(asyncio.to_thread(body))
    try:
        while (p := await queue.get()) is not None:
            progress = pb.PullProgress(digest=p.digest, status=p.status, done=p.done, total=p.total)
            yield pb.PullImageEvent(progress=progress)
        out.append(await task)
    finally:
        if not task.done():
            if stop is not None:
                stop()
            with contextlib.suppress(Exception):
                await asyncio.shield(task)


def image_to_pb(image: Image, edge_id: str) -> pb.ImageInfo:
    cfg = image.config
    return pb.ImageInfo(
        name=image.name,
        layers=list(image.diff_ids),
        env=list(cfg.env),
        cmd=list(cfg.cmd),
        entrypoint=list(cfg.entrypoint),
        workdir=cfg.workdir,
        user=cfg.user,
        created=image.created,
        source=image.source,
        edge_id=edge_id,
    )


def vm_image_to_pb(image: VmImport, edge_id: str) -> pb.ImageInfo:
    """An imported VM system image as an image entry (``backend`` "vm", no layers)."""
    return pb.ImageInfo(
        name=image.name,
        created=image.created,
        source=f"{image.os_name}, kernel {image.kernel_version}, root {image.root} "
        f"({image.fstype}), {image.size >> 20} MiB",
        edge_id=edge_id,
        backend="vm",
    )


class EdgeImages:
    """One edge's image store, pulls and garbage collection."""

    def __init__(
        self,
        store: ImageStore,
        edge_id: str,
        settings_file: Path | None,
        *,
        vm_paths: Paths | None = None,
    ) -> None:
        self.store = store
        self.edge_id = edge_id
        self.vm_paths = vm_paths  # where imported VM images go (dsec image import-vm)
        self.puller = Puller(store, RegistryCredentials(settings_file, default_docker_configs()))
        self._cond = asyncio.Condition()
        self._users = 0  # pulls, packs and pushes in flight (they may run together)
        self._collecting = False  # a gc runs: it needs the store to itself
        self._gc_waiting = 0  # queued gcs go before newer pulls (no starvation)

    @contextlib.asynccontextmanager
    async def _shared(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._collecting and not self._gc_waiting)
            self._users += 1
        try:
            yield
        finally:
            async with self._cond:
                self._users -= 1
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def _exclusive(self) -> AsyncIterator[None]:
        async with self._cond:
            self._gc_waiting += 1
            try:
                await self._cond.wait_for(lambda: not self._collecting and self._users == 0)
            finally:
                self._gc_waiting -= 1
                self._cond.notify_all()  # matters when this wait was cancelled
            self._collecting = True
        try:
            yield
        finally:
            async with self._cond:
                self._collecting = False
                self._cond.notify_all()

    async def pull(self, req: pb.PullImageRequest) -> AsyncIterator[pb.PullImageEvent]:
        """Pull ``req.reference``; yield progress events, then the image."""
        last: dict[str, tuple[str, float]] = {}
        opts = PullOptions(
            platform=req.platform or DEFAULT_PLATFORM,
            insecure=req.insecure,
            username=req.username,
            password=req.password,
        )

        def work(report: Report) -> Image:
            def throttled(p: LayerProgress) -> None:
                now = time.monotonic()
                prev = last.get(p.digest)
                if prev and prev[0] == p.status and now - prev[1] < PROGRESS_INTERVAL_S:
                    return
                last[p.digest] = (p.status, now)
                report(p)

            return self.puller.pull(req.reference, opts, throttled)

        image: list[Image] = []
        async with self._shared(), contextlib.aclosing(thread_progress(work, image)) as events:
            async for event in events:  # no gc while layers are being added
                yield event
        yield pb.PullImageEvent(image=image_to_pb(image[0], self.edge_id))

    async def pack(self, upper: Path, base: str, name: str) -> Image:
        """Record ``upper`` (a frozen sandbox's overlay upper dir) as image ``name``."""
        from dsec.edge.images.pack import pack_image
        from dsec.edge.images.store import validate_name

        validate_name(name)
        base_image = self.store.resolve(base)
        async with self._shared():
            return await asyncio.to_thread(pack_image, self.store, upper, base_image, name)

    async def push(self, name: str, req: pb.PackSandboxRequest) -> str:
        """Push the stored image ``name`` to the registry reference ``name``."""
        from dsec.edge.images.push import push_image

        async with self._shared():
            return await asyncio.to_thread(
                push_image,
                self.store,
                name,
                name,
                self.puller.credentials,
                insecure=req.insecure,
                username=req.username,
                password=req.password,
            )

    async def build(
        self,
        requests: AsyncIterator[pb.BuildImageRequest],
        manager: SandboxManager,
        caller: Caller,
    ) -> AsyncIterator[pb.BuildImageEvent]:
        """Receive the options and the context tar, build, and stream the progress."""
        from dsec.edge.images.build import (
            MAX_CONTEXT_BYTES,
            Builder,
            BuildOptions,
            unpack_context,
        )
        from dsec.edge.images.build_step import SandboxSteps
        from dsec.edge.images.store import validate_name

        first = await anext(aiter(requests), None)
        if first is None or not first.HasField("options") or not first.options.tag:
            raise InvalidArgument("a build starts with its options (at least a tag)")
        o = first.options
        opts = BuildOptions(
            tag=validate_name(o.tag),
            dockerfile=o.dockerfile or "Dockerfile",
            build_args=dict(o.build_args),
            no_cache=o.no_cache,
            memory_mb=o.memory_mb or 2048,
            timeout_s=o.timeout_s or 3600,
        )
        with self.store.scratch_dir() as scratch:
            tar = scratch / "context.tar"
            size = 0
            with tar.open("wb") as f:
                f.write(first.context)
                size += len(first.context)
                async for req in requests:
                    size += len(req.context)
                    if size > MAX_CONTEXT_BYTES:
                        raise InvalidArgument(
                            f"the build context is larger than {MAX_CONTEXT_BYTES >> 20} MiB"
                        )
                    f.write(req.context)
            context = scratch / "context"
            context.mkdir()
            await asyncio.to_thread(unpack_context, tar, context)
            builder = Builder(self.store, SandboxSteps(manager, caller, opts))
            async with self._shared():
                async for ev in builder.build(context, opts):
                    if isinstance(ev, Image):
                        yield pb.BuildImageEvent(image=image_to_pb(ev, self.edge_id))
                    elif ev.kind == "step":
                        step = pb.BuildStep(
                            index=ev.index, total=ev.total, instruction=ev.text, line=ev.line
                        )
                        yield pb.BuildImageEvent(step=step)
                    elif ev.kind == "cached":
                        yield pb.BuildImageEvent(cached=True)
                    else:
                        yield pb.BuildImageEvent(log=ev.text)

    async def save(self, name: str) -> AsyncIterator[pb.SaveImageChunk]:
        """Stream the stored image ``name`` as an OCI layout tar."""
        from dsec.edge.images.archive import save_image
        from dsec.edge.images.pipe import ChunkWriter

        self.store.resolve(name)  # a clear ImageNotFound before the stream starts
        out = ChunkWriter(asyncio.get_running_loop())

        def work() -> None:
            save_image(self.store, name, cast("IO[bytes]", out))  # buffers CHUNK bytes
            out.finish()

        async with self._shared():
            task = asyncio.ensure_future(asyncio.to_thread(work))
            try:
                while (chunk := await out.next_chunk()) is not None:
                    yield pb.SaveImageChunk(data=chunk)
                await task
            finally:
                out.aborted.set()
                if not task.done():
                    with contextlib.suppress(Exception):
                        await asyncio.shield(task)

    async def load(
        self, requests: AsyncIterator[pb.LoadImageRequest]
    ) -> AsyncIterator[pb.PullImageEvent]:
        """Import the OCI layout tar streamed in ``requests``; yield progress, then images."""
        from dsec.edge.images.archive import load_image
        from dsec.edge.images.pipe import ChunkReader, PipeClosed

        src = ChunkReader()
        first = await anext(aiter(requests), None)
        name = first.name if first is not None else ""
        if first is not None and first.kind == "vm":
            async for event in self._import_vm(first, requests):
                yield event
            return
        if first is not None and first.kind:
            raise InvalidArgument(f"unknown kind of image to load: {first.kind!r}")

        def work(report: Report) -> list[Image]:
            try:
                with io.BufferedReader(src, 1 << 20) as f:
                    return load_image(self.store, f, name=name, progress=report)
            finally:
                src.stop()

        async def feed() -> None:
            with contextlib.suppress(PipeClosed):
                if first is not None and first.data:
                    await src.feed(first.data)
                async for req in requests:
                    if req.data:
                        await src.feed(req.data)
                await src.feed(None)

        images: list[list[Image]] = []
        async with self._shared():
            feeder = asyncio.ensure_future(feed())
            try:
                async with contextlib.aclosing(thread_progress(work, images, src.stop)) as events:
                    async for event in events:
                        yield event
            finally:
                feeder.cancel()
                src.stop()
        for image in images[0]:
            yield pb.PullImageEvent(image=image_to_pb(image, self.edge_id))

    async def _import_vm(
        self, first: pb.LoadImageRequest, requests: AsyncIterator[pb.LoadImageRequest]
    ) -> AsyncIterator[pb.PullImageEvent]:
        """Receive a disk image into a file, then import it (:mod:`dsec.edge.backends.vm.imports`)
        as vm system image ``first.name``; progress is one pseudo-layer ``vm:NAME``."""
        from dsec.edge.backends.vm import imports

        if self.vm_paths is None:
            raise Unavailable("this edge does not import VM images")
        data, bundle, name = self.vm_paths.data, self.vm_paths.agent_bundle, first.name
        try:
            imports.check_name(name)
            if imports.find(data, name) is not None or self.store.has(name):
                raise AlreadyExists(f"an image named {name!r} exists on this edge: pick another")
            why = imports.missing()
            if why:
                raise Unavailable(why)
        except DsecError:
            # Answer once the sender is done: a status while the apiserver still streams
            # the disk reached it as "Internal error from Core" instead of this error.
            async for _ in requests:
                pass
            raise
        tag = f"vm:{name}"
        upload = imports.upload_path(data)
        try:
            received = len(first.data)
            with upload.open("wb") as f:
                await asyncio.to_thread(f.write, first.data)
                async for req in requests:
                    if req.data:
                        await asyncio.to_thread(f.write, req.data)
                        received += len(req.data)
            yield pb.PullImageEvent(
                progress=pb.PullProgress(
                    digest=tag, status="received", done=received, total=received
                )
            )

            def work(report: Report) -> imports.VmImport:
                return imports.import_disk(
                    data,
                    name,
                    upload,
                    bundle,
                    source="dsec image import-vm",
                    progress=lambda status, done, total: report(
                        LayerProgress(tag, status, done, total)
                    ),
                    consume=True,
                )

            imported: list[imports.VmImport] = []
            async with contextlib.aclosing(thread_progress(work, imported)) as events:
                async for event in events:
                    yield event
        finally:
            upload.unlink(missing_ok=True)
        yield pb.PullImageEvent(image=vm_image_to_pb(imported[0], self.edge_id))

    def list(self) -> pb.ImageList:
        images = [image_to_pb(i, self.edge_id) for i in self.store.list()]
        if self.vm_paths is not None:
            from dsec.edge.backends.vm import imports

            vms = imports.list_imports(self.vm_paths.data)
            images += [vm_image_to_pb(i, self.edge_id) for i in vms]
        return pb.ImageList(images=images)

    def remove(self, name: str) -> None:
        if self.vm_paths is not None:
            from dsec.edge.backends.vm import imports

            if imports.remove(self.vm_paths.data, name, edge_dir=self.vm_paths.home / "edge"):
                return
        self.store.remove(name)

    async def gc(self) -> GcResult:
        async with self._exclusive():
            return await asyncio.to_thread(self.store.gc)
