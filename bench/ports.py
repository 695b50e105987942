"""Sandbox ports benchmark: raw TCP streams (``sbx.connect_tcp``) and ``port-forward``.

Starts the real platform in a temp home, runs a small server in one sandbox, and measures
side by side with the runtime channel's other users, alternating run by run:

* opening a stream and getting the first byte back, against ``exec("true")``;
* a 64-byte echo round trip on an open stream, against the same over a plain loopback TCP
  connection on this host (the floor);
* 64 MiB sent into the sandbox (``send`` then the server's byte count) against
  ``files.write`` of the same bytes, and 64 MiB out (``recv``) against ``files.read``;
* 64 MiB out through ``dsec sandbox port-forward`` (a local socket).

    .venv/bin/python -m bench.ports [--quick]

Prints JSON and writes ``bench/results/ports.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench.foundation import settle, summary
from dsec.core.errors import Unavailable
from dsec.sdk import Client, Sandbox
from dsec.testing.platform import running_platform

PORT = 7300
MIB = 64
SERVER = f"""
import socket, threading
def serve(c):
    f = c.makefile("rb")
    cmd = f.readline().split()
    if not cmd:
        pass
    elif cmd[0] == b"echo":
        while data := f.read1(65536):
            c.sendall(data)
    elif cmd[0] == b"sink":
        n = 0
        while data := f.read1(1 << 20):
            n += len(data)
        c.sendall(str(n).encode())
    elif cmd[0] == b"source":
        block, left = b"x" * (1 << 20), int(cmd[1])
        while left > 0:
            c.sendall(block[:left]); left -= len(block)
    c.close()
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", {PORT})); s.listen()
while True:
    c, _ = s.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"""


def start(sbx: Sandbox) -> None:
    sbx.files.write("/root/srv.py", SERVER)
    sbx.processes.start(["python3", "/root/srv.py"])
    deadline = time.monotonic() + 20
    while True:
        try:
            sbx.connect_tcp(PORT).close()
            return
        except Unavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def open_first_byte(sbx: Sandbox) -> float:
    t0 = time.perf_counter()
    with sbx.connect_tcp(PORT) as tcp:
        tcp.send(b"echo\nx")
        assert tcp.recv()
        return time.perf_counter() - t0


def exec_true(sbx: Sandbox) -> float:
    t0 = time.perf_counter()
    assert sbx.exec("true").exit_code == 0
    return time.perf_counter() - t0


def echo_round_trips(sbx: Sandbox, n: int) -> tuple[list[float], list[float]]:
    local = socket.create_server(("127.0.0.1", 0))

    def echo() -> None:
        c, _ = local.accept()
        while data := c.recv(65536):
            c.sendall(data)
        c.close()

    threading.Thread(target=echo, daemon=True).start()
    plain = socket.create_connection(local.getsockname())
    plain.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    msg = b"m" * 64
    a, b = [], []
    with sbx.connect_tcp(PORT) as tcp:
        tcp.send(b"echo\n")
        for _ in range(n):
            t0 = time.perf_counter()
            tcp.send(msg)
            got = b""
            while len(got) < len(msg):
                got += tcp.recv()
            a.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            plain.sendall(msg)
            got = b""
            while len(got) < len(msg):
                got += plain.recv(65536)
            b.append(time.perf_counter() - t0)
    plain.close()
    local.close()
    return a, b


def upload(sbx: Sandbox) -> tuple[float, float]:
    data = os.urandom(1 << 20) * MIB
    t0 = time.perf_counter()
    with sbx.connect_tcp(PORT) as tcp:
        tcp.send(b"sink\n")
        for i in range(0, len(data), 1 << 20):
            tcp.send(data[i : i + (1 << 20)])
        tcp.close_write()
        assert b"".join(tcp) == str(len(data)).encode()
    stream = time.perf_counter() - t0
    t0 = time.perf_counter()
    sbx.files.write("/tmp/up.bin", data)
    files = time.perf_counter() - t0
    return stream, files


def download(sbx: Sandbox) -> tuple[float, float]:
    n = MIB << 20
    t0 = time.perf_counter()
    with sbx.connect_tcp(PORT) as tcp:
        tcp.send(f"source {n}\n")
        got = sum(len(chunk) for chunk in tcp)
    stream = time.perf_counter() - t0
    assert got == n
    sbx.exec(f"head -c {n} /dev/zero > /tmp/down.bin")
    t0 = time.perf_counter()
    assert len(sbx.files.read("/tmp/down.bin")) == n
    return stream, time.perf_counter() - t0


def forwarded_download(sbx: Sandbox, env: dict[str, str], runs: int) -> list[float]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "dsec.cli.main", "sandbox", "port-forward", sbx.id, f"0:{PORT}"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        m = re.match(r"forwarding ([\d.]+):(\d+) ", proc.stdout.readline())
        assert m, "port-forward did not start"
        out = []
        for _ in range(runs):
            t0 = time.perf_counter()
            with socket.create_connection((m[1], int(m[2]))) as s:
                s.sendall(f"source {MIB << 20}\n".encode())
                got = 0
                while data := s.recv(1 << 20):
                    got += len(data)
            out.append(time.perf_counter() - t0)
            assert got == MIB << 20
        return out
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def mib_s(samples: list[float]) -> float:
    return round(MIB / sorted(samples)[len(samples) // 2], 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller samples (smoke run)")
    args = ap.parse_args()
    n, bulk = (20, 2) if args.quick else (100, 5)
    res: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count()}
    with running_platform() as plat:
        client = Client(api_url=plat.api_url, api_key=plat.admin_key)
        sbx = Sandbox.create(cpu=1.0, memory_mb=512, timeout=1800, client=client)
        try:
            start(sbx)
            open_first_byte(sbx)
            exec_true(sbx)
            settle(1)
            a, b = [], []
            for _ in range(n):
                a.append(open_first_byte(sbx))
                b.append(exec_true(sbx))
            res["open_stream_first_byte"] = {"connect_tcp": summary(a), "exec_true": summary(b)}
            ra, rb = echo_round_trips(sbx, n * 2)
            res["echo_64b_round_trip"] = {"connect_tcp": summary(ra), "loopback_tcp": summary(rb)}
            settle(1)
            ups = [upload(sbx) for _ in range(bulk)]
            downs = [download(sbx) for _ in range(bulk)]
            res[f"upload_{MIB}mib_mib_s"] = {
                "connect_tcp": mib_s([u[0] for u in ups]),
                "files_write": mib_s([u[1] for u in ups]),
            }
            res[f"download_{MIB}mib_mib_s"] = {
                "connect_tcp": mib_s([d[0] for d in downs]),
                "files_read": mib_s([d[1] for d in downs]),
                "port_forward": mib_s(forwarded_download(sbx, plat.env(), bulk)),
            }
        finally:
            sbx.kill()
            client.close()
    out_dir = Path(__file__).with_name("results")
    out_dir.mkdir(exist_ok=True)
    name = "ports-quick.json" if args.quick else "ports.json"
    (out_dir / name).write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
