"""dsec.agent.users reads the image's passwd and group files itself."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsec.agent import users
from dsec.agent.wire import AgentError


@pytest.fixture
def etc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(users, "ETC", str(tmp_path))
    return tmp_path


def test_lines_skip_comments_and_take_any_line_ending(etc: Path) -> None:
    (etc / "passwd").write_bytes(
        b"# a comment\nroot:x:0:0:root:/root:/bin/sh\r\n\nbob:x:1000:1000:B\xff:/home/bob:/bin/sh"
    )
    assert users._lines("passwd") == [
        ["root", "x", "0", "0", "root", "/root", "/bin/sh"],
        [""],
        ["bob", "x", "1000", "1000", "B\ufffd", "/home/bob", "/bin/sh"],
    ]
    assert users._lines("missing") == []


def test_resolve_by_name_and_uid_with_groups(etc: Path) -> None:
    (etc / "passwd").write_text("root:x:0:0::/root:/bin/sh\nbob:x:1000:1000::/home/bob:/bin/sh\n")
    (etc / "group").write_text("bob:x:1000:\nwheel:x:10:bob,alice\n")
    bob = users.resolve("bob")
    assert (bob.uid, bob.gid, bob.home, bob.groups) == (1000, 1000, "/home/bob", (10,))
    assert users.resolve(0).name == "root"
    with pytest.raises(AgentError, match="no user 'carol'"):
        users.resolve("carol")


def test_own_user_is_read_again_when_passwd_changes(etc: Path) -> None:
    import os

    me = os.getuid()
    (etc / "passwd").write_text(f"me:x:{me}:{os.getgid()}::/home/one:/bin/sh\n")
    first = users.resolve(None)
    assert (first.name, first.home) == ("me", "/home/one")
    assert users.resolve(None) is first  # unchanged files: not parsed again
    (etc / "passwd").write_text(f"me:x:{me}:{os.getgid()}::/home/second:/bin/sh\n")
    assert users.resolve(None).home == "/home/second"
    (etc / "group").write_text("extra:x:4242:me\n")
    assert users.resolve(None).groups == (4242,)


def test_a_frozen_environment_is_read_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(users, "_frozen_env", None)
    monkeypatch.setenv("DSEC_IMAGE_USER", "app")
    monkeypatch.setenv("KEEP_ME", "1")
    users.freeze_env()
    monkeypatch.setenv("DSEC_IMAGE_USER", "other")
    monkeypatch.setenv("KEEP_ME", "2")
    assert users.image_user() == "app"
    env = users.base_env()
    assert env["KEEP_ME"] == "1"
    assert "DSEC_IMAGE_USER" not in env
    env["KEEP_ME"] = "changed"  # a copy: the next command gets the agent's again
    assert users.base_env()["KEEP_ME"] == "1"
