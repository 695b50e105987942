"""Sandbox specs between their core form (``dsec.core.spec``) and the wire (protobuf).

One place for both directions, used by the apiserver and the edge alike.
"""

from __future__ import annotations

from typing import Any

from dsec.core.netpolicy import NetworkPolicy
from dsec.core.spec import SandboxSpec
from dsec.rpc._gen import dsec_pb2 as pb


def spec_to_pb(spec: SandboxSpec) -> pb.SandboxSpec:
    return pb.SandboxSpec(
        backend=spec.backend,
        image=spec.image,
        cpu=spec.cpu,
        memory_mb=spec.memory_mb,
        pids=spec.pids,
        timeout_s=spec.timeout_s,
        env=spec.env,
        metadata=spec.metadata,
        network=pb.NetworkPolicy(allow=spec.network.allow, deny=spec.network.deny),
        on_timeout=spec.on_timeout,
    )


def spec_from_pb(msg: pb.SandboxSpec) -> SandboxSpec:
    """The spec a message carries; unset fields take the defaults (validated)."""
    d = spec_json(msg)
    return SandboxSpec(**{**d, "network": policy_from_pb(msg.network)})


def spec_json(msg: pb.SandboxSpec) -> dict[str, Any]:
    """``spec_from_pb(msg).to_dict()`` without validating again what an edge answered (an
    API answer carries one per sandbox)."""
    return {
        "backend": msg.backend or "container",
        "image": msg.image or "base",
        "cpu": msg.cpu or 1.0,
        "memory_mb": msg.memory_mb or 512,
        "pids": msg.pids or 1024,
        "timeout_s": msg.timeout_s or 300,
        "env": dict(msg.env),
        "metadata": dict(msg.metadata),
        "network": {"allow": list(msg.network.allow), "deny": list(msg.network.deny)},
        "on_timeout": msg.on_timeout or "kill",
    }


def policy_from_pb(msg: pb.NetworkPolicy) -> NetworkPolicy:
    return NetworkPolicy(allow=tuple(msg.allow), deny=tuple(msg.deny))
