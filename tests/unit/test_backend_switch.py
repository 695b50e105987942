"""The backend switch outside the edge: gateway choice, edge report, CLI table, capabilities."""

from __future__ import annotations

from typing import Any

import pytest

from dsec.apiserver.backends import backend_json
from dsec.cli.backends import backend_rows
from dsec.core.errors import InvalidArgument
from dsec.edge import backend_report
from dsec.edge.backends.api import Availability, Capabilities, capabilities_of
from dsec.gateway.control import choose_backend
from dsec.rpc._gen import dsec_pb2 as pb
from dsec.testing.fake_backend import FakeBackend


@pytest.mark.parametrize(
    ("template", "metadata", "expected"),
    [
        ("base", {}, ("container", "base")),
        ("function", {}, ("function", "base")),
        ("function:py", {}, ("function", "py")),
        ("microvm:127.0.0.1:5000/x:v1", {}, ("microvm", "127.0.0.1:5000/x:v1")),
        ("base", {"dsec.backend": "function"}, ("function", "base")),
        ("vm:base", {"dsec.backend": "container"}, ("container", "base")),
        ("127.0.0.1:5000/x:v1", {}, ("container", "127.0.0.1:5000/x:v1")),
    ],
)
def test_gateway_chooses_backend(
    template: str, metadata: dict[str, str], expected: tuple[str, str]
) -> None:
    assert choose_backend(template, metadata) == expected


def test_gateway_rejects_unknown_backend() -> None:
    with pytest.raises(InvalidArgument, match=r"dsec\.backend"):
        choose_backend("base", {"dsec.backend": "lambda"})


class _Old:
    """A backend written before capabilities() existed."""

    name = "vm"

    def availability(self) -> Availability:
        raise RuntimeError("boom")


def test_report_lists_every_known_backend() -> None:
    reports = backend_report.report([FakeBackend(), _Old()])  # type: ignore[list-item]
    by_name = {r.name: r for r in reports}
    assert [r.name for r in reports] == ["function", "container", "microvm", "vm"]
    assert by_name["container"].availability.available
    assert by_name["container"].capabilities.pause
    assert by_name["function"].availability == Availability(False, "not implemented on this edge")
    assert not by_name["vm"].availability.available
    assert "boom" in by_name["vm"].availability.reason
    assert by_name["vm"].capabilities == Capabilities()
    assert capabilities_of(object()) == Capabilities()
    msg = backend_report.to_pb("e1", reports)
    assert msg.edge_id == "e1"
    assert [b.name for b in msg.backends if b.available] == ["container"]
    assert msg.backends[1].capabilities.persistent_processes


def test_sizing_hints_reach_the_http_api() -> None:
    """min_memory_mb, min_vcpus and create_seconds: edge report -> gRPC -> GET /v1/backends."""
    caps = Capabilities(min_memory_mb=256, min_vcpus=1.0, create_seconds=50.0)
    report = backend_report.BackendReport("vm", Availability(True, ""), caps)
    info = backend_report.to_pb("e1", [report]).backends[0]
    got = backend_json(pb.BackendInfo.FromString(info.SerializeToString()))["capabilities"]
    assert (got["min_memory_mb"], got["min_vcpus"], got["create_seconds"]) == (256, 1.0, 50.0)
    assert set(got) == set(Capabilities.__dataclass_fields__)  # every capability, no more
    cheap = backend_report.BackendReport("container", Availability(True, ""), Capabilities())
    plain = backend_json(backend_report.to_pb("e1", [cheap]).backends[0])["capabilities"]
    assert (plain["min_vcpus"], plain["create_seconds"]) == (0, 0)  # no hint


def test_bench_sizes_a_backend_by_its_advertised_create_cost() -> None:
    from bench.backends import samples

    assert samples(20, {}) == 20  # no hint: a create is cheap
    assert samples(20, {"create_seconds": 0.0}) == 20
    assert samples(20, {"create_seconds": 40.0}) == 5  # a full VM: what fits the budget
    assert samples(3, {"create_seconds": 40.0}) == 3
    assert samples(20, {"create_seconds": 10_000.0}) == 1  # at least one


def test_cli_table_rows() -> None:
    edges: list[dict[str, Any]] = [
        {
            "edge_id": "e1",
            "backends": [
                {
                    "name": "container",
                    "available": True,
                    "reason": "cgroup v2",
                    "capabilities": {"pause": True, "pty": True, "max_vcpus": 2.0},
                },
                {
                    "name": "vm",
                    "available": False,
                    "reason": "no kvm",
                    "capabilities": {
                        "min_memory_mb": 128,
                        "min_vcpus": 1.0,
                        "create_seconds": 50.0,
                    },
                },
            ],
        },
        {"edge_id": "e2", "error": "down", "backends": []},
    ]
    rows = backend_rows(edges)
    assert rows[0] == ["e1", "container", "yes", "pause,pty", "2", "host", "-", "cgroup v2"]
    assert rows[1][:3] == ["e1", "vm", "no"]
    assert rows[1][4:7] == ["1-host", "128-host", "~50 s"]
    assert rows[1][-1] == "no kvm"
    assert rows[2][0] == "e2"
    assert rows[2][-1] == "down"


def test_create_hint_becomes_what_creates_take_here() -> None:
    """Once the edge made a few creates of a backend, their median is its create hint."""
    times = backend_report.CreateTimes(keep=4, least=3)
    times.note("container", 9.0)
    times.note("container", 1.0)
    before = {r.name: r for r in backend_report.report([FakeBackend()], times)}
    assert before["container"].capabilities.create_seconds == 0.0  # two: the backend's own
    for s in (2.0, 3.0, 4.0):  # the oldest (9.0) falls out of the last four
        times.note("container", s)
    after = {r.name: r for r in backend_report.report([FakeBackend()], times)}
    assert after["container"].capabilities.create_seconds == 2.5
    assert after["container"].capabilities.pause  # the rest as the backend says
    assert times.median("vm") is None
