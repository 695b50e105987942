"""A fake internet for network tests: namespaces, veth pairs and servers on this machine.

``gw`` plays the edge host (sandbox host ends, firewall, resolver live there); ``inet``
plays the internet, reached from ``gw`` over a veth. Every name carries a random suffix,
and :meth:`FakeInternet.close` removes the namespaces and kills the server by PID.
Nothing is added to the host's own namespace.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SERVERS = Path(__file__).with_name("fakenet_servers.py")
UPLINK_GW, UPLINK_INET = "198.18.0.1", "198.18.0.2"
WEB1, WEB2, WEB3 = "198.18.1.10", "198.18.1.11", "198.18.1.12"
DNS_IP = "198.18.1.53"
# IPv6 (documentation prefix, never routed off this machine)
UPLINK6_GW, UPLINK6_INET = "2001:db8:ffff::1", "2001:db8:ffff::2"
WEB6 = "2001:db8:1::10"
POOL6 = "fd00:dec:213::/64"
ZONE = {
    "web6.test.example": [WEB6, 300],
    "web1.test.example": [WEB1, 300],
    "web2.test.example": [WEB2, 4],  # its expiry is tested
    "web2tcp.test.example": [WEB2, 300],
    "api.svc.example": [WEB3, 300],
    "svc.example": [WEB3, 300],
}
TCP_PORTS = (80, 443, 8080)
UDP_PORT = 5353
SINK_PORT = 9000
POOL = "10.213.0.0/16"


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, check=check, capture_output=True, text=True, timeout=30)


def _is_mount_point(path: str) -> bool:
    # os.path.ismount misses a bind mount of a directory onto itself
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == path for line in f)


class FakeInternet:
    def __init__(self) -> None:
        tag = secrets.token_hex(3)
        self.gw = f"dsect-gw-{tag}"
        self.inet = f"dsect-in-{tag}"
        self.tmp = Path(tempfile.mkdtemp(prefix="dsec-fakenet-"))
        self.dns_log = self.tmp / "dns.log"
        self.proc: subprocess.Popen[str] | None = None
        # `ip netns add` bind-mounts /run/netns onto itself once; undo it if we caused it
        self.run_netns_was_mount = _is_mount_point("/run/netns")

    @property
    def gw_path(self) -> str:
        return f"/run/netns/{self.gw}"

    def start(self) -> FakeInternet:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def _start(self) -> None:
        sh("ip", "netns", "add", self.gw)
        sh("ip", "netns", "add", self.inet)
        g, i = ("ip", "-n", self.gw), ("ip", "-n", self.inet)
        sh(*g, "link", "set", "lo", "up")
        sh(*i, "link", "set", "lo", "up")
        sh(*g, "link", "add", "up0", "type", "veth", "peer", "name", "up1", "netns", self.inet)
        sh(*g, "addr", "add", f"{UPLINK_GW}/24", "dev", "up0")
        sh(*g, "link", "set", "up0", "up")
        sh(*i, "addr", "add", f"{UPLINK_INET}/24", "dev", "up1")
        sh(*i, "link", "set", "up1", "up")
        sh(*g, "route", "add", "default", "via", UPLINK_INET)
        for ns in (self.gw, self.inet):
            sh("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=0")
        sh(*g, "-6", "addr", "add", f"{UPLINK6_GW}/64", "dev", "up0", "nodad")
        sh(*i, "-6", "addr", "add", f"{UPLINK6_INET}/64", "dev", "up1", "nodad")
        sh(*g, "-6", "route", "add", "default", "via", UPLINK6_INET)
        sh(*i, "-6", "addr", "add", f"{WEB6}/128", "dev", "lo")
        sh(*i, "-6", "route", "add", POOL6, "via", UPLINK6_GW)
        for ip in (WEB1, WEB2, WEB3, DNS_IP):
            sh(*i, "addr", "add", f"{ip}/32", "dev", "lo")
        # A route back to the sandbox pool, so ingress attempts really reach the gateway.
        sh(*i, "route", "add", POOL, "via", UPLINK_GW)
        cfg = {
            "tcp": [[ip, p] for ip in (WEB1, WEB2, WEB3, WEB6) for p in TCP_PORTS],
            "udp": [[ip, UDP_PORT] for ip in (WEB1, WEB2, WEB3)],
            "sink": [[WEB1, SINK_PORT]],
            "dns": [DNS_IP, 53],
            "zone": ZONE,
            "log": str(self.dns_log),
        }
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", self.inet, sys.executable, str(SERVERS), json.dumps(cfg)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError("fake internet servers did not start")

    def dns_queries(self) -> list[str]:
        return self.dns_log.read_text().split() if self.dns_log.exists() else []

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None
        for ns in (self.gw, self.inet):
            sh("ip", "netns", "del", ns, check=False)
        run_netns = Path("/run/netns")
        if (
            not self.run_netns_was_mount
            and _is_mount_point("/run/netns")
            and not any(run_netns.iterdir())
        ):
            for _ in range(4):  # `ip netns` may have stacked more than one
                if not _is_mount_point("/run/netns"):
                    break
                sh("umount", str(run_netns), check=False)
        for f in self.tmp.iterdir():
            f.unlink()
        self.tmp.rmdir()


PROBE = r"""
import socket, sys, json
kind, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
try:
    if kind == "tcp":
        s = socket.create_connection((host, port), timeout=float(sys.argv[4]))
        s.settimeout(3); print(s.recv(100).decode().strip())
    elif kind == "udp":
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(float(sys.argv[4]))
        s.sendto(b"ping", (host, port)); print(s.recv(100).decode())
    elif kind == "dns":  # host: NAME or NAME/AAAA
        from dnslib import DNSRecord, RCODE
        q = DNSRecord.question(*host.split("/"))
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(float(sys.argv[4]))
        s.sendto(q.pack(), (sys.argv[5], 53)); r = DNSRecord.parse(s.recv(4096))
        print(RCODE.get(r.header.rcode), *[str(a.rdata) for a in r.rr])
    elif kind == "dnstcp":  # two queries on one connection (RFC 7766 framing)
        from dnslib import DNSRecord, RCODE
        s = socket.create_connection((sys.argv[5], 53), timeout=float(sys.argv[4]))
        out = []
        for name in host.split(","):
            q = DNSRecord.question(name).pack()
            s.sendall(len(q).to_bytes(2, "big") + q)
            n = int.from_bytes(s.recv(2), "big"); data = b""
            while len(data) < n:
                data += s.recv(n - len(data))
            r = DNSRecord.parse(data)
            out.append(" ".join([RCODE.get(r.header.rcode), *[str(a.rdata) for a in r.rr]]))
        print(" | ".join(out))
except socket.gaierror as e:
    print("gaierror", e.errno)
except ConnectionRefusedError:
    print("refused")
except OSError as e:
    print(type(e).__name__, e.errno)
"""


def probe(
    netns: str | os.PathLike[str],
    kind: str,
    host: str,
    port: int = 0,
    timeout: float = 1.5,
    server: str = "",
) -> str:
    """Run a probe (tcp, udp, dns) inside a namespace; returns its one-line outcome."""
    argv = [sys.executable, "-c", PROBE, kind, host, str(port), str(timeout), server]
    out = subprocess.run(
        ["nsenter", f"--net={netns}", *argv],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return out.stdout.strip() or out.stderr.strip()


def wait_for(fn, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while True:
        v = fn()
        if v or time.monotonic() > deadline:
            return v
        time.sleep(0.05)
