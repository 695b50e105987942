"""CPU time per ``exec(["true"])`` call in each process on its path, by backend.

Starts the real platform, then for each backend runs n sequential calls through the SDK
and reads, before and after, the CPU time (user + system, ``/proc/<pid>/task/*/stat``) of
the client (this process), the apiserver and the edge (by thread name: ``python`` is the
interpreter's threads, ``event_engine`` gRPC's), and the edge's descendants by command
name (the function pool, its workers and zygotes; a zygote's ``children`` are the calls'
processes it reaped). The container's own processes (aether) are not under the edge and
are not counted. CPU time moves less with the machine's load than wall time does, so this
shows where a call's cost is on a busy machine.

    .venv/bin/python -m bench.call_cpu [--n 500] [--backends function,container]
        [--json FILE --label NAME]

``--json`` appends one JSON line per backend to FILE (labelled, with the ``dsec`` that
ran: the daemons inherit ``PYTHONPATH``), so two versions can be compared side by side
under the same load by alternating them:

    for i in 1 2 3; do
      PYTHONPATH=/path/to/main/src .venv/bin/python -m bench.call_cpu --json ab.jsonl --label main
      .venv/bin/python -m bench.call_cpu --json ab.jsonl --label branch
    done
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import dsec
from dsec.sdk import Client, Sandbox
from dsec.testing.platform import RunningPlatform, running_platform

TICK = os.sysconf("SC_CLK_TCK")


def _descendants(pid: int) -> list[int]:
    out = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                for child in f.read().split():
                    out += [int(child), *_descendants(int(child))]
    except OSError:
        pass
    return out


def _fields(path: str) -> tuple[str, list[str]]:
    with open(path) as f:
        text = f.read()
    return text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :].split()


def _cpu(pid: int, prefix: str, by_thread: bool, out: dict[str, float]) -> None:
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            name, f = _fields(f"/proc/{pid}/task/{task}/stat")
            key = f"{prefix}:{name if by_thread else 'all'}"
            out[key] = out.get(key, 0.0) + (int(f[11]) + int(f[12])) / TICK
        _, f = _fields(f"/proc/{pid}/stat")
        key = f"{prefix}:children"
        out[key] = out.get(key, 0.0) + (int(f[13]) + int(f[14])) / TICK
    except OSError:
        pass  # it exited meanwhile


def snapshot(plat: RunningPlatform) -> dict[str, float]:
    out: dict[str, float] = {}
    _cpu(os.getpid(), "client", False, out)
    for component in ("apiserver", "edge"):
        pid = plat.pid(component)
        _cpu(pid, component, True, out)
        for child in _descendants(pid):
            try:
                with open(f"/proc/{child}/comm") as f:
                    name = f.read().strip()
            except OSError:
                continue
            _cpu(child, f"{component}>{name}", False, out)
    out.pop("client:children", None)
    return out


def measure(plat: RunningPlatform, backend: str, n: int) -> dict[str, object]:
    with Client() as client:
        sbx = Sandbox.create(backend=backend, memory_mb=256, timeout=600, client=client)
        try:
            for _ in range(30):
                sbx.exec(["true"])
            before, load = snapshot(plat), os.getloadavg()[0]
            samples = []
            t0 = time.perf_counter()
            for _ in range(n):
                t = time.perf_counter()
                sbx.exec(["true"])
                samples.append(time.perf_counter() - t)
            wall = time.perf_counter() - t0
            after = snapshot(plat)
        finally:
            sbx.kill()
    per_call = {
        k: round((v - before.get(k, 0.0)) / n * 1000, 2)
        for k, v in sorted(after.items())
        if (v - before.get(k, 0.0)) / n * 1000 >= 0.01
    }
    return {
        "p50_ms": round(statistics.median(samples) * 1000, 2),
        "calls_per_s": round(n / wall, 1),
        "load": [round(load, 1), round(os.getloadavg()[0], 1)],
        "cpu_ms_per_call": per_call,
        "cpu_ms_total": round(sum(per_call.values()), 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--backends", default="function,container")
    ap.add_argument("--json", help="append one JSON line per backend to this file")
    ap.add_argument("--label", default="this")
    args = ap.parse_args()
    with running_platform() as plat:
        os.environ.update(DSEC_API_URL=plat.api_url, DSEC_API_KEY=plat.admin_key)
        for backend in args.backends.split(","):
            r = measure(plat, backend, args.n)
            print(f"{backend}: p50 {r['p50_ms']} ms, {r['calls_per_s']} calls/s, load {r['load']}")
            cpu = r["cpu_ms_per_call"]
            assert isinstance(cpu, dict)
            for k, v in cpu.items():
                print(f"  {k:40s} {v:6.2f} ms CPU per call")
            print(f"  {'total':40s} {r['cpu_ms_total']:6.2f}")
            if args.json:
                code = {"label": args.label, "dsec": os.path.dirname(dsec.__file__)}
                with open(args.json, "a") as f:
                    f.write(json.dumps({**code, "backend": backend, "n": args.n, **r}) + "\n")


if __name__ == "__main__":
    main()
