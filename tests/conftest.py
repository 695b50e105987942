"""Test order for scripts/test, which builds the microVM guest kernel in the background
(``DSEC_KERNEL_BUILD``, see dsec.testing.kernel_build): the tests marked ``guest_kernel``
run last, and the first of them waits for the build; a failed build fails them with the
end of its log. Without that variable the order and the tests are unchanged."""

from __future__ import annotations

import pytest

from dsec.testing import kernel_build

_WAITED = pytest.StashKey[str | None]()


@pytest.hookimpl(trylast=True)  # after pytest's own grouping by fixture scope
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if kernel_build.from_env() is not None:
        items.sort(key=lambda item: item.get_closest_marker("guest_kernel") is not None)


@pytest.hookimpl(tryfirst=True)  # before the item's fixtures look for the kernel
def pytest_runtest_setup(item: pytest.Item) -> None:
    build = kernel_build.from_env()
    if build is None or item.get_closest_marker("guest_kernel") is None:
        return
    stash = item.config.stash
    if _WAITED not in stash:
        reporter = item.config.pluginmanager.get_plugin("terminalreporter")

        def progress(msg: str) -> None:
            if reporter is not None:
                reporter.write_line(msg)

        if build.status() is None:
            progress(f"the tests that need the guest kernel wait for its build: {build.log}")
        stash[_WAITED] = build.wait(progress)
    why = stash[_WAITED]
    if why:
        pytest.fail(why, pytrace=False)
