"""The apiserver's cache of trajectory bindings (``apiserver/trajectory_bindings.py``)."""

from __future__ import annotations

from dsec.apiserver.trajectory_bindings import Bindings


def test_bound_and_unbound_entries() -> None:
    b = Bindings()
    assert not b.unbound("s1")  # never seen: not known
    assert b.tid("s1") == ""
    b.saw("s1", "")
    assert b.unbound("s1")
    b.saw("s1", "t1")
    assert not b.unbound("s1")
    assert b.tid("s1") == "t1"
    b.forget("s1")
    assert (b.unbound("s1"), b.tid("s1")) == (False, "")


def test_a_refused_sandbox_is_not_cached_unbound_again() -> None:
    b = Bindings()
    b.saw("s1", "")
    b.refused("s1")  # the edge says bound, the store (now) says not: the edge wins
    assert not b.unbound("s1")
    b.saw("s1", "")
    assert not b.unbound("s1"), "every call of it looks the binding up"
    b.saw("s1", "t1")
    assert b.tid("s1") == "t1"
    b.forget("s1")  # unmarked at the edge: may be cached again
    b.saw("s1", "")
    assert b.unbound("s1")


def test_the_cache_is_bounded() -> None:
    b = Bindings(max_entries=3)
    for i in range(5):
        b.saw(f"s{i}", "")
    assert [b.unbound(f"s{i}") for i in range(5)] == [False, False, True, True, True]
