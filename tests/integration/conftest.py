"""Fixtures shared by the integration tests that run real containers."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dsec.edge.backends.container import testkit
from dsec.edge.backends.container.backend import ContainerBackend
from dsec.edge.backends.container.testkit import ContainerTestEnv


@pytest.fixture(scope="module")
def cenv() -> Iterator[ContainerTestEnv]:
    """A throw-away node per test module (skipped, with the reason, where it can't run)."""
    reason = testkit.skip_reason()
    if reason:
        pytest.skip(reason)
    with testkit.container_test_env() as env:
        yield env


@pytest.fixture
def backend(cenv: ContainerTestEnv) -> ContainerBackend:
    return cenv.backend()
