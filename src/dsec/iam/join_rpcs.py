"""Joining nodes: ``Iam.CreateJoinToken`` (admins, through the apiserver) and the ``Join``
service a new node calls on the iam's join address (see :mod:`dsec.rpc.join`)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any, TypeAlias

import grpc

from dsec.core.errors import DsecError, InvalidArgument
from dsec.iam.audit_rpcs import actor_of
from dsec.iam.state import IamState
from dsec.obs import Metrics, log
from dsec.rpc import join, trust
from dsec.rpc._gen import dsec_pb2 as pb
from dsec.rpc._gen import dsec_pb2_grpc as pb_grpc
from dsec.rpc.errors import status_for, trailers_for
from dsec.rpc.reload import PkiFiles, dynamic_credentials
from dsec.rpc.tls import Identity

_log = logging.getLogger("dsec.iam")
_Ctx: TypeAlias = grpc.aio.ServicerContext[Any, Any]


class JoinTokenRpcs:
    """``CreateJoinToken``, mixed into :class:`dsec.iam.service.IamService`."""

    _state: IamState
    pki_dir: Path | None

    async def CreateJoinToken(
        self, request: pb.CreateJoinTokenRequest, context: _Ctx
    ) -> pb.JoinToken:
        ttl = request.ttl_s or join.DEFAULT_TTL_S
        if not 1 <= ttl <= join.MAX_TTL_S:
            raise InvalidArgument(f"ttl_s must be between 1 and {join.MAX_TTL_S}")
        if self.pki_dir is None:
            raise InvalidArgument("this iam has no CA to sign joining nodes with")
        fingerprint = join.ca_fingerprint((self.pki_dir / "ca.crt").read_bytes())
        token_id, secret = join.new_token_parts()
        actor, rid = actor_of(context)
        expires = await self._state.create_join_token(
            token_id, secret, ttl, actor=actor, request_id=rid
        )
        log(_log, "bootstrap token created", token_id=token_id, expires_at=expires)
        return pb.JoinToken(
            token=join.format_token(token_id, secret, fingerprint),
            token_id=token_id,
            expires_at=expires,
        )


class JoinService(pb_grpc.JoinServicer):
    """Redeems bootstrap tokens for edge certificates signed by the CA in ``pki_dir``."""

    def __init__(self, state: IamState, pki_dir: Path, metrics: Metrics) -> None:
        self._state = state
        self._pki = pki_dir
        self._metrics = metrics

    async def Join(self, request: pb.JoinRequest, context: _Ctx) -> pb.JoinReply:
        try:
            ident = Identity.edge(request.edge_id, tuple(request.sans))
            await self._state.redeem_join_token(request.token_id, request.secret, ident.name)
            cert, _ = await asyncio.to_thread(join.sign_csr, self._pki, request.csr_pem, ident)
            ca = (await asyncio.to_thread(trust.ca_state, self._pki)).bundle  # 2 CAs mid-rotation
        except DsecError as exc:
            self._metrics.inc("joins", result=exc.code)
            log(_log, "join refused", logging.WARNING, edge_id=request.edge_id, error=exc.message)
            context.set_trailing_metadata(trailers_for(exc))
            await context.abort(status_for(exc), exc.message)
        self._metrics.inc("joins", result="ok")
        log(_log, "edge joined", edge_id=ident.name, sans=list(request.sans))
        return pb.JoinReply(cert_pem=cert, ca_pem=ca)


def join_server(pki_dir: Path, listen: str, service: JoinService) -> tuple[grpc.aio.Server, int]:
    """A server-authenticated TLS server for ``Join`` only (chain: iam leaf + CA bundle).

    The chain is re-read when the files change (a CA rotation), so tokens naming the new CA
    find it in the chain."""
    files = PkiFiles(pki_dir, "iam")

    def config() -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration([(files.key, files.cert + files.ca)])

    server = grpc.aio.server()
    creds = dynamic_credentials(
        config(), lambda: config() if files.changed() else None, client_auth=False
    )
    port = server.add_secure_port(listen, creds)
    pb_grpc.add_JoinServicer_to_server(service, server)
    return server, port
