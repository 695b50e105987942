"""``dsec edge join``: turn this machine into an edge of a cluster with a bootstrap token.

See :mod:`dsec.rpc.join` for the exchange. On success ``<home>/pki`` holds the cluster CA
and this edge's key (made here, never sent) and certificate, and ``<home>/edge.id`` its id;
then ``python -m dsec.edge --home <home> --iam ... --watcher ...`` runs it.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence
from pathlib import Path

import grpc
from cryptography import x509

from dsec.core.errors import InvalidArgument
from dsec.rpc import join, trust
from dsec.rpc._gen import dsec_pb2 as pb
from dsec.rpc._gen import dsec_pb2_grpc as pb_grpc
from dsec.rpc.errors import translated
from dsec.rpc.tls import Identity, ensure_edge_id, write_leaf

IAM_NAME = Identity.singleton("iam").dns_name  # the name the iam's certificate must carry


async def join_cluster(
    home: Path, token: str, cluster: str, *, sans: Sequence[str] = (), edge_id: str = ""
) -> str:
    """Join the cluster whose iam serves joins at ``cluster``; returns this edge's id.

    Raises:
        InvalidArgument: a malformed token.
        Unauthenticated: the token is invalid, expired or used, or the server is not the
            cluster the token names.
        AlreadyExists: another edge joined with this id.
        Unavailable: the cluster cannot be reached.
    """
    token_id, secret, fingerprint = join.parse_token(token)
    if (home / "pki" / "ca.crt").exists():
        raise InvalidArgument(f"{home} already has a PKI: join with a fresh --home")
    ca_pem = await asyncio.to_thread(join.fetch_ca, cluster, fingerprint)
    edge_id = edge_id or await asyncio.to_thread(ensure_edge_id, home)
    Identity.edge(edge_id, tuple(sans))  # validates the id and the SANs before any call
    key_pem, csr_pem = await asyncio.to_thread(join.new_csr, edge_id)
    creds = grpc.ssl_channel_credentials(root_certificates=ca_pem)
    options = [("grpc.ssl_target_name_override", IAM_NAME)]
    async with grpc.aio.secure_channel(cluster, creds, options=options) as ch:
        req = pb.JoinRequest(
            token_id=token_id, secret=secret, edge_id=edge_id, csr_pem=csr_pem, sans=list(sans)
        )
        async with translated("iam"):
            reply = await pb_grpc.JoinStub(ch).Join(req, timeout=30)
    bundle = x509.load_pem_x509_certificates(reply.ca_pem)  # two CAs during a CA rotation
    if fingerprint not in [trust.fingerprint(c) for c in bundle]:
        raise InvalidArgument("the iam answered with a different CA than the token names")
    join.verify_chain(reply.cert_pem, ca_pem)
    await asyncio.to_thread(
        write_leaf, home / "pki", edge_id, key_pem, reply.cert_pem, reply.ca_pem
    )
    return edge_id


def main(argv: list[str]) -> int:
    """``python -m dsec.edge join --bootstrap-token T --cluster ADDR [--home H]``."""
    from dsec.core.errors import DsecError
    from dsec.paths import Paths

    ap = argparse.ArgumentParser(prog="dsec-edge join")
    ap.add_argument("--bootstrap-token", required=True)
    ap.add_argument("--cluster", required=True, help="the iam's join address HOST:PORT")
    ap.add_argument("--home", type=Path, default=None)
    ap.add_argument("--edge-id", default="")
    ap.add_argument("--san", action="append", default=[], help="address others dial us on")
    args = ap.parse_args(argv)
    home = Paths.from_env(args.home).home
    try:
        edge_id = asyncio.run(
            join_cluster(home, args.bootstrap_token, args.cluster, sans=args.san,
                         edge_id=args.edge_id)
        )  # fmt: skip
    except DsecError as exc:
        print(f"dsec edge join: {exc.message}")
        return 2
    print(f"joined as edge {edge_id}; certificate in {home / 'pki'}")
    return 0
