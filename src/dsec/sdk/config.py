"""Where the SDK and the CLI find the API URL and key.

Each setting is taken from the first place that has it:

1. the argument (``Sandbox.create(api_url=..., api_key=...)``, ``dsec --api-url/--api-key``);
2. the environment: ``DSEC_API_URL``, ``DSEC_API_KEY``;
3. the client file ``dsec up`` writes, ``<home>/client.json`` (home is ``$DSEC_HOME`` or
   ``/var/lib/dsec``): ``{"api_url": ..., "api_key_file": ...}`` (``api_key`` inline is
   accepted too; a relative key file is relative to the client file).

The URL defaults to ``http://127.0.0.1:8420``; a key that cannot be found raises
:class:`~dsec.sdk.errors.MissingCredentials` naming exactly what to set.
"""

from __future__ import annotations

import json
import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsec.core.errors import InvalidArgument
from dsec.paths import DEFAULT_HOME, Paths
from dsec.sdk.errors import MissingCredentials

DEFAULT_API_URL = "http://127.0.0.1:8420"
ENV_URL = "DSEC_API_URL"
ENV_KEY = "DSEC_API_KEY"
ENV_HOME = "DSEC_HOME"


@dataclass(frozen=True, slots=True)
class ClientConfig:
    """A resolved API URL and key, with where each came from (for error messages)."""

    api_url: str
    api_key: str = field(repr=False)
    url_source: str = "default"
    key_source: str = "argument"

    def __post_init__(self) -> None:
        if not self.api_url.startswith(("http://", "https://")):
            raise InvalidArgument(
                f"API URL must start with http:// or https://, got {self.api_url!r} "
                f"(from {self.url_source})"
            )


def client_file(environ: Mapping[str, str] | None = None) -> Path:
    """Return the path of the client file ``dsec up`` writes for this environment."""
    env = os.environ if environ is None else environ
    return Paths.from_env(env.get(ENV_HOME) or DEFAULT_HOME).client_config


def _load_client_file(path: Path) -> dict[str, Any] | None:
    try:
        raw = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise MissingCredentials(
            f"cannot read {path} ({exc.strerror}); set {ENV_KEY} (and {ENV_URL}) or run as "
            "a user that can read it"
        ) from None
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise InvalidArgument(f"{path} is not valid JSON ({exc}); rerun `dsec up`") from None
    if not isinstance(data, dict):
        raise InvalidArgument(f"{path} must hold a JSON object; rerun `dsec up`")
    return data


def _key_from_file(data: dict[str, Any], path: Path) -> str | None:
    inline = data.get("api_key")
    if isinstance(inline, str) and inline.strip():
        return inline.strip()
    key_file = data.get("api_key_file")
    if not isinstance(key_file, str) or not key_file:
        return None
    kpath = Path(key_file)
    if not kpath.is_absolute():
        kpath = path.parent / kpath
    try:
        key = kpath.read_text().strip()
    except OSError as exc:
        raise MissingCredentials(
            f"cannot read the API key file {kpath} named in {path} ({exc.strerror}); "
            f"set {ENV_KEY} or run as a user that can read it"
        ) from None
    return key or None


def resolve_config(
    api_url: str | None = None,
    api_key: str | None = None,
    *,
    environ: Mapping[str, str] | None = None,
) -> ClientConfig:
    """Resolve the API URL and key: arguments, then environment, then the client file.

    Args:
        api_url: Explicit URL of the apiserver; wins over everything else.
        api_key: Explicit API key; wins over everything else.
        environ: The environment to read (``os.environ`` when omitted).

    Returns:
        The resolved configuration.

    Raises:
        MissingCredentials: No key anywhere, or the client file names one that can't be read.
        InvalidArgument: The client file is malformed or the URL is not http(s).
    """
    env = os.environ if environ is None else environ
    url, url_source = api_url, "argument"
    key, key_source = api_key, "argument"
    if not url and env.get(ENV_URL):
        url, url_source = env[ENV_URL], ENV_URL
    if not key and env.get(ENV_KEY):
        key, key_source = env[ENV_KEY], ENV_KEY
    path = client_file(env)
    if not url or not key:
        data = _load_client_file(path)
        if data is not None:
            if not url and isinstance(data.get("api_url"), str) and data["api_url"]:
                url, url_source = data["api_url"], str(path)
            if not key:
                key, key_source = _key_from_file(data, path), str(path)
    if not key:
        raise MissingCredentials(
            f"no API key: set {ENV_KEY} (and {ENV_URL} if the apiserver is not at "
            f"{DEFAULT_API_URL}), pass --api-key (CLI) or api_key= (SDK), or run `dsec up` "
            f"on this machine so {path} exists"
        )
    if not url:
        url, url_source = DEFAULT_API_URL, "default"
    return ClientConfig(
        api_url=url.rstrip("/"), api_key=key.strip(), url_source=url_source, key_source=key_source
    )


_tls_context: ssl.SSLContext | None = None


def tls_verify(api_url: str) -> ssl.SSLContext | bool:
    """httpx's ``verify`` for ``api_url``: one shared, verifying context for https.

    Building a context loads the CA bundle (~25 ms), which every client used to pay; a
    plain http URL (the local default) needs none.
    """
    global _tls_context
    if not api_url.lower().startswith("https:"):
        return False
    if _tls_context is None:
        _tls_context = ssl.create_default_context()
    return _tls_context
