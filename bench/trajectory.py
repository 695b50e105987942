"""Trajectory log benchmark on the real platform (SQLite log), once per ``--modes`` entry:
``--trajectory-sync FULL`` (each step fsynced before it is answered) and ``NORMAL`` (each
step in the WAL before it is answered; fsynced at WAL checkpoints).

* recording overhead: ``exec("true")`` round trip in a sandbox bound to a trajectory (each
  call appended to the log before it is answered) against the same in an unbound sandbox,
  alternating in blocks of ``--block`` calls so load drift hits both alike; around each
  block the CPU time (user + system, ``/proc/<pid>/task/*/stat``) of every process on the
  path is read (the client, the apiserver by thread, the edge, iam, watcher), so the
  CPU a recorded call adds shows per process (it moves less with the machine's load than
  wall time); then the same with ``--parallel`` sandboxes on each side calling at once (RL
  rollouts: their appends share commits);
* where the time of a recorded call goes: the log alone (no platform), per step: the append
  transaction (from the record the previous append answered, as the apiserver does; its
  wall time and the CPU time of the whole process, every thread, it took) and,
  for comparison, the read of the bound record a call without that cache would add, one
  writer and ``--parallel`` writers; and the floor, one ``fdatasync`` of a small write to a
  preallocated file on the same disk;
* replay speed: re-opening a recorded 200-step trajectory and issuing the same 200 calls,
  which are answered from the log (steps/s);
* resume vs re-run: a preempted task's restart that replays 200 recorded steps (create with
  the trajectory + 200 replayed calls) against running the 200 steps again in a new
  sandbox (create + 200 real calls).

    .venv/bin/python -m bench.trajectory [--steps 200] [--calls 400] [--parallel 8]
        [--modes FULL,NORMAL] [--only overhead,parallel,resume,log] [--label NAME --json FILE]

Prints JSON and writes ``bench/results/trajectory.json`` (unless ``--json``: then one line,
labelled with ``--label`` and the ``dsec`` that ran, is appended to FILE). The daemons
inherit ``PYTHONPATH``, so two versions compare side by side under the same load when their
runs alternate:

    for i in 1 2 3; do
      PYTHONPATH=<other checkout>/src .venv/bin/python -m bench.trajectory --only overhead \
        --label main --json ab.jsonl
      .venv/bin/python -m bench.trajectory --only overhead --label branch --json ab.jsonl
    done
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import shutil
import statistics
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import dsec
from bench.call_cpu import _cpu
from bench.foundation import settle, summary
from dsec.sdk import Client, Sandbox
from dsec.store.sqlite import SqliteStore
from dsec.testing.platform import RunningPlatform, running_platform
from dsec.trajectory.blobs import FileBlobStore
from dsec.trajectory.log import Step, TrajectoryLog


def step_cmd(i: int) -> str:
    return f"echo step-{i} >> /tmp/log && wc -l < /tmp/log"


COMPONENTS = ("apiserver", "edge", "iam", "watcher")


def cpu_snapshot(plat: RunningPlatform) -> dict[str, float]:
    """CPU seconds so far of this process (the client) and each component, the apiserver's
    by thread."""
    out: dict[str, float] = {}
    _cpu(os.getpid(), "client", False, out)
    for component in COMPONENTS:
        _cpu(plat.pid(component), component, component == "apiserver", out)
    return {k: v for k, v in out.items() if not k.endswith(":children")}


def overhead(client: Client, plat: RunningPlatform, calls: int, block: int) -> dict[str, Any]:
    plain = Sandbox.create(memory_mb=256, timeout=900, client=client)
    bound = Sandbox.create(
        memory_mb=256, timeout=900, trajectory=f"bench/{uuid.uuid4().hex}", client=client
    )
    sides = (("unbound", plain), ("recorded", bound))
    try:
        for s in (plain, bound):
            for _ in range(20):
                s.exec("true")
        samples: dict[str, list[float]] = {"unbound": [], "recorded": []}
        cpu: dict[str, dict[str, float]] = {"unbound": {}, "recorded": {}}
        for _ in range(calls // block):
            for name, s in sides:
                before = cpu_snapshot(plat)
                for _ in range(block):
                    t0 = time.perf_counter()
                    s.exec("true")
                    samples[name].append(time.perf_counter() - t0)
                for k, v in cpu_snapshot(plat).items():
                    cpu[name][k] = cpu[name].get(k, 0.0) + v - before.get(k, 0.0)
        out: dict[str, Any] = {}
        n = calls // block * block
        for name, _ in sides:
            per = {k: v / n * 1000 for k, v in sorted(cpu[name].items())}
            by_process: dict[str, float] = {}
            for k, v in per.items():
                by_process[k.split(":")[0]] = by_process.get(k.split(":")[0], 0.0) + v
            out[name] = summary(samples[name]) | {
                "cpu_ms_per_call": {k: round(v, 3) for k, v in by_process.items()},
                "apiserver_cpu_ms_by_thread": {
                    k.removeprefix("apiserver:"): round(v, 3)
                    for k, v in per.items()
                    if k.startswith("apiserver:") and v >= 0.005
                },
            }
        base, rec = out["unbound"]["p50_ms"], out["recorded"]["p50_ms"]
        out["overhead_p50_ms"] = round(rec - base, 2)
        out["overhead_p50_pct"] = round(100 * (rec - base) / base, 1)
        u, r = out["unbound"]["cpu_ms_per_call"], out["recorded"]["cpu_ms_per_call"]
        out["cpu_overhead_ms_per_call"] = {k: round(r[k] - u.get(k, 0.0), 3) for k in r}
        return out
    finally:
        plain.kill()
        bound.kill()


def overhead_parallel(client: Client, rounds: int, n: int) -> dict[str, Any]:
    """``n`` unbound and ``n`` bound sandboxes; each round all unbound ones call at once,
    then all bound ones."""
    plain = [Sandbox.create(memory_mb=128, timeout=900, client=client) for _ in range(n)]
    bound = [
        Sandbox.create(
            memory_mb=128, timeout=900, trajectory=f"bench/{uuid.uuid4().hex}", client=client
        )
        for _ in range(n)
    ]

    def timed(s: Sandbox) -> float:
        t0 = time.perf_counter()
        s.exec("true")
        return time.perf_counter() - t0

    try:
        samples: dict[str, list[float]] = {"unbound": [], "recorded": []}
        with ThreadPoolExecutor(n) as pool:
            for s in plain + bound:
                s.exec("true")
            for _ in range(rounds):
                for name, group in (("unbound", plain), ("recorded", bound)):
                    samples[name] += list(pool.map(timed, group))
        out: dict[str, Any] = {"sandboxes_per_side": n}
        out.update({k: summary(v) for k, v in samples.items()})
        base, rec = out["unbound"]["p50_ms"], out["recorded"]["p50_ms"]
        out["overhead_p50_ms"] = round(rec - base, 2)
        out["overhead_p50_pct"] = round(100 * (rec - base) / base, 1)
        return out
    finally:
        for s in plain + bound:
            s.kill()


async def _log_costs(sync: str, steps: int, writers: int) -> dict[str, float]:
    top = Path(tempfile.mkdtemp(prefix="dsec-bench-log-"))
    store = await SqliteStore.open(top / "log.db", synchronous=sync, retain_revisions=10_000)
    tlog = TrajectoryLog(store, FileBlobStore(top / "blobs"), default_quota_bytes=1 << 40)
    result = {"result": {"exit_code": 0}, "stdout": "", "stderr": "", "events": []}
    reads: list[float] = []
    appends: list[float] = []
    cpu: list[float] = []  # process CPU time (every thread) per append
    # (the apiserver checks the quota before the call runs and tells the append so; an
    # older log has no such argument and checks again)
    params = inspect.signature(tlog.append_known).parameters
    once: dict[str, Any] = {"quota_checked": True} if "quota_checked" in params else {}
    paired = "record" not in params  # (the record and its stored form: one argument now)

    async def writer(i: int) -> None:
        t, _ = await tlog.open("bench/log", f"w{i}", spec={})
        await tlog.bind(t.id, f"sbx-{i}")
        found = await tlog.lookup(f"sbx-{i}", t.id)
        assert found is not None
        rec, kv = found
        for n in range(steps):
            t0 = time.perf_counter()
            assert await tlog.lookup(f"sbx-{i}", t.id) is not None  # (what the cache saves)
            t1, c1 = time.perf_counter(), time.process_time()
            await tlog.check_quota("bench/log")
            known: dict[str, Any] = {"known": (rec, kv)} if paired else {"known": kv, "record": rec}
            _, rec, kv = await tlog.append_known(
                t.id,
                lambda k: Step(k, "exec", {"op": "exec", "cmd": "true"}, 200, result, time.time()),
                **known,
                **once,
            )
            if n >= steps // 4:  # past the warm-up
                reads.append(t1 - t0)
                appends.append(time.perf_counter() - t1)
                cpu.append(time.process_time() - c1)
            await asyncio.sleep(0.005)  # the call itself

    try:
        await asyncio.gather(*(writer(i) for i in range(writers)))
    finally:
        await store.aclose()
        shutil.rmtree(top, ignore_errors=True)
    return {
        "read_p50_ms": round(statistics.median(reads) * 1000, 2),
        "append_p50_ms": round(statistics.median(appends) * 1000, 2),
        "append_p90_ms": round(sorted(appends)[int(0.9 * (len(appends) - 1))] * 1000, 2),
        "append_cpu_p50_ms": round(statistics.median(cpu) * 1000, 3),
    }


def fdatasync_floor(n: int) -> dict[str, float]:
    """One durable small write on this disk: ``pwrite`` of a step-sized record into a
    preallocated (written) file, then ``fdatasync``; no durable append can cost less."""
    with tempfile.NamedTemporaryFile(prefix="dsec-bench-fsync-") as f:
        fd = f.fileno()
        os.write(fd, bytes(4 << 20))
        os.fsync(fd)
        record = b"x" * 400
        samples = []
        for i in range(n):
            t0 = time.perf_counter()
            os.pwrite(fd, record, i * len(record))
            os.fdatasync(fd)
            samples.append(time.perf_counter() - t0)
            time.sleep(0.005)
    return {"p50_ms": round(statistics.median(samples) * 1000, 2)}


def log_costs(sync: str, steps: int, parallel: int) -> dict[str, Any]:
    """The log alone (SQLite on the same disk as the platform's home), per recorded step."""
    return {
        "fdatasync_floor": fdatasync_floor(steps // 2),
        "one_writer": asyncio.run(_log_costs(sync, steps, 1)),
        f"{parallel}_writers": asyncio.run(_log_costs(sync, steps // parallel * 2, parallel)),
    }


def resume(client: Client, steps: int) -> dict[str, Any]:
    name = f"bench/{uuid.uuid4().hex}"
    t0 = time.perf_counter()
    sbx = Sandbox.create(memory_mb=256, timeout=900, trajectory=name, client=client)
    for i in range(steps):
        sbx.exec(step_cmd(i))
    record_s = time.perf_counter() - t0
    # A rerun from the top: the same create and calls, answered from the log.
    t0 = time.perf_counter()
    again = Sandbox.create(memory_mb=256, timeout=900, trajectory=name, client=client)
    opened = time.perf_counter() - t0
    t1 = time.perf_counter()
    for i in range(steps):
        again.exec(step_cmd(i))
    replay_s = time.perf_counter() - t1
    resume_s = time.perf_counter() - t0
    status = again.trajectory_status()
    assert status["replayed"] == steps, status
    # The same task without a log: a new sandbox and every step for real.
    t0 = time.perf_counter()
    fresh = Sandbox.create(memory_mb=256, timeout=900, client=client)
    for i in range(steps):
        fresh.exec(step_cmd(i))
    rerun_s = time.perf_counter() - t0
    sbx.kill()
    fresh.kill()
    for t in client.list_trajectories(name=name):
        client.remove_trajectory(t["id"])
    return {
        "steps": steps,
        "first_run_recorded_s": round(record_s, 3),
        "resume_s": round(resume_s, 3),
        "resume_open_s": round(opened, 3),
        "replay_steps_per_s": round(steps / replay_s, 1),
        "rerun_without_log_s": round(rerun_s, 3),
        "resume_speedup": round(rerun_s / resume_s, 2),
    }


def run(sync: str, args: argparse.Namespace) -> dict[str, Any]:
    os.environ["DSEC_TRAJECTORY_SYNC"] = sync
    only = set(args.only.split(","))
    out: dict[str, Any] = {"load_average_at_mode_start": os.getloadavg()}
    with running_platform() as p:
        client = Client(api_url=p.api_url, api_key=p.admin_key)
        settle(3)
        try:
            if "overhead" in only:
                out["recording_overhead"] = overhead(client, p, args.calls, args.block)
            if "parallel" in only:
                out["recording_overhead_parallel"] = overhead_parallel(
                    client, args.calls // args.parallel, args.parallel
                )
            if "resume" in only:
                out[f"resume_{args.steps}"] = resume(client, args.steps)
        finally:
            client.close()
    if "log" in only:
        out["log_alone"] = log_costs(sync, args.calls, args.parallel)
    out["load_average_at_mode_end"] = os.getloadavg()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--calls", type=int, default=400, help="exec calls per side (overhead)")
    ap.add_argument("--block", type=int, default=20, help="calls per side between CPU reads")
    ap.add_argument("--parallel", type=int, default=8, help="sandboxes per side calling at once")
    ap.add_argument("--modes", default="FULL,NORMAL", help="--trajectory-sync modes to run")
    ap.add_argument("--only", default="overhead,parallel,resume,log", help="parts to run")
    ap.add_argument("--label", default="this", help="names this run's code (with --json)")
    ap.add_argument("--json", help="append one JSON line to this file instead")
    args = ap.parse_args()
    results: dict[str, Any] = {"label": args.label, "dsec": os.path.dirname(dsec.__file__)}
    results["load_average_at_start"] = os.getloadavg()
    results |= {f"sync_{mode.lower()}": run(mode, args) for mode in args.modes.split(",")}
    results["load_average_at_end"] = os.getloadavg()
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(results) + "\n")
        print(json.dumps(results))
        return
    text = json.dumps(results, indent=2)
    print(text)
    out = Path(__file__).parent / "results" / "trajectory.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(text + "\n")


if __name__ == "__main__":
    main()
