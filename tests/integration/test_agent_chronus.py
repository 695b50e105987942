"""chronus through aether on this host: processes, PTYs, shell sessions, aether restarts."""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Iterator
from typing import Any

import pytest

from dsec.agent.local import LocalAgent, SyncStream, local_agent
from dsec.agent.protocol import KIND_ERR, KIND_IN, KIND_OUT
from tests.waits import until

pytestmark = pytest.mark.skipif(not shutil.which("bash"), reason="needs bash")


@pytest.fixture
def agent() -> Iterator[LocalAgent]:
    with local_agent() as a:
        yield a


def start(agent: LocalAgent, **req: object) -> int:
    pid = agent.call({"op": "process.start", **req}).result["pid"]
    assert isinstance(pid, int)
    return pid


def read_until(stream: SyncStream, pattern: bytes, timeout: float = 10.0) -> bytes:
    """Read output frames until ``pattern`` (a regex) matches what was read."""
    seen = b""
    deadline = time.monotonic() + timeout
    while not re.search(pattern, seen):
        assert time.monotonic() < deadline, f"no {pattern!r} in {seen!r}"
        frame = stream.recv()
        assert frame is not None, f"stream ended; no {pattern!r} in {seen!r}"
        if frame[0] in (KIND_OUT, KIND_ERR):
            seen += frame[1]
    return seen


def wait_exit(agent: LocalAgent, pid: int) -> dict[str, Any]:
    deadline = time.monotonic() + 10
    while True:
        procs: list[dict[str, Any]] = agent.call({"op": "process.list"}).result["processes"]
        (info,) = [p for p in procs if p["pid"] == pid]
        if not info["running"] or time.monotonic() > deadline:
            return info
        time.sleep(0.05)


# -- processes ------------------------------------------------------------------------------


def test_process_replay_and_list(agent: LocalAgent):
    pid = start(agent, cmd="echo out1; echo err1 >&2; sleep 0.3; echo out2", tag="job")
    info = wait_exit(agent, pid)
    fields = (info["running"], info["exit_code"], info["tag"], info["pty"])
    assert fields == (False, 0, "job", False)
    assert isinstance(info["started_at"], float)
    reply = agent.call({"op": "process.connect", "pid": pid})
    assert (reply.stdout, reply.stderr) == (b"out1\nout2\n", b"err1\n")
    assert reply.result == {"exit_code": 0, "signal": None}
    again = agent.call({"op": "process.connect", "pid": pid})  # replay is repeatable
    assert again.stdout == b"out1\nout2\n"


def test_process_start_and_follow_in_one_call(agent: LocalAgent):
    reply = agent.call(
        {"op": "process.start", "cmd": "echo a; echo b >&2; exit 3", "follow": True, "tag": "f"}
    )
    [started] = [e for e in reply.events if e.get("event") == "started"]
    assert (reply.stdout, reply.stderr) == (b"a\n", b"b\n")
    assert reply.result == {"exit_code": 3, "signal": None}
    info = wait_exit(agent, started["pid"])  # a kept process like any other
    assert (info["tag"], info["exit_code"]) == ("f", 3)
    assert agent.call({"op": "process.start", "cmd": "true", "follow": 1}).error_code == (
        "invalid_argument"
    )


def test_process_live_output_and_stdin(agent: LocalAgent):
    pid = start(agent, cmd="read line; echo got:$line; read line2; echo got:$line2")
    agent.call({"op": "process.input", "pid": pid}, stdin=b"first\n")
    with agent.stream({"op": "process.connect", "pid": pid}) as stream:
        assert read_until(stream, rb"got:first\n") == b"got:first\n"
        stream.send(KIND_IN, b"second\n")
        assert read_until(stream, rb"got:second\n") == b"got:second\n"
        reply = stream.collect()
    assert reply.result["exit_code"] == 0


def test_process_stdin_close(agent: LocalAgent):
    pid = start(agent, cmd=["wc", "-c"])
    agent.call({"op": "process.input", "pid": pid}, stdin=b"12345")
    agent.call({"op": "process.input", "pid": pid, "close": True}, stdin=b"678")
    assert wait_exit(agent, pid)["exit_code"] == 0
    assert agent.call({"op": "process.connect", "pid": pid}).stdout.strip() == b"8"


