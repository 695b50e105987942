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
