"""Pure core logic: ids, errors, lifecycle table, specs, node admission."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import inspect
import json
import os
import re

import pytest

from dsec.core import admission, audit, errors, ids, lifecycle, spec
from dsec.core.lifecycle import Event, State


def test_sandbox_id_is_fixed_width_dns_label_and_names_its_edge() -> None:
    sid = ids.new_sandbox_id("e0a1", bytes(range(13)))
    assert len(sid) == 29
    assert re.fullmatch(r"[a-z0-9-]{1,63}", sid)
    assert ids.edge_of(sid) == "e0a1"
    assert ids.is_sandbox_id(sid)
    assert ids.new_sandbox_id("e0a1", bytes(range(13))) == sid  # deterministic in its input
    assert ids.new_sandbox_id("e0a1", bytes(range(1, 14))) != sid


def test_sandbox_id_random_part_is_the_base32_of_its_bytes() -> None:
    for raw in (bytes(13), b"\xff" * 13, bytes(range(13)), os.urandom(13), os.urandom(16)):
        b32 = base64.b32encode(raw[:13]).decode().lower()[:20]
        assert ids.new_sandbox_id("e0a1", raw) == f"sbx-e0a1-{b32}"


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "sbx-E0A1-aaaaaaaaaaaaaaaaaaaa",
        "sbx-e0a1-short",
        "xyz-e0a1-aaaaaaaaaaaaaaaaaaaa",
        "../../etc/passwd",
    ],
)
def test_malformed_sandbox_ids_are_not_found(bad: str) -> None:
    with pytest.raises(errors.SandboxNotFound):
        ids.edge_of(bad)


def test_edge_id_and_random_length_are_validated() -> None:
    with pytest.raises(errors.InvalidArgument):
        ids.new_sandbox_id("E0A1", bytes(13))
    with pytest.raises(ValueError, match="random bytes"):
        ids.new_sandbox_id("e0a1", bytes(5))


def test_api_key_round_trip_and_rejection() -> None:
    key = ids.format_api_key("abcdefghij12", "A" * 43)
    assert ids.parse_api_key(key) == ("abcdefghij12", "A" * 43)
    with pytest.raises(errors.InvalidArgument):
        ids.parse_api_key("dsk_short_x")


def test_every_error_is_in_the_docstring_tree_with_a_unique_code() -> None:
    doc = errors.__doc__ or ""
    classes = [
        c for c in vars(errors).values() if inspect.isclass(c) and issubclass(c, errors.DsecError)
    ]
    codes = [c.code for c in classes]
    assert len(codes) == len(set(codes))
    for cls in classes:
        assert cls.__name__ in doc, cls.__name__
        assert errors.error_from_wire(cls.code, "m").__class__ is cls
    assert isinstance(errors.error_from_wire("nonsense", "m"), errors.Internal)


def test_lifecycle_table_every_pair() -> None:
    allowed = {(s, e) for s, moves in lifecycle.TRANSITIONS.items() for e in moves}
    for s in State:
        for e in Event:
            if (s, e) in allowed:
                assert lifecycle.apply(s, e) is lifecycle.TRANSITIONS[s][e]
                assert lifecycle.can(s, e)
            else:
                with pytest.raises(errors.InvalidState):
                    lifecycle.apply(s, e)
    assert frozenset({State.STOPPED, State.FAILED}) == lifecycle.TERMINAL
    # Every non-terminal state can reach a terminal one.
    for s in lifecycle.LIVE:
        seen, todo = set(), [s]
        while todo:
            cur = todo.pop()
            seen.add(cur)
            todo += [n for n in lifecycle.TRANSITIONS[cur].values() if n not in seen]
        assert seen & lifecycle.TERMINAL


def test_only_lifecycle_assigns_state() -> None:
    import pathlib

    src = pathlib.Path(lifecycle.__file__).parents[1]
    offenders = [p for p in src.rglob("*.py") if re.search(r"\.state\s*=[^=]", p.read_text())]
    assert offenders == []


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("cpu", 0),
        ("cpu", 1000),
        ("memory_mb", 1),
        ("memory_mb", 10**9),
        ("pids", 1),
        ("timeout_s", 0),
        ("backend", "docker"),
        ("image", "UPPER case"),
        ("env", {"1X": "y"}),
        ("env", {"X": "a\0b"}),
        ("metadata", {"k": 5}),
    ],
)
def test_absurd_specs_are_rejected(field: str, value: object) -> None:
    with pytest.raises(errors.InvalidArgument):
        spec.SandboxSpec(**{field: value})  # type: ignore[arg-type]


def test_spec_round_trip_and_unknown_fields() -> None:
    s = spec.SandboxSpec(cpu=0.5, memory_mb=128, env={"A": "1"}, metadata={"run": "7"})
    assert spec.SandboxSpec.from_dict(s.to_dict()) == s
    with pytest.raises(errors.InvalidArgument, match="unknown sandbox fields: bogus"):
        spec.SandboxSpec.from_dict({"bogus": 1})
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.cpu = 2  # type: ignore[misc]


def test_node_admission() -> None:
    cap = admission.NodeCapacity(
        cpu_total=2, memory_total_mb=1000, max_sandboxes=3, cpu_overcommit=2, memory_overcommit=1
    )
    small = spec.SandboxSpec(cpu=1, memory_mb=300)
    admission.admit(cap, admission.NodeLoad(sandboxes=0, cpu=0, memory_mb=0), small)
    with pytest.raises(errors.NodeFull, match="maximum of 3"):
        admission.admit(cap, admission.NodeLoad(sandboxes=3, cpu=0, memory_mb=0), small)
    with pytest.raises(errors.NodeFull, match="cpu"):
        admission.admit(cap, admission.NodeLoad(sandboxes=1, cpu=3.5, memory_mb=0), small)
    with pytest.raises(errors.NodeFull, match="memory"):
        admission.admit(cap, admission.NodeLoad(sandboxes=1, cpu=0, memory_mb=800), small)
    with pytest.raises(errors.InvalidArgument, match="exceeds this node"):
        admission.admit(
            cap, admission.NodeLoad(sandboxes=0, cpu=0, memory_mb=0), spec.SandboxSpec(cpu=4)
        )


def test_project_paths() -> None:
    from dsec.core import projects

    assert projects.validate("org/team-1/exp_2") == "org/team-1/exp_2"
    for bad in ("", "Org", "org//x", "/org", "org/", "a/" * 20 + "b", "x" * 64, "org/../x"):
        with pytest.raises(errors.InvalidArgument):
            projects.validate(bad)
    assert projects.ancestors("a/b/c") == ["a", "a/b", "a/b/c"]
    assert projects.parent("a/b/c") == "a/b"
    assert projects.parent("a") == ""
    assert projects.contains("a", "a/b")
    assert projects.contains("a/b", "a/b")
    assert not projects.contains("a", "ab/c")
    assert not projects.contains("a/b", "a")


def test_audit_hash_is_the_sha256_of_the_sorted_compact_json_of_the_entry() -> None:
    first = audit.chain(None, audit.AuditEvent(ts=0.0, actor="a", action="x.y"), now=12.5)
    second = audit.chain(first, audit.AuditEvent(ts=3.0, actor="b", action="x.z", target="t"))
    assert (first.ts, first.seq, first.prev_hash) == (12.5, 1, audit.GENESIS)
    assert (second.ts, second.seq, second.prev_hash) == (3.0, 2, first.hash)  # its own time
    for e in (first, second):  # the definition stored logs were hashed with
        body = {k: v for k, v in dataclasses.asdict(e).items() if k != "hash"}
        text = json.dumps(body, sort_keys=True, separators=(",", ":"))
        assert e.hash == hashlib.sha256(text.encode()).hexdigest()
    assert audit.verify([first, second]) is None
