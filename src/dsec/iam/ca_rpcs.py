"""The ``Ca`` service on the iam: CA rotation driven from the component that holds the CA key.

Phases of a rotation (``CaStatus.phase``)::

    idle          one CA
    distributing  `dsec ca rotate` made a new CA; components fetch the two-CA bundle with
                  their next Bundle call and report that they trust it
    reissuing     every live component has trusted the new CA for SETTLE_S: Bundle answers
                  renew=true and each component renews its own certificate (Renew); the iam
                  re-issues its own leaves (iam, admin) itself
    ready         every live component presents and serves a new-CA certificate:
                  `dsec ca rotate --finish` may drop the old CA

A component is live while it calls Bundle at least every few check intervals. What a
component presents is read from its TLS connection, not taken from its word. The view is
in memory: after an iam restart it is rebuilt within one check interval.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeAlias

import grpc
from cryptography import x509

from dsec.core.errors import InvalidArgument, InvalidState, Unauthenticated
from dsec.obs import Metrics, log
from dsec.rpc import join, trust
from dsec.rpc._gen import ca_pb2 as pb
from dsec.rpc._gen import ca_pb2_grpc as pb_grpc
from dsec.rpc.server import peer_identity
from dsec.rpc.tls import Identity

_log = logging.getLogger("dsec.iam.ca")
_Ctx: TypeAlias = grpc.aio.ServicerContext[Any, Any]

MEMBERS = {"apiserver", "watcher", "edge", "admin"}
CA_ALLOWED_ROLES = {
    "dsec.v1.Ca": {"admin"},
    "/dsec.v1.Ca/Bundle": MEMBERS,
    "/dsec.v1.Ca/Renew": MEMBERS,
}
SETTLE_S = 3.0  # > 2 x dsec.rpc.reload.CHECK_EVERY_S: reloads have happened everywhere
_OWN = (Identity.singleton("iam"), Identity.singleton("admin"))
_STANDARD_SANS = {"localhost", "127.0.0.1", "::1"}


@dataclass
class Seen:
    """One process as last reported."""

    identity: str
    instance: str
    presented: str = ""
    serving: str = ""
    trusted: tuple[str, ...] = ()
    last_seen: float = 0.0
    trusts_since: dict[str, float] = field(default_factory=dict)  # CA -> first reported at


def extra_sans(cert: x509.Certificate, ident: Identity) -> tuple[str, ...]:
    """The SANs of ``cert`` beyond those every leaf of ``ident`` carries (kept on renewal)."""
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return ()
    names = [*sans.get_values_for_type(x509.DNSName)]
    names += [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)]
    return tuple(n for n in names if n not in _STANDARD_SANS and n != ident.dns_name)


class CaService(pb_grpc.CaServicer):
    """Drives rotations of the CA in ``pki_dir``; components are expected every ``check_s``."""

    def __init__(self, pki_dir: Path, metrics: Metrics, check_s: float) -> None:
        self._pki = pki_dir
        self._metrics = metrics
        self._live_s = 3 * check_s + 5
        self._seen: dict[tuple[str, str], Seen] = {}
        self._rotated_at = time.time()

    # -- members --------------------------------------------------------------------------

    async def Bundle(self, request: pb.CaBundleRequest, context: _Ctx) -> pb.CaBundle:
        state = await asyncio.to_thread(trust.ca_state, self._pki)
        peer = peer_identity(context)
        now = time.time()
        if peer.role != "admin":
            key = (peer.spiffe_id, request.instance[:128])
            seen = self._seen.setdefault(key, Seen(*key))
            seen.presented = trust.issuer_fingerprint(_peer_pem(context), state.trusted)
            seen.serving = request.serving_issuer
            seen.trusted = tuple(request.trusted)
            seen.last_seen = now
            seen.trusts_since = {ca: seen.trusts_since.get(ca, now) for ca in seen.trusted}
            self._forget(now)
        renew = self._renew_allowed(state, now)
        if renew and state.rotating:
            await self._reissue_own()
        return pb.CaBundle(bundle_pem=state.bundle, signing=state.signing_fingerprint, renew=renew)

    async def Renew(self, request: pb.CaRenewRequest, context: _Ctx) -> pb.CaRenewReply:
        peer = peer_identity(context)
        try:
            current = x509.load_pem_x509_certificate(_peer_pem(context))
        except ValueError:
            raise Unauthenticated("no readable peer certificate to renew") from None
        ident = Identity(peer.role, peer.name, extra_sans(current, peer))
        try:
            cert, _ = await asyncio.to_thread(join.sign_csr, self._pki, request.csr_pem, ident)
        except InvalidArgument:
            self._metrics.inc("cert_renewals", result="invalid")
            raise
        state = await asyncio.to_thread(trust.ca_state, self._pki)
        self._metrics.inc("cert_renewals", result="ok")
        log(_log, "certificate renewed", identity=peer.spiffe_id, ca=state.signing_fingerprint[:16])
        return pb.CaRenewReply(cert_pem=cert, bundle_pem=state.bundle)

    # -- admins ---------------------------------------------------------------------------

    async def Rotate(self, request: pb.CaRotateRequest, context: _Ctx) -> pb.CaStatus:
        state = await asyncio.to_thread(trust.begin_rotation, self._pki)
        self._rotated_at = time.time()
        self._metrics.inc("ca_rotations", step="begin")
        log(_log, "CA rotation started", signing=state.signing_fingerprint[:16],
            old=[f[:16] for f in state.old_fingerprints])  # fmt: skip
        return await self._status(["a new CA signs from now on; components are moving to it"])

    async def Finish(self, request: pb.CaFinishRequest, context: _Ctx) -> pb.CaStatus:
        state = await asyncio.to_thread(trust.ca_state, self._pki)
        if not state.rotating:
            raise InvalidState("no CA rotation is in progress: run `dsec ca rotate` first")
        now = time.time()
        behind = [s for s in self._live(now) if not self._on(s, state.signing_fingerprint)]
        own = await asyncio.to_thread(trust.local_view, self._pki, "iam")
        if own.leaf_issuer != state.signing_fingerprint:
            behind.append(Seen("spiffe://dsec/iam/iam", "this iam"))
        if behind and not request.force:
            names = ", ".join(f"{s.identity} ({s.instance})" for s in behind)
            raise InvalidState(
                f"{len(behind)} component(s) still use the old CA: {names}; wait for them "
                "(dsec ca status) or finish with --force (they will have to re-join)"
            )
        gone = [s for s in self._seen.values() if s not in self._live(now)]
        await self._reissue_own()
        await asyncio.to_thread(trust.finish_rotation, self._pki)
        self._metrics.inc("ca_rotations", step="finish")
        log(_log, "CA rotation finished", signing=state.signing_fingerprint[:16],
            forced=bool(behind), dropped=[f[:16] for f in state.old_fingerprints])  # fmt: skip
        notes = ["the old CA is no longer trusted; its certificates are refused"]
        notes += [f"{s.identity} ({s.instance}) was not seen recently: it must re-join"
                  for s in gone if not self._on(s, state.signing_fingerprint)]  # fmt: skip
        return await self._status(notes)

    async def Status(self, request: pb.CaStatusRequest, context: _Ctx) -> pb.CaStatus:
        return await self._status([])

    # -- the view -------------------------------------------------------------------------

    def _live(self, now: float) -> list[Seen]:
        return [s for s in self._seen.values() if now - s.last_seen <= self._live_s]

    def _forget(self, now: float) -> None:
        for key in [k for k, s in self._seen.items() if now - s.last_seen > 10 * self._live_s]:
            del self._seen[key]

    @staticmethod
    def _on(seen: Seen, signing: str) -> bool:
        return seen.presented == signing and seen.serving == signing

    def _renew_allowed(self, state: trust.CaState, now: float) -> bool:
        if not state.rotating:
            return True  # nothing to wait for: anyone not on the signing CA renews
        ca = state.signing_fingerprint
        return now - self._rotated_at >= SETTLE_S and all(
            now - s.trusts_since.get(ca, now) >= SETTLE_S for s in self._live(now)
        )

    async def _reissue_own(self) -> None:
        renewed = await asyncio.to_thread(trust.reissue_local, self._pki, _OWN)
        if renewed:
            log(_log, "re-issued own certificates", names=renewed)

    async def _status(self, notes: list[str]) -> pb.CaStatus:
        state = await asyncio.to_thread(trust.ca_state, self._pki)
        now = time.time()
        ca = state.signing_fingerprint
        live = self._live(now)
        comps = [
            pb.CaComponent(
                identity=s.identity, instance=s.instance, presented_issuer=s.presented,
                serving_issuer=s.serving, trusts_signing=ca in s.trusted, last_seen=s.last_seen,
                live=s in live, on_signing=self._on(s, ca),
            )
            for s in sorted(self._seen.values(), key=lambda s: (s.identity, s.instance))
        ]  # fmt: skip
        own = await asyncio.to_thread(trust.local_view, self._pki, "iam")
        me = pb.CaComponent(
            identity="spiffe://dsec/iam/iam", instance="this iam", presented_issuer=own.leaf_issuer,
            serving_issuer=own.leaf_issuer, trusts_signing=ca in own.trusted, last_seen=now,
            live=True, on_signing=own.leaf_issuer == ca,
        )  # fmt: skip
        comps.insert(0, me)
        if not state.rotating:
            phase = "idle"
        elif me.on_signing and all(self._on(s, ca) for s in live):
            phase = "ready"
        elif self._renew_allowed(state, now):
            phase = "reissuing"
        else:
            phase = "distributing"
        return pb.CaStatus(
            phase=phase, signing=ca, old=state.old_fingerprints, components=comps,
            rotated_at=self._rotated_at if state.rotating else 0.0, message=notes,
        )  # fmt: skip


def _peer_pem(context: _Ctx) -> bytes:
    return next(iter(context.auth_context().get("x509_pem_cert", ())), b"")
