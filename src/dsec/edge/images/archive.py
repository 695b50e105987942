"""Save a stored image as an OCI image-layout tarball, and load one back (no registry).

A saved tarball holds ``oci-layout``, ``index.json`` (one manifest descriptor, named by
``org.opencontainers.image.ref.name``) and ``blobs/sha256/<hex>`` for the manifest, the
config and every layer blob: the compressed blobs the store keeps from a pull, pack or
push, or (for a layer without one, like ``base``) the blob :mod:`push` exports once.

Loading reads the tar in one pass into a scratch directory, checks every blob against its
name's sha256, then imports each image of ``index.json`` (nested indexes pick the
platform) the way a pull does: each layer the store lacks is unpacked once, confined, and
checked against the config's diff_id; the ref is written last. A tarball with a bad
digest, a missing blob, a stray member or a truncated end is refused before anything is
imported.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import tarfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from dsec.core.errors import InvalidArgument
from dsec.edge.images.pull import (
    DEFAULT_PLATFORM,
    LayerProgress,
    ProgressFn,
    _config_from,
    select_platform,
)
from dsec.edge.images.push import layer_blobs, oci_manifest
from dsec.edge.images.registry import INDEX_TYPES, MANIFEST_TYPES, OCI_INDEX, sha256_digest
from dsec.edge.images.store import Image, ImageStore, LayerBlob

REF_NAME = "org.opencontainers.image.ref.name"
CONTAINERD_NAME = "io.containerd.image.name"
LAYOUT = b'{"imageLayoutVersion":"1.0.0"}'
MAX_JSON_BYTES = 4 << 20  # index.json, manifests and configs are small
_BLOB_RE = re.compile(r"^blobs/sha256/([0-9a-f]{64})$")
_CHUNK = 1 << 20


def _noop(_p: LayerProgress) -> None:
    pass


def save_image(
    store: ImageStore, name: str, out: IO[bytes], progress: ProgressFn | None = None
) -> str:
    """Write the stored image ``name`` to ``out`` as an OCI layout tar (streamed).

    Returns:
        The manifest digest.

    Raises:
        ImageNotFound: ``name`` is not in the store.
    """
    report = progress or _noop
    image = store.resolve(name)
    blobs = layer_blobs(store, image.name, image)
    config, manifest = oci_manifest(image, blobs)
    digest = sha256_digest(manifest)
    index = {
        "schemaVersion": 2,
        "mediaType": OCI_INDEX,
        "manifests": [
            {
                "mediaType": json.loads(manifest)["mediaType"],
                "digest": digest,
                "size": len(manifest),
                "annotations": {REF_NAME: image.name, CONTAINERD_NAME: image.name},
            }
        ],
    }
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        _add_bytes(tar, "oci-layout", LAYOUT)
        _add_bytes(tar, "index.json", json.dumps(index, indent=2).encode())
        _add_bytes(tar, f"blobs/sha256/{sha256_digest(config)[7:]}", config)
        _add_bytes(tar, f"blobs/sha256/{digest[7:]}", manifest)
        for b in blobs:
            path = store.blob_path(b.digest)
            info = tarfile.TarInfo(f"blobs/sha256/{b.digest[7:]}")
            info.size = path.stat().st_size
            info.mode = 0o644
            report(LayerProgress(b.digest, "saving", 0, info.size))
            with path.open("rb") as f:
                tar.addfile(info, f)
            report(LayerProgress(b.digest, "done", info.size, info.size))
    return digest


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    tar.addfile(info, io.BytesIO(data))


def load_image(
    store: ImageStore,
    src: IO[bytes],
    *,
    name: str = "",
    platform: str = DEFAULT_PLATFORM,
    progress: ProgressFn | None = None,
) -> list[Image]:
    """Import every image of the OCI layout tar read from ``src``; return them.

    Args:
        name: the name to store the image under (required when the tarball does not name
            it; only for a tarball with one image).

    Raises:
        InvalidArgument: not an OCI layout tar, truncated, a blob whose content does not
            match its digest, a missing blob, or a layer that fails to unpack; nothing is
            recorded.
    """
    report = progress or _noop
    with _received(store, src, report) as blobs:
        index = _json(blobs, "index.json")
        if not isinstance(index.get("manifests"), list) or not index["manifests"]:
            raise InvalidArgument("index.json lists no manifests")
        todo: list[tuple[str, dict[str, Any]]] = []
        for desc in index["manifests"]:
            label = _label(desc)
            if desc.get("mediaType") in INDEX_TYPES:
                desc = select_platform(_json(blobs, _blob_key(desc)), platform)
            todo.append((label, desc))
        if name and len(todo) != 1:
            raise InvalidArgument(f"the tarball holds {len(todo)} images: a name fits only one")
        plans = [_plan(blobs, name or label, desc) for label, desc in todo]
        return [_import(store, blobs, plan, report) for plan in plans]


@contextmanager
def _received(store: ImageStore, src: IO[bytes], report: ProgressFn) -> Iterator[dict[str, Path]]:
    """Unpack the tar's blobs into scratch, verified; yield {key: path}."""
    with store.scratch_dir() as scratch:
        files: dict[str, Path] = {}
        try:
            with tarfile.open(fileobj=src, mode="r|") as tar:
                for member in tar:
                    _receive(tar, member, scratch, files, report)
        except (tarfile.TarError, EOFError) as exc:
            raise InvalidArgument(f"not a complete tar archive: {exc}") from None
        if "oci-layout" not in files or "index.json" not in files:
            raise InvalidArgument("not an OCI image layout: oci-layout or index.json is missing")
        try:
            version = json.loads(files["oci-layout"].read_bytes()).get("imageLayoutVersion")
        except (ValueError, AttributeError):
            version = None
        if not isinstance(version, str) or not version.startswith("1."):
            raise InvalidArgument(f"unsupported OCI layout version {version!r}")
        yield files


