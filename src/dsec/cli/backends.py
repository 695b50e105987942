"""``dsec backends``: every edge's backends, what they can do, and why one is unavailable."""

from __future__ import annotations

from typing import Any

import click

from dsec.cli.output import json_option, print_json, simple_table, state, stdout

_FLAGS = (
    ("pause", "pause"),
    ("fork", "fork"),
    ("snapshot", "snapshot"),
    ("pty", "pty"),
    ("persistent_processes", "procs"),
    ("network_policy", "net"),
)


def backend_rows(edges: list[dict[str, Any]]) -> list[list[str]]:
    rows: list[list[str]] = []
    for edge in edges:
        if edge.get("error"):
            rows.append([edge["edge_id"], "-", "no", "-", "-", "-", "-", edge["error"]])
            continue
        for b in edge.get("backends", []):
            caps = b.get("capabilities", {})
            can = ",".join(label for key, label in _FLAGS if caps.get(key)) or "-"
            vcpus = caps.get("max_vcpus") or 0
            mem = caps.get("max_memory_mb") or 0
            least = caps.get("min_memory_mb") or 0
            few = caps.get("min_vcpus") or 0
            create = caps.get("create_seconds") or 0
            rows.append(
                [
                    edge["edge_id"],
                    b["name"],
                    "yes" if b["available"] else "no",
                    can,
                    f"{few:g}-" * bool(few) + (f"{vcpus:g}" if vcpus else "host"),
                    f"{least}-" * bool(least) + (f"{mem}" if mem else "host"),
                    f"~{create:g} s" if create else "-",
                    b.get("reason", ""),
                ]
            )
    return rows


@click.command("backends")
@json_option
def backends(as_json: bool) -> None:
    """List each edge's backends with capabilities and availability."""
    edges = state().client().backends()
    if as_json:
        print_json(edges)
        return
    header = ["EDGE", "BACKEND", "AVAILABLE", "CAN", "VCPUS", "MEM MB", "CREATE", "NOTE"]
    stdout().print(simple_table(header, backend_rows(edges)))
