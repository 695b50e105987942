"""Backends side by side: create -> first exec, exec round trip, call rate, idle memory.

Starts the real platform in a temp home and measures, in the same run and through the SDK
(SDK -> apiserver -> edge -> backend), every backend the edge reports available:

* create -> first ``exec("true")`` returns (n sandboxes, one after another);
* ``exec(["true"])`` round trip in one sandbox (sequential), and the call rate with one
  and with four callers in parallel;
* host memory (PSS) per idle instance: containers count their own processes; function
  sandboxes have none, so the pool and its warm workers are divided among them. Idle
  instances get 64 MiB and a quarter core, or what the backend advertises it needs if
  more (``min_memory_mb``, ``min_vcpus``; vm: 256 MiB and a whole core).

A backend that advertises slow creates (``create_seconds``: a full VM boots systemd under
TCG, ~40 s idle) gets as many create -> first exec and idle samples as fit in
``CREATE_BUDGET_S`` each (vm: 5); the table gives each row's n.

    .venv/bin/python -m bench.backends [--quick] [--backends function,container]

Prints a Markdown table and the load average (this machine is shared: compare backends
within one run) and writes ``bench/results/backends.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform as host_platform
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.foundation import _pss_kib, settle, summary
from dsec.core.errors import DsecError
from dsec.sdk import Client, Sandbox
from dsec.testing.platform import RunningPlatform, running_platform

MEMORY_MB = 256
IDLE_MEMORY_MB = 64
IDLE_CPU = 0.25
CREATE_BUDGET_S = 200.0  # creates per measurement of a backend with slow ones (vm: 5)


def create_to_first_exec(backend: str, n: int) -> list[float]:
    out = []
    with Client() as client:
        for _ in range(n):
            t0 = time.perf_counter()
            sbx = Sandbox.create(backend=backend, memory_mb=MEMORY_MB, timeout=120, client=client)
            r = sbx.exec(["true"])
            out.append(time.perf_counter() - t0)
            assert r.exit_code == 0, r
            sbx.kill()
            settle(0.3)
    return out


def round_trip(backend: str, n: int, callers: int) -> dict[str, Any]:
    with Client() as client:
        sbx = Sandbox.create(backend=backend, memory_mb=MEMORY_MB, timeout=600, client=client)
        try:
            for _ in range(10):
                sbx.exec(["true"])
            samples: list[float] = []

            def one(_: int) -> None:
                t0 = time.perf_counter()
                r = sbx.exec(["true"])
                samples.append(time.perf_counter() - t0)
                assert r.exit_code == 0, r

            t0 = time.perf_counter()
            with ThreadPoolExecutor(callers) as pool:
                list(pool.map(one, range(n)))
            wall = time.perf_counter() - t0
        finally:
            sbx.kill()
    return {**summary(samples), "callers": callers, "calls_per_s": round(n / wall, 1)}


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for t in tasks:
        try:
            with open(f"/proc/{pid}/task/{t}/children") as f:
                out += [int(x) for x in f.read().split()]
        except OSError:
            pass
    return out


def _function_pool_pids(edge_pid: int) -> list[int]:
    pools = []
    for pid in _children(edge_pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"dsec.edge.backends.function.pool" in f.read():
                    pools.append(pid)
        except OSError:
            pass
    return [p for pool in pools for p in (pool, *_children(pool))]


def samples(n: int, caps: dict[str, Any]) -> int:
    """``n``, or fewer for a backend whose advertised create cost makes n too slow."""
    cost = caps.get("create_seconds") or 0
    return n if cost <= 0 else max(1, min(n, int(CREATE_BUDGET_S // cost)))


def idle_memory(
    plat: RunningPlatform, backend: str, n: int, memory_mb: int, cpu: float
) -> dict[str, Any]:
    with Client() as client:
        sbxs = [
            Sandbox.create(
                backend=backend,
                memory_mb=memory_mb,
                cpu=cpu,
                timeout=1800,
                client=client,
            )
            for _ in range(n)
        ]
        try:
            for s in sbxs:
                s.exec(["true"])
            time.sleep(2)
            if backend == "function":
                pids = _function_pool_pids(plat.pid("edge"))
                total = sum(_pss_kib(p) for p in pids) / 1024
                per = [total / n]
                procs = len(pids) / n
            else:
                per, counts = [], []
                for s in sbxs:
                    ps = plat.sandbox_pids(s.id)
                    counts.append(len(ps))
                    per.append(sum(_pss_kib(p) for p in ps) / 1024)
                procs = statistics.median(counts)
            return {
                "instances": n,
                "pss_mib_per_instance": round(statistics.median(per), 2),
                "processes_per_instance": round(procs, 2),
            }
        finally:
            for s in sbxs:
                s.kill()


def measure(
    plat: RunningPlatform,
    name: str,
    n_create: int,
    n_calls: int,
    n_idle: int,
    caps: dict[str, Any],
) -> dict[str, Any]:
    """One backend's row; sizes from what it advertises (``caps``)."""
    # idle instances get the least the backend starts well with (64 MiB, 1/4 core or more)
    idle_mb = max(IDLE_MEMORY_MB, caps.get("min_memory_mb") or 0)
    idle_cpu = max(IDLE_CPU, caps.get("min_vcpus") or 0)
    out: dict[str, Any] = {}
    out["round_trip"] = round_trip(name, n_calls, callers=1)
    settle(2)
    out["parallel"] = round_trip(name, n_calls, callers=4)
    settle(2)
    out["create_to_first_exec"] = summary(create_to_first_exec(name, samples(n_create, caps)))
    settle(2)
    idle = idle_memory(plat, name, samples(n_idle, caps), idle_mb, idle_cpu)
    out["idle"] = {**idle, "memory_mb": idle_mb, "cpu": idle_cpu}
    return out


