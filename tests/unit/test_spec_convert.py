"""Sandbox specs on the wire: to protobuf and back, and the JSON an API answer carries."""

from __future__ import annotations

import pytest

from dsec.core.errors import InvalidArgument
from dsec.core.netpolicy import NetworkPolicy
from dsec.core.spec import SandboxSpec
from dsec.rpc._gen import dsec_pb2 as pb
from dsec.rpc.convert import spec_from_pb, spec_json, spec_to_pb

SPECS = [
    SandboxSpec(),
    SandboxSpec(backend="vm", image="python:3.12", cpu=0.25, memory_mb=2048, pids=64,
                timeout_s=3600, env={"A": "1"}, metadata={"run": "x"},
                network=NetworkPolicy(allow=("10.0.0.0/8",), deny=("0.0.0.0/0",))),
]  # fmt: skip


@pytest.mark.parametrize("spec", SPECS)
def test_round_trip_and_json(spec: SandboxSpec) -> None:
    msg = spec_to_pb(spec)
    assert spec_from_pb(msg) == spec
    assert spec_json(msg) == spec.to_dict()


def test_unset_fields_take_the_defaults() -> None:
    assert spec_json(pb.SandboxSpec()) == SandboxSpec().to_dict()


def test_spec_from_pb_still_validates() -> None:
    with pytest.raises(InvalidArgument):
        spec_from_pb(pb.SandboxSpec(memory_mb=1))
