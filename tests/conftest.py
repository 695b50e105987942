"""``--guest-kernel-tests``: scripts/test runs the suite in two passes, the tests that do not
boot the microVM guest kernel while it builds in the background (``none``), then, once it
is built, the ones marked ``guest_kernel`` (``only``). A separate pass, because the
platform the end-to-end tests share looks for the kernel once, when its edge starts."""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--guest-kernel-tests",
        choices=("all", "none", "only"),
        default="all",
        help="run all tests, none or only those marked guest_kernel (scripts/test's passes)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    which = config.getoption("--guest-kernel-tests")
    if which == "all":
        return
    keep: list[pytest.Item] = []
    drop: list[pytest.Item] = []
    for item in items:
        marked = item.get_closest_marker("guest_kernel") is not None
        (keep if marked == (which == "only") else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
