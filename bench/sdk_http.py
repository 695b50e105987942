"""The SDK's HTTP cost per JSON call: its keep-alive pool (``dsec.sdk.http1``) against httpx.

Starts a small aiohttp server in a child process that answers an exec-sized JSON body, then
sends n POSTs with each client in turn (alternating rounds) and reports the median wall
time and the client's own CPU time per request (``getrusage``; the server's CPU is not
counted). Needs no platform and no root.

    .venv/bin/python -m bench.sdk_http [--n 2000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import httpx

from dsec.sdk.http1 import Http1Pool
from dsec.sdk.wire import Request, auth_headers, json_body
from dsec.testing.ports import free_port

SERVER = """
import sys
from aiohttp import web
REPLY = {"exit_code": 0, "signal": None, "stdout": "", "stderr": "", "truncated": False}
async def exec_(request):
    await request.read()
    return web.json_response(REPLY)
app = web.Application()
app.router.add_post("/v1/sandboxes/{sid}/exec", exec_)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None)
"""


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _wait_listening(port: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _measure(send: Callable[[], None], n: int) -> dict[str, float]:
    for _ in range(50):
        send()
    samples = []
    c0 = _cpu()
    for _ in range(n):
        t = time.perf_counter()
        send()
        samples.append(time.perf_counter() - t)
    return {
        "p50_ms": round(statistics.median(samples) * 1000, 3),
        "client_cpu_ms": round((_cpu() - c0) / n * 1000, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(port)])
    load_before = [round(x, 2) for x in os.getloadavg()]
    try:
        _wait_listening(port)
        headers = auth_headers("dsk_" + "x" * 40)
        body = json_body({"cmd": ["true"], "timeout": 60})
        req = Request(
            "POST",
            "/v1/sandboxes/abc/exec",
            body=body,
            headers=(("Content-Type", "application/json"),),
            timeout=60,
        )
        pool = Http1Pool(url, headers, False)
        hx = httpx.Client(headers=headers, timeout=60)
        target = httpx.URL(url + req.path)

        def via_pool() -> None:
            status, data = pool.request(req, body)
            assert status == 200
            json.loads(data)

        def via_httpx() -> None:
            r = hx.request("POST", target, content=body, headers=dict(req.headers))
            assert r.status_code == 200
            json.loads(r.content)

        runs: dict[str, list[dict[str, float]]] = {"http1 pool": [], "httpx": []}
        for _ in range(args.rounds):
            runs["http1 pool"].append(_measure(via_pool, args.n))
            runs["httpx"].append(_measure(via_httpx, args.n))
        pool.close()
        hx.close()
    finally:
        server.terminate()
        server.wait()
    load_after = [round(x, 2) for x in os.getloadavg()]
    print("| client | wall p50 (ms), median of rounds | client CPU per request (ms) |")
    print("|---|---|---|")
    for name, rs in runs.items():
        p50 = statistics.median(r["p50_ms"] for r in rs)
        cpu = statistics.median(r["client_cpu_ms"] for r in rs)
        print(f"| {name} | {p50:.3f} | {cpu:.3f} |")
    print(f"load average: {load_before} before, {load_after} after; n={args.n} x {args.rounds}")


if __name__ == "__main__":
    main()
