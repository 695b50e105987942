"""Sandbox network setup benchmark: what dsec.edge.net adds to a sandbox create.

Runs the edge's EdgeNetwork against a fake internet of namespaces made for the run (see
tests/integration/fakenet.py) and times, per sandbox: create (netns + veth + addresses +
route + the nft transaction of its chains, sets and counters), the same with a warm slot
(only the policy is attached), a policy replacement, a DNS answer that opens addresses,
and destroy. Then holds ``--scale`` networks at once and
times one more create, to show how create grows with the number of sandboxes.

    .venv/bin/python -m bench.network [--n 50] [--scale 300]
    .venv/bin/python -m bench.network --tap [--n 30]   # microVM (TAP) vs container slots
    .venv/bin/python -m bench.network --warm [--n 50]  # warm-slot create: now vs libnftables

Prints medians and writes ``bench/results/network.json`` (``network-tap.json``,
``network-warm.json``). Needs root.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from dsec.core.netpolicy import NetworkPolicy
from dsec.edge.net import ruleset
from dsec.edge.net.config import NetConfig
from dsec.edge.net.edgenet import EdgeNetwork
from tests.integration.fakenet import DNS_IP, SINK_PORT, WEB1, WEB2, FakeInternet

POLICY = NetworkPolicy(
    allow=(f"{WEB1}/32", f"{WEB2}:80", "198.18.2.0/24:1000-2000/udp", "web1.test.example"),
    deny=(f"{WEB1}:22",),
)


def summary(samples_s: list[float]) -> dict[str, float]:
    ms = sorted(x * 1000 for x in samples_s)
    return {
        "n": len(ms),
        "p50_ms": round(statistics.median(ms), 3),
        "p90_ms": round(ms[int(0.9 * (len(ms) - 1))], 3),
        "min_ms": round(ms[0], 3),
    }


async def timed(fn: Any) -> float:
    t = time.perf_counter()
    await fn
    return time.perf_counter() - t


BULK = (
    "import socket,sys,time\n"
    "s=socket.create_connection((sys.argv[1],int(sys.argv[2])));buf=b'x'*(1<<20);n=int(sys.argv[3])\n"
    "t=time.perf_counter()\n"
    "for _ in range(n): s.sendall(buf)\n"
    "s.shutdown(socket.SHUT_WR);got=int(s.makefile().readline())\n"
    "assert got==n<<20, got\n"
    "print(n/(time.perf_counter()-t))"
)


async def bulk_mbps(netns: Path, mib: int = 1024) -> float:
    """MiB/s of one TCP stream of ``mib`` MiB from ``netns`` to the sink (best of 3)."""
    best = 0.0
    for _ in range(3):
        res = await asyncio.to_thread(
            subprocess.run,
            [
                "nsenter",
                f"--net={netns}",
                sys.executable,
                "-c",
                BULK,
                WEB1,
                str(SINK_PORT),
                str(mib),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        best = max(best, float(res.stdout))
    return round(best, 1)


@contextlib.asynccontextmanager
async def bench_network(name: str) -> AsyncIterator[tuple[EdgeNetwork, FakeInternet, Path]]:
    """A started edge network on a fake internet, in a temp dir; all of it removed after."""
    inet = FakeInternet().start()
    tmp = Path(tempfile.mkdtemp(prefix=f"dsec-{name}-"))
    cfg = NetConfig(
        pool="10.213.0.0/16",
        upstream_dns=f"{DNS_IP}:53",
        state_dir=tmp / "state",
        netns_dir=tmp / "netns",
        gateway_netns=inet.gw_path,
    )
    net = EdgeNetwork(name, cfg)
    await net.start()
    try:
        yield net, inet, tmp
    finally:
        for sid in list(net._nets):
            await net.destroy(sid)
        await net.release()
        inet.close()
        shutil.rmtree(tmp)  # records and empty dirs only: every namespace is unmounted


async def tap_compare(n: int) -> dict[str, Any]:
    """Cold create and destroy of a container's network vs a microVM's (same slot + TAP
    and bridge), alternating, so both see the same load."""
    times: dict[str, list[float]] = {k: [] for k in ("veth", "tap", "veth_rm", "tap_rm")}
    async with bench_network("benchtap") as (net, _inet, _tmp):
        for i in range(n):
            for kind in ("veth", "tap"):
                sid = f"{kind}-{i}"
                times[kind].append(await timed(net.create(sid, POLICY, tap=kind == "tap")))
                times[f"{kind}_rm"].append(await timed(net.destroy(sid)))
    return {
        "create_container": summary(times["veth"]),
        "create_microvm_tap": summary(times["tap"]),
        "destroy_container": summary(times["veth_rm"]),
        "destroy_microvm_tap": summary(times["tap_rm"]),
    }


async def warm_compare(n: int, present: int) -> dict[str, Any]:
    """Create from a warm slot as the edge does it (record + one netlink batch of set
    elements on the event loop) against the previous way (record on a thread, then the
    same elements as libnftables text on the worker thread), alternating, with an empty
    table and with ``present`` other sandboxes in it."""
    inet = FakeInternet().start()
    tmp = Path(tempfile.mkdtemp(prefix="dsec-bench-warm-"))
    cfg = NetConfig(
        pool="10.213.0.0/16",
        upstream_dns=f"{DNS_IP}:53",
        state_dir=tmp / "state",
        netns_dir=tmp / "netns",
        gateway_netns=inet.gw_path,
        warm=2,
    )
    net = EdgeNetwork("benchwarm", cfg)
    await net.start()

    async def ready() -> None:
        for _ in range(500):
            if len(net._warm) == 2 and not net._making:
                return
            await asyncio.sleep(0.01)

    async def libnftables_way(sid: str) -> float:
        sn = await net.create(sid, NetworkPolicy())  # a warm slot, nothing attached
        await ready()  # the refill this create started is done, as before the other create
        t = time.perf_counter()
        await asyncio.to_thread(net._save, replace(sn, policy=POLICY))
        text = ruleset.policy_elements(net.t.family_table, sn.key, POLICY, net.t.pool)
        await net._run(lambda: net._nft_run(text))
        return time.perf_counter() - t

    out: dict[str, Any] = {}
    try:
        for label, others in (("empty_table", 0), (f"{present}_present", present)):
            for i in range(others - len(net._nets)):
                await net.create(f"other-{i}", POLICY)
            now, before = [], []
            for i in range(n):
                await ready()
                now.append(await timed(net.create(f"w-{label}-{i}", POLICY)))
                await net.destroy(f"w-{label}-{i}")
                await ready()
                before.append(await libnftables_way(f"o-{label}-{i}"))
                await net.destroy(f"o-{label}-{i}")
            out[f"warm_create_{label}"] = summary(now)
            out[f"warm_create_libnftables_{label}"] = summary(before)
    finally:
        for sid in list(net._nets):
            await net.destroy(sid)
        await net.release()
        inet.close()
        shutil.rmtree(tmp)
    out["loadavg"] = [round(x, 2) for x in os.getloadavg()]
    return out


async def run(n: int, scale: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with bench_network("bench") as (net, inet, tmp):
        create, policy_times, destroy, dns = [], [], [], []
        for i in range(n):
            sid = f"bench-{i}"
            create.append(await timed(net.create(sid, POLICY)))
            policy_times.append(await timed(net.set_policy(sid, POLICY)))
            dns.append(await timed(net._open_resolved(sid, "web1.test.example", [(WEB1, 60)])))
            destroy.append(await timed(net.destroy(sid)))
        out["create"] = summary(create)
        out["set_policy"] = summary(policy_times)
        out["dns_open_addresses"] = summary(dns)
        out["destroy"] = summary(destroy)
        # with warm slots: the create only attaches the policy (refilled between creates)
        warm_net = EdgeNetwork(
            "benchw",
            replace(
                net.config,
                warm=2,
                state_dir=tmp / "wstate",
                netns_dir=tmp / "wnetns",
                pool="10.214.0.0/16",
                dns_port=5300,
            ),
        )
        await warm_net.start()
        try:
            warm = []
            for i in range(n):
                for _ in range(200):
                    if len(warm_net._warm) == 2:
                        break
                    await asyncio.sleep(0.01)
                warm.append(await timed(warm_net.create(f"warm-{i}", POLICY)))
                await warm_net.destroy(f"warm-{i}")
            out["create_warm"] = summary(warm)
        finally:
            await warm_net.release()
        # bulk TCP throughput: a sandbox with an allow rule vs the gateway itself (no rules,
        # one veth hop fewer), to the same sink in the fake internet
        bulk = await net.create("bench-bulk", NetworkPolicy(allow=(f"{WEB1}:{SINK_PORT}",)))
        out["bulk_tcp_sandbox_MBps"] = await bulk_mbps(bulk.netns)
        out["bulk_tcp_plain_MBps"] = await bulk_mbps(Path(inet.gw_path))
        out["bulk_tcp_ratio"] = round(out["bulk_tcp_sandbox_MBps"] / out["bulk_tcp_plain_MBps"], 3)
        await net.destroy("bench-bulk")
        # end to end DNS through the resolver from inside a sandbox namespace
        probe = await net.create("bench-dns", POLICY)
        code = (
            "import socket,time;from dnslib import DNSRecord;s=socket.socket(2,2);r=[]\n"
            "for i in range(20):\n"
            " t=time.perf_counter();s.sendto(DNSRecord.question('web1.test.example').pack(),"
            f"('{probe.gateway}',53));s.recv(999);r.append(time.perf_counter()-t)\n"
            "r.sort();print(r[10])"
        )
        res = await asyncio.to_thread(
            subprocess.run,
            ["nsenter", f"--net={probe.netns}", sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=60,
        )
        out["dns_query_through_resolver_p50_ms"] = round(float(res.stdout) * 1000, 3)
        await net.destroy("bench-dns")
        if scale:
            t = time.perf_counter()
            for i in range(scale):
                await net.create(f"scale-{i}", POLICY)
            out[f"create_{scale}_total_s"] = round(time.perf_counter() - t, 2)
            extra = [await timed(net.create(f"extra-{i}", POLICY)) for i in range(5)]
            out[f"create_with_{scale}_present"] = summary(extra)
            opens = [
                await timed(net._open_resolved("scale-0", "web1.test.example", [(WEB1, 60)]))
                for _ in range(20)
            ]
            out[f"dns_open_addresses_with_{scale}_present"] = summary(opens)
            pols = [await timed(net.set_policy("scale-0", POLICY)) for _ in range(5)]
            out[f"set_policy_with_{scale}_present"] = summary(pols)
            t = time.perf_counter()
            for sid in list(net._nets):
                await net.destroy(sid)
            out[f"destroy_{scale + 5}_total_s"] = round(time.perf_counter() - t, 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--scale", type=int, default=300)
    ap.add_argument("--tap", action="store_true", help="only: container vs microVM (TAP) slots")
    ap.add_argument("--warm", action="store_true", help="only: warm-slot create, now vs before")
    ap.add_argument("--present", type=int, default=100, help="--warm: other sandboxes held")
    args = ap.parse_args()
    if args.warm:
        res = asyncio.run(warm_compare(args.n, args.present))
        print(json.dumps(res, indent=2))
        (Path(__file__).parent / "results" / "network-warm.json").write_text(
            json.dumps(res, indent=2) + "\n"
        )
        return
    if args.tap:
        tap = asyncio.run(tap_compare(args.n))
        print(json.dumps(tap, indent=2))
        (Path(__file__).parent / "results" / "network-tap.json").write_text(
            json.dumps(tap, indent=2) + "\n"
        )
        return
    res = asyncio.run(run(args.n, args.scale))
    print(json.dumps(res, indent=2))
    dest = Path(__file__).parent / "results" / "network.json"
    dest.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
