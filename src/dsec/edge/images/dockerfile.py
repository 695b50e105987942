"""Parse a Dockerfile into instructions (the subset ``dsec image build`` runs).

Supported: FROM (one stage), RUN, COPY, ADD (local files), ENV, WORKDIR, USER, ENTRYPOINT,
CMD, ARG, LABEL, EXPOSE (recorded nothing: accepted so common files build). Lines join on a
trailing backslash; ``#`` starts a comment at the beginning of a line; keywords are
case-insensitive; RUN, CMD, ENTRYPOINT, COPY and ADD take the shell or the JSON (exec)
form. ``$VAR``, ``${VAR}``, ``${VAR:-default}`` and ``${VAR:+alt}`` are expanded from ARG
and ENV values in FROM, COPY, ADD, ENV, WORKDIR, USER, LABEL and EXPOSE; RUN leaves that to
the shell (ARG values are in its environment).

Every error is a :class:`DockerfileError` naming the line.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field

from dsec.core.errors import InvalidArgument

KEYWORDS = frozenset(
    {"FROM", "RUN", "COPY", "ADD", "ENV", "WORKDIR", "USER", "ENTRYPOINT", "CMD", "ARG"}
    | {"LABEL", "EXPOSE"}
)
UNSUPPORTED = {
    "ONBUILD": "ONBUILD triggers are not supported",
    "HEALTHCHECK": "HEALTHCHECK is not supported",
    "VOLUME": "VOLUME is not supported (sandboxes have no volumes)",
    "STOPSIGNAL": "STOPSIGNAL is not supported",
    "SHELL": "SHELL is not supported (RUN uses /bin/sh -c)",
    "MAINTAINER": "MAINTAINER is deprecated: use LABEL",
}
COPY_FLAGS = frozenset({"chown", "chmod"})
_VAR_RE = re.compile(
    r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)(?::([-+])([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))"
)
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class DockerfileError(InvalidArgument):
    """A Dockerfile that cannot be built as written (the message names the line)."""

    def __init__(self, line: int, message: str) -> None:
        super().__init__(f"Dockerfile line {line}: {message}")
        self.line = line


@dataclass(frozen=True, slots=True)
class Instruction:
    """One instruction: where it is, its keyword and its arguments as written."""

    line: int
    keyword: str  # upper case
    text: str  # the arguments, continuation lines joined
    flags: Mapping[str, str] = field(default_factory=dict)  # --chown=... of COPY/ADD
    exec_form: tuple[str, ...] | None = None  # the JSON form's list, if used

    @property
    def source(self) -> str:
        """The instruction as one normalised line (part of the step cache key)."""
        flags = "".join(f" --{k}={v}" for k, v in sorted(self.flags.items()))
        body = json.dumps(list(self.exec_form)) if self.exec_form is not None else self.text
        return f"{self.keyword}{flags} {body}"

    def error(self, message: str) -> DockerfileError:
        return DockerfileError(self.line, message)


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """(first line number, joined text) of every instruction line."""
    out: list[tuple[int, str]] = []
    parts: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not parts):
            continue  # comments (and parser directives) and blank lines
        if not parts:
            start = number
        if stripped.endswith("\\"):
            parts.append(stripped[:-1])
            continue
        parts.append(stripped)
        out.append((start, " ".join(p.strip() for p in parts if p.strip())))
        parts = []
    if parts:
        out.append((start, " ".join(p.strip() for p in parts if p.strip())))
    return out


def _exec_form(text: str) -> tuple[str, ...] | None:
    if not text.startswith("["):
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None  # Docker runs it in the shell form then
    if not isinstance(value, list) or not all(isinstance(a, str) for a in value):
        return None
    return tuple(value)


def _split_flags(line: int, keyword: str, text: str) -> tuple[dict[str, str], str]:
    flags: dict[str, str] = {}
    while text.startswith("--"):
        word, _, rest = text.partition(" ")
        name, sep, value = word[2:].partition("=")
        if name == "from":
            raise DockerfileError(line, f"{keyword} --from (multi-stage builds) is not supported")
        if name not in COPY_FLAGS or not sep or not value:
            raise DockerfileError(line, f"unknown or empty {keyword} flag {word!r}")
        flags[name] = value
        text = rest.strip()
    return flags, text


def parse(text: str) -> list[Instruction]:
    """Parse ``text``; the first instruction other than ARG must be the only FROM.

    Raises:
        DockerfileError: unknown or unsupported instructions, a missing or second FROM,
            missing arguments, malformed JSON arguments.
    """
    out: list[Instruction] = []
    seen_from = False
    for line, joined in _logical_lines(text):
        word, _, rest = joined.partition(" ")
        if not word.isascii() or not word.isalpha():
            raise DockerfileError(line, f"expected an instruction, got {word!r}")
        keyword, rest = word.upper(), rest.strip()
        if keyword in UNSUPPORTED:
            raise DockerfileError(line, UNSUPPORTED[keyword])
        if keyword not in KEYWORDS:
            raise DockerfileError(line, f"unknown instruction {word!r}")
        if not rest:
            raise DockerfileError(line, f"{keyword} needs arguments")
        if keyword == "FROM":
            if seen_from:
                raise DockerfileError(line, "a second FROM (multi-stage builds) is not supported")
            seen_from = True
        elif keyword != "ARG" and not seen_from:
            raise DockerfileError(line, f"{keyword} before FROM (only ARG may come first)")
        flags: dict[str, str] = {}
        if keyword in ("COPY", "ADD"):
            flags, rest = _split_flags(line, keyword, rest)
        exec_form = None
        if keyword in ("RUN", "CMD", "ENTRYPOINT", "COPY", "ADD"):
            exec_form = _exec_form(rest)
            if rest.startswith("[") and exec_form is None and keyword in ("COPY", "ADD"):
                raise DockerfileError(line, f"{keyword} has malformed JSON arguments")
        out.append(Instruction(line, keyword, rest, flags, exec_form))
    if not seen_from:
        raise DockerfileError(max(1, len(text.splitlines())), "no FROM instruction")
    return out


# --- argument helpers (used by the builder) ------------------------------------------


def expand(text: str, values: Mapping[str, str]) -> str:
    """Expand ``$VAR`` references in ``text`` from ``values`` (unknown ones are empty)."""

    def sub(m: re.Match[str]) -> str:
        braced, op, word, plain = m.groups()
        value = values.get(braced or plain, "")
        if op == "-":
            return value or word
        if op == "+":
            return word if value else ""
        return value

    return _VAR_RE.sub(sub, text.replace("\\$", "\x00")).replace("\x00", "$")


def words(ins: Instruction, values: Mapping[str, str]) -> list[str]:
    """The arguments split like a shell would (quotes honoured), after expansion."""
    try:
        return shlex.split(expand(ins.text, values))
    except ValueError as exc:
        raise ins.error(f"cannot split arguments: {exc}") from None


def key_values(ins: Instruction, values: Mapping[str, str]) -> list[tuple[str, str]]:
    """``K=V K2="v 2"`` pairs of ENV and LABEL (and ENV's legacy ``K value`` form)."""
    parts = words(ins, values)
    if ins.keyword == "ENV" and parts and "=" not in parts[0]:
        if len(parts) < 2:
            raise ins.error("ENV needs a value (ENV NAME=value)")
        _, _, legacy = ins.text.partition(parts[0])
        return [(parts[0], expand(legacy.strip(), values))]
    pairs: list[tuple[str, str]] = []
    for part in parts:
        key, sep, value = part.partition("=")
        if not sep or not key:
            raise ins.error(f"expected NAME=value, got {part!r}")
        if ins.keyword == "ENV" and not _NAME_RE.match(key):
            raise ins.error(f"invalid variable name {key!r}")
        pairs.append((key, value))
    return pairs


def arg_decl(ins: Instruction) -> tuple[str, str | None]:
    """(name, default or None) of an ARG."""
    name, sep, default = ins.text.partition("=")
    name = name.strip()
    if not _NAME_RE.match(name):
        raise ins.error(f"invalid ARG {ins.text!r} (expected NAME or NAME=default)")
    if sep:
        parts = shlex.split(default) if default.strip() else [""]
        return name, parts[0] if parts else ""
    return name, None


def command(ins: Instruction) -> list[str]:
    """RUN/CMD/ENTRYPOINT as argv: the JSON form as is, the shell form via ``/bin/sh -c``."""
    if ins.exec_form is not None:
        return list(ins.exec_form)
    return ["/bin/sh", "-c", ins.text]


def copy_args(ins: Instruction, values: Mapping[str, str]) -> tuple[list[str], str]:
    """(sources, destination) of COPY/ADD."""
    parts = list(ins.exec_form) if ins.exec_form is not None else words(ins, values)
    if ins.exec_form is not None:
        parts = [expand(p, values) for p in parts]
    if len(parts) < 2:
        raise ins.error(f"{ins.keyword} needs at least one source and a destination")
    return parts[:-1], parts[-1]
