"""E2B gateway benchmark: the unmodified ``e2b`` SDK through the gateway vs our own SDK.

Starts the real platform (with its gateway) in a temp home and measures, alternating the two
clients run by run so drift hits both alike:

* ``Sandbox.create()`` -> first ``commands.run("true")`` returns (E2B) against
  ``Sandbox.create()`` -> first ``exec("true")`` (OpenDsec SDK), same image, 1 CPU, 512 MiB,
  and against what the gateway does for E2B done with our SDK (a kept background process
  running ``bash -l -c true``, followed to its exit);
* the ``commands.run("true")`` round trip in a running sandbox against ``exec("true")`` and
  against the same kept process through our SDK;
* reading a 100 MiB file: ``files.read(format="bytes")`` against ``files.read``.

    .venv/bin/python -m bench.e2b_gateway [--quick]

Prints JSON and writes ``bench/results/e2b_gateway.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from bench.foundation import settle, summary
from dsec.sdk import Client
from dsec.sdk import Sandbox as DsecSandbox
from dsec.testing.platform import running_platform

BIG_MIB = 100


def e2b_create_run() -> float:
    from e2b import Sandbox

    t0 = time.perf_counter()
    sbx = Sandbox.create(timeout=120)
    sbx.commands.run("true")
    elapsed = time.perf_counter() - t0
    sbx.kill()
    return elapsed


def dsec_create_exec(client: Client) -> float:
    t0 = time.perf_counter()
    sbx = DsecSandbox.create(cpu=1.0, memory_mb=512, timeout=120, client=client)
    r = sbx.exec("true")
    elapsed = time.perf_counter() - t0
    assert r.exit_code == 0
    sbx.kill()
    return elapsed


def dsec_create_process(client: Client) -> float:
    """What the gateway does for E2B, through our SDK: a kept process running a login bash."""
    t0 = time.perf_counter()
    sbx = DsecSandbox.create(cpu=1.0, memory_mb=512, timeout=120, client=client)
    _kept_true(sbx)
    elapsed = time.perf_counter() - t0
    sbx.kill()
    return elapsed


def _kept_true(sbx: DsecSandbox) -> None:
    """``commands.run("true")`` done with our SDK: a kept login-bash process, followed."""
    pid = sbx.processes.start(["/bin/bash", "-l", "-c", "true"]).pid
    assert list(sbx.processes.connect(pid))[-1].exit_code == 0


def round_trips(n: int, client: Client) -> tuple[list[float], list[float], list[float]]:
    from e2b import Sandbox

    e2b_sbx = Sandbox.create(timeout=600)
    ours = DsecSandbox.create(cpu=1.0, memory_mb=512, timeout=600, client=client)
    try:
        for _ in range(10):
            e2b_sbx.commands.run("true")
            ours.exec("true")
            _kept_true(ours)
        a, b, c = [], [], []
        for _ in range(n):
            t0 = time.perf_counter()
            e2b_sbx.commands.run("true")
            a.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            ours.exec("true")
            b.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            _kept_true(ours)
            c.append(time.perf_counter() - t0)
        return a, b, c
    finally:
        e2b_sbx.kill()
        ours.kill()


def big_read(n: int, client: Client) -> dict[str, Any]:
    from e2b import Sandbox

    e2b_sbx = Sandbox.create(timeout=600)
    ours = DsecSandbox.connect(e2b_sbx.sandbox_id, client=client)
    try:
        e2b_sbx.commands.run(f"head -c {BIG_MIB}M /dev/urandom > /tmp/big", timeout=120)
        a, b = [], []
        for _ in range(n):
            t0 = time.perf_counter()
            data = e2b_sbx.files.read("/tmp/big", format="bytes")
            a.append(time.perf_counter() - t0)
            assert len(data) == BIG_MIB << 20
            t0 = time.perf_counter()
            raw = ours.files.read("/tmp/big")
            b.append(time.perf_counter() - t0)
            assert len(raw) == BIG_MIB << 20
        return {
            "e2b_gateway_mib_s": round(BIG_MIB / sorted(a)[len(a) // 2], 1),
            "dsec_sdk_mib_s": round(BIG_MIB / sorted(b)[len(b) // 2], 1),
            "n": n,
        }
    finally:
        e2b_sbx.kill()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller samples (smoke run)")
    args = ap.parse_args()
    n = 5 if args.quick else 20
    res: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "cpus": os.cpu_count(),
        "loadavg_start": [round(x, 1) for x in os.getloadavg()],
    }
    with running_platform() as plat:
        gateway = f"http://{plat.layout.gateway}"
        os.environ.update(
            DSEC_API_URL=plat.api_url,
            DSEC_API_KEY=plat.admin_key,
            E2B_API_URL=gateway,
            E2B_SANDBOX_URL=gateway,
            E2B_API_KEY=plat.admin_key,
        )
        client = Client()
        try:
            e2b_create_run()  # warm both paths once (imports, connection pools)
            dsec_create_exec(client)
            settle(2)
            a, b, c = [], [], []
            for _ in range(n):
                a.append(e2b_create_run())
                settle(0.5)
                b.append(dsec_create_exec(client))
                settle(0.5)
                c.append(dsec_create_process(client))
                settle(0.5)
            res["create_to_first_run"] = {
                "e2b_gateway": summary(a),
                "dsec_sdk": summary(b),
                "dsec_sdk_same_semantics": summary(c),
            }
            ratio = res["create_to_first_run"]["e2b_gateway"]["p50_ms"] / max(
                res["create_to_first_run"]["dsec_sdk"]["p50_ms"], 1e-9
            )
            res["create_to_first_run"]["gateway_overhead_pct"] = round(100 * (ratio - 1), 1)
            settle()
            ra, rb, rc = round_trips(30 if args.quick else 200, client)
            res["run_true_round_trip"] = {
                "e2b_gateway": summary(ra),
                "dsec_sdk": summary(rb),
                "dsec_sdk_same_semantics": summary(rc),
            }
            settle()
            res["read_100mib"] = big_read(2 if args.quick else 5, client)
        finally:
            client.close()
    res["loadavg_end"] = [round(x, 1) for x in os.getloadavg()]
    out_dir = Path(__file__).with_name("results")
    out_dir.mkdir(exist_ok=True)
    name = "e2b_gateway-quick.json" if args.quick else "e2b_gateway.json"
    (out_dir / name).write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