def _receive(
    tar: tarfile.TarFile,
    member: tarfile.TarInfo,
    scratch: Path,
    files: dict[str, Path],
    report: ProgressFn,
) -> None:
    key = member.name.removeprefix("./").rstrip("/")
    if member.isdir() and key in ("", "blobs", "blobs/sha256"):
        return
    match = _BLOB_RE.match(key)
    if not member.isfile() or not (match or key in ("oci-layout", "index.json")):
        raise InvalidArgument(f"unexpected member {member.name!r} in an OCI layout tar")
    if key in files:
        raise InvalidArgument(f"member {member.name!r} appears twice")
    if not match and member.size > MAX_JSON_BYTES:
        raise InvalidArgument(f"{key} is larger than {MAX_JSON_BYTES} bytes")
    f = tar.extractfile(member)
    assert f is not None  # a regular file
    dest = scratch / (match.group(1) if match else key)
    digest = f"sha256:{match.group(1)}" if match else key
    h = hashlib.sha256()
    done = 0
    if match:
        report(LayerProgress(digest, "loading", 0, member.size))
    with dest.open("wb") as out:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            out.write(chunk)
            done += len(chunk)
    if done != member.size:
        raise InvalidArgument(f"{key} is truncated ({done} of {member.size} bytes)")
    if match and h.hexdigest() != match.group(1):
        raise InvalidArgument(
            f"blob {digest} does not match its digest (sha256:{h.hexdigest()}); nothing was stored"
        )
    if match:
        report(LayerProgress(digest, "verified", done, member.size))
    files[f"sha256:{match.group(1)}" if match else key] = dest


def _blob_key(desc: Any) -> str:
    digest = str(desc.get("digest", "")) if isinstance(desc, dict) else ""
    if not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
        raise InvalidArgument(f"unsupported or malformed digest {digest!r}")
    return digest


