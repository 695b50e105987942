"""Validation of request arguments: every check answers ``invalid_argument`` on failure."""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # `signal` would import enum

from dsec.agent.users import image_user
from dsec.agent.wire import AgentError

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


def bad(message: str) -> AgentError:
    return AgentError("invalid_argument", message)


def opt_str(req: dict[str, Any], key: str) -> str | None:
    value = req.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise bad(f"'{key}' must be a string")
    return value


def req_str(req: dict[str, Any], key: str) -> str:
    value = opt_str(req, key)
    if not value:
        raise bad(f"'{key}' is required")
    return value


def opt_bool(req: dict[str, Any], key: str, default: bool = False) -> bool:
    value = req.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(f"'{key}' must be true or false")
    return value


def opt_int(req: dict[str, Any], key: str, default: int | None = None) -> int | None:
    value = req.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(f"'{key}' must be an integer")
    return value


def req_int(req: dict[str, Any], key: str) -> int:
    value = opt_int(req, key)
    if value is None:
        raise bad(f"'{key}' is required")
    return value


def opt_timeout(req: dict[str, Any], key: str = "timeout") -> float | None:
    value = req.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise bad(f"'{key}' must be a positive number of seconds")
    return float(value)


def check_text(value: str, what: str) -> str:
    """Reject NUL and text that cannot be encoded as UTF-8 (lone surrogates)."""
    if "\x00" in value:
        raise bad(f"{what} contains a NUL character")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise bad(f"{what} is not valid UTF-8") from None
    return value


def req_path(req: dict[str, Any], key: str = "path") -> str:
    value = req.get(key)
    if not isinstance(value, str) or not value:
        raise bad(f"'{key}' must be a non-empty path")
    return check_text(value, f"'{key}'")


def cmd(req: dict[str, Any]) -> tuple[list[str], str | list[str]]:
    """Return ``(argv, original)``: a string runs with ``/bin/sh -c``, a list is exec'd."""
    value = req.get("cmd")
    if isinstance(value, str) and value.strip():
        return ["/bin/sh", "-c", check_text(value, "'cmd'")], value
    if isinstance(value, list) and value and all(isinstance(a, str) for a in value):
        return [check_text(a, "'cmd'") for a in value], list(value)
    raise bad("'cmd' must be a non-empty string or a non-empty list of strings")


def env(req: dict[str, Any]) -> dict[str, str]:
    value = req.get("env")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad("'env' must be an object of strings")
    for k, v in value.items():
        if not isinstance(v, str) or not k or "=" in k:
            raise bad(f"invalid environment variable {k!r}")
        check_text(k, "an environment name")
        check_text(v, f"the value of {k}")
    return value


def user(req: dict[str, Any]) -> str | int | None:
    """The requested user, else the image's ``User`` (``None``: the agent's own)."""
    value = req.get("user")
    if value is None or value == "":
        return image_user()
    if (
        value is None
        or isinstance(value, str)
        or (isinstance(value, int) and not isinstance(value, bool) and value >= 0)
    ):
        return value
    raise bad("'user' must be a user name or a numeric uid")


def signal_number(value: Any) -> int:
    """A signal given as a number (``15``) or a name (``"TERM"``, ``"SIGTERM"``)."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 65:
        return value
    if isinstance(value, str):
        name = value.upper()
        name = name if name.startswith("SIG") else "SIG" + name
        sig = getattr(_signal, name, None)
        if isinstance(sig, int) and not name.startswith("SIG_") and 0 < sig < 65:
            return sig
    raise bad(f"unknown signal {value!r}")
