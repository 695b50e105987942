"""Certificates that change under a running daemon: servers and channels reload them.

A CA rotation (:mod:`dsec.rpc.trust`) rewrites ``ca.crt`` and every leaf while the cluster
serves. Nothing restarts:

* **servers** use ``grpc.dynamic_ssl_server_credentials``: gRPC asks :class:`ServerPki` for
  the certificate configuration at every new TLS handshake, and it answers with the files'
  current contents when they changed (checked by ``stat``, at most once a second). Calls on a
  connection made before the change are checked again per call (:meth:`ServerPki.accepts`),
  so a client whose CA left the bundle is refused on its old connection too.
* **clients** get a :class:`ReloadingChannel`: a ``grpc.aio.Channel`` whose multicallables
  look up the current inner channel at every call. When the files change it opens a new inner
  channel with the new credentials; the old one finishes its calls and is closed after
  ``OLD_CHANNEL_GRACE_S``. Stubs made once keep working.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from dsec.core.errors import Unavailable
from dsec.obs import log
from dsec.rpc.tls import load_bundle, read_pki
from dsec.rpc.trust import issuer_of

_log = logging.getLogger("dsec.rpc.reload")
CHECK_EVERY_S = 1.0
OLD_CHANNEL_GRACE_S = 60.0  # then calls still running on the old channel get 10 more minutes


class PkiFiles:
    """``ca.crt``, ``<name>.key`` and ``<name>.crt`` of one identity, re-read when changed."""

    def __init__(self, pki_dir: Path, name: str) -> None:
        self.pki_dir = pki_dir
        self.name = name
        self._paths = (pki_dir / "ca.crt", pki_dir / f"{name}.key", pki_dir / f"{name}.crt")
        self._checked = 0.0
        self._stamp = self._stat()
        self.ca, self.key, self.cert = read_pki(pki_dir, name)

    def _stat(self) -> tuple[int, ...]:
        out: list[int] = []
        for p in self._paths:
            try:
                st = p.stat()
            except OSError:
                return ()
            out += [st.st_mtime_ns, st.st_ino, st.st_size]
        return tuple(out)

    def changed(self) -> bool:
        """Re-read the files if they changed since last time (checked once a second)."""
        now = time.monotonic()
        if now - self._checked < CHECK_EVERY_S:
            return False
        self._checked = now
        stamp = self._stat()
        if not stamp or stamp == self._stamp:
            return False
        try:
            ca, key, cert = read_pki(self.pki_dir, self.name)
        except Unavailable:
            return False
        if not _usable(ca, key, cert):  # half-written (key before cert): retry next time
            self._checked = 0.0
            return False
        if (ca, key, cert) == (self.ca, self.key, self.cert):
            self._stamp = stamp
            return False
        self._stamp, self.ca, self.key, self.cert = stamp, ca, key, cert
        return True


Fetcher = Callable[[], grpc.ServerCertificateConfiguration | None]


def dynamic_credentials(
    initial: grpc.ServerCertificateConfiguration, fetch: Fetcher, *, client_auth: bool
) -> grpc.ServerCredentials:
    """Server credentials gRPC refreshes by calling ``fetch`` at each handshake (None: same)."""
    fetcher = cast(Callable[[], grpc.ServerCertificateConfiguration], fetch)  # stub lacks None
    return grpc.dynamic_ssl_server_credentials(
        initial, fetcher, require_client_authentication=client_auth
    )


def _usable(ca: bytes, key_pem: bytes, cert_pem: bytes) -> bool:
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
        cert = x509.load_pem_x509_certificate(cert_pem)
        cas = x509.load_pem_x509_certificates(ca)
    except (ValueError, TypeError):
        return False
    fmt, enc = serialization.PublicFormat.SubjectPublicKeyInfo, serialization.Encoding.DER
    return bool(cas) and cert.public_key().public_bytes(enc, fmt) == key.public_key().public_bytes(
        enc, fmt
    )


class ServerPki:
    """Dynamic server credentials for identity ``name``, plus the per-call trust check."""

    def __init__(self, pki_dir: Path, name: str) -> None:
        self.files = PkiFiles(pki_dir, name)
        self._lock = threading.Lock()  # gRPC calls the fetcher on its own threads
        self._cas = load_bundle(pki_dir / "ca.crt")
        self._verdicts: dict[bytes, bool] = {}
        self._generation = 0  # bumped at each reload
        self._served = 0  # the generation gRPC was last given

    def credentials(self) -> grpc.ServerCredentials:
        return dynamic_credentials(self._config(), self._fetch, client_auth=True)

    def _config(self) -> grpc.ServerCertificateConfiguration:
        f = self.files
        return grpc.ssl_server_certificate_configuration([(f.key, f.cert)], root_certificates=f.ca)

    def _refresh(self) -> None:
        with self._lock:
            if self.files.changed():
                self._cas = load_bundle(self.files.pki_dir / "ca.crt")
                self._verdicts = {}
                self._generation += 1
                log(_log, "server certificate reloaded", name=self.files.name, cas=len(self._cas))

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC's fetcher: a new configuration if the files changed since it last got one."""
        self._refresh()
        with self._lock:
            if self._served == self._generation:
                return None
            self._served = self._generation
            return self._config()

    def accepts(self, peer_pem: bytes) -> bool:
        """Whether a CA of the current bundle issued ``peer_pem`` (cached per certificate)."""
        self._refresh()  # a rotation with no new connection must still be noticed
        verdicts = self._verdicts
        verdict = verdicts.get(peer_pem)
        if verdict is None:
            try:
                cert = x509.load_pem_x509_certificate(peer_pem)
            except ValueError:
                return False
            verdict = issuer_of(cert, self._cas) is not None
            if len(verdicts) > 4096:
                verdicts.clear()
            verdicts[peer_pem] = verdict
        return verdict


