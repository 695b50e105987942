"""The edge's local image store: unpacked layers keyed by diff_id, and named refs.

Layout (OCI-compatible in shape: a layer is identified by the sha256 of its uncompressed
tar, the OCI ``diff_id``, and an image is an ordered list of layers plus a config)::

    <root>/layers/sha256/<diff_id>/      one unpacked layer, shared by every image using it
    <root>/refs/<name>.json              {name, layers: [diff_id bottom..top],
                                          config: {env, cmd, entrypoint, workdir, user},
                                          created}
    <root>/blobs/sha256/<digest>         registry blobs (compressed layers, configs, manifests)
    <root>/tmp/                          unpack scratch (same filesystem, so renames are atomic)

A pulled image's ref also records ``blobs`` (the manifest, config and layer digests it
came from) so that garbage collection keeps them.

Layers are written once and never changed; a ref is replaced atomically.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from dsec.core.errors import ImageNotFound, Internal, InvalidArgument

_DIFF_ID_RE = re.compile(r"^[0-9a-f]{64}$")
_NAME_RE = re.compile(r"^[a-z0-9][a-zA-Z0-9._/:@-]{0,254}$")  # tags may have capitals


@dataclass(frozen=True, slots=True)
class ImageConfig:
    """The part of an OCI image config a sandbox uses."""

    env: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    entrypoint: tuple[str, ...] = ()
    workdir: str = ""
    user: str = ""

    def main_command(self) -> tuple[str, ...]:
        """What a sandbox of this image starts at create: Entrypoint + Cmd, if Entrypoint.

        An image without an Entrypoint starts nothing: its Cmd is almost always an
        interactive shell or interpreter (``/bin/bash``, ``python3``), and a sandbox is
        driven by exec calls instead. The Cmd stays recorded and shown.
        """
        return (*self.entrypoint, *self.cmd) if self.entrypoint else ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "env": list(self.env),
            "cmd": list(self.cmd),
            "entrypoint": list(self.entrypoint),
            "workdir": self.workdir,
            "user": self.user,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ImageConfig:
        return cls(
            env=tuple(str(x) for x in data.get("env") or ()),
            cmd=tuple(str(x) for x in data.get("cmd") or ()),
            entrypoint=tuple(str(x) for x in data.get("entrypoint") or ()),
            workdir=str(data.get("workdir") or ""),
            user=str(data.get("user") or ""),
        )


@dataclass(frozen=True, slots=True)
class LayerBlob:
    """The compressed registry blob a layer came from (or was packed into)."""

    diff_id: str  # the layer it belongs to (its directory's key)
    digest: str  # sha256:<hex>
    media_type: str
    size: int
    uncompressed: str = ""  # the blob's own diff_id when it differs (a re-exported layer)

    @property
    def blob_diff_id(self) -> str:
        return self.uncompressed or self.diff_id


@dataclass(frozen=True, slots=True)
class Image:
    """A resolved image: its layers on disk and its config."""

    name: str
    diff_ids: tuple[str, ...]  # bottom..top, as in the ref
    layer_dirs: tuple[Path, ...]  # top..bottom: overlayfs lowerdir order
    config: ImageConfig
    created: str
    blobs: tuple[str, ...] = ()  # registry digests (manifest, config, layers) it came from
    source: str = ""  # the reference it was pulled from, if any
    layer_blobs: tuple[LayerBlob, ...] = ()  # known blobs of its layers (for push)

    def blob_of(self, diff_id: str) -> LayerBlob | None:
        return next((b for b in self.layer_blobs if b.diff_id == diff_id), None)

    @property
    def env(self) -> tuple[str, ...]:
        return self.config.env

    @property
    def workdir(self) -> str:
        return self.config.workdir

    @property
    def user(self) -> str:
        return self.config.user


def validate_name(name: str) -> str:
    """Check an image name can safely name a ref file.

    Raises:
        InvalidArgument: the name is malformed or contains ``..`` segments.
    """
    if not _NAME_RE.match(name) or any(seg in ("", ".", "..") for seg in name.split("/")):
        raise InvalidArgument(f"invalid image name {name!r}")
    return name


def sha256_file(path: Path, bufsize: int = 1 << 20) -> str:
    """Hex sha256 of a file's content."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(bufsize):
            h.update(chunk)
    return h.hexdigest()


