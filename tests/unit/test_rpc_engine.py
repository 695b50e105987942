"""gRPC's engine is chosen before grpc is imported, without leaking into child processes."""

from __future__ import annotations

import os
import subprocess
import sys

PROBE = """
import os, sys
{before}
from dsec.rpc.engine import use_fast_engine
print(use_fast_engine(), "grpc" in sys.modules, os.environ.get("GRPC_EXPERIMENTS", "-"))
"""


def _probe(before: str = "", **env: str) -> list[str]:
    environ = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"} | env
    out = subprocess.run([sys.executable, "-c", PROBE.format(before=before)], env=environ,
                         capture_output=True, text=True, check=True, timeout=60)  # fmt: skip
    return out.stdout.split()


def test_imports_grpc_with_the_setting_and_puts_the_environment_back() -> None:
    assert _probe() == ["True", "True", "-"]


def test_too_late_once_grpc_is_imported() -> None:
    assert _probe("import grpc") == ["False", "True", "-"]


def test_the_operators_setting_wins() -> None:
    assert _probe(GRPC_EXPERIMENTS="-foo") == ["False", "False", "-foo"]
