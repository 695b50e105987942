"""Registry settings and credentials: ``dsec registry login`` and Docker's ``config.json``.

dsec's own file (mode 0600) maps a registry host to its settings::

    {"registries": {"127.0.0.1:5000": {"username": "u", "password": "p",
                                        "insecure": true, "ca_file": "/path/ca.pem"}}}

``insecure`` means plain HTTP; it is only ever used when set here or asked for per pull.
Docker's ``config.json`` (``auths.<host>.auth`` = base64 ``user:pass``) is read for
credentials only; credential helpers are not run.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dsec.core.errors import InvalidArgument
from dsec.edge.images.reference import DOCKER_HUB

_HUB_ALIASES = ("https://index.docker.io/v1/", "index.docker.io", "registry-1.docker.io")


@dataclass(frozen=True, slots=True)
class RegistrySettings:
    """How to reach one registry."""

    username: str = ""
    password: str = ""
    insecure: bool = False
    ca_file: str = ""

    @property
    def has_credentials(self) -> bool:
        return bool(self.username)


def default_docker_configs() -> list[Path]:
    """Docker config files to consult: ``$DOCKER_CONFIG/config.json`` or ``~/.docker``."""
    env = os.environ.get("DOCKER_CONFIG")
    if env:
        return [Path(env) / "config.json"]
    return [Path.home() / ".docker" / "config.json"]


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"cannot read registry settings {path}: {exc}") from None
    return data if isinstance(data, dict) else {}


class RegistryCredentials:
    """Looks up :class:`RegistrySettings` for a registry host."""

    def __init__(self, path: Path | None = None, docker_configs: Sequence[Path] = ()) -> None:
        self.path = path
        self.docker_configs = tuple(docker_configs)

    def _own(self) -> dict[str, Any]:
        if self.path is None:
            return {}
        regs = _read_json(self.path).get("registries")
        return regs if isinstance(regs, dict) else {}

    def lookup(self, registry: str) -> RegistrySettings:
        """Settings for ``registry`` (host[:port]); empty settings when nothing is known."""
        entry = self._own().get(registry)
        settings = RegistrySettings()
        if isinstance(entry, dict):
            settings = RegistrySettings(
                username=str(entry.get("username") or ""),
                password=str(entry.get("password") or ""),
                insecure=bool(entry.get("insecure", False)),
                ca_file=str(entry.get("ca_file") or ""),
            )
        if not settings.has_credentials:
            user, password = self._docker_auth(registry)
            if user:
                settings = replace(settings, username=user, password=password)
        return settings

    def _docker_auth(self, registry: str) -> tuple[str, str]:
        keys = [registry, f"https://{registry}", f"http://{registry}"]
        if registry == DOCKER_HUB:
            keys.extend(_HUB_ALIASES)
        for cfg in self.docker_configs:
            auths = _read_json(cfg).get("auths")
            if not isinstance(auths, dict):
                continue
            for key in keys:
                entry = auths.get(key)
                if not isinstance(entry, dict):
                    continue
                if entry.get("username"):
                    return str(entry["username"]), str(entry.get("password") or "")
                raw = entry.get("auth")
                if isinstance(raw, str) and raw:
                    try:
                        user, _, password = base64.b64decode(raw).decode().partition(":")
                    except (binascii.Error, UnicodeDecodeError):
                        continue
                    return user, password
        return "", ""

    def save(self, registry: str, settings: RegistrySettings) -> None:
        """Store ``settings`` for ``registry`` (the file is written 0600, atomically)."""
        if self.path is None:
            raise InvalidArgument("no registry settings file configured")
        data = _read_json(self.path)
        regs = data.get("registries")
        if not isinstance(regs, dict):
            regs = {}
        entry: dict[str, Any] = {}
        if settings.username:
            entry["username"] = settings.username
            entry["password"] = settings.password
        if settings.insecure:
            entry["insecure"] = True
        if settings.ca_file:
            entry["ca_file"] = settings.ca_file
        regs[registry] = entry
        data["registries"] = regs
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2)
        os.replace(tmp, self.path)

    def remove(self, registry: str) -> bool:
        """Forget ``registry``; True if it was known."""
        if self.path is None:
            return False
        data = _read_json(self.path)
        regs = data.get("registries")
        if not isinstance(regs, dict) or registry not in regs:
            return False
        del regs[registry]
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2)
        os.replace(tmp, self.path)
        return True