class ImageStore:
    """Unpacked layers and image refs under one root directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.layers_dir = root / "layers" / "sha256"
        self.refs_dir = root / "refs"
        self.tmp_dir = root / "tmp"
        self.blobs_dir = root / "blobs" / "sha256"

    # --- reading -------------------------------------------------------------------

    def ref_path(self, name: str) -> Path:
        return self.refs_dir / f"{validate_name(name)}.json"

    def layer_dir(self, diff_id: str) -> Path:
        diff_id = diff_id.removeprefix("sha256:")
        if not _DIFF_ID_RE.match(diff_id):
            raise InvalidArgument(f"invalid layer diff_id {diff_id!r}")
        return self.layers_dir / diff_id

    def blob_path(self, digest: str) -> Path:
        """Where the blob ``sha256:<hex>`` is (or would be) stored."""
        hexd = digest.removeprefix("sha256:")
        if not _DIFF_ID_RE.match(hexd):
            raise InvalidArgument(f"invalid blob digest {digest!r}")
        return self.blobs_dir / hexd

    def has_layer(self, diff_id: str) -> bool:
        return self.layer_dir(diff_id).is_dir()

    def has(self, name: str) -> bool:
        """True if a ref ``name`` exists (its layers are not checked)."""
        try:
            return self.ref_path(name).is_file()
        except InvalidArgument:
            return False

    def resolve(self, name: str) -> Image:
        """Return the image named ``name``.

        Raises:
            ImageNotFound: no such ref, or one of its layers is missing on disk.
            InvalidArgument: the name is malformed.
        """
        path = self.ref_path(name)
        if not path.is_file():
            canonical = _canonical(name)
            if canonical != name:
                path = self.ref_path(canonical)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ImageNotFound(self._not_found_message(name)) from None
        except (OSError, ValueError) as exc:
            raise ImageNotFound(f"image {name!r} has an unreadable ref {path}: {exc}") from None
        image = self._image_from_ref(name, data)
        for diff_id, d in zip(reversed(image.diff_ids), image.layer_dirs, strict=True):
            if not d.is_dir():
                raise ImageNotFound(
                    f"image {name!r} is incomplete: layer sha256:{diff_id} is missing "
                    f"from {self.layers_dir}; pull or build the image again"
                )
        return image

    def list(self) -> list[Image]:
        """Every image with a readable ref, sorted by name."""
        out: list[Image] = []
        if not self.refs_dir.is_dir():
            return out
        for path in sorted(self.refs_dir.rglob("*.json")):
            name = path.relative_to(self.refs_dir).as_posix().removesuffix(".json")
            try:
                out.append(self._image_from_ref(name, json.loads(path.read_text())))
            except (OSError, ValueError, InvalidArgument):
                continue
        return out

    def _image_from_ref(self, name: str, data: Any) -> Image:
        if not isinstance(data, dict) or not isinstance(data.get("layers"), list):
            raise ImageNotFound(f"image {name!r} has a malformed ref (no layer list)")
        diff_ids = tuple(str(x).removeprefix("sha256:") for x in data["layers"])
        if not diff_ids:
            raise ImageNotFound(f"image {name!r} has no layers")
        return Image(
            name=name,
            diff_ids=diff_ids,
            layer_dirs=tuple(self.layer_dir(d) for d in reversed(diff_ids)),
            config=ImageConfig.from_dict(data.get("config") or {}),
            created=str(data.get("created", "")),
            blobs=tuple(str(b) for b in data.get("blobs") or ()),
            source=str(data.get("source") or ""),
            layer_blobs=tuple(
                LayerBlob(
                    str(b.get("diff_id", "")),
                    str(b.get("digest", "")),
                    str(b.get("mediaType", "")),
                    int(b.get("size", 0)),
                    str(b.get("uncompressed", "")),
                )
                for b in data.get("layer_blobs") or ()
                if isinstance(b, dict)
            ),
        )

    def _not_found_message(self, name: str) -> str:
        names = [i.name for i in self.list()]
        known = ", ".join(names) if names else "none"
        hint = (
            " Build it with `python -m dsec.edge.images.base` (or `dsec setup`)."
            if name == "base"
            else ""
        )
        return f"image {name!r} is not on this edge (available: {known}).{hint}"

    # --- writing -------------------------------------------------------------------

    def write_ref(
        self,
        name: str,
        diff_ids: Sequence[str],
        config: ImageConfig,
        *,
        blobs: Sequence[str] = (),
        source: str = "",
        layer_blobs: Sequence[LayerBlob] = (),
    ) -> Image:
        """Create or replace the ref ``name`` (atomically) and return the image.

        ``blobs`` are the registry digests the image came from (kept by :meth:`gc`).

        Raises:
            ImageNotFound: one of the layers is not in the store.
        """
        path = self.ref_path(name)
        data: dict[str, Any] = {
            "name": name,
            "layers": [d.removeprefix("sha256:") for d in diff_ids],
            "config": config.to_dict(),
            "created": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        }
        if blobs:
            data["blobs"] = list(blobs)
        if source:
            data["source"] = source
        if layer_blobs:
            data["layer_blobs"] = [
                {
                    "diff_id": b.diff_id,
                    "digest": b.digest,
                    "mediaType": b.media_type,
                    "size": b.size,
                    **({"uncompressed": b.uncompressed} if b.uncompressed else {}),
                }
                for b in layer_blobs
            ]
        for d in data["layers"]:
            if not self.has_layer(d):
                raise ImageNotFound(f"cannot write image {name!r}: layer sha256:{d} is missing")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        os.replace(tmp, path)
        return self.resolve(name)

    @contextlib.contextmanager
    def scratch_dir(self) -> Iterator[Path]:
        """A temporary directory on the store's filesystem, removed afterwards."""
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        d = Path(tempfile.mkdtemp(prefix="unpack-", dir=self.tmp_dir))
        try:
            yield d
        finally:
            shutil.rmtree(d, ignore_errors=True)

    def import_trusted_tar(self, tar: Path, *, diff_id: str | None = None) -> str:
        """Unpack a locally built, trusted layer tar into the store.

        Owners, modes and device nodes are kept (``tar -x --numeric-owner -p``); the
        layer appears atomically by rename. Only for content this host built itself:
        registry layers need the confined unpacker (a later issue).

        Args:
            tar: an uncompressed tar.
            diff_id: its sha256 if already known (otherwise computed).

        Returns:
            The layer's diff_id (hex, without the ``sha256:`` prefix).

        Raises:
            Internal: tar failed.
        """
        digest = diff_id or sha256_file(tar)
        final = self.layer_dir(digest)
        if final.is_dir():
            return digest
        with self.scratch_dir() as scratch:
            target = scratch / "layer"
            target.mkdir()
            proc = subprocess.run(
                ["tar", "-x", "--numeric-owner", "-p", "-f", str(tar), "-C", str(target)],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                check=False,
            )
            if proc.returncode != 0:
                msg = proc.stderr.decode(errors="replace").strip()
                raise Internal(f"unpacking {tar} failed: {msg}")
            final.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.rename(target, final)
            except OSError:
                if not final.is_dir():  # lost a race with an identical import: fine
                    raise
        return digest

    def import_layer_blob(self, blob: Path, media_type: str, diff_id: str) -> str:
        """Unpack an untrusted registry layer blob (confined, overlay format), once.

        Raises:
            InvalidArgument: the layer is malformed or malicious, or its uncompressed
                sha256 is not ``diff_id``; nothing is stored.
        """
        from dsec.edge.images.unpack import compression_of, unpack_layer

        diff_id = diff_id.removeprefix("sha256:")
        final = self.layer_dir(diff_id)
        if final.is_dir():
            return diff_id
        compression = compression_of(media_type)
        with self.scratch_dir() as scratch:
            target = scratch / "layer"
            target.mkdir()
            got = unpack_layer(blob, compression, target)
            if got != diff_id:
                raise InvalidArgument(
                    f"layer {blob.name[:12]} unpacked to sha256:{got}, but the image config "
                    f"says sha256:{diff_id}; nothing was stored"
                )
            target.chmod(0o755)
            final.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.rename(target, final)
            except OSError:
                if not final.is_dir():
                    raise
        return diff_id

    def remove(self, name: str) -> None:
        """Delete the ref ``name`` (its layers stay until :meth:`gc`).

        Raises:
            ImageNotFound: there is no such ref.
        """
        path = self.ref_path(name)
        try:
            path.unlink()
        except FileNotFoundError:
            raise ImageNotFound(self._not_found_message(name)) from None

    def gc(self) -> GcResult:
        """Remove layers and blobs no ref uses (layers under a mounted overlay are kept)."""
        from dsec.edge.images.gc import collect

        return collect(self)


@dataclass(frozen=True, slots=True)
class GcResult:
    """What :meth:`ImageStore.gc` removed."""

    layers: int
    blobs: int
    bytes_freed: int


def _canonical(name: str) -> str:
    """``python:3`` -> ``docker.io/library/python:3`` (the name a pull records), else name."""
    from dsec.edge.images.reference import parse_reference

    try:
        return parse_reference(name).name
    except InvalidArgument:
        return name
