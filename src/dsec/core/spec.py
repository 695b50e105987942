"""What a user asks for when creating a sandbox, validated so an invalid spec cannot exist."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from dsec.core.errors import InvalidArgument
from dsec.core.netpolicy import NetworkPolicy

BACKENDS = ("function", "container", "microvm", "vm")
# What the edge does when a sandbox's timeout passes: end it, or pause it (kept paused for
# PAUSED_KEEP_S, resumed by a resume call, which starts a new timeout).
ON_TIMEOUT = ("kill", "pause")
# How long the apiserver waits for an edge's create (an image pull, a VM boot); the vm
# backend boots Debian with systemd, minutes under TCG on a loaded host (its edge watchdog,
# vm.backend.VM_BOOT_TIMEOUT_S, is 480 s), so the layers above wait a little longer than it.
CREATE_DEADLINE_S = 290.0
VM_CREATE_DEADLINE_S = 500.0


def create_deadline_s(backend: str | None) -> float:
    return VM_CREATE_DEADLINE_S if backend == "vm" else CREATE_DEADLINE_S


# A move's new sandbox holds no allocation until the apiserver renames the old one's to it,
# right after the start. Its edge kills it if it still holds none this long after it started
# (the apiserver died); an apiserver that got near this gives the move up instead.
MOVE_GRACE_S = 300.0


MIN_CPU, MAX_CPU = 0.05, 64.0
MIN_MEMORY_MB, MAX_MEMORY_MB = 32, 256 * 1024
MIN_PIDS, MAX_PIDS = 16, 65536
MIN_TIMEOUT_S, MAX_TIMEOUT_S = 1, 7 * 24 * 3600
MAX_ENV = 256
MAX_METADATA = 64
MAX_VALUE_LEN = 4096

_IMAGE_RE = re.compile(r"^[a-z0-9][a-z0-9._/:@-]{0,254}$")
_ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,255}$")
_META_KEY_RE = re.compile(r"^[A-Za-z0-9_.\-/]{1,128}$")


def _check_range(name: str, value: float, lo: float, hi: float, unit: str = "") -> None:
    if not (lo <= value <= hi):
        raise InvalidArgument(f"{name} must be between {lo:g} and {hi:g}{unit}, got {value:g}")


@dataclass(frozen=True, slots=True, kw_only=True)
class SandboxSpec:
    """Resources, image and lifetime of one sandbox."""

    backend: str = "container"
    image: str = "base"
    cpu: float = 1.0
    memory_mb: int = 512
    pids: int = 1024
    timeout_s: int = 300
    env: dict[str, str] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    network: NetworkPolicy = field(default_factory=NetworkPolicy)
    on_timeout: str = "kill"

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise InvalidArgument(
                f"unknown backend {self.backend!r}; choose one of {', '.join(BACKENDS)}"
            )
        if not _IMAGE_RE.match(self.image):
            raise InvalidArgument(f"invalid image reference {self.image!r}")
        _check_range("cpu", self.cpu, MIN_CPU, MAX_CPU, " cores")
        _check_range("memory_mb", self.memory_mb, MIN_MEMORY_MB, MAX_MEMORY_MB, " MiB")
        _check_range("pids", self.pids, MIN_PIDS, MAX_PIDS)
        _check_range("timeout_s", self.timeout_s, MIN_TIMEOUT_S, MAX_TIMEOUT_S, " s")
        _check_mapping("env", self.env, MAX_ENV, _ENV_KEY_RE)
        _check_mapping("metadata", self.metadata, MAX_METADATA, _META_KEY_RE)
        if not isinstance(self.network, NetworkPolicy):
            raise InvalidArgument("network must be a NetworkPolicy")
        if self.on_timeout not in ON_TIMEOUT:
            raise InvalidArgument(
                f"on_timeout must be one of {', '.join(ON_TIMEOUT)}, got {self.on_timeout!r}"
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "image": self.image,
            "cpu": self.cpu,
            "memory_mb": self.memory_mb,
            "pids": self.pids,
            "timeout_s": self.timeout_s,
            "env": dict(self.env),
            "metadata": dict(self.metadata),
            "network": self.network.to_dict(),
            "on_timeout": self.on_timeout,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SandboxSpec:
        known = set(cls.__dataclass_fields__)
        unknown = set(data) - known
        if unknown:
            raise InvalidArgument(f"unknown sandbox fields: {', '.join(sorted(unknown))}")
        if "network" in data:
            data = {**data, "network": NetworkPolicy.from_dict(data["network"])}
        try:
            return cls(**data)
        except TypeError as exc:
            raise InvalidArgument(str(exc)) from None


def _check_mapping(name: str, value: object, limit: int, key_re: re.Pattern[str]) -> None:
    if not isinstance(value, dict):
        raise InvalidArgument(f"{name} must be an object of strings")
    if len(value) > limit:
        raise InvalidArgument(f"{name} has {len(value)} entries; at most {limit} allowed")
    for k, v in value.items():
        if not isinstance(k, str) or not key_re.match(k):
            raise InvalidArgument(f"invalid {name} key {k!r}")
        if not isinstance(v, str) or len(v) > MAX_VALUE_LEN or "\0" in v:
            raise InvalidArgument(f"{name}[{k}] must be a string of at most {MAX_VALUE_LEN} chars")
