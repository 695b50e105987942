"""Which VMM drives the microVMs of this edge: Firecracker or QEMU ``microvm``.

The edge's ``--vmm`` setting is ``auto`` (the default), ``firecracker`` or ``qemu``.
``auto`` takes Firecracker when its binary is installed and KVM really runs guests (the
timed probe in :mod:`kvm`), else QEMU (which falls back to TCG without KVM). An explicit
choice that cannot work here is refused with the reason, never silently replaced.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable

from dsec.core.errors import BackendUnavailable, InvalidArgument
from dsec.edge.backends.microvm import kvm
from dsec.edge.backends.microvm.qemu import QEMU, QEMU_KVM_MICROVM, QemuVmm
from dsec.edge.backends.microvm.vmm import Vmm

CHOICES = ("auto", "firecracker", "qemu")


def choose_vmm(
    preference: str = "auto",
    *,
    which: Callable[[str], str | None] = shutil.which,
    kvm_usable: Callable[[], tuple[bool, str]] = kvm.usable,
) -> tuple[str, str]:
    """``(driver name, why)`` for ``preference``; raise ``BackendUnavailable`` when the
    asked-for driver (or, for ``auto``, any driver) cannot run here."""
    if preference not in CHOICES:
        raise InvalidArgument(f"--vmm must be one of {', '.join(CHOICES)}, not {preference!r}")
    fc, qemu = which("firecracker"), which(QEMU)
    if preference in ("auto", "firecracker"):
        if fc is None:
            fc_why = "firecracker binary not found on PATH"
        else:
            ok, detail = kvm_usable()
            if ok:
                return "firecracker", f"{fc} with KVM ({detail})"
            fc_why = f"firecracker needs KVM, which cannot run guests here: {detail}"
        if preference == "firecracker":
            raise BackendUnavailable(fc_why)
    if qemu is None:
        why = f"{QEMU} not found on PATH"
        raise BackendUnavailable(why if preference == "qemu" else f"{fc_why}; {why}")
    ok, detail = kvm_usable()
    accel = "kvm" if ok else f"tcg, since KVM cannot run guests here: {detail}"
    if ok and (small := which(QEMU_KVM_MICROVM)):
        accel += f" (microvm guests on {small}, its KVM-only build)"
    if preference == "qemu":
        return "qemu", f"asked for; {qemu} with {accel}"
    return "qemu", f"{fc_why}; {qemu} with {accel}"


def new_vmm(name: str) -> Vmm:
    """A fresh driver named ``name`` (as ``choose_vmm`` answers, or a VM's saved choice)."""
    if name == "qemu":
        return QemuVmm()
    if name == "firecracker":
        from dsec.edge.backends.microvm.firecracker import FirecrackerVmm

        return FirecrackerVmm()
    raise InvalidArgument(f"unknown VMM {name!r}: expected qemu or firecracker")
