"""E2B egress rules (``network=`` at create, ``update_network``) through the gateway, on a
platform whose edge has sandbox networking, against the fake internet of
``test_network.py`` (root only). Written as E2B user code.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from dsec.testing.platform import RunningPlatform, requirements_missing, running_platform
from tests.integration.fakenet import DNS_IP, WEB1, WEB2, WEB3, FakeInternet

e2b = pytest.importorskip("e2b", reason="the e2b SDK is a dev dependency (pip install -e .[dev])")

from e2b import ALL_TRAFFIC, AsyncSandbox, Sandbox, SandboxException  # noqa: E402

_MISSING = requirements_missing()
pytestmark = [
    pytest.mark.skipif(_MISSING is not None, reason=_MISSING or ""),
    pytest.mark.root,
    pytest.mark.timeout(300),
]


@pytest.fixture(scope="module")
def e2b_net() -> Iterator[RunningPlatform]:
    if os.geteuid() != 0:
        pytest.skip("needs root (network namespaces)")
    inet = FakeInternet().start()
    try:
        args = ["--net-upstream-dns", f"{DNS_IP}:53", "--net-gateway-netns", inet.gw_path]
        with running_platform(edge_args=args) as p, pytest.MonkeyPatch.context() as mp:
            gateway = f"http://{p.layout.gateway}"
            mp.setenv("E2B_API_URL", gateway)
            mp.setenv("E2B_SANDBOX_URL", gateway)
            mp.setenv("E2B_API_KEY", p.admin_key)
            yield p
    finally:
        inet.close()


def reach(sbx: Sandbox, ip: str) -> bool:
    script = f"timeout 3 bash -c 'exec 3<>/dev/tcp/{ip}/80; head -c 5 <&3'"
    return sbx.commands.run(script + " >/dev/null 2>&1 && echo yes || echo no").stdout == "yes\n"


def test_allow_deny_at_create_and_update(e2b_net: RunningPlatform) -> None:
    sbx = Sandbox.create(timeout=120, network={"deny_out": [ALL_TRAFFIC], "allow_out": [WEB1]})
    try:
        assert reach(sbx, WEB1)
        assert not reach(sbx, WEB2)
        # E2B's default model: everything open but denyOut
        sbx.update_network({"deny_out": [WEB2]})
        assert reach(sbx, WEB1)
        assert reach(sbx, WEB3)
        assert not reach(sbx, WEB2)
        sbx.update_network({"deny_out": [ALL_TRAFFIC]})
        assert not reach(sbx, WEB1)
        with pytest.raises(SandboxException, match="reopens"):
            sbx.update_network({"deny_out": ["198.18.0.0/16"], "allow_out": [WEB1]})
        assert not reach(sbx, WEB1)  # a refused update changes nothing
    finally:
        sbx.kill()


def test_no_internet_and_async_update(e2b_net: RunningPlatform) -> None:
    import asyncio

    sbx = Sandbox.create(timeout=120, allow_internet_access=False)
    try:
        assert not reach(sbx, WEB1)

        async def open_up() -> None:
            a = await AsyncSandbox.connect(sbx.sandbox_id)
            await a.update_network({})  # every field omitted: the open internet

        asyncio.run(open_up())
        assert reach(sbx, WEB1)
    finally:
        sbx.kill()
