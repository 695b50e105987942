"""Real etcd members on loopback for tests and benchmarks: one, or a TLS cluster.

Each member is an ``etcd`` process (Debian's ``etcd-server``) on random loopback ports with a
temp data dir, ended by its PID. With ``tls=True`` a throwaway CA signs one certificate per
member (serverAuth + clientAuth: etcd 3.4 dials itself with it) and one for the client, and
both client and peer connections require certificates.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import ipaddress
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from dsec.core.errors import Unavailable
from dsec.store._gen import etcd_v3_subset_pb2 as pb
from dsec.store._gen import etcd_v3_subset_pb2_grpc as pbg
from dsec.store.etcd import EtcdTls
from dsec.testing.ports import free_port

START_TIMEOUT_S = 20.0


def etcd_binary() -> str | None:
    return shutil.which("etcd")


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


@dataclass(frozen=True)
class TestPki:
    """PEM files of a throwaway CA, a member certificate and a client certificate."""

    ca: Path
    member_cert: Path
    member_key: Path
    client_cert: Path
    client_key: Path

    def client_tls(self) -> EtcdTls:
        return EtcdTls(
            self.ca.read_bytes(), self.client_cert.read_bytes(), self.client_key.read_bytes()
        )


def make_test_pki(out: Path) -> TestPki:
    out.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "dsec test etcd CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )

    def leaf(name: str) -> tuple[bytes, bytes]:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(
                x509.SubjectAlternativeName(
                    [
                        x509.DNSName("localhost"),
                        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                    ]
                ),
                critical=False,
            )
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .sign(ca_key, hashes.SHA256())
        )
        return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)

    pki = TestPki(
        out / "ca.pem",
        out / "member.pem",
        out / "member-key.pem",
        out / "client.pem",
        out / "client-key.pem",
    )
    pki.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    for cert_path, key_path, name in (
        (pki.member_cert, pki.member_key, "etcd-member"),
        (pki.client_cert, pki.client_key, "dsec-client"),
    ):
        cert, key = leaf(name)
        cert_path.write_bytes(cert)
        key_path.write_bytes(key)
        key_path.chmod(0o600)
    return pki


@dataclass
class Member:
    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"


@dataclass
class EtcdCluster:
    root: Path
    members: list[Member]
    pki: TestPki | None
    _argv: dict[str, list[str]] = field(default_factory=dict)

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    def client_tls(self) -> EtcdTls | None:
        return self.pki.client_tls() if self.pki else None

    def start(self, member: Member) -> None:
        log = (self.root / f"{member.name}.log").open("ab")
        with log:
            member.proc = subprocess.Popen(
                self._argv[member.name], stdout=log, stderr=subprocess.STDOUT, close_fds=True
            )

    def kill(self, member: Member) -> None:
        """SIGKILL one member (by its PID) and reap it."""
        proc, member.proc = member.proc, None
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        if proc is not None:
            proc.wait(timeout=10)

    def stop(self) -> None:
        for m in self.members:
            self.kill(m)

    def _status(self, member: Member) -> pb.StatusResponse | None:
        target = member.endpoint
        if self.pki is not None:
            tls = self.pki.client_tls()
            creds = grpc.ssl_channel_credentials(tls.ca, tls.key, tls.cert)
            channel = grpc.secure_channel(target, creds)
        else:
            channel = grpc.insecure_channel(target)
        with channel:
            try:
                resp: pb.StatusResponse = pbg.MaintenanceStub(channel).Status(
                    pb.StatusRequest(), timeout=1.0
                )
                return resp
            except grpc.RpcError:
                return None

    def leader(self) -> Member | None:
        for m in self.members:
            if m.proc is None:
                continue
            st = self._status(m)
            if st is not None and st.leader and st.leader == st.header.member_id:
                return m
        return None

    def wait_leader(self, timeout_s: float = START_TIMEOUT_S) -> Member:
        give_up = time.monotonic() + timeout_s
        while time.monotonic() < give_up:
            for m in self.members:
                if m.proc is not None and m.proc.poll() is not None:
                    log = (self.root / f"{m.name}.log").read_text(errors="replace")[-2000:]
                    raise Unavailable(f"etcd member {m.name} exited: {log}")
            got = self.leader()
            if got is not None:
                return got
            time.sleep(0.1)
        raise Unavailable(f"no etcd leader within {timeout_s} s")


@contextlib.contextmanager
def etcd_cluster(root: Path, *, size: int = 1, tls: bool = False) -> Iterator[EtcdCluster]:
    """Start ``size`` etcd members under ``root``; yields once a leader is elected."""
    binary = etcd_binary()
    if binary is None:
        raise Unavailable("no etcd binary on PATH (apt-get install etcd-server)")
    root.mkdir(parents=True, exist_ok=True)
    pki = make_test_pki(root / "pki") if tls else None
    scheme = "https" if tls else "http"
    members = [Member(f"m{i}", free_port(), free_port(), root / f"m{i}.data") for i in range(size)]
    initial = ",".join(f"{m.name}={scheme}://127.0.0.1:{m.peer_port}" for m in members)
    cluster = EtcdCluster(root, members, pki)
    for m in members:
        client_url = f"{scheme}://127.0.0.1:{m.client_port}"
        peer_url = f"{scheme}://127.0.0.1:{m.peer_port}"
        argv = [
            binary,
            f"--name={m.name}",
            f"--data-dir={m.data_dir}",
            f"--listen-client-urls={client_url}",
            f"--advertise-client-urls={client_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster={initial}",
            "--initial-cluster-state=new",
            f"--initial-cluster-token=dsec-test-{os.getpid()}-{members[0].client_port}",
            "--heartbeat-interval=50",
            "--election-timeout=500",
            "--logger=zap",
            "--log-level=warn",
        ]
        if pki is not None:
            argv += [
                f"--cert-file={pki.member_cert}",
                f"--key-file={pki.member_key}",
                f"--trusted-ca-file={pki.ca}",
                "--client-cert-auth",
                f"--peer-cert-file={pki.member_cert}",
                f"--peer-key-file={pki.member_key}",
                f"--peer-trusted-ca-file={pki.ca}",
                "--peer-client-cert-auth",
            ]
        cluster._argv[m.name] = argv
    try:
        for m in members:
            cluster.start(m)
        cluster.wait_leader()
        yield cluster
    finally:
        cluster.stop()
