"""Where the SDK finds its URL and key: arguments > environment > the client file."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dsec.core.errors import InvalidArgument, Unauthenticated
from dsec.sdk.config import DEFAULT_API_URL, client_file, resolve_config
from dsec.sdk.errors import MissingCredentials


def _home(tmp_path: Path, url: str | None = "http://10.0.0.1:9000", key: str = "file-key") -> Path:
    (tmp_path / "admin.key").write_text(key + "\n")
    data: dict[str, str] = {"api_key_file": "admin.key"}
    if url:
        data["api_url"] = url
    (tmp_path / "client.json").write_text(json.dumps(data))
    return tmp_path


def test_arguments_win_over_environment_and_file(tmp_path: Path) -> None:
    env = {"DSEC_HOME": str(_home(tmp_path)), "DSEC_API_URL": "http://e:1", "DSEC_API_KEY": "ek"}
    cfg = resolve_config("http://arg:2/", "ak", environ=env)
    assert (cfg.api_url, cfg.api_key) == ("http://arg:2", "ak")
    assert (cfg.url_source, cfg.key_source) == ("argument", "argument")


def test_environment_wins_over_file(tmp_path: Path) -> None:
    env = {"DSEC_HOME": str(_home(tmp_path)), "DSEC_API_URL": "http://e:1", "DSEC_API_KEY": "ek"}
    cfg = resolve_config(environ=env)
    assert (cfg.api_url, cfg.api_key, cfg.key_source) == ("http://e:1", "ek", "DSEC_API_KEY")


def test_each_field_resolves_on_its_own(tmp_path: Path) -> None:
    env = {"DSEC_HOME": str(_home(tmp_path)), "DSEC_API_KEY": "ek"}
    cfg = resolve_config(environ=env)
    assert (cfg.api_url, cfg.api_key) == ("http://10.0.0.1:9000", "ek")
    assert cfg.url_source == str(tmp_path / "client.json")


def test_client_file_alone_is_enough(tmp_path: Path) -> None:
    cfg = resolve_config(environ={"DSEC_HOME": str(_home(tmp_path))})
    assert (cfg.api_url, cfg.api_key) == ("http://10.0.0.1:9000", "file-key")
    assert client_file({"DSEC_HOME": str(tmp_path)}) == tmp_path / "client.json"


def test_url_defaults_to_loopback(tmp_path: Path) -> None:
    cfg = resolve_config(environ={"DSEC_HOME": str(_home(tmp_path, url=None))})
    assert cfg.api_url == DEFAULT_API_URL


def test_key_never_appears_in_repr(tmp_path: Path) -> None:
    cfg = resolve_config("http://x:1", "s3cret-key", environ={"DSEC_HOME": str(tmp_path)})
    assert "s3cret" not in repr(cfg)


def test_missing_key_says_what_to_set(tmp_path: Path) -> None:
    with pytest.raises(MissingCredentials) as info:
        resolve_config(environ={"DSEC_HOME": str(tmp_path)})
    msg = str(info.value)
    assert "DSEC_API_KEY" in msg
    assert "dsec up" in msg
    assert str(tmp_path / "client.json") in msg
    assert isinstance(info.value, Unauthenticated)


def test_unreadable_key_file_names_the_file(tmp_path: Path) -> None:
    home = _home(tmp_path)
    (home / "admin.key").unlink()
    with pytest.raises(MissingCredentials, match=r"admin\.key"):
        resolve_config(environ={"DSEC_HOME": str(home)})


@pytest.mark.skipif(os.geteuid() == 0, reason="root can read a mode-000 file")
def test_permission_denied_client_file(tmp_path: Path) -> None:
    home = _home(tmp_path)
    (home / "client.json").chmod(0)
    with pytest.raises(MissingCredentials, match="DSEC_API_KEY"):
        resolve_config(environ={"DSEC_HOME": str(home)})


def test_malformed_client_file(tmp_path: Path) -> None:
    (tmp_path / "client.json").write_text("{not json")
    with pytest.raises(InvalidArgument, match=r"client\.json"):
        resolve_config(environ={"DSEC_HOME": str(tmp_path)})


def test_inline_key_in_client_file_and_bad_url(tmp_path: Path) -> None:
    (tmp_path / "client.json").write_text(json.dumps({"api_key": "inline"}))
    assert resolve_config(environ={"DSEC_HOME": str(tmp_path)}).api_key == "inline"
    with pytest.raises(InvalidArgument, match="http://"):
        resolve_config("ftp://x", environ={"DSEC_HOME": str(tmp_path)})
