"""The function worker's per-call state: users looked up once per worker (the image's
files are the same for every call), the environment set only when the sandbox changes."""

from __future__ import annotations

import os

import pytest

from dsec.agent import execop, users
from dsec.agent.users import User
from dsec.agent.wire import AgentError, Conn
from dsec.edge.backends.function import worker
from dsec.edge.backends.function.worker import cached_lookup, pinned


def test_each_user_is_looked_up_once_and_kept_by_spec() -> None:
    seen: list[str | int | None] = []

    def lookup(spec: str | int | None) -> User:
        seen.append(spec)
        return User(65534, 65534, "nobody", "/", (7,))

    resolve = cached_lookup(lookup)
    first = resolve("nobody")
    assert resolve("nobody") is first
    assert resolve(65534) is resolve(65534)
    assert resolve("65534") is not None
    assert seen == ["nobody", 65534, "65534"]  # an int and its digits are separate specs


def test_failed_lookups_are_not_kept() -> None:
    calls = 0

    def lookup(spec: str | int | None) -> User:
        nonlocal calls
        calls += 1
        raise AgentError("invalid_argument", f"no user {spec!r} in /etc/passwd")

    resolve = cached_lookup(lookup)
    for _ in range(2):
        with pytest.raises(AgentError):
            resolve("ghost")
    assert calls == 2


def test_exec_runs_the_calls_checked_user_without_a_second_lookup() -> None:
    seen: list[str | int | None] = []

    def lookup(spec: str | int | None) -> User:
        seen.append(spec)
        return User(1000, 1000, str(spec), "/", ())

    nobody = User(65534, 65534, "nobody", "/", (7,))
    resolve = pinned(nobody, lookup)
    assert resolve(65534) is nobody
    assert seen == []
    assert resolve("other").name == "other"  # anyone else: looked up
    assert seen == ["other"]


def test_exec_looks_users_up_with_the_resolver_it_is_given() -> None:
    def refuse(spec: str | int | None) -> User:
        raise AgentError("permission_denied", f"the caller's resolver refused {spec!r}")

    req = {"op": "exec", "cmd": ["true"], "user": 4321}
    conn: Conn = None  # type: ignore[assignment]  # never reached: the lookup comes first
    with pytest.raises(AgentError, match="resolver refused 4321"):
        execop.op_exec(conn, req, None, refuse)


def test_the_environment_is_the_sandboxs_and_set_again_only_when_it_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    env = _Environ(HOST_ONLY="1")
    monkeypatch.setattr(os, "environ", env)
    worker.set_environ({"A": "1"})
    assert env == {"A": "1", "PATH": users.DEFAULT_PATH}
    worker.set_environ({"A": "1"})
    assert env.clears == 1  # only the first time
    worker.set_environ({"B": "2", "PATH": "/bin"})
    assert env.clears == 2
    assert env == {"B": "2", "PATH": "/bin"}


class _Environ(dict[str, str]):
    clears = 0

    def clear(self) -> None:
        self.clears += 1
        super().clear()
