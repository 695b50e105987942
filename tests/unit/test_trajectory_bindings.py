"""The apiserver's cache of trajectory bindings (``apiserver/trajectory_bindings.py``)."""

from __future__ import annotations

from dataclasses import replace

from dsec.apiserver.trajectory_bindings import Bindings
from dsec.store.api import KeyValue
from dsec.trajectory.records import Trajectory


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


def _record(tid: str, mode: str = "record", epoch: str = "e1") -> tuple[Trajectory, KeyValue]:
    t = Trajectory(id=tid, project="p", name="n", created_at=0, updated_at=0, mode=mode)
    return replace(t, epoch=epoch), KeyValue(b"/t/" + tid.encode(), b"{}", 1, 2, 1)


def test_the_record_of_a_recording_sandbox_is_kept_until_the_binding_is_looked_up() -> None:
    b = Bindings()
    b.wrote("s1", *_record("t1"))
    assert b.recording("s1") is None, "kept for a sandbox not known bound to t1"
    b.saw("s1", "t1")
    b.wrote("s1", *_record("t1"))
    got = b.recording("s1")
    assert got is not None
    assert got[0].epoch == "e1"
    b.stale("s1")  # the edge refused its epoch
    assert b.recording("s1") is None
    assert b.tid("s1") == "t1"  # the binding hint stays
    for drop in ("saw", "forget", "refused"):
        b.saw("s1", "t1")
        b.wrote("s1", *_record("t1"))
        if drop == "saw":
            b.saw("s1", "t1")  # looked up again (a call that missed the cache)
        else:
            getattr(b, drop)("s1")
        assert b.recording("s1") is None, drop


def test_only_a_recording_record_with_an_epoch_is_kept() -> None:
    b = Bindings()
    b.saw("s1", "t1")
    b.wrote("s1", *_record("t1", mode="replay"))
    assert b.recording("s1") is None
    b.wrote("s1", *_record("t1", epoch=""))  # bound before epochs: the edge cannot check it
    assert b.recording("s1") is None
