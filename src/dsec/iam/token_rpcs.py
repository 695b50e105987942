"""Access-token RPCs of the iam (a mixin of :class:`dsec.iam.service.IamService`):
exchange an API key for a signed token, publish the verification keys, revoke, and serve
the revocation feed apiservers follow."""

from __future__ import annotations

import secrets
import time
from typing import Any, TypeAlias

import grpc
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dsec.core import tokens
from dsec.core.errors import InvalidArgument
from dsec.iam.audit_rpcs import actor_of
from dsec.iam.signing import raw_public
from dsec.iam.state import IamState
from dsec.rpc._gen import dsec_pb2 as pb

_Ctx: TypeAlias = grpc.aio.ServicerContext[Any, Any]


class TokenRpcs:
    _state: IamState
    _signing: tuple[str, Ed25519PrivateKey]

    async def IssueToken(self, request: pb.IssueTokenRequest, context: _Ctx) -> pb.TokenReply:
        ttl = request.ttl_s or tokens.DEFAULT_TTL_S
        if not 1 <= ttl <= tokens.MAX_TTL_S:
            raise InvalidArgument(f"ttl_s must be between 1 and {tokens.MAX_TTL_S}")
        p = await self._state.authenticate(request.api_key)
        now = time.time()
        claims = tokens.Claims(
            subject=p.subject, project=p.project, role=p.role, key_id=p.key_id,
            token_id=secrets.token_hex(12), issued_at=now, expires_at=now + ttl,
        )  # fmt: skip
        kid, key = self._signing
        return pb.TokenReply(
            token=tokens.issue(claims, key, kid), token_id=claims.token_id,
            expires_at=claims.expires_at,
        )  # fmt: skip

    async def TokenKeys(self, request: pb.Empty, context: _Ctx) -> pb.TokenKeyList:
        kid, key = self._signing
        return pb.TokenKeyList(keys=[pb.TokenKey(kid=kid, public_key=raw_public(key.public_key()))])

    async def Revoke(self, request: pb.RevokeRequest, context: _Ctx) -> pb.Empty:
        actor, rid = actor_of(context)
        await self._state.revoke(request.kind, request.value, actor=actor, request_id=rid)
        return pb.Empty()

    async def Revocations(self, request: pb.RevocationsRequest, context: _Ctx) -> pb.RevocationList:
        rows = await self._state.revocations_after(request.after_seq)
        return pb.RevocationList(
            entries=[pb.Revocation(seq=s, kind=k, value=v, at=a) for s, k, v, a in rows]
        )