def _json(blobs: dict[str, Path], key: str) -> dict[str, Any]:
    path = blobs.get(key)
    if path is None:
        raise InvalidArgument(f"blob {key} is not in the tarball")
    if path.stat().st_size > MAX_JSON_BYTES:
        raise InvalidArgument(f"{key} is larger than {MAX_JSON_BYTES} bytes")
    try:
        data = json.loads(path.read_bytes())
    except ValueError:
        raise InvalidArgument(f"{key} is not valid JSON") from None
    if not isinstance(data, dict):
        raise InvalidArgument(f"{key} is not a JSON object")
    return data


def _label(desc: Any) -> str:
    ann = desc.get("annotations") if isinstance(desc, dict) else None
    ann = ann if isinstance(ann, dict) else {}
    return str(ann.get(CONTAINERD_NAME) or ann.get(REF_NAME) or "")


_Plan = tuple[str, list[str], list[tuple[dict[str, Any], str]], Any]


def _plan(blobs: dict[str, Path], name: str, desc: dict[str, Any]) -> _Plan:
    """Check one image's manifest, config and layers are all present before importing."""
    key = _blob_key(desc)
    if not name:
        raise InvalidArgument(f"manifest {key} has no {REF_NAME} annotation: give the image a name")
    manifest = _json(blobs, key)
    media_type = manifest.get("mediaType") or desc.get("mediaType")
    if media_type not in MANIFEST_TYPES:
        raise InvalidArgument(f"manifest {key} has unsupported media type {media_type!r}")
    config_key = _blob_key(manifest.get("config"))
    config = _json(blobs, config_key)
    layers = manifest.get("layers")
    try:
        diff_ids = [str(d) for d in config["rootfs"]["diff_ids"]]
    except (KeyError, TypeError):
        raise InvalidArgument(f"image config {config_key} is malformed") from None
    if not isinstance(layers, list) or not layers or len(layers) != len(diff_ids):
        raise InvalidArgument(f"manifest {key}: layers and the config's diff_ids do not match")
    for layer in layers:
        lkey = _blob_key(layer)
        if lkey not in blobs:
            raise InvalidArgument(f"layer blob {lkey} is not in the tarball")
        if int(layer.get("size", -1)) != blobs[lkey].stat().st_size:
            raise InvalidArgument(f"layer blob {lkey} has a different size than its manifest says")
    blob_list = [key, config_key, *(_blob_key(x) for x in layers)]
    return name, blob_list, list(zip(layers, diff_ids, strict=True)), config


def _import(store: ImageStore, blobs: dict[str, Path], plan: _Plan, report: ProgressFn) -> Image:
    name, blob_list, jobs, config = plan
    for key in blob_list[:2]:  # manifest and config: kept, like a pull keeps them
        _keep(store, blobs[key], key)
    for desc, diff_id in jobs:
        digest = _blob_key(desc)
        size = int(desc.get("size", 0))
        if store.has_layer(diff_id):
            report(LayerProgress(digest, "exists", size, size))
        else:
            report(LayerProgress(digest, "unpacking", size, size))
            store.import_layer_blob(blobs[digest], str(desc.get("mediaType", "")), diff_id)
            report(LayerProgress(digest, "done", size, size))
        _keep(store, blobs[digest], digest)
    return store.write_ref(
        name,
        diff_ids=[d for _, d in jobs],
        config=_config_from(config),
        blobs=blob_list,
        layer_blobs=[
            LayerBlob(
                d.removeprefix("sha256:"),
                _blob_key(desc),
                str(desc.get("mediaType", "")),
                int(desc.get("size", 0)),
            )
            for desc, d in jobs
        ],
    )


def _keep(store: ImageStore, src: Path, digest: str) -> None:
    dest = store.blob_path(digest)
    if dest.is_file() or not src.is_file():
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".tmp")
    tmp.unlink(missing_ok=True)
    os.link(src, tmp)  # scratch is on the store's filesystem
    os.replace(tmp, dest)
