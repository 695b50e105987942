"""The function worker looks each user up once (the image's files are the same per call)."""

from __future__ import annotations

import pytest

from dsec.agent.users import User
from dsec.agent.wire import AgentError
from dsec.edge.backends.function.worker import cached_lookup


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
