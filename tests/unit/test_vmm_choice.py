"""How an edge picks its VMM driver from ``--vmm`` and what the host has."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from dsec.core.errors import BackendUnavailable, InvalidArgument
from dsec.edge import backend_report
from dsec.edge.app import candidate_backends, parse_args
from dsec.edge.backends.api import Availability
from dsec.edge.backends.microvm.backend import MicrovmBackend
from dsec.edge.backends.microvm.choice import choose_vmm
from dsec.paths import Paths

BOTH = {"firecracker": "/usr/local/bin/firecracker", "qemu-system-x86_64": "/usr/bin/qemu"}


def host(bins: dict[str, str], kvm_ok: bool):
    return {
        "which": bins.get,
        "kvm_usable": lambda: (kvm_ok, "probe guest ran" if kvm_ok else "KVM_RUN hangs"),
    }


def test_auto_prefers_firecracker_when_kvm_works() -> None:
    name, why = choose_vmm("auto", **host(BOTH, True))
    assert name == "firecracker"
    assert "probe guest ran" in why


def test_auto_falls_back_to_qemu_with_the_reason() -> None:
    name, why = choose_vmm("auto", **host(BOTH, False))
    assert name == "qemu"
    assert "KVM_RUN hangs" in why
    assert "tcg" in why
    name, why = choose_vmm("auto", **host({"qemu-system-x86_64": "/q"}, True))
    assert (name, "firecracker binary not found" in why, "with kvm" in why) == ("qemu", True, True)
    small = {"qemu-system-x86_64": "/q", "qemu-system-x86_64-microvm": "/m"}
    assert "microvm guests on /m" in choose_vmm("qemu", **host(small, True))[1]
    assert "/m" not in choose_vmm("qemu", **host(small, False))[1]  # it has no TCG


def test_explicit_choices() -> None:
    assert choose_vmm("qemu", **host(BOTH, True))[0] == "qemu"
    with pytest.raises(BackendUnavailable, match="KVM_RUN hangs"):
        choose_vmm("firecracker", **host(BOTH, False))
    with pytest.raises(BackendUnavailable, match="firecracker binary not found"):
        choose_vmm("firecracker", **host({}, True))
    with pytest.raises(BackendUnavailable, match="qemu-system-x86_64 not found"):
        choose_vmm("qemu", **host({"firecracker": "/f"}, True))
    with pytest.raises(BackendUnavailable, match=r"not found on PATH; qemu"):
        choose_vmm("auto", **host({}, False))
    with pytest.raises(InvalidArgument, match="must be one of"):
        choose_vmm("xen")


def test_choice_on_this_host_has_a_reason() -> None:
    if shutil.which("firecracker") is None and shutil.which("qemu-system-x86_64") is None:
        with pytest.raises(BackendUnavailable, match="not found"):
            choose_vmm("auto")
        return
    name, why = choose_vmm("auto")
    assert name in ("firecracker", "qemu")
    assert why


def test_edge_flag() -> None:
    assert parse_args([]).vmm == "auto"
    assert parse_args(["--vmm", "firecracker"]).vmm == "firecracker"
    with pytest.raises(SystemExit):
        parse_args(["--vmm", "xen"])


def test_the_edge_flag_reaches_the_microvm_backend_and_dsec_backends_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = Paths(home=tmp_path / "home", data=tmp_path / "data", run=tmp_path / "run")
    backends = {b.name: b for b in candidate_backends(paths, "e1", None, "firecracker")}
    microvm, vm = backends["microvm"], backends["vm"]
    assert isinstance(microvm, MicrovmBackend)
    assert isinstance(vm, MicrovmBackend)
    assert microvm.vmm_preference == "firecracker"
    assert vm.vmm_preference == "qemu"  # a q35 PC runs on QEMU whatever --vmm says

    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    reports = {r.name: r for r in backend_report.report([microvm])}
    assert reports["microvm"].availability == Availability(
        False, "no VMM: firecracker binary not found on PATH"
    )
    assert "no VMM: firecracker binary not found" in reports["microvm"].capabilities.notes

    microvm._vmm_choice = ("firecracker", "/usr/bin/firecracker with KVM (probe guest ran)")
    reports = {r.name: r for r in backend_report.report([microvm])}
    notes = reports["microvm"].capabilities.notes
    assert notes.startswith("Firecracker (VMM firecracker: /usr/bin/firecracker with KVM")
