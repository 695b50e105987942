"""Trajectory log benchmark on the real platform (SQLite log), run twice: with
``--trajectory-sync FULL`` (each step fsynced before it is answered) and ``NORMAL`` (each
step in the WAL before it is answered; fsynced at WAL checkpoints).

* recording overhead: ``exec("true")`` round trip in a sandbox bound to a trajectory (each
  call appended to the log before it is answered) against the same in an unbound sandbox,
  alternating call by call so load drift hits both alike;
* replay speed: re-opening a recorded 200-step trajectory and issuing the same 200 calls,
  which are answered from the log (steps/s);
* resume vs re-run: a preempted task's restart that replays 200 recorded steps (create with
  the trajectory + 200 replayed calls) against running the 200 steps again in a new
  sandbox (create + 200 real calls).

    .venv/bin/python -m bench.trajectory [--steps 200] [--calls 400]

Prints JSON and writes ``bench/results/trajectory.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

from bench.foundation import settle, summary
from dsec.sdk import Client, Sandbox
from dsec.testing.platform import running_platform

BLOCK = 1  # alternate call by call, so load drift hits both sides alike


def step_cmd(i: int) -> str:
    return f"echo step-{i} >> /tmp/log && wc -l < /tmp/log"


def overhead(client: Client, calls: int) -> dict[str, Any]:
    plain = Sandbox.create(memory_mb=256, timeout=900, client=client)
    bound = Sandbox.create(
        memory_mb=256, timeout=900, trajectory=f"bench/{uuid.uuid4().hex}", client=client
    )
    try:
        for s in (plain, bound):
            for _ in range(5):
                s.exec("true")
        samples: dict[str, list[float]] = {"unbound": [], "recorded": []}
        for _ in range(calls // BLOCK):
            for name, s in (("unbound", plain), ("recorded", bound)):
                for _ in range(BLOCK):
                    t0 = time.perf_counter()
                    s.exec("true")
                    samples[name].append(time.perf_counter() - t0)
        out: dict[str, Any] = {k: summary(v) for k, v in samples.items()}
        base, rec = out["unbound"]["p50_ms"], out["recorded"]["p50_ms"]
        out["overhead_p50_ms"] = round(rec - base, 2)
        out["overhead_p50_pct"] = round(100 * (rec - base) / base, 1)
        return out
    finally:
        plain.kill()
        bound.kill()


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
    with running_platform() as p:
        client = Client(api_url=p.api_url, api_key=p.admin_key)
        settle(3)
        try:
            return {
                "recording_overhead": overhead(client, args.calls),
                f"resume_{args.steps}": resume(client, args.steps),
            }
        finally:
            client.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--calls", type=int, default=400, help="exec calls per side (overhead)")
    args = ap.parse_args()
    results = {f"sync_{mode.lower()}": run(mode, args) for mode in ("FULL", "NORMAL")}
    text = json.dumps(results, indent=2)
    print(text)
    out = Path(__file__).parent / "results" / "trajectory.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(text + "\n")


if __name__ == "__main__":
    main()
