"""Control-plane scale benchmark: 100 simulated edges, a 100,000-sandbox inventory, and the
create path (apiserver -> iam admission -> placement -> edge) at full speed.

Separate processes, as in a cluster: the iam (state on SQLite, or on a 3-member etcd
cluster with mutual TLS), the watcher, the apiserver, and one process holding 100
SIMULATED edges (``dsec.testing.simulated_edges``: real gRPC edge servers with their own
certificates that book resources, answer "node full" and send heartbeats, but run no
sandboxes). Before the run the iam's state is loaded with 100,000 live allocations (1,000
per edge, across 100 projects) and the simulated edges with the matching bookings.

The load: ``--concurrency`` callers create sandboxes through the apiserver's public API
with the asyncio SDK (``AsyncSandbox.create`` on one ``AsyncClient``: its keep-alive
HTTP/1.1 pool, the cheapest client a user gets) as fast as they are answered, for
``--seconds`` after a short warm-up. Reported:
creates/s and p50/p99 latency of ``POST /v1/sandboxes`` (authentication, admission against
the project's quota, placement, the edge's create and the audit entry).

    .venv/bin/python -m bench.cluster [--seconds 20] [--concurrency 32] [--only sqlite|etcd]
        [--apiservers N] [--compare SRC --rounds N]

``--apiservers N`` runs N apiserver processes sharing one port (``--reuse-port``), as one
would on an N-core host. ``--compare SRC`` runs each row first with the code in SRC (a
``src`` directory, e.g. from ``git archive REV src``) and then with this checkout's, for
``--rounds`` rounds, and reports the medians: on a shared machine only rows measured side
by side compare. Each row reports the CPU time per create of every process on the path
(``/proc/<pid>/stat`` before and after the run; the bench's own HTTP clients too), the CPU
the processes spend idle (heartbeats, polling) and what a create adds beyond it, and how
many ``AdmitMany`` calls the apiserver made per create (from its ``/metrics``; absent for
code that does not count them), and the CPU time a fixed piece of Python takes in the
bench's process before and after the run (``calibration_ms``): when the rounds' CPU per
create drifts by the same ratio, the machine drifted, not the code or its state.
``BENCH_PYSPY=DIR`` samples every process with py-spy during the run.

Prints a Markdown table and writes ``bench/results/cluster.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from dsec.core.errors import DsecError
from dsec.core.ids import RANDOM_BYTES, new_sandbox_id
from dsec.iam import kv as kvlayout
from dsec.iam.db import IamDb
from dsec.iam.kv import KvIam
from dsec.iam.records import Admission, Project
from dsec.rpc.tls import Identity, ensure_pki
from dsec.sdk import AsyncClient, AsyncSandbox
from dsec.store.api import Put
from dsec.store.etcd import EtcdStore
from dsec.testing.etcd import etcd_binary, etcd_cluster
from dsec.testing.ports import free_port

EDGES = 100
PROJECTS = 100
INVENTORY = 100_000
IDLE_S = 6.0


def _edge_ids() -> list[str]:
    return [f"s{n:03d}" for n in range(EDGES)]


def _inventory() -> list[Admission]:
    out = []
    for n in range(INVENTORY):
        edge = f"s{n % EDGES:03d}"
        sid = new_sandbox_id(edge, os.urandom(RANDOM_BYTES))
        out.append(Admission(f"bench/p{n % PROJECTS:03d}", sid, 0.1, 64, edge))
    return out


def _projects() -> list[Project]:
    return [Project("bench", 0, 0, 0)] + [
        Project(f"bench/p{i:03d}", 5000, 0, 0) for i in range(PROJECTS)
    ]


def _write_key(home: Path) -> Any:
    def write(key_id: str, api_key: str) -> None:
        (home / "admin.key").write_text(api_key + "\n")
        os.chmod(home / "admin.key", 0o600)

    return write


def load_sqlite(home: Path) -> None:
    db = IamDb(home / "iam.db")
    try:
        db.bootstrap(_write_key(home))
        for p in _projects():
            db.put_project(p)
        inv = _inventory()
        for i in range(0, len(inv), 5000):
            db.admit_many(inv[i : i + 5000])
    finally:
        db.close()


async def load_kv(home: Path, store: EtcdStore) -> None:
    """Projects through KvIam; the inventory written straight in KvIam's layout (the
    allocation records and the per-project usage they sum), 120 keys per transaction: the
    same state 100,000 admissions would leave, without 100,000 admissions' worth of time."""
    kv = KvIam(store)
    await kv.bootstrap(_write_key(home))
    for p in _projects():
        await kv.put_project(p)
    inv = _inventory()
    usage: dict[str, list[int]] = {}
    puts = []
    for a in inv:
        puts.append(Put(kvlayout.alloc_key(a.sandbox_id), kvlayout.dump(
            {"p": a.project, "c": 100, "m": a.memory_mb, "t": time.time()})))  # fmt: skip
        for level in (a.project.rpartition("/")[0], a.project):
            u = usage.setdefault(level, [0, 0, 0])
            u[0], u[1], u[2] = u[0] + 1, u[1] + 100, u[2] + a.memory_mb
    puts += [Put(kvlayout.usage_key(lv), kvlayout.dump(u)) for lv, u in usage.items()]
    for i in range(0, len(puts), 120):
        await store.txn((), puts[i : i + 120])