class _Call:
    """A multicallable that dispatches to the current inner channel of a ReloadingChannel."""

    def __init__(self, owner: ReloadingChannel, kind: str, args: tuple[Any, ...], kw: Any) -> None:
        self._owner = owner
        self._kind = kind
        self._args = args
        self._kw = kw
        self._inner: grpc.aio.Channel | None = None
        self._call: Any = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        inner = self._owner.current()
        if inner is not self._inner:
            self._call = getattr(inner, self._kind)(*self._args, **self._kw)
            self._inner = inner
        return self._call(*args, **kwargs)


class ReloadingChannel(grpc.aio.Channel):
    """An mTLS channel that moves to new certificates when the PKI files change."""

    def __init__(self, files: PkiFiles, make: Callable[[PkiFiles], grpc.aio.Channel]) -> None:
        self._files = files
        self._make = make
        self._inner = make(files)
        self._old: dict[grpc.aio.Channel, asyncio.Task[None]] = {}

    def current(self) -> grpc.aio.Channel:
        if self._files.changed():
            old, self._inner = self._inner, self._make(self._files)
            log(_log, "client certificate reloaded", name=self._files.name)
            self._old[old] = asyncio.ensure_future(self._retire(old))
        return self._inner

    async def _retire(self, old: grpc.aio.Channel) -> None:
        await asyncio.sleep(OLD_CHANNEL_GRACE_S)
        self._old.pop(old, None)
        await old.close(grace=600.0)

    async def close(self, grace: float | None = None) -> None:
        for old, task in list(self._old.items()):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await old.close(grace)
        self._old.clear()
        await self._inner.close(grace)

    async def __aenter__(self) -> ReloadingChannel:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close(None)

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        return self.current().get_state(try_to_connect)

    async def wait_for_state_change(self, last_observed_state: grpc.ChannelConnectivity) -> None:
        await self.current().wait_for_state_change(last_observed_state)

    async def channel_ready(self) -> None:
        await self.current().channel_ready()

    def unary_unary(self, *args: Any, **kwargs: Any) -> Any:
        return _Call(self, "unary_unary", args, kwargs)

    def unary_stream(self, *args: Any, **kwargs: Any) -> Any:
        return _Call(self, "unary_stream", args, kwargs)

    def stream_unary(self, *args: Any, **kwargs: Any) -> Any:
        return _Call(self, "stream_unary", args, kwargs)

    def stream_stream(self, *args: Any, **kwargs: Any) -> Any:
        return _Call(self, "stream_stream", args, kwargs)
