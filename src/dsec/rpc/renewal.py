"""A member's side of CA rotation: keep ``ca.crt`` and our own certificate current.

Every ``check_s`` seconds (``DSEC_CERT_CHECK_S``, default 30) a component calls
``Ca.Bundle`` on the iam over its existing mTLS channel, reporting which CAs it trusts and
which issued its certificate. It stores the bundle it gets back; when the iam says
``renew`` and our certificate is not from the signing CA, it makes a new key (which never
leaves this machine), sends a CSR (``Ca.Renew``) and stores the certificate. A certificate
due to expire (within ``RENEW_BEFORE``) is renewed the same way outside rotations. The running
servers and channels pick the files up themselves (:mod:`dsec.rpc.reload`).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import os
import socket
from pathlib import Path

import grpc
from cryptography import x509

from dsec.core.errors import DsecError, Unauthenticated, Unavailable
from dsec.obs import log
from dsec.rpc import join, trust
from dsec.rpc._gen import ca_pb2 as pb
from dsec.rpc._gen import ca_pb2_grpc as pb_grpc
from dsec.rpc.errors import translated
from dsec.rpc.tls import RENEW_BEFORE, load_cert, write_atomic

_log = logging.getLogger("dsec.rpc.renewal")
DEFAULT_CHECK_S = 30.0


def check_interval() -> float:
    """Seconds between certificate checks: ``DSEC_CERT_CHECK_S`` or 30."""
    raw = os.environ.get("DSEC_CERT_CHECK_S", "")
    try:
        value = float(raw) if raw else DEFAULT_CHECK_S
    except ValueError:
        value = DEFAULT_CHECK_S
    return min(max(value, 0.2), 3600.0)


def instance_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class CertRenewer:
    """Checks and renews the certificate ``<name>.crt`` in ``pki_dir`` through the iam."""

    def __init__(self, pki_dir: Path, name: str, iam_channel: grpc.aio.Channel) -> None:
        self.pki_dir = pki_dir
        self.name = name
        self._ca = pb_grpc.CaStub(iam_channel)
        self._instance = instance_name()
        self.renewals = 0

    async def check(self) -> bool:
        """One check; returns whether anything on disk changed.

        Raises:
            Unauthenticated: the cluster no longer accepts our certificate (its CA was
                dropped by a finished rotation): this node has to join again.
        """
        view = await asyncio.to_thread(trust.local_view, self.pki_dir, self.name)
        req = pb.CaBundleRequest(
            instance=self._instance, trusted=list(view.trusted), serving_issuer=view.leaf_issuer
        )
        try:
            async with translated("iam"):
                reply = await self._ca.Bundle(req, timeout=10)
        except Unavailable as exc:
            if any(w in exc.message.lower() for w in ("handshake", "ssl", "socket closed")):
                raise Unauthenticated(
                    "the cluster refused our certificate (its CA was rotated out?): join again "
                    f"with a new bootstrap token ({exc.message})"
                ) from exc
            raise
        changed = await asyncio.to_thread(self._store_bundle, reply.bundle_pem)
        if reply.renew and (view.leaf_issuer != reply.signing or self._expiring()):
            await self._renew(reply.signing)
            changed = True
        return changed

    def _expiring(self) -> bool:
        cert = load_cert(self.pki_dir / f"{self.name}.crt")
        now = dt.datetime.now(dt.UTC)
        return cert is None or cert.not_valid_after_utc - now < RENEW_BEFORE

    def _store_bundle(self, bundle: bytes) -> bool:
        path = self.pki_dir / "ca.crt"
        if not x509.load_pem_x509_certificates(bundle):
            raise Unavailable("the iam sent an empty trust bundle")
        if path.read_bytes() == bundle:
            return False
        write_atomic(path, bundle, 0o644)
        log(_log, "trust bundle updated", name=self.name, cas=bundle.count(b"BEGIN CERTIFICATE"))
        return True

    async def _renew(self, signing: str) -> None:
        key_pem, csr_pem = await asyncio.to_thread(join.new_csr, self.name)
        async with translated("iam"):
            reply = await self._ca.Renew(pb.CaRenewRequest(csr_pem=csr_pem), timeout=10)
        cas = x509.load_pem_x509_certificates(reply.bundle_pem)
        if trust.issuer_fingerprint(reply.cert_pem, cas) != signing:
            raise Unauthenticated("the renewed certificate is not issued by the signing CA")
        await asyncio.to_thread(self._store_leaf, key_pem, reply.cert_pem)
        self.renewals += 1
        log(_log, "certificate renewed", name=self.name, ca=signing[:16])

    def _store_leaf(self, key_pem: bytes, cert_pem: bytes) -> None:
        # Readers accept the pair only once key and certificate match (dsec.rpc.reload).
        write_atomic(self.pki_dir / f"{self.name}.key", key_pem, 0o600)
        write_atomic(self.pki_dir / f"{self.name}.crt", cert_pem, 0o644)


async def run_renewer(renewer: CertRenewer, stop: asyncio.Event, every_s: float) -> None:
    """Check every ``every_s`` until ``stop``; failures are logged, never fatal."""
    while not stop.is_set():
        try:
            await renewer.check()
        except DsecError as exc:
            level = logging.ERROR if isinstance(exc, Unauthenticated) else logging.WARNING
            log(_log, "certificate check failed", level, name=renewer.name, error=exc.message)
        except Exception:
            _log.exception("certificate check failed")
        try:
            await asyncio.wait_for(stop.wait(), every_s)
        except TimeoutError:
            pass


async def renew_forever(pki_dir: Path, name: str, iam_address: str, stop: asyncio.Event) -> None:
    """Run a :class:`CertRenewer` for ``name`` against the iam at ``iam_address`` until ``stop``."""
    from dsec.rpc.client import secure_channel
    from dsec.rpc.tls import Identity

    channel = secure_channel(pki_dir, name, iam_address, server=Identity.singleton("iam"))
    try:
        await run_renewer(CertRenewer(pki_dir, name, channel), stop, check_interval())
    finally:
        await channel.close()
