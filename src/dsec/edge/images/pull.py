"""Pull an image from a registry into the :class:`ImageStore`.

reference -> manifest (an index picks the platform) -> config -> layers: each layer the
store lacks is downloaded (verified, resumable, in parallel) and unpacked once, confined;
then the ref is written. A layer already in the store (from any image) is neither
downloaded nor unpacked again. Nothing is recorded unless every layer is in place.
"""

from __future__ import annotations

import errno
import json
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dsec.core.errors import ImageNotFound, Internal, InvalidArgument
from dsec.edge.images.credentials import RegistryCredentials
from dsec.edge.images.reference import parse_reference
from dsec.edge.images.registry import INDEX_TYPES, Manifest, RegistryClient
from dsec.edge.images.store import Image, ImageConfig, ImageStore, LayerBlob

DEFAULT_PLATFORM = "linux/amd64"


@dataclass(frozen=True, slots=True)
class LayerProgress:
    """One progress report: a layer's state and bytes so far."""

    digest: str
    status: str  # "waiting" | "downloading" | "unpacking" | "done" | "exists"
    done: int
    total: int


ProgressFn = Callable[[LayerProgress], None]


@dataclass(frozen=True, slots=True)
class PullOptions:
    """How to pull: platform, transport and explicit credentials (override stored ones)."""

    platform: str = DEFAULT_PLATFORM
    insecure: bool = False
    username: str = ""
    password: str = ""
    workers: int = 4


def select_platform(index: dict[str, Any], platform: str) -> dict[str, Any]:
    """The manifest descriptor of ``index`` for ``os/arch[/variant]``.

    Raises:
        ImageNotFound: the index has no manifest for that platform.
    """
    want = platform.split("/")
    if len(want) < 2:
        raise InvalidArgument(f"invalid platform {platform!r} (expected os/arch[/variant])")
    seen: list[str] = []
    for desc in index.get("manifests") or []:
        plat = desc.get("platform") or {}
        os_, arch, variant = plat.get("os", ""), plat.get("architecture", ""), plat.get("variant")
        if not os_ or os_ == "unknown":
            continue  # attestation manifests and the like
        seen.append("/".join(x for x in (os_, arch, variant) if x))
        if [os_, arch] == want[:2] and (len(want) < 3 or variant == want[2]):
            return dict(desc)
    raise ImageNotFound(
        f"the image has no manifest for platform {platform} "
        f"(available: {', '.join(seen) or 'none'})"
    )


def _config_from(data: dict[str, Any]) -> ImageConfig:
    cfg = data.get("config") or {}
    return ImageConfig(
        env=tuple(str(x) for x in cfg.get("Env") or ()),
        cmd=tuple(str(x) for x in cfg.get("Cmd") or ()),
        entrypoint=tuple(str(x) for x in cfg.get("Entrypoint") or ()),
        workdir=str(cfg.get("WorkingDir") or ""),
        user=str(cfg.get("User") or ""),
    )


