"""Push a stored image to a registry as an OCI image (config + manifest + layer blobs).

Each layer goes up as the blob it came from when the store has it (a pulled or packed
layer); a layer without one (the locally built ``base``) is exported from its directory
(overlay format -> OCI tar with whiteouts, as in :mod:`pack`) and gzip'd once, and the
new blob is remembered. Blobs the registry already has are skipped (HEAD); a blob of the
same registry's other repository is mounted across instead of uploaded.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import replace
from pathlib import Path

from dsec.core.errors import Internal
from dsec.edge.images.credentials import RegistryCredentials
from dsec.edge.images.pack import LAYER_GZIP, write_diff_tar
from dsec.edge.images.reference import parse_reference
from dsec.edge.images.registry import OCI_MANIFEST, RegistryClient, sha256_digest
from dsec.edge.images.store import Image, ImageStore, LayerBlob, sha256_file

OCI_CONFIG = "application/vnd.oci.image.config.v1+json"


def export_layer(store: ImageStore, diff_id: str, layer_dir: Path) -> LayerBlob:
    """Export an unpacked layer dir as a gzip'd OCI layer blob in the store."""
    with store.scratch_dir() as scratch:
        tar = scratch / "layer.tar"
        with tar.open("wb") as f:
            tar_diff_id, _, _, _ = write_diff_tar(layer_dir, f)
        gz = scratch / "layer.tar.gz"
        with tar.open("rb") as src, gz.open("wb") as dst:
            proc = subprocess.run(
                ["gzip", "-1", "-n", "-c"], stdin=src, stdout=dst, stderr=subprocess.PIPE
            )
        if proc.returncode != 0:
            raise Internal(f"gzip failed: {proc.stderr.decode(errors='replace').strip()}")
        digest = "sha256:" + sha256_file(gz)
        size = gz.stat().st_size
        dest = store.blob_path(digest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(gz, dest)
    uncompressed = tar_diff_id if tar_diff_id != diff_id else ""
    return LayerBlob(diff_id, digest, LAYER_GZIP, size, uncompressed)


def push_image(
    store: ImageStore,
    name: str,
    target: str,
    credentials: RegistryCredentials | None = None,
    *,
    insecure: bool = False,
    username: str = "",
    password: str = "",
) -> str:
    """Push the stored image ``name`` to the reference ``target``; return the manifest digest.

    Raises:
        ImageNotFound: ``name`` is not in the store.
        Unauthenticated / PermissionDenied / Unavailable: as the registry answers.
    """
    image = store.resolve(name)
    ref = parse_reference(target)
    settings = (credentials or RegistryCredentials()).lookup(ref.registry)
    if username:
        settings = replace(settings, username=username, password=password)
    blobs = layer_blobs(store, name, image)
    source = parse_reference(image.source) if image.source else None
    mount_from = (
        source.repository
        if source and source.registry == ref.registry and source.repository != ref.repository
        else ""
    )
    config, manifest = oci_manifest(image, blobs)
    config_digest = sha256_digest(config)
    with RegistryClient(ref, settings, insecure=insecure, push=True) as client:
        for b in blobs:
            client.upload_blob_file(b.digest, store.blob_path(b.digest), mount_from=mount_from)
        client.upload_blob(config_digest, config)
        return client.put_manifest(ref.tag or "latest", OCI_MANIFEST, manifest)


def oci_manifest(image: Image, blobs: list[LayerBlob]) -> tuple[bytes, bytes]:
    """The OCI image config and manifest (JSON bytes) of ``image`` with layer ``blobs``."""
    cfg = image.config
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {
                "Env": list(cfg.env),
                "Cmd": list(cfg.cmd) or None,
                "Entrypoint": list(cfg.entrypoint) or None,
                "WorkingDir": cfg.workdir,
                "User": cfg.user,
            },
            "rootfs": {"type": "layers", "diff_ids": [f"sha256:{b.blob_diff_id}" for b in blobs]},
        },
        sort_keys=True,
    ).encode()
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": {
                "mediaType": OCI_CONFIG,
                "digest": sha256_digest(config),
                "size": len(config),
            },
            "layers": [
                {"mediaType": b.media_type, "digest": b.digest, "size": b.size} for b in blobs
            ],
        }
    ).encode()
    return config, manifest


def layer_blobs(store: ImageStore, name: str, image: Image) -> list[LayerBlob]:
    """The layer blobs of ``image`` (exported once when missing, and remembered)."""
    blobs = _layer_blobs(store, image)
    if blobs != list(image.layer_blobs):  # remember exported blobs for the next push/save
        store.write_ref(
            name,
            image.diff_ids,
            image.config,
            blobs=image.blobs,
            source=image.source,
            layer_blobs=blobs,
        )
    return blobs


def _layer_blobs(store: ImageStore, image: Image) -> list[LayerBlob]:
    out = []
    for diff_id, layer_dir in zip(image.diff_ids, reversed(image.layer_dirs), strict=True):
        known = image.blob_of(diff_id)
        if known is not None and store.blob_path(known.digest).is_file():
            out.append(known)
        else:
            out.append(export_layer(store, diff_id, layer_dir))
    return out