def _calibrate() -> float:
    """CPU ms of a fixed piece of pure Python (the best of 5): how fast this machine runs
    Python just now. Rounds whose CPU per create differ by the same ratio differ by the
    machine (its clock, what shares its caches), not by the code or the state."""
    best = float("inf")
    for _ in range(5):
        t = time.process_time()
        sum(i * i for i in range(100_000))
        best = min(best, time.process_time() - t)
    return round(best * 1000, 2)


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _batch_counts(api: str) -> tuple[float, float] | None:
    """The apiserver's ``AdmitMany`` calls and the items they carried so far (None: the
    code measured does not count them)."""
    async with httpx.AsyncClient() as c:
        text = (await c.get(f"{api}/metrics", timeout=10)).text
    got = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("dsec_apiserver_iam_batch_calls", "dsec_apiserver_iam_batch_items"):
            got[name.rpartition("_")[2]] = float(value)
    return (got["calls"], got["items"]) if len(got) == 2 else None


def _spawn(argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with open(log, "ab") as f:
        return subprocess.Popen(argv, stdout=f, stderr=f, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)  # fmt: skip


def _profile(
    procs: list[subprocess.Popen[bytes]], names: list[str], seconds: float
) -> list[subprocess.Popen[bytes]]:
    """With BENCH_PYSPY=DIR: sample each process with py-spy over the measured run, only
    while it holds the GIL (raw stacks, DIR/<process><n>.txt). py-spy must be installed."""
    out = os.environ.get("BENCH_PYSPY")
    if not out:
        return []
    Path(out).mkdir(parents=True, exist_ok=True)
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    argv = [spy, "record", "--nonblocking", "--gil", "-r", "200", "-f", "raw"]
    spies = []
    for i, (p, name) in enumerate(zip(procs, names, strict=True)):
        where = f"{out}/{name.replace(' ', '_')}{i}.txt"
        run = [*argv, "-d", str(int(seconds + 3)), "-p", str(p.pid), "-o", where]
        spies.append(subprocess.Popen(run, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return spies


async def _wait_edges(api: str, key: str, n: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {key}"}) as c:
        while time.monotonic() < deadline:
            try:
                r = await c.get(f"{api}/v1/edges", timeout=5)
                if r.status_code == 200 and sum(e["healthy"] for e in r.json()["edges"]) >= n:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.5)
    raise RuntimeError(f"{n} edges did not become healthy")


async def load(api: str, key: str, seconds: float, concurrency: int) -> dict[str, Any]:
    """``concurrency`` callers creating sandboxes through the asyncio SDK (one client: its
    keep-alive HTTP/1.1 pool, a connection per caller) as fast as they are answered."""
    latencies: list[float] = []
    errors: dict[str, int] = {}
    warmup_end = time.monotonic() + 3.0
    end = warmup_end + seconds
    cpu0 = time.process_time()
    async with AsyncClient(api, key) as client:

        async def worker(w: int) -> None:
            n = 0
            while time.monotonic() < end:
                project = f"bench/p{(w * 7 + n) % PROJECTS:03d}"
                n += 1
                t = time.perf_counter()
                try:
                    await AsyncSandbox.create(cpu=0.1, memory_mb=64, timeout=3600,
                                              project=project, client=client)  # fmt: skip
                except DsecError as exc:
                    errors[exc.code] = errors.get(exc.code, 0) + 1
                    continue
                took = time.perf_counter() - t
                if time.monotonic() > warmup_end:
                    latencies.append(took)

        await asyncio.gather(*(worker(w) for w in range(concurrency)))
    ms = sorted(x * 1000 for x in latencies)
    return {
        "creates": len(ms),
        "creates_per_s": round(len(ms) / seconds, 1),
        "p50_ms": round(statistics.median(ms), 1) if ms else None,
        "p99_ms": round(ms[min(len(ms) - 1, int(len(ms) * 0.99))], 1) if ms else None,
        "errors": errors,
        "client_cpu_ms_per_create": round((time.process_time() - cpu0) * 1000 / max(1, len(ms)), 2),
    }


def _make_pki(pki: Path) -> None:
    idents = [Identity.singleton(r) for r in ("iam", "watcher", "apiserver", "admin")]
    ensure_pki(pki, [*idents, *(Identity.edge(e) for e in _edge_ids())])


async def run_one(
    backend: str, home: Path, seconds: float, concurrency: int, apiservers: int = 1, *,
    src: str = "", sqlite_template: Path | None = None,
) -> dict[str, Any]:  # fmt: skip
    """One row: fresh processes (of the code in ``src`` when given) over a fresh copy of the
    state; SQLite state is copied from ``sqlite_template`` when given."""
    iam_home, w_home = home / "iam", home / "watcher"
    a_homes = [home / f"apiserver{i}" for i in range(apiservers)]
    if sqlite_template is not None:
        shutil.copytree(sqlite_template, iam_home)
    for h in (iam_home, w_home, *a_homes):
        h.mkdir(parents=True, exist_ok=True)
    pki = iam_home / "pki"
    if not pki.exists():
        _make_pki(pki)
    for h in (w_home, *a_homes):
        shutil.copytree(pki, h / "pki")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if src:  # another version of dsec, ahead of the installed one
        env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [env.get("PYTHONPATH")])])
    procs: list[subprocess.Popen[bytes]] = []
    store_args: list[str] = []
    cluster_cm = None
    t0 = time.monotonic()
    try:
        if backend == "etcd":
            cluster_cm = etcd_cluster(home / "etcd", size=3, tls=True)
            cluster = cluster_cm.__enter__()
            assert cluster.pki is not None
            tls_dir = home / "etcd-tls"
            tls_dir.mkdir()
            for name, pem in (("ca.pem", cluster.pki.ca), ("client.pem", cluster.pki.client_cert),
                              ("client-key.pem", cluster.pki.client_key)):  # fmt: skip
                shutil.copy2(pem, tls_dir / name)
            store = EtcdStore(cluster.endpoints, tls=cluster.client_tls())
            try:
                await load_kv(iam_home, store)
            finally:
                await store.aclose()
            store_args = ["--store", "etcd://" + ",".join(cluster.endpoints),
                          "--etcd-tls", str(tls_dir)]  # fmt: skip
        elif sqlite_template is None:
            await asyncio.to_thread(load_sqlite, iam_home)
        loaded_s = time.monotonic() - t0
        if sqlite_template is None:
            print(f"  {backend}: {INVENTORY} allocations loaded in {loaded_s:.0f} s", flush=True)
        iam_port, w_port, a_port = free_port(), free_port(), free_port()
        py = sys.executable
        procs.append(_spawn([py, "-m", "dsec.iam", "--home", str(iam_home), "--listen",
                             f"127.0.0.1:{iam_port}", "--metrics-listen", "",
                             "--log-level", "WARNING", *store_args],
                            home / "iam.log", env))  # fmt: skip
        procs.append(_spawn([py, "-m", "dsec.watcher", "--home", str(w_home), "--listen",
                             f"127.0.0.1:{w_port}", "--metrics-listen", "",
                             "--log-level", "WARNING"], home / "watcher.log", env))  # fmt: skip
        prof = ["-m", "cProfile", "-o", os.environ["BENCH_PROFILE"]] if os.environ.get(
            "BENCH_PROFILE") else []  # fmt: skip
        for i, a_home in enumerate(a_homes):
            out = [*prof[:-1], f"{prof[-1]}.{i}"] if prof else []
            procs.append(_spawn([py, *out, "-m", "dsec.apiserver", "--home", str(a_home),
                                 "--listen", f"127.0.0.1:{a_port}", "--iam",
                                 f"127.0.0.1:{iam_port}", "--watcher", f"127.0.0.1:{w_port}",
                                 "--log-level", "WARNING", "--reuse-port"],
                                home / f"apiserver{i}.log", env))  # fmt: skip
        procs.append(_spawn([py, "-m", "dsec.testing.simulated_edges", "--pki", str(pki),
                             "--edges", ",".join(_edge_ids()), "--watcher",
                             f"127.0.0.1:{w_port}", "--preload", str(INVENTORY // EDGES)],
                            home / "edges.log", env))  # fmt: skip
        key = (iam_home / "admin.key").read_text().strip()
        api = f"http://127.0.0.1:{a_port}"
        await _wait_edges(api, key, EDGES)
        names = ["iam", "watcher", *["apiserver"] * apiservers, "simulated edges"]
        idle0 = [_cpu_s(p.pid) for p in procs]
        await asyncio.sleep(IDLE_S)  # what each process spends with no creates (heartbeats)
        idle = [(_cpu_s(p.pid) - b) * 1000 / IDLE_S for p, b in zip(procs, idle0, strict=True)]
        calibration = _calibrate()
        spies = _profile(procs, names, seconds)
        batches0 = await _batch_counts(api) if apiservers == 1 else None
        before = [_cpu_s(p.pid) for p in procs]
        result = await load(api, key, seconds, concurrency)
        for s in spies:
            s.wait()
        spent = [_cpu_s(p.pid) - b for p, b in zip(procs, before, strict=True)]
        batches1 = await _batch_counts(api) if batches0 is not None else None
        if batches0 is not None and batches1 is not None:
            calls = max(1.0, batches1[0] - batches0[0])
            made = max(1.0, result["creates"] * (seconds + 3.0) / seconds)  # and the warm-up's
            result["iam_calls_per_create"] = round(calls / made, 3)
            result["items_per_iam_call"] = round((batches1[1] - batches0[1]) / calls, 1)
        n = max(1, result["creates"])
        cpu: dict[str, float] = {}
        for k, v in zip(names, spent, strict=True):
            cpu[k] = cpu.get(k, 0.0) + v * 1000 / n
        cpu["bench client"] = result["client_cpu_ms_per_create"]  # the HTTP clients' share
        result["cpu_ms_per_create"] = {k: round(v, 2) for k, v in cpu.items()}
        idle_ms: dict[str, float] = {}
        for k, v in zip(names, idle, strict=True):
            idle_ms[k] = idle_ms.get(k, 0.0) + v
        idle_ms["bench client"] = 0.0  # it only runs during the load
        result["idle_cpu_ms_per_s"] = {k: round(v, 1) for k, v in idle_ms.items()}
        # what a create adds: the CPU of the run less what the processes spend idle (their
        # heartbeats and polling, which a low rate on a loaded machine inflates per create)
        rate = max(0.1, result["creates_per_s"])
        result["added_cpu_ms_per_create"] = {
            k: round(max(0.0, cpu[k] - idle_ms[k] / rate), 2) for k in cpu
        }
        result["apiservers"] = apiservers
        result["load_average"] = os.getloadavg()
        result["calibration_ms"] = (calibration, _calibrate())  # before and after the run
        result["inventory_load_s"] = round(loaded_s, 1)
        return result
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if cluster_cm is not None:
            cluster_cm.__exit__(None, None, None)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """Rows in turn, ``--rounds`` times; with ``--compare SRC`` each round runs the code in
    SRC first, then this checkout's (same load, same machine, minutes apart)."""
    backends = ["sqlite", "etcd"] if not args.only else [args.only]
    if "etcd" in backends and etcd_binary() is None:
        print("  etcd: skipped (no etcd binary; apt-get install etcd-server)")
        backends.remove("etcd")
    variants = [("compare", args.compare), ("now", "")] if args.compare else [("now", "")]
    out: dict[str, Any] = {}
    root = Path(tempfile.mkdtemp(prefix=f"dsec-bench-{secrets.token_hex(2)}-", dir="/tmp"))
    try:
        template = None
        if "sqlite" in backends:  # loaded once, copied for each row
            template = root / "sqlite-template"
            template.mkdir()
            t0 = time.monotonic()
            await asyncio.to_thread(load_sqlite, template)
            _make_pki(template / "pki")
            print(f"  sqlite: {INVENTORY} allocations loaded in {time.monotonic() - t0:.0f} s")
        for rnd in range(args.rounds):
            for b in backends:
                for label, src in variants:
                    name = b if label == "now" else f"{b} ({label}: {args.compare})"
                    home = root / f"{b}-{label}-{rnd}"
                    t = template if b == "sqlite" else None
                    r = await run_one(b, home, args.seconds, args.concurrency, args.apiservers,
                                      src=src, sqlite_template=t)  # fmt: skip
                    shutil.rmtree(home, ignore_errors=True)
                    cpu = sum(r["cpu_ms_per_create"].values())
                    print(f"  {name}, round {rnd + 1}: {r['creates_per_s']}/s, "
                          f"p99 {r['p99_ms']} ms, {cpu:.2f} CPU ms per create, "
                          f"calibration {r['calibration_ms'][0]} ms, "
                          f"load {r['load_average'][0]:.1f}", flush=True)  # fmt: skip
                    out.setdefault(name, []).append(r)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {name: _median_row(rows) for name, rows in out.items()}


def _median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of each number over the rounds (the rounds themselves kept in "runs")."""
    if len(rows) == 1:
        return rows[0]

    def med(key: str, sub: str = "") -> float:
        return round(float(statistics.median(r[key][sub] if sub else r[key] for r in rows)), 2)

    errors: dict[str, int] = {}
    for r in rows:
        for k, v in r["errors"].items():
            errors[k] = errors.get(k, 0) + v
    batching = {k: med(k) for k in ("iam_calls_per_create", "items_per_iam_call")
                if all(k in r for r in rows)}  # fmt: skip
    return {
        **batching,
        "creates_per_s": med("creates_per_s"), "p50_ms": med("p50_ms"), "p99_ms": med("p99_ms"),
        "cpu_ms_per_create": {k: med("cpu_ms_per_create", k) for k in rows[0]["cpu_ms_per_create"]},
        "idle_cpu_ms_per_s": {k: med("idle_cpu_ms_per_s", k) for k in rows[0]["idle_cpu_ms_per_s"]},
        "added_cpu_ms_per_create": {k: med("added_cpu_ms_per_create", k)
                                    for k in rows[0]["added_cpu_ms_per_create"]},
        "errors": errors, "load_average": [r["load_average"][0] for r in rows], "runs": rows,
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--only", choices=["sqlite", "etcd"], default="")
    ap.add_argument("--apiservers", type=int, default=1, help="apiserver processes on one port")
    ap.add_argument("--out", default="", help="results file (default bench/results/cluster.json)")
    ap.add_argument("--inventory", type=int, default=INVENTORY, help="live sandboxes at start")
    ap.add_argument("--compare", default="",
                    help="also run the code in this src directory (e.g. of `git archive REV src`) "
                         "before each row of this checkout's")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=1, help="rows per variant (medians reported)")
    args = ap.parse_args()
    globals()["INVENTORY"] = args.inventory
    results = asyncio.run(run(args))
    print(f"\n{EDGES} simulated edges, {INVENTORY} live sandboxes, "
          f"{args.concurrency} concurrent clients, {args.apiservers} apiserver(s), "
          f"{args.seconds:g} s, load average at the end "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}\n")  # fmt: skip
    print("| iam state | creates/s | p50 ms | p99 ms | CPU ms per create | of it added by "
          "the create | idle CPU ms/s | iam calls per create | errors |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")

    def parts(d: dict[str, float]) -> str:
        return " / ".join(f"{v}" for v in d.values()) + f" = {sum(d.values()):.2f}"

    for name, r in results.items():
        print(f"| {name} | {r['creates_per_s']} | {r['p50_ms']} | {r['p99_ms']} | "
              f"{parts(r['cpu_ms_per_create'])} | {parts(r['added_cpu_ms_per_create'])} | "
              f"{parts(r['idle_cpu_ms_per_s'])} | {r.get('iam_calls_per_create', '-')} | "
              f"{r['errors'] or '-'} |")  # fmt: skip
    print(f"\n(CPU columns: {' / '.join(next(iter(results.values()))['cpu_ms_per_create'])})")
    out = Path(args.out or Path(__file__).parent / "results" / "cluster.json")
    out.write_text(json.dumps({"edges": EDGES, "inventory": INVENTORY,
                               "concurrency": args.concurrency, "apiservers": args.apiservers,
                               "seconds": args.seconds, "rounds": args.rounds,
                               "compare": args.compare, "results": results},
                              indent=2) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
