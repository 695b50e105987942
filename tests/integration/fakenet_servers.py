"""Servers of the fake internet (run inside its namespace by fakenet.FakeInternet).

argv[1] is a JSON object: {"tcp": [[ip, port], ...], "udp": [[ip, port], ...],
"sink": [[ip, port], ...] (read everything, answer the byte count),
"dns": [ip, port], "zone": {name: [ip, ttl]}} (an IPv6 ip answers AAAA questions). TCP
servers answer "hello <ip>:<port>\\n" and then echo; UDP servers echo; the DNS server
is authoritative for the zone's names.
"""

import asyncio
import json
import sys

from dnslib import AAAA, QTYPE, RCODE, RR, A, DNSRecord


async def main() -> None:
    cfg = json.loads(sys.argv[1])
    loop = asyncio.get_running_loop()

    def tcp_handler(ip: str, port: int):
        async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            w.write(f"hello {ip}:{port}\n".encode())
            try:
                while data := await r.read(65536):
                    w.write(data)
                    await w.drain()
            except OSError:
                pass
            w.close()

        return handle

    for ip, port in cfg["tcp"]:
        await asyncio.start_server(tcp_handler(ip, port), ip, port)

    async def sink(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        total = 0
        while data := await r.read(1 << 20):
            total += len(data)
        w.write(f"{total}\n".encode())
        await w.drain()
        w.close()

    for ip, port in cfg.get("sink", []):
        await asyncio.start_server(sink, ip, port)

    class Echo(asyncio.DatagramProtocol):
        def connection_made(self, transport):
            self.t = transport

        def datagram_received(self, data, addr):
            self.t.sendto(data, addr)

    for ip, port in cfg["udp"]:
        await loop.create_datagram_endpoint(Echo, local_addr=(ip, port))

    zone = cfg["zone"]

    class Dns(asyncio.DatagramProtocol):
        def connection_made(self, transport):
            self.t = transport

        def datagram_received(self, data, addr):
            q = DNSRecord.parse(data)
            name = str(q.q.qname).rstrip(".").lower()
            reply = q.reply()
            with open(cfg["log"], "a") as f:
                f.write(name + "\n")
            if name in zone:
                ip, ttl = zone[name]
                if q.q.qtype == QTYPE.A and ":" not in ip:
                    reply.add_answer(RR(name, QTYPE.A, rdata=A(ip), ttl=ttl))
                if q.q.qtype == QTYPE.AAAA and ":" in ip:
                    reply.add_answer(RR(name, QTYPE.AAAA, rdata=AAAA(ip), ttl=ttl))
            else:
                reply.header.rcode = RCODE.NXDOMAIN
            self.t.sendto(reply.pack(), addr)

    await loop.create_datagram_endpoint(Dns, local_addr=tuple(cfg["dns"]))
    print("ready", flush=True)
    await asyncio.Event().wait()


asyncio.run(main())
