"""A real OCI registry on loopback for tests (Debian's ``docker-registry``), and image builders.

:func:`local_registry` writes its own config (never the package's, which binds every
interface) binding ``127.0.0.1:<free port>``, optionally with an htpasswd file made with
PyPI ``bcrypt``, starts ``docker-registry serve`` and stops it by PID afterwards.
:func:`push_image` uploads layers (tar bytes), a config and a manifest (OCI or Docker v2,
optionally inside a multi-platform index) with the product's own registry client.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import os
import shutil
import ssl
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from dsec.edge.images.credentials import RegistrySettings
from dsec.edge.images.reference import parse_reference
from dsec.edge.images.registry import (
    DOCKER_LIST,
    DOCKER_MANIFEST,
    OCI_INDEX,
    OCI_MANIFEST,
    RegistryClient,
    sha256_digest,
)
from dsec.testing.ports import free_port


@dataclass(frozen=True, slots=True)
class LocalRegistry:
    """A running registry: where it is and how to log in (if it wants a login)."""

    host: str  # 127.0.0.1:<port>
    storage: Path
    username: str = ""
    password: str = ""
    ca_file: str = ""  # set when it serves TLS (a self-signed certificate for 127.0.0.1)

    @property
    def settings(self) -> RegistrySettings:
        return RegistrySettings(
            username=self.username,
            password=self.password,
            insecure=not self.ca_file,
            ca_file=self.ca_file,
        )

    def blob_file(self, digest: str) -> Path:
        """The registry's on-disk file for a blob (filesystem storage driver layout)."""
        hexd = digest.removeprefix("sha256:")
        return self.storage / "docker/registry/v2/blobs/sha256" / hexd[:2] / hexd / "data"


def skip_reason() -> str | None:
    """Why a local registry cannot run here, or None."""
    if shutil.which("docker-registry") is None:
        return "needs docker-registry (apt-get install docker-registry)"
    return None


