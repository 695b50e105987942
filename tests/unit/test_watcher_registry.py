"""EdgeRegistry: health by report age, transitions, and the saved view (no network)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsec.core.errors import InvalidArgument
from dsec.rpc._gen import dsec_pb2 as pb
from dsec.watcher.registry import EdgeRegistry


def status(edge_id: str, sandboxes: int = 0) -> pb.EdgeStatus:
    return pb.EdgeStatus(
        edge_id=edge_id, address="127.0.0.1:9000", sandboxes=sandboxes, backends=["container"]
    )


def test_health_follows_report_age() -> None:
    reg = EdgeRegistry(timeout_s=6)
    assert reg.report(status("ab12", 3), now=1000.0, mono=50.0)  # new to the view
    assert reg.report(status("cd34"), now=1002.0, mono=52.0)
    views = reg.views(mono=56.0)
    assert [(v.status.edge_id, v.healthy, v.last_seen) for v in views] == [
        ("ab12", True, 1000.0),
        ("cd34", True, 1002.0),
    ]
    views = reg.views(mono=57.5)  # ab12 silent for 7.5 s: unhealthy, still listed
    assert [(v.status.edge_id, v.healthy) for v in views] == [("ab12", False), ("cd34", True)]
    assert views[0].status.sandboxes == 3
    assert reg.counts(mono=57.5) == (2, 1)
    assert not reg.report(status("ab12", 4), now=1008.0, mono=58.0)  # known already
    assert reg.counts(mono=58.0) == (2, 2)  # cd34 is exactly 6 s old: still healthy
    assert reg.views(mono=58.0)[0].status.sandboxes == 4


def test_report_keeps_a_copy() -> None:
    reg = EdgeRegistry()
    s = status("ab12", 1)
    reg.report(s, now=1.0, mono=1.0)
    s.sandboxes = 99
    assert reg.views(mono=1.0)[0].status.sandboxes == 1


def test_transitions() -> None:
    reg = EdgeRegistry(timeout_s=6)
    reg.report(status("ab12"), now=1.0, mono=0.0)
    assert [(t.edge_id, t.healthy) for t in reg.sweep(mono=1.0)] == [("ab12", True)]
    assert reg.sweep(mono=2.0) == []
    assert [(t.edge_id, t.healthy) for t in reg.sweep(mono=10.0)] == [("ab12", False)]
    assert reg.sweep(mono=11.0) == []
    reg.report(status("ab12"), now=12.0, mono=12.0)
    assert [(t.edge_id, t.healthy) for t in reg.sweep(mono=12.0)] == [("ab12", True)]


def test_rejects_bad_input() -> None:
    with pytest.raises(InvalidArgument):
        EdgeRegistry(timeout_s=0)
    with pytest.raises(InvalidArgument):
        EdgeRegistry().report(status("NOPE"), now=1.0, mono=1.0)


def test_forget() -> None:
    reg = EdgeRegistry()
    reg.report(status("ab12"), now=1.0, mono=1.0)
    assert reg.forget("ab12")
    assert not reg.forget("ab12")
    assert reg.views(mono=1.0) == []


def test_saved_view_survives_a_restart_as_unhealthy(tmp_path: Path) -> None:
    path = tmp_path / "watcher.json"
    reg = EdgeRegistry()
    reg.report(status("ab12", 5), now=1000.0, mono=10.0)
    assert reg.dirty
    reg.save(path)
    assert not reg.dirty

    again = EdgeRegistry()
    assert again.load(path) == 1
    (view,) = again.views(mono=0.0)
    assert (view.status.edge_id, view.status.sandboxes, view.healthy) == ("ab12", 5, False)
    assert view.last_seen == 1000.0
    assert list(view.status.backends) == ["container"]
    again.report(status("ab12", 6), now=2000.0, mono=1.0)
    assert again.views(mono=1.0)[0].healthy


def test_load_missing_and_damaged(tmp_path: Path) -> None:
    assert EdgeRegistry().load(tmp_path / "missing.json") == 0
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(InvalidArgument):
        EdgeRegistry().load(bad)
    partial = tmp_path / "partial.json"
    partial.write_text('{"edges": [{"status": {"edgeId": "BAD"}, "last_seen": 1}, {"x": 1}]}')
    assert EdgeRegistry().load(partial) == 0
