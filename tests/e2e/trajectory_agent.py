"""An RL-style agent for the preemption test: run as ``python trajectory_agent.py T N``.

It binds its sandbox to trajectory T and does N rounds of three non-idempotent things:
append a line to a file, commit to a repository (``minigit``: a hash-chained commit log
made with python3, since the base image has no git) and call a counter service (a unix
socket server process inside the sandbox that counts requests in memory and logs each).
After each round it prints one JSON line with what the calls answered.
"""

from __future__ import annotations

import json
import sys

from dsec.sdk import Sandbox

COUNTER = r"""
import os, socketserver
n = 0
class H(socketserver.StreamRequestHandler):
    def handle(self):
        global n
        if self.rfile.readline().strip() == b"inc":
            n += 1
            with open("/srv/counter.log", "a") as f:
                f.write(f"{n}\n")
            self.wfile.write(f"{n}\n".encode())
if os.path.exists("/srv/counter.sock"):
    os.unlink("/srv/counter.sock")
socketserver.UnixStreamServer("/srv/counter.sock", H).serve_forever()
"""

CALL_COUNTER = r"""
import socket
s = socket.socket(socket.AF_UNIX)
s.connect("/srv/counter.sock")
s.sendall(b"inc\n")
print(s.makefile().readline().strip())
"""

MINIGIT = r"""
import hashlib, json, os, sys
repo, msg = sys.argv[1], sys.argv[2]
head_path = os.path.join(repo, ".minigit", "HEAD")
os.makedirs(os.path.dirname(head_path), exist_ok=True)
parent = open(head_path).read().strip() if os.path.exists(head_path) else ""
tree = hashlib.sha256()
for name in sorted(os.listdir(repo)):
    p = os.path.join(repo, name)
    if os.path.isfile(p):
        tree.update(name.encode() + b"\0" + open(p, "rb").read())
commit = hashlib.sha256(f"{parent}\n{tree.hexdigest()}\n{msg}".encode()).hexdigest()[:12]
with open(os.path.join(repo, ".minigit", "log"), "a") as f:
    f.write(json.dumps({"commit": commit, "parent": parent, "msg": msg}) + "\n")
open(head_path, "w").write(commit)
print(commit)
"""

WAIT = "for i in $(seq 100); do [ -S /srv/counter.sock ] && exit 0; sleep 0.05; done; exit 1"


def main() -> None:
    trajectory, rounds = sys.argv[1], int(sys.argv[2])
    sbx = Sandbox.create(memory_mb=256, timeout=900, trajectory=trajectory)
    sbx.files.write("/srv/counter.py", COUNTER)
    sbx.files.write("/srv/call_counter.py", CALL_COUNTER)
    sbx.files.write("/srv/minigit.py", MINIGIT)
    sbx.processes.start(["python3", "/srv/counter.py"])
    assert sbx.exec(WAIT).exit_code == 0, "the counter service did not start"
    sbx.exec("mkdir -p /repo")
    for i in range(rounds):
        lines = sbx.exec(f"echo round-{i} >> /repo/notes.txt && wc -l < /repo/notes.txt")
        commit = sbx.exec(["python3", "/srv/minigit.py", "/repo", f"round {i}"])
        count = sbx.exec(["python3", "/srv/call_counter.py"])
        out = {
            "round": i,
            "lines": lines.stdout.strip(),
            "commit": commit.stdout.strip(),
            "count": count.stdout.strip(),
        }
        print(json.dumps(out), flush=True)
    status = sbx.trajectory_status()
    print(json.dumps({"done": sbx.id, "replayed": status["replayed"]}), flush=True)
    sbx.close()


if __name__ == "__main__":
    main()