class Puller:
    """Pulls images into one store."""

    def __init__(self, store: ImageStore, credentials: RegistryCredentials | None = None) -> None:
        self.store = store
        self.credentials = credentials or RegistryCredentials()
        self._layer_locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()

    def _lock_for(self, diff_id: str) -> threading.Lock:
        with self._locks_guard:
            return self._layer_locks.setdefault(diff_id, threading.Lock())

    def pull(
        self,
        reference: str,
        options: PullOptions | None = None,
        progress: ProgressFn | None = None,
    ) -> Image:
        """Pull ``reference``; return the stored image (named by its canonical reference).

        Raises:
            InvalidArgument: a bad reference, a digest mismatch or a rejected layer.
            Unauthenticated / PermissionDenied / ImageNotFound / QuotaExceeded: the
                registry said 401 / 403 / 404 / 429.
            Unavailable: the registry cannot be reached.
        """
        opts = options or PullOptions()
        ref = parse_reference(reference)
        settings = self.credentials.lookup(ref.registry)
        if opts.username:
            settings = replace(settings, username=opts.username, password=opts.password)
        report = progress or (lambda _p: None)
        with RegistryClient(ref, settings, insecure=opts.insecure) as client:
            manifest = client.get_manifest(ref.selector)
            blobs = [manifest.digest]
            if manifest.media_type in INDEX_TYPES:
                desc = select_platform(manifest.json(), opts.platform)
                manifest = client.get_manifest(str(desc["digest"]))
                if manifest.media_type in INDEX_TYPES:
                    raise InvalidArgument("nested image indexes are not supported")
                blobs.append(manifest.digest)
            self._save_blob(manifest)
            body = manifest.json()
            config_desc = body.get("config") or {}
            layers = body.get("layers") or []
            config_digest = str(config_desc.get("digest", ""))
            config_bytes = client.get_blob_bytes(config_digest)
            self._save_bytes(config_digest, config_bytes)
            blobs.append(config_digest)
            try:
                config = json.loads(config_bytes)
                diff_ids = [str(d) for d in config["rootfs"]["diff_ids"]]
            except (ValueError, KeyError, TypeError):
                raise InvalidArgument(f"image config {config_digest} is malformed") from None
            if len(diff_ids) != len(layers) or not layers:
                raise InvalidArgument(
                    f"image {ref.name}: {len(layers)} layers but {len(diff_ids)} diff_ids"
                )
            blobs.extend(str(layer.get("digest", "")) for layer in layers)
            jobs = list(zip(layers, diff_ids, strict=True))
            with ThreadPoolExecutor(max_workers=max(1, opts.workers)) as pool:
                futures = [pool.submit(self._layer, client, d, i, report) for d, i in jobs]
                for f in futures:
                    f.result()
        return self.store.write_ref(
            ref.name,
            diff_ids,
            _config_from(config),
            blobs=blobs,
            source=ref.name,
            layer_blobs=[
                LayerBlob(
                    diff_id.removeprefix("sha256:"),
                    str(desc.get("digest", "")),
                    str(desc.get("mediaType", "")),
                    int(desc.get("size", 0)),
                )
                for desc, diff_id in jobs
            ],
        )

    def _layer(
        self, client: RegistryClient, desc: dict[str, Any], diff_id: str, report: ProgressFn
    ) -> None:
        digest = str(desc.get("digest", ""))
        size = int(desc.get("size", -1))
        media_type = str(desc.get("mediaType", ""))
        with self._lock_for(diff_id):
            if self.store.has_layer(diff_id):
                report(LayerProgress(digest, "exists", size, size))
                return
            blob = self.store.blob_path(digest)
            try:
                self._fetch_and_unpack(client, blob, digest, size, media_type, diff_id, report)
            except OSError as exc:
                part = blob.with_name(blob.name + ".part")
                if exc.errno == errno.ENOSPC:
                    part.unlink(missing_ok=True)
                    blob.unlink(missing_ok=True)
                raise Internal(
                    f"storing layer {digest} failed: {exc.strerror or exc}; nothing was recorded"
                ) from None
            except InvalidArgument:
                blob.unlink(missing_ok=True)  # a blob that unpacks wrong is not worth keeping
                raise

    def _fetch_and_unpack(
        self,
        client: RegistryClient,
        blob: Path,
        digest: str,
        size: int,
        media_type: str,
        diff_id: str,
        report: ProgressFn,
    ) -> None:
        if not blob.is_file():
            blob.parent.mkdir(parents=True, exist_ok=True)
            done = 0

            def step(n: int) -> None:
                nonlocal done
                done += n
                report(LayerProgress(digest, "downloading", done, size))

            report(LayerProgress(digest, "downloading", 0, size))
            client.download_blob(digest, blob, size=size, progress=step)
        report(LayerProgress(digest, "unpacking", size, size))
        self.store.import_layer_blob(blob, media_type, diff_id)
        report(LayerProgress(digest, "done", size, size))

    def _save_blob(self, manifest: Manifest) -> None:
        self._save_bytes(manifest.digest, manifest.body)

    def _save_bytes(self, digest: str, data: bytes) -> None:
        path = self.store.blob_path(digest)
        if path.is_file():
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(data)
        tmp.replace(path)
