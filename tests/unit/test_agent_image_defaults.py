"""The image's User and WorkingDir are the agent's defaults for every command."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsec.agent import args, users


def test_no_image_user_means_the_agents_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DSEC_IMAGE_USER", raising=False)
    assert args.user({}) is None
    assert args.user({"user": "bob"}) == "bob"


def test_image_user_is_the_default_and_a_request_overrides_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DSEC_IMAGE_USER", "app:staff")
    assert args.user({}) == "app"  # the group part is not used
    assert args.user({"user": ""}) == "app"
    assert args.user({"user": "root"}) == "root"
    assert args.user({"user": 0}) == 0


def test_image_workdir_is_the_default_cwd(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    home = users.User(1000, 1000, "app", str(tmp_path))
    monkeypatch.delenv("DSEC_IMAGE_WORKDIR", raising=False)
    assert users.resolve_cwd(None, home) == str(tmp_path)
    monkeypatch.setenv("DSEC_IMAGE_WORKDIR", "/")  # Docker's default: not a choice
    assert users.resolve_cwd(None, home) == str(tmp_path)
    monkeypatch.setenv("DSEC_IMAGE_WORKDIR", "/srv/app")
    assert users.resolve_cwd(None, home) == "/srv/app"
    assert users.resolve_cwd("data", home) == "/srv/app/data"
    assert users.resolve_cwd("/tmp", home) == "/tmp"


def test_image_variables_are_not_passed_to_commands(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSEC_IMAGE_USER", "app")
    monkeypatch.setenv("DSEC_IMAGE_WORKDIR", "/srv")
    env = users.base_env()
    assert "DSEC_IMAGE_USER" not in env
    assert "DSEC_IMAGE_WORKDIR" not in env
