"""A tiny WebSocket server (stdlib only) that tests copy into a sandbox and run there.

``python3 ws_server.py PORT``: greets with ``hello <path> auth=<whether an Authorization
header arrived>``, echoes text upper-cased and binary reversed, answers pings, closes
with 4001 when sent ``bye``, and records the close code a client sent in /root/ws-closed.
"""

from __future__ import annotations

import base64
import hashlib
import socket
import struct
import sys
import threading

GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


def recv_some(c: socket.socket, n: int = 4096) -> bytes:
    d = c.recv(n)
    if not d:  # never loop on EOF: a thread spinning on it eats the sandbox's CPU
        raise EOFError
    return d


def recv_exact(c: socket.socket, n: int) -> bytes:
    b = b""
    while len(b) < n:
        b += recv_some(c, n - len(b))
    return b


def read_frame(c: socket.socket) -> tuple[int, bytes]:
    h = recv_exact(c, 2)
    op, n = h[0] & 15, h[1] & 127
    if n == 126:
        n = struct.unpack("!H", recv_exact(c, 2))[0]
    elif n == 127:
        n = struct.unpack("!Q", recv_exact(c, 8))[0]
    mask = recv_exact(c, 4)
    data = bytes(b ^ mask[i % 4] for i, b in enumerate(recv_exact(c, n)))
    return op, data


def send_frame(c: socket.socket, op: int, data: bytes) -> None:
    n = len(data)
    if n < 126:
        h = bytes([0x80 | op, n])
    elif n < 65536:
        h = bytes([0x80 | op, 126]) + struct.pack("!H", n)
    else:
        h = bytes([0x80 | op, 127]) + struct.pack("!Q", n)
    c.sendall(h + data)


def serve(c: socket.socket) -> None:
    try:
        answer(c)
    except (EOFError, OSError):
        pass  # the client left (a readiness probe connects and closes at once)
    finally:
        c.close()


def answer(c: socket.socket) -> None:
    req = b""
    while b"\r\n\r\n" not in req:
        req += recv_some(c)
    lines = req.decode().split("\r\n")
    hdr: dict[str, str] = {}
    for line in lines[1:]:
        k, sep, v = line.partition(":")
        if sep:
            hdr[k.strip().lower()] = v.strip()
    key = hdr["sec-websocket-key"] + GUID
    accept = base64.b64encode(hashlib.sha1(key.encode()).digest()).decode()
    resp = "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    resp += "Sec-WebSocket-Accept: " + accept + "\r\n"
    if "sec-websocket-protocol" in hdr:
        chosen = hdr["sec-websocket-protocol"].split(",")[0].strip()
        resp += "Sec-WebSocket-Protocol: " + chosen + "\r\n"
    c.sendall((resp + "\r\n").encode())
    path = lines[0].split()[1]
    send_frame(c, 1, f"hello {path} auth={'authorization' in hdr}".encode())
    while True:
        op, data = read_frame(c)
        if op == 8:
            code = str(struct.unpack("!H", data[:2])[0]) if data else "none"
            with open("/root/ws-closed", "w") as f:
                f.write(code)
            send_frame(c, 8, data[:2])
            break
        if op == 9:
            send_frame(c, 10, data)
        elif data == b"bye":
            send_frame(c, 8, struct.pack("!H", 4001) + b"server says bye")
        else:
            send_frame(c, op, data.upper() if op == 1 else data[::-1])


def main() -> None:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", int(sys.argv[1])))
    s.listen()
    while True:
        conn, _ = s.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


if __name__ == "__main__":
    main()
