"""Project-scoped roles: how the apiserver's Principal and the edge's Caller decide."""

from __future__ import annotations

import pytest

from dsec.apiserver.auth import Principal
from dsec.core import errors
from dsec.edge.manager import Caller
from dsec.edge.service import caller_of


def _p(*grants: tuple[str, str], project: str = "org/a/x", role: str = "viewer") -> Principal:
    return Principal("u", project, role, "k").for_request(tuple(grants))


def test_roles_are_inherited_downward_and_not_upward_or_sideways() -> None:
    p = _p(("org/a", "member"), ("org", "viewer"))
    assert p.rank_on("org/a/x/deep") == 1
    assert p.rank_on("org/a") == 1
    assert p.rank_on("org") == 0
    assert p.rank_on("org/b") == 0
    assert p.rank_on("orga") == -1  # a sibling that shares a prefix, not a child
    assert p.rank_on("other") == -1
    assert p.scopes("member") == ["org/a"]
    assert p.scopes("viewer") == ["org", "org/a", "org/a/x"]
    assert not p.admin
    p.require_on("org/a/y", "member")
    for project, role in (("org/b", "member"), ("org/a", "admin"), ("other", "viewer")):
        with pytest.raises(errors.PermissionDenied) as e:
            p.require_on(project, role)
        assert e.value.http_status == 403


def test_platform_grant_covers_every_project() -> None:
    p = _p(("*", "admin"))
    assert p.admin
    assert p.rank_on("anything/at/all") == 2
    assert dict(p.metadata())["x-dsec-role"] == "admin"
    project_admin = _p(project="org", role="admin")
    assert not project_admin.admin
    with pytest.raises(errors.PermissionDenied):
        project_admin.require_on("*", "admin")


def test_metadata_forwards_the_scopes_of_the_role_the_route_needed() -> None:
    p = _p(("org/a", "member"), ("org", "viewer"))
    p.require("member")
    md = dict(p.metadata())
    assert md["x-dsec-scopes"] == "org/a"
    assert md["x-dsec-visible"] == "org,org/a,org/a/x"
    assert md["x-dsec-role"] != "admin"
    fresh = p.for_request(p.grants)  # per request: what one route needed does not leak
    assert dict(fresh.metadata())["x-dsec-scopes"] == "org,org/a,org/a/x"


class _Ctx:
    def __init__(self, md: dict[str, str]) -> None:
        self._md = md

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return tuple(self._md.items())


def test_edge_denies_visible_sandboxes_with_403_and_hides_others() -> None:
    p = _p(("org/a", "member"), ("org", "viewer"))
    p.require("member")
    caller = caller_of(_Ctx(dict(p.metadata())))  # type: ignore[arg-type]
    assert caller.covers("org/a/x")
    assert not caller.covers("org/b")

    class Rec:
        id = "sbx"
        project = "org/b"

    with pytest.raises(errors.PermissionDenied):
        caller.check(Rec)  # type: ignore[arg-type]
    Rec.project = "other"
    with pytest.raises(errors.SandboxNotFound):
        caller.check(Rec)  # type: ignore[arg-type]
    legacy = Caller(project="org", subject="u", admin=False)  # no scopes header: own project
    assert legacy.covers("org/b")
    assert not legacy.covers("other")