def test_process_signal(agent: LocalAgent):
    pid = start(agent, cmd=["sleep", "60"])
    assert agent.call({"op": "process.signal", "pid": pid, "signal": "TERM"}).result == {}
    info = wait_exit(agent, pid)
    assert info["exit_code"] == 128 + 15
    res = agent.call({"op": "process.connect", "pid": pid}).result
    assert res == {"exit_code": 143, "signal": 15}
    assert agent.call({"op": "process.signal", "pid": pid, "signal": 9}).error_code == (
        "invalid_state"
    )
    assert agent.call({"op": "process.connect", "pid": 999999}).error_code == ("process_not_found")


def test_process_ring_keeps_the_last_mebibyte(agent: LocalAgent):
    pid = start(agent, cmd="head -c 3000000 /dev/zero | tr '\\0' a; echo; echo END")
    wait_exit(agent, pid)
    out = agent.call({"op": "process.connect", "pid": pid}).stdout
    assert out.endswith(b"a\nEND\n")
    assert 1024 * 1024 - 256 * 1024 < len(out) <= 1024 * 1024


def test_process_start_errors(agent: LocalAgent):
    assert agent.call({"op": "process.start", "cmd": ["/no/such/bin"]}).error_code == "not_found"
    bad_pty = agent.call({"op": "process.start", "cmd": "true", "pty": {"cols": 0}})
    assert bad_pty.error_code == "invalid_argument"
    pid = start(agent, cmd="true")
    assert agent.call({"op": "pty.resize", "pid": pid, "cols": 10, "rows": 10}).error_code == (
        "invalid_argument"
    )


# -- PTY ------------------------------------------------------------------------------------


def test_pty_output_input_and_resize(agent: LocalAgent):
    pid = start(agent, cmd=["bash", "--norc", "--noprofile", "-i"], pty={"cols": 80, "rows": 24})
    with agent.stream({"op": "process.connect", "pid": pid}) as stream:
        stream.send(KIND_IN, b"tty; stty size\n")
        out = read_until(stream, rb"24 80")
        assert b"/dev/pts/" in out
        stream.send_json({"resize": [100, 40]})
        stream.send(KIND_IN, b"stty size\n")
        read_until(stream, rb"40 100")
        assert agent.call({"op": "pty.resize", "pid": pid, "cols": 120, "rows": 50}).result == {}
        stream.send(KIND_IN, b"stty size; exit 5\n")
        read_until(stream, rb"50 120")
        reply = stream.collect()
    assert reply.result == {"exit_code": 5, "signal": None}
    info = agent.call({"op": "process.list"}).result["processes"][0]
    assert info["pty"] is True


def test_pty_has_a_controlling_terminal(agent: LocalAgent):
    pid = start(agent, cmd="sleep 0.2; ps -o tty=,sid=,pid= -p $$", pty={"cols": 80, "rows": 24})
    wait_exit(agent, pid)
    out = agent.call({"op": "process.connect", "pid": pid}).stdout.decode()
    tty, sid, own = out.split()
    assert tty.startswith("pts/")
    assert sid == own  # a session leader


# -- shell sessions -------------------------------------------------------------------------


def run(
    agent: LocalAgent, cmd: str, session: str = "s", **extra: object
) -> tuple[int, bytes, bytes]:
    reply = agent.call({"op": "shell.run", "session": session, "cmd": cmd, **extra})
    res = reply.result
    return res["exit_code"], reply.stdout, reply.stderr


def test_shell_state_persists(agent: LocalAgent, tmp_path: object):
    assert run(agent, f"cd {tmp_path}; export FOO=bar; X=local") == (0, b"", b"")
    _, out, _ = run(agent, 'echo "$PWD $FOO $X"')
    assert out.decode() == f"{tmp_path} bar local\n"
    sessions = agent.call({"op": "shell.list"}).result["sessions"]
    assert [(s["name"], s["cwd"], s["busy"]) for s in sessions] == [("s", str(tmp_path), False)]
    assert run(agent, "echo $FOO", session="other")[1] == b"\n"  # independent session
    assert run(agent, "echo $FOO", env={"FOO": "override"})[1] == b"override\n"
    assert run(agent, "pwd", cwd="/")[1] == b"/\n"


