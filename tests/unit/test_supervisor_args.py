"""`dsec up` hands --domain / --tls-listen to the apiserver it starts (only when given)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from dsec import supervisor
from dsec.cli import platform
from dsec.paths import Paths
from dsec.supervisor import Layout, Supervisor, api_args


def _sup(tmp_path: Path, extra: list[str]) -> Supervisor:
    return Supervisor(Paths.from_env(tmp_path), Layout.from_port_base(18420), api_args=extra)


def test_apiserver_gets_domain_and_tls_listen_only_when_given(tmp_path: Path) -> None:
    argv = _sup(tmp_path, api_args("sbx.example.test", "127.0.0.1:18443"))._argv("apiserver")
    assert argv[-4:] == ["--domain", "sbx.example.test", "--tls-listen", "127.0.0.1:18443"]
    plain = _sup(tmp_path, api_args())._argv("apiserver")
    assert "--domain" not in plain
    assert "--tls-listen" not in plain
    # the other components never get them
    assert "--domain" not in _sup(tmp_path, api_args("a.b"))._argv("edge")


def test_detached_supervisor_parses_the_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    def fake_run(paths: Paths, layout: Layout, **kw: Any) -> int:
        seen.update(kw, base=layout.apiserver)
        return 0

    monkeypatch.setattr(supervisor, "run_foreground", fake_run)
    with pytest.raises(SystemExit):
        supervisor.main(["/tmp/x", "18420", "--domain", "d.test", "--tls-listen", ":8443"])
    assert seen["api_args"] == ["--domain", "d.test", "--tls-listen", ":8443"]
    assert seen["base"].endswith(":18420")
    assert seen["keep_sandboxes"] is False


def test_up_passes_flags_and_refuses_tls_without_domain(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, Any] = {}
    monkeypatch.setattr(platform, "_setup", lambda paths, quiet=False: None)

    def fake_run(paths: Paths, layout: Layout, **kw: Any) -> int:
        seen.update(kw)
        return 0

    monkeypatch.setattr(platform, "run_foreground", fake_run)
    home = ["--home", str(tmp_path)]
    bad = CliRunner().invoke(platform.up, [*home, "--tls-listen", "127.0.0.1:8443"])
    assert bad.exit_code == 2
    assert "needs --domain" in bad.output
    assert not seen
    ok = CliRunner().invoke(platform.up, [*home, "--domain", "d.test", "--tls-listen", ":8443"])
    assert ok.exit_code == 0, ok.output
    assert seen["api_args"] == ["--domain", "d.test", "--tls-listen", ":8443"]
