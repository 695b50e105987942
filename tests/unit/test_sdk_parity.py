"""The sync and async SDK surfaces must match name for name, parameter for parameter."""

from __future__ import annotations

import inspect

import pytest

from dsec import sdk

PAIRS = [
    (sdk.Client, sdk.AsyncClient),
    (sdk.Sandbox, sdk.AsyncSandbox),
    (sdk.Files, sdk.AsyncFiles),
    (sdk.Processes, sdk.AsyncProcesses),
    (sdk.Ptys, sdk.AsyncPtys),
    (sdk.Pty, sdk.AsyncPty),
    (sdk.Shell, sdk.AsyncShell),
    (sdk.TcpStream, sdk.AsyncTcpStream),
]
# Local-resource cleanup and the protocols follow asyncio naming; everything else is equal.
RENAMED = {
    "close": "aclose",
    "__enter__": "__aenter__",
    "__exit__": "__aexit__",
    "__iter__": "__aiter__",
}
SAME_NAME_CLOSE = {sdk.Shell}  # Shell.close ends a remote session: same name when async


def _public(cls: type) -> dict[str, object]:
    names = {n for n in dir(cls) if not n.startswith("_")}
    names |= {n for n in RENAMED.keys() | set(RENAMED.values()) if n in vars(cls)}
    return {n: inspect.getattr_static(cls, n) for n in names}


def _shape(obj: object) -> list[tuple[str, object, object]]:
    fn = obj.__func__ if isinstance(obj, classmethod | staticmethod) else obj
    if isinstance(fn, property):
        return [("<property>", None, None)]
    assert callable(fn)
    sig = inspect.signature(fn)
    return [(p.name, p.kind, p.default) for p in sig.parameters.values()]


@pytest.mark.parametrize(("sync_cls", "async_cls"), PAIRS, ids=lambda c: c.__name__)
def test_same_methods_and_parameters(sync_cls: type, async_cls: type) -> None:
    sync_members, async_members = _public(sync_cls), _public(async_cls)
    expected = {}
    for name, member in sync_members.items():
        target = name if sync_cls in SAME_NAME_CLOSE else RENAMED.get(name, name)
        expected[target] = member
    assert sorted(expected) == sorted(async_members)
    for name, member in expected.items():
        assert _shape(member) == _shape(async_members[name]), name


# Methods that only build a local handle (no I/O), and those returning async iterators.
HANDLES = {("AsyncClient", "sandbox"), ("AsyncSandbox", "shell"), ("AsyncPtys", "connect")}
ITERATORS = {"exec_stream", "read_stream", "__aiter__", "AsyncProcesses.connect"}


@pytest.mark.parametrize(("sync_cls", "async_cls"), PAIRS, ids=lambda c: c.__name__)
def test_async_methods_are_awaitable_or_async_iterators(sync_cls: type, async_cls: type) -> None:
    for name, member in _public(async_cls).items():
        fn = member.__func__ if isinstance(member, classmethod) else member
        if isinstance(fn, property) or (async_cls.__name__, name) in HANDLES:
            continue
        if not callable(fn):
            continue
        if name in ITERATORS or f"{async_cls.__name__}.{name}" in ITERATORS:
            returns = str(inspect.signature(fn).return_annotation)
            assert inspect.isasyncgenfunction(fn) or "AsyncGenerator" in returns, name
            continue
        assert inspect.iscoroutinefunction(fn), f"{async_cls.__name__}.{name} is not async"


def test_instance_attributes_match() -> None:
    for cls in (sdk.Sandbox, sdk.AsyncSandbox):  # set in __init__ (through _bind)
        assert "_bind" in cls.__init__.__code__.co_names
        assert {"files", "processes", "pty"} <= set(cls._bind.__code__.co_names)
