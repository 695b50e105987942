"""`dsec ca rotate` on a running cluster of separate processes, with real mTLS throughout.

One iam, one watcher, one apiserver and two edges (one real container edge when this machine
can run containers, else two fake-backend edges). While sandboxes are created, exec'd in
(on the real edge) and killed in a loop, the CA is rotated and the rotation finished; not
one call may fail. Afterwards a client presenting the old edge certificate is refused by
the iam and the watcher, while the renewed certificate of the same edge is accepted.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from dsec.rpc._gen import ca_pb2 as capb
from dsec.rpc._gen import ca_pb2_grpc as ca_grpc
from dsec.rpc._gen import dsec_pb2 as pb
from dsec.rpc._gen import dsec_pb2_grpc as pb_grpc
from dsec.sdk import Client, Sandbox
from dsec.testing.cluster import LocalCluster, local_cluster
from dsec.testing.platform import requirements_missing

pytestmark = pytest.mark.timeout(420)
_REAL = requirements_missing()
CHECK_S = "0.5"  # DSEC_CERT_CHECK_S for every process: a rotation takes seconds, not minutes


@pytest.fixture
def cluster(monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalCluster]:
    monkeypatch.setenv("DSEC_CERT_CHECK_S", CHECK_S)
    with local_cluster(apiservers=1, health_timeout_s=5.0) as c:
        admin = Client(api_url=c.api_url(0), api_key=c.admin_key)
        c.add_edge(admin.create_join_token(600)["token"], backend="fake" if _REAL else "real")
        c.add_edge(admin.create_join_token(600)["token"], backend="fake")
        deadline = time.monotonic() + 60
        while sum(bool(e["healthy"]) for e in admin.list_edges()) < 2:
            assert time.monotonic() < deadline, "two healthy edges: not within 60 s"
            time.sleep(0.2)
        admin.close()
        yield c


def _dsec(c: LocalCluster, *args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "dsec.cli.main", "ca", *args,
            "--iam", c.iam.address, "--pki", str(c.iam.home / "pki")]  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, timeout=180, env=os.environ)


class Load:
    """Creates, uses and kills sandboxes in a loop; remembers every failed call."""

    def __init__(self, c: LocalCluster, real_edge: str) -> None:
        self.client = Client(api_url=c.api_url(0), api_key=c.admin_key)
        self.real_edge = real_edge
        self.failures: list[str] = []
        self.calls = 0
        self.execs = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(120)
        self.client.close()

    def _run(self) -> None:
        keep = None  # one long-lived sandbox on the real edge, exec'd in every round
        while not self._stop.is_set():
            try:
                s = Sandbox.create(memory_mb=64, cpu=0.1, timeout=300, client=self.client)
                info = s.info()
                self.calls += 2
                if info.edge_id == self.real_edge:
                    out = s.exec(["echo", "rotating"], timeout=30)
                    assert out.stdout.strip() == "rotating", out
                    self.execs += 1
                    if keep is None:
                        keep = s
                        continue
                if keep is not None:
                    assert keep.exec(["true"], timeout=30).exit_code == 0
                    self.execs += 1
                self.client.kill_sandbox(s.id)
                self.calls += 1
            except Exception as exc:
                self.failures.append(f"{time.time():.2f} {type(exc).__name__}: {exc}")
                time.sleep(0.2)
        if keep is not None:
            try:
                self.client.kill_sandbox(keep.id)
            except Exception as exc:  # every failure is the finding
                self.failures.append(f"final kill: {type(exc).__name__}: {exc}")


def _status(c: LocalCluster) -> dict[str, Any]:
    done = _dsec(c, "status", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    parsed: dict[str, Any] = json.loads(done.stdout)
    return parsed


def _finish_now(c: LocalCluster) -> str:
    """Ca.Finish as the admin, in process (no CLI start-up delay); the refusal's message."""
    pki = c.iam.home / "pki"
    creds = grpc.ssl_channel_credentials(
        (pki / "ca.crt").read_bytes(), (pki / "admin.key").read_bytes(),
        (pki / "admin.crt").read_bytes(),
    )  # fmt: skip
    opts = [("grpc.ssl_target_name_override", "iam.iam.dsec")]
    with (
        grpc.secure_channel(c.iam.address, creds, options=opts) as ch,
        pytest.raises(grpc.RpcError) as err,
    ):
        ca_grpc.CaStub(ch).Finish(capb.CaFinishRequest(), timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, err.value
    details: str = err.value.details() or ""
    return details


def _list_edges(target: str, ca: bytes, key: bytes, cert: bytes) -> grpc.StatusCode:
    """A call to the watcher presenting ``cert``; the status code it ends with."""
    creds = grpc.ssl_channel_credentials(ca, key, cert)
    opts = [("grpc.ssl_target_name_override", "watcher.watcher.dsec")]
    with grpc.secure_channel(target, creds, options=opts) as ch:
        try:
            pb_grpc.WatcherStub(ch).ListEdges(pb.Empty(), timeout=10)
        except grpc.RpcError as err:
            code: grpc.StatusCode = err.code()
            return code
    return grpc.StatusCode.OK


def test_rotate_under_load_then_old_certificates_are_refused(cluster: LocalCluster) -> None:
    c = cluster
    edge_ids = [(e.home / "edge.id").read_text().strip() for e in c.edges]
    old_pki = c.root / "old-edge1-pki"
    shutil.copytree(c.edges[1].home / "pki", old_pki)
    initial = _status(c)
    assert initial["phase"] == "idle"
    nothing = _dsec(c, "rotate", "--finish")
    assert nothing.returncode == 2, nothing.stdout + nothing.stderr
    assert "no CA rotation is in progress" in nothing.stderr

    with Load(c, edge_ids[0] if _REAL is None else "") as load:
        time.sleep(2)
        rotate = subprocess.Popen(
            [sys.executable, "-m", "dsec.cli.main", "ca", "rotate", "--timeout", "120",
             "--iam", c.iam.address, "--pki", str(c.iam.home / "pki")],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        bundle = c.iam.home / "pki" / "ca.crt"
        deadline = time.monotonic() + 60
        while bundle.read_bytes().count(b"BEGIN CERTIFICATE") < 2:
            assert time.monotonic() < deadline, "the rotation did not start"
            time.sleep(0.02)
        early = _finish_now(c)  # nobody may renew before the new CA settled everywhere
        out, err = rotate.communicate(timeout=180)
        assert rotate.returncode == 0, out + err
        assert "distributing the new CA" in err or "re-issuing" in err, err  # progress shown
        assert "every component uses the new CA" in out
        mid = _status(c)
        finished = _dsec(c, "rotate", "--finish")
        assert finished.returncode == 0, finished.stdout + finished.stderr
        calls_at_finish = load.calls
        deadline = time.monotonic() + 60
        while load.calls < calls_at_finish + 6 and time.monotonic() < deadline:
            time.sleep(0.2)  # calls keep flowing after the old CA is gone

    assert "still use the old CA" in early
    assert f"edge/{edge_ids[1]}" in early
    assert f"edge/{edge_ids[0]}" in early
    assert mid["phase"] == "ready"
    assert len(mid["old"]) == 1
    assert load.failures == [], "\n".join(load.failures)
    assert load.calls >= calls_at_finish + 6, (calls_at_finish, load.calls)
    if _REAL is None:
        assert load.execs >= 2, load.execs
    after = _status(c)
    assert after["phase"] == "idle"
    assert not after.get("old")
    comps = after["components"]
    assert isinstance(comps, list)
    names = {x["identity"].rsplit("/", 1)[1] for x in comps if x.get("live")}
    assert {"apiserver", "watcher", *edge_ids} <= names
    assert all(x.get("on_signing") for x in comps if x.get("live")), comps
    assert after["signing"] != initial["signing"]
    table = _dsec(c, "status")
    assert table.returncode == 0, table.stderr
    assert f"edge/{edge_ids[0]}" in table.stdout
    assert "phase    idle" in table.stdout

    # The new bundle with the edge's old certificate: refused by the watcher (and the iam).
    new_ca = (c.iam.home / "pki" / "ca.crt").read_bytes()
    old_key = (old_pki / f"{edge_ids[1]}.key").read_bytes()
    old_cert = (old_pki / f"{edge_ids[1]}.crt").read_bytes()
    assert _list_edges(c.watcher.address, new_ca, old_key, old_cert) in (
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.UNAUTHENTICATED,
    )
    # ... while its renewed certificate is accepted (so the refusal above is the CA's doing).
    pki = c.edges[1].home / "pki"
    new_key, new_cert = (pki / f"{edge_ids[1]}.key").read_bytes(), (pki / f"{edge_ids[1]}.crt")
    assert new_key != old_key
    got = _list_edges(c.watcher.address, new_ca, new_key, new_cert.read_bytes())
    assert got == grpc.StatusCode.PERMISSION_DENIED  # authenticated; edges may not ListEdges
    # The old trust alone no longer reaches anyone: the servers present new-CA certificates.
    old_ca = (old_pki / "ca.crt").read_bytes()
    assert _list_edges(c.watcher.address, old_ca, old_key, old_cert) == (
        grpc.StatusCode.UNAVAILABLE
    )
    for e in c.edges:
        assert e.proc.poll() is None, Path(e.log).read_text()[-2000:]
