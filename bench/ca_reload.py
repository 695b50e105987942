"""What certificate reloading costs per call, and how long a CA rotation takes end to end.

1. Unary gRPC round trips over loopback mTLS, sequential, against two servers that differ
   only in credentials: ``static`` (``grpc.ssl_server_credentials``, no per-call trust
   check: the code before CA rotation) and ``reloading`` (``make_server``: dynamic
   credentials plus the per-call issuer check), through a plain channel and a
   ``ReloadingChannel`` respectively. Rounds alternate; medians of the round medians.
2. A rotation in process: an iam, and N members each running a ``CertRenewer`` every
   ``--check-s``; seconds from ``Rotate`` to phase ``ready`` and to ``Finish``.

    .venv/bin/python -m bench.ca_reload [--calls 400 --rounds 6 --members 20 --check-s 0.5]

Prints a table and writes ``bench/results/ca_reload.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from dsec.iam import ca_rpcs
from dsec.iam.app import IamApp, IamConfig
from dsec.rpc._gen import ca_pb2 as capb
from dsec.rpc._gen import ca_pb2_grpc as ca_grpc
from dsec.rpc._gen import dsec_pb2 as pb
from dsec.rpc._gen import dsec_pb2_grpc as pb_grpc
from dsec.rpc.client import TranslateErrors, secure_channel
from dsec.rpc.options import CLIENT_OPTIONS, SERVER_OPTIONS
from dsec.rpc.renewal import CertRenewer, run_renewer
from dsec.rpc.server import Guards, make_server, server_port
from dsec.rpc.tls import Identity, channel_credentials, ensure_pki, server_credentials


class _Watcher(pb_grpc.WatcherServicer):
    async def Report(self, request: pb.EdgeStatus, context: Any) -> pb.Empty:
        return pb.Empty()

    async def ListEdges(self, request: pb.Empty, context: Any) -> pb.EdgeViewList:
        return pb.EdgeViewList()


ROLES = {"dsec.v1.Watcher": {"apiserver"}}


async def _round(stub: pb_grpc.WatcherAsyncStub, calls: int) -> float:
    samples = []
    for _ in range(calls):
        t = time.perf_counter()
        await stub.ListEdges(pb.Empty(), timeout=10)
        samples.append(time.perf_counter() - t)
    return statistics.median(samples) * 1e6


async def per_call(pki: Path, calls: int, rounds: int) -> dict[str, float]:
    static = grpc.aio.server(options=SERVER_OPTIONS)
    Guards(ROLES).install(static)
    static_port = static.add_secure_port("127.0.0.1:0", server_credentials(pki, "watcher"))
    reloading = make_server(pki, "watcher", "127.0.0.1:0", ROLES)
    for s in (static, reloading):
        pb_grpc.add_WatcherServicer_to_server(_Watcher(), s)
        await s.start()
    opts = [*CLIENT_OPTIONS, ("grpc.ssl_target_name_override", "watcher.watcher.dsec")]
    plain = grpc.aio.secure_channel(
        f"127.0.0.1:{static_port}", channel_credentials(pki, "apiserver"), options=opts,
        interceptors=[TranslateErrors("watcher")],
    )  # fmt: skip
    target = f"127.0.0.1:{server_port(reloading)}"
    reload_ch = secure_channel(pki, "apiserver", target, server=Identity.singleton("watcher"))
    stubs = {"static": pb_grpc.WatcherStub(plain), "reloading": pb_grpc.WatcherStub(reload_ch)}
    for stub in stubs.values():
        await _round(stub, 50)  # warm up
    got: dict[str, list[float]] = {k: [] for k in stubs}
    for _ in range(rounds):
        for name, stub in stubs.items():
            got[name].append(await _round(stub, calls))
    await plain.close()
    await reload_ch.close()
    for s in (static, reloading):
        await s.stop(0)
    return {f"{k}_us": round(statistics.median(v), 1) for k, v in got.items()}


async def rotation(root: Path, members: int, check_s: float) -> dict[str, float]:
    home = root / "iam"
    names = [f"m{i:03d}" for i in range(members)]
    ensure_pki(home / "pki", [Identity.singleton("iam"), Identity.singleton("admin"),
                              *(Identity.edge(n) for n in names)])  # fmt: skip
    app = IamApp(IamConfig(home, listen="127.0.0.1:0", metrics_listen=""))
    port = await app.start()
    target = f"127.0.0.1:{port}"
    stop = asyncio.Event()
    tasks, channels = [], []
    for n in names:
        d = root / n / "pki"
        d.mkdir(parents=True)
        for f in ("ca.crt", f"{n}.crt", f"{n}.key"):
            shutil.copy2(home / "pki" / f, d / f)
        ch = secure_channel(d, n, target, server=Identity.singleton("iam"))
        channels.append(ch)
        tasks.append(asyncio.create_task(run_renewer(CertRenewer(d, n, ch), stop, check_s)))
    admin = secure_channel(home / "pki", "admin", target, server=Identity.singleton("iam"))
    ca = ca_grpc.CaStub(admin)
    await asyncio.sleep(2 * check_s)  # every member has reported once
    t0 = time.perf_counter()
    await ca.Rotate(capb.CaRotateRequest(), timeout=10)
    while (await ca.Status(capb.CaStatusRequest(), timeout=10)).phase != "ready":
        await asyncio.sleep(0.05)
    ready = time.perf_counter() - t0
    await ca.Finish(capb.CaFinishRequest(), timeout=10)
    finished = time.perf_counter() - t0
    stop.set()
    await asyncio.gather(*tasks)
    for ch in [*channels, admin]:
        await ch.close()
    await app.stop()
    return {
        "members": members,
        "check_s": check_s,
        "settle_s": ca_rpcs.SETTLE_S,
        "rotate_to_ready_s": round(ready, 2),
        "rotate_to_finished_s": round(finished, 2),
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="dsec-bench-ca-"))
    try:
        pki = root / "pki"
        ensure_pki(pki, [Identity.singleton("watcher"), Identity.singleton("apiserver")])
        calls = await per_call(pki, args.calls, args.rounds)
        rot = await rotation(root, args.members, args.check_s)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"per_call": calls, "rotation": rot, "load_avg_1m": round(os.getloadavg()[0], 1),
            "calls_per_round": args.calls, "rounds": args.rounds}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(prog="bench.ca_reload")
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--members", type=int, default=20)
    ap.add_argument("--check-s", type=float, default=0.5)
    args = ap.parse_args()
    out = asyncio.run(main_async(args))
    pc, rot = out["per_call"], out["rotation"]
    print("| unary mTLS call (median of round medians) | static | reloading |")
    print("|---|---|---|")
    print(f"| µs per call | {pc['static_us']} | {pc['reloading_us']} |")
    print(f"rotation, {rot['members']} members checking every {rot['check_s']} s: "
          f"ready after {rot['rotate_to_ready_s']} s, finished after "
          f"{rot['rotate_to_finished_s']} s (load avg {out['load_avg_1m']})")  # fmt: skip
    path = Path(__file__).parent / "results" / "ca_reload.json"
    path.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