def table(res: dict[str, Any]) -> str:
    rows = [
        "| backend | create → first exec p50 (ms) | exec round trip p50 / p90 / p99 (ms) "
        "| calls/s, 1 caller | calls/s, 4 callers | idle PSS per instance |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in res["backends"].items():
        if "skipped" in r:
            rows.append(f"| {name} | not available: {r['skipped']} | | | | |")
            continue
        if "failed" in r:
            rows.append(f"| {name} | failed: {r['failed']} | | | | |")
            continue
        c, rt, par, mem = r["create_to_first_exec"], r["round_trip"], r["parallel"], r["idle"]
        rows.append(
            f"| {name} | {c['p50_ms']} (n={c['n']}) "
            f"| {rt['p50_ms']} / {rt['p90_ms']} / {rt['p99_ms']} "
            f"| {rt['calls_per_s']} | {par['calls_per_s']} "
            f"| {mem['pss_mib_per_instance']} MiB ({mem['instances']} of "
            f"{mem.get('memory_mb', IDLE_MEMORY_MB)} MiB instances) |"
        )
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller samples (smoke run)")
    ap.add_argument("--out", default="", help="results file name under bench/results/")
    ap.add_argument(
        "--backends", default="", help="comma-separated backends to measure (default: all)"
    )
    args = ap.parse_args()
    n_create, n_calls, n_idle = (5, 50, 5) if args.quick else (20, 300, 20)
    res: dict[str, Any] = {
        "host": {
            "cpus": os.cpu_count(),
            "kernel": host_platform.release(),
            "python": host_platform.python_version(),
        },
        "date": time.strftime("%Y-%m-%d"),
        "load_average_before": [round(x, 2) for x in os.getloadavg()],
        "backends": {},
    }
    with running_platform() as plat:
        os.environ.update(DSEC_API_URL=plat.api_url, DSEC_API_KEY=plat.admin_key)
        with Client() as client:
            edges = client.backends()
        only = {x for x in args.backends.split(",") if x}
        for b in edges[0]["backends"]:
            name = b["name"]
            if only and name not in only:
                continue
            if not b["available"]:
                res["backends"][name] = {"skipped": b["reason"]}
                continue
            try:
                caps = b["capabilities"]
                res["backends"][name] = measure(plat, name, n_create, n_calls, n_idle, caps)
            except DsecError as exc:  # one backend failing must not hide the others
                res["backends"][name] = {"failed": f"{type(exc).__name__}: {exc}"}
            settle(3)
    res["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    results = Path(__file__).with_name("results")
    results.mkdir(exist_ok=True)
    path = results / (args.out or ("backends-quick.json" if args.quick else "backends.json"))
    path.write_text(json.dumps(res, indent=2) + "\n")
    print(table(res))
    print(
        f"load average (1, 5, 15 min): {res['load_average_before']} before, "
        f"{res['load_average_after']} after"
    )


if __name__ == "__main__":
    main()