def _self_signed(root: Path) -> tuple[Path, Path]:
    """A key and a self-signed certificate for 127.0.0.1 (the certificate is its own CA)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "dsec test registry")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_path, cert_path = root / "tls.key", root / "tls.crt"
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key_path, cert_path


@contextlib.contextmanager
def local_registry(
    *, username: str = "", password: str = "", tls: bool = False
) -> Iterator[LocalRegistry]:
    """Run ``docker-registry`` on 127.0.0.1 (htpasswd auth when a username is given, HTTPS
    with a self-signed certificate when ``tls``)."""
    root = Path(tempfile.mkdtemp(prefix="dsec-registry-"))
    port = free_port()
    storage = root / "data"
    storage.mkdir()
    lines = [
        "version: 0.1",
        "log: {level: error}",
        f"storage: {{filesystem: {{rootdirectory: {storage}}}, delete: {{enabled: true}}}}",
    ]
    ca_file = ""
    if tls:
        key_path, cert_path = _self_signed(root)
        ca_file = str(cert_path)
        lines.append(
            f"http: {{addr: 127.0.0.1:{port}, tls: {{certificate: {cert_path}, key: {key_path}}}}}"
        )
    else:
        lines.append(f"http: {{addr: 127.0.0.1:{port}}}")
    if username:
        import bcrypt

        hashed = bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=5)).decode()
        (root / "htpasswd").write_text(f"{username}:{hashed}\n")
        lines.append(f"auth: {{htpasswd: {{realm: dsec-test, path: {root / 'htpasswd'}}}}}")
    (root / "config.yml").write_text("\n".join(lines) + "\n")
    log = (root / "registry.log").open("wb")
    proc = subprocess.Popen(
        ["docker-registry", "serve", str(root / "config.yml")],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                scheme = "https" if tls else "http"
                verify: Any = ssl.create_default_context(cafile=ca_file) if ca_file else True
                httpx.get(f"{scheme}://127.0.0.1:{port}/v2/", timeout=1.0, verify=verify)
                break
            except httpx.HTTPError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        "docker-registry did not start: "
                        + (root / "registry.log").read_text(errors="replace")[-2000:]
                    ) from None
                time.sleep(0.05)
        yield LocalRegistry(f"127.0.0.1:{port}", storage, username, password, ca_file)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        shutil.rmtree(root, ignore_errors=True)


# --- building test images ---------------------------------------------------------------

# A small slice of the base image: a shell, a few tools, the C library and the user
# database (the whole base layer is 230 MB: tens of seconds to push and unpack on a busy
# disk). The agent bundle brings its own libraries, so this is enough for a sandbox.
BASE_SLICE = (
    *("bin", "lib", "lib64", "sbin", "usr", "usr/bin", "usr/lib", "usr/lib64", "usr/sbin"),
    *("usr/lib/x86_64-linux-gnu", "etc", "proc", "sys", "dev", "tmp", "root", "run"),
    *("etc/passwd", "etc/group", "usr/bin/sh", "usr/bin/dash", "usr/bin/bash", "usr/bin/tr"),
    *("usr/bin/readlink", "usr/bin/cat", "usr/bin/sleep", "usr/bin/pwd", "usr/bin/ls"),
    *("usr/bin/env", "usr/bin/echo", "usr/bin/mkdir", "usr/bin/rm"),
    "usr/lib/x86_64-linux-gnu/libc.so.6",
    "usr/lib/x86_64-linux-gnu/libtinfo.so.6",
    "usr/lib/x86_64-linux-gnu/libtinfo.so.6.4",
    "usr/lib/x86_64-linux-gnu/libselinux.so.1",
    "usr/lib/x86_64-linux-gnu/libpcre2-8.so.0",
    "usr/lib/x86_64-linux-gnu/libpcre2-8.so.0.11.2",
    "usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2",
    "usr/lib64/ld-linux-x86-64.so.2",
)


def base_slice_tar(layer: Path) -> bytes:
    """The :data:`BASE_SLICE` of an unpacked base layer as an uncompressed tar."""
    present = [p for p in BASE_SLICE if os.path.lexists(layer / p)]
    proc = subprocess.run(
        ["tar", "-C", str(layer), "--numeric-owner", "--no-recursion", "-cf", "-", *present],
        capture_output=True,
        check=True,
    )
    return proc.stdout


@dataclass
class TarBuilder:
    """Builds a layer tar in memory from explicit members (including malicious ones)."""

    members: list[tuple[tarfile.TarInfo, bytes | None]] = field(default_factory=list)

    def file(self, name: str, data: bytes = b"", mode: int = 0o644, **kw: Any) -> TarBuilder:
        info = tarfile.TarInfo(name)
        info.size, info.mode = len(data), mode
        for k, v in kw.items():
            setattr(info, k, v)
        self.members.append((info, data))
        return self

    def dir(self, name: str, mode: int = 0o755) -> TarBuilder:
        info = tarfile.TarInfo(name)
        info.type, info.mode = tarfile.DIRTYPE, mode
        self.members.append((info, None))
        return self

    def link(self, name: str, target: str, *, hard: bool = False) -> TarBuilder:
        info = tarfile.TarInfo(name)
        info.type = tarfile.LNKTYPE if hard else tarfile.SYMTYPE
        info.linkname = target
        info.mode = 0o777
        self.members.append((info, None))
        return self

    def special(self, name: str, kind: bytes) -> TarBuilder:
        info = tarfile.TarInfo(name)
        info.type = kind
        info.devmajor, info.devminor = 1, 3
        self.members.append((info, None))
        return self

    def build(self) -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
            for info, data in self.members:
                tf.addfile(info, io.BytesIO(data) if data is not None else None)
        return buf.getvalue()


@dataclass(frozen=True, slots=True)
class PushedImage:
    """What :func:`push_image` stored: the top digest and each manifest and blob."""

    digest: str  # the tag's target: the index if any, else the manifest
    manifests: dict[str, str]  # platform -> manifest digest
    layer_digests: tuple[str, ...]
    config_digest: str


def _image_config(diff_ids: Sequence[str], arch: str, config: dict[str, Any]) -> bytes:
    body = {
        "architecture": arch,
        "os": "linux",
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": list(diff_ids)},
    }
    return json.dumps(body, sort_keys=True).encode()


def push_image(
    registry: LocalRegistry,
    name: str,
    layers: Sequence[bytes],
    *,
    config: dict[str, Any] | None = None,
    docker: bool = False,
    compress: bool = True,
    platforms: Sequence[str] = (),
) -> PushedImage:
    """Push an image built from uncompressed layer tars to ``registry`` as ``name``.

    Args:
        name: ``repo:tag`` (the registry host is prepended).
        docker: Docker v2 schema 2 media types instead of OCI.
        compress: gzip the layers (else OCI uncompressed tar layers; OCI only).
        platforms: e.g. ``("linux/amd64", "linux/arm64")`` to push an index; each platform
            gets the same layers plus a one-file layer naming it.
    """
    ref = parse_reference(f"{registry.host}/{name}")
    client = RegistryClient(ref, registry.settings, push=True)
    with client:
        manifests: dict[str, str] = {}
        result: tuple[str, tuple[str, ...], str] = ("", (), "")
        entries = []
        for plat in platforms or ("linux/amd64",):
            arch = plat.split("/")[1]
            plat_layers = list(layers)
            if platforms:
                plat_layers.append(TarBuilder().file("platform", plat.encode()).build())
            mtype, body, digests, cfg_digest = _push_one(
                client, plat_layers, arch, config or {}, docker=docker, compress=compress
            )
            digest = sha256_digest(body)
            if platforms:
                client.put_manifest(digest, mtype, body)
                os_, arch_ = plat.split("/")[:2]
                entries.append(
                    {
                        "mediaType": mtype,
                        "digest": digest,
                        "size": len(body),
                        "platform": {"os": os_, "architecture": arch_},
                    }
                )
            else:
                client.put_manifest(ref.tag, mtype, body)
            manifests[plat] = digest
            result = (digest, digests, cfg_digest)
        if platforms:
            index_type = DOCKER_LIST if docker else OCI_INDEX
            index = json.dumps(
                {"schemaVersion": 2, "mediaType": index_type, "manifests": entries}
            ).encode()
            top = client.put_manifest(ref.tag, index_type, index)
        else:
            top = result[0]
    return PushedImage(top, manifests, result[1], result[2])


def _push_one(
    client: RegistryClient,
    layers: Sequence[bytes],
    arch: str,
    config: dict[str, Any],
    *,
    docker: bool,
    compress: bool,
) -> tuple[str, bytes, tuple[str, ...], str]:
    diff_ids = ["sha256:" + hashlib.sha256(t).hexdigest() for t in layers]
    descs = []
    digests = []
    for tar in layers:
        blob = gzip.compress(tar, compresslevel=1, mtime=0) if compress else tar
        digest = sha256_digest(blob)
        client.upload_blob(digest, blob)
        if docker:
            mtype = "application/vnd.docker.image.rootfs.diff.tar.gzip"
        else:
            mtype = "application/vnd.oci.image.layer.v1.tar" + ("+gzip" if compress else "")
        descs.append({"mediaType": mtype, "digest": digest, "size": len(blob)})
        digests.append(digest)
    cfg = _image_config(diff_ids, arch, config)
    cfg_digest = sha256_digest(cfg)
    client.upload_blob(cfg_digest, cfg)
    mtype = DOCKER_MANIFEST if docker else OCI_MANIFEST
    cfg_type = (
        "application/vnd.docker.container.image.v1+json"
        if docker
        else "application/vnd.oci.image.config.v1+json"
    )
    body = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": mtype,
            "config": {"mediaType": cfg_type, "digest": cfg_digest, "size": len(cfg)},
            "layers": descs,
        }
    ).encode()
    return mtype, body, tuple(digests), cfg_digest
