"""Access tokens through the real platform: exchange, use, revoke, fail closed."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from dsec.core import errors
from dsec.sdk import Client
from dsec.testing.platform import RunningPlatform


def _eventually(fn, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            fn()
            return
        except (AssertionError, errors.DsecError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_token_exchange_use_and_revocation(platform: RunningPlatform, api: Client) -> None:
    key = api.create_key("tokuser", "default", "member", "token test")
    user = Client(api_url=platform.api_url, api_key=key.api_key)
    tok = user.create_token(ttl_s=300)
    via_token = Client(api_url=platform.api_url, api_key=tok.token)
    assert via_token.whoami().subject == "tokuser"
    with pytest.raises(errors.PermissionDenied):
        via_token.create_token(60)  # tokens are minted from keys only

    api.revoke("token", tok.token_id)
    with pytest.raises(errors.Unauthenticated, match="revoked"):
        via_token.whoami()

    second = Client(api_url=platform.api_url, api_key=user.create_token(300).token)
    assert second.whoami().subject == "tokuser"
    api.revoke("subject", "tokuser")  # every key and token of the user
    with pytest.raises(errors.Unauthenticated):
        second.whoami()
    with pytest.raises(errors.Unauthenticated):
        user.whoami()
    for c in (user, via_token, second):
        c.close()


def test_forged_token_is_refused(platform: RunningPlatform, api: Client) -> None:
    tok = api.create_token(60).token
    h, p, s = tok.split(".")
    forged = f"{h}.{p}.{s[::-1]}"
    r = httpx.get(f"{platform.api_url}/v1/whoami", headers={"Authorization": f"Bearer {forged}"})
    assert r.status_code == 401
    assert "signature" in r.json()["error"]["message"]


@pytest.mark.timeout(60)
def test_tokens_are_refused_while_the_revocation_feed_is_stale(
    platform: RunningPlatform, api: Client
) -> None:
    tok = api.create_token(300).token
    c = Client(api_url=platform.api_url, api_key=tok)
    assert c.whoami().subject == "admin"
    iam = platform.pid("iam")
    os.kill(iam, signal.SIGSTOP)
    try:

        def refused() -> None:
            try:
                c.whoami()
            except errors.Unauthenticated as exc:
                if "stale" in exc.message:
                    return
                raise AssertionError(f"refused for another reason: {exc.message}") from exc
            raise AssertionError("the token was still accepted")

        _eventually(refused, seconds=15)
    finally:
        os.kill(iam, signal.SIGCONT)
    _eventually(lambda: c.whoami(), seconds=15)
    c.close()