def test_shell_output_is_byte_exact(agent: LocalAgent):
    assert run(agent, "printf 'no newline'") == (0, b"no newline", b"")
    assert run(agent, "printf 'e1' >&2; printf 'o1'; false") == (1, b"o1", b"e1")
    code, out, _ = run(agent, "head -c 200000 /dev/zero | tr '\\0' z")
    assert (code, out) == (0, b"z" * 200000)
    assert run(agent, 'printf \'%s\' "it\'s \\"q\\""')[1] == b'it\'s "q"'


def test_shell_background_job_persists(agent: LocalAgent):
    assert run(agent, "sleep 30 & echo $! > /dev/null; JOB=$!")[0] == 0
    _, out, _ = run(agent, "kill -0 $JOB && echo alive; jobs | wc -l")
    assert out == b"alive\n1\n"
    run(agent, "kill $JOB")


def test_shell_syntax_error_and_exit(agent: LocalAgent):
    run(agent, "export KEEP=1")
    code, _, err = run(agent, "if then fi (")
    assert code == 2
    assert b"syntax error" in err
    assert run(agent, "echo $KEEP")[1] == b"1\n"  # the session survived
    pid = agent.call({"op": "shell.list"}).result["sessions"][0]["pid"]
    assert run(agent, "echo bye; exit 3") == (3, b"bye\n", b"")
    assert run(agent, "echo ${KEEP:-fresh}")[1] == b"fresh\n"
    assert agent.call({"op": "shell.list"}).result["sessions"][0]["pid"] != pid


def test_shell_timeout_interrupts_but_keeps_the_session(agent: LocalAgent):
    run(agent, "export KEEP=2")
    start_t = time.monotonic()
    req = {"op": "shell.run", "session": "s", "timeout": 0.3}
    res = agent.call({**req, "cmd": "sleep 30; echo no"})
    assert res.result == {"exit_code": 130, "timed_out": True}
    assert res.stdout == b""
    res = agent.call({**req, "cmd": "while :; do :; done"})
    assert res.result["timed_out"] is True
    stubborn = "trap '' INT; sleep 30"  # ignores SIGINT: its sleep gets SIGKILL
    res = agent.call({**req, "cmd": stubborn})
    assert res.result["timed_out"] is True
    assert time.monotonic() - start_t < 10
    assert run(agent, "trap - INT; echo $KEEP")[1] == b"2\n"


def test_shell_close_and_busy(agent: LocalAgent):
    run(agent, "true", session="c")
    busy = agent.stream({"op": "shell.run", "session": "c", "cmd": "sleep 30"})
    until(lambda: any(s["busy"] for s in agent.call({"op": "shell.list"}).result["sessions"]))
    assert agent.call({"op": "shell.run", "session": "c", "cmd": "true"}).error_code == (
        "invalid_state"
    )
    assert agent.call({"op": "shell.close", "session": "c"}).result == {}
    busy.collect()
    busy.close()
    assert agent.call({"op": "shell.close", "session": "c"}).error_code == "not_found"


# -- restarts -------------------------------------------------------------------------------


def test_killing_aether_keeps_chronus_state(agent: LocalAgent):
    pid = start(agent, cmd="echo before; sleep 60")
    run(agent, "export SURVIVES=yes; cd /tmp")
    chronus = agent.chronus_pid()
    assert chronus is not None
    agent.kill_aether()
    agent.start()
    assert agent.chronus_pid() == chronus
    procs = agent.call({"op": "process.list"}).result["processes"]
    assert [(p["pid"], p["running"]) for p in procs] == [(pid, True)]
    assert run(agent, 'echo "$SURVIVES $PWD"')[1] == b"yes /tmp\n"
    with agent.stream({"op": "process.connect", "pid": pid}) as stream:
        assert read_until(stream, rb"before\n") == b"before\n"
        stream.send_json({"signal": 9})
        assert stream.collect().result == {"exit_code": 137, "signal": 9}
    assert os.path.exists(f"/proc/{chronus}")


def test_chronus_stop_kills_its_processes():
    with local_agent() as agent:
        pid = start(agent, cmd=["sleep", "60"])
        run(agent, "sleep 60 &")
        shell_pid = agent.call({"op": "shell.list"}).result["sessions"][0]["pid"]
    for p in (pid, shell_pid):
        deadline = time.monotonic() + 5
        while os.path.exists(f"/proc/{p}") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{p}")
