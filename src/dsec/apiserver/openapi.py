"""The OpenAPI 3.1 document of the public API, built from the route tables so it cannot
list a route that does not exist (a test checks the reverse)."""

from __future__ import annotations

import re
from typing import Any

from dsec.core.spec import BACKENDS

_STR = {"type": "string"}
_NUM = {"type": "number"}
_INT = {"type": "integer"}
_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_CMD = {"oneOf": [_STR, {"type": "array", "items": _STR, "minItems": 1}]}

SCHEMAS: dict[str, Any] = {
    "Error": {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {"type": "object", "properties": {"code": _STR, "message": _STR}},
            "result": {"$ref": "#/components/schemas/ExecResult"},
        },
    },
    "SandboxSpec": {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "backend": {"type": "string", "enum": list(BACKENDS), "default": "container"},
            "image": {"type": "string", "default": "base"},
            "cpu": {"type": "number", "minimum": 0.05, "maximum": 64, "default": 1.0},
            "memory_mb": {"type": "integer", "minimum": 32, "default": 512},
            "pids": {"type": "integer", "minimum": 16, "default": 1024},
            "timeout_s": {"type": "integer", "minimum": 1, "default": 300},
            "env": _MAP,
            "metadata": _MAP,
            "network": {"$ref": "#/components/schemas/NetworkPolicy"},
            "on_timeout": {
                "type": "string",
                "enum": ["kill", "pause"],
                "default": "kill",
                "description": "at the timeout: end the sandbox, or pause it (backends that "
                "pause; a resume starts a new timeout)",
            },
            "snapshot": {
                "type": "string",
                "description": "start from this named snapshot (then only timeout_s, "
                "metadata, project and edge may be given)",
            },
            "edge": {
                "type": "string",
                "description": "with snapshot: start on this edge (a full snapshot is copied "
                "there first, checked by digest)",
            },
        },
    },
    "NetworkPolicy": {
        "type": "object",
        "additionalProperties": False,
        "description": "Rules: CIDR, CIDR:PORT[-PORT][/udp], DOMAIN, *.DOMAIN; deny wins.",
        "properties": {
            "allow": {"type": "array", "items": {"type": "string"}},
            "deny": {"type": "array", "items": {"type": "string"}},
        },
    },
    "SandboxInfo": {
        "type": "object",
        "properties": {
            "id": _STR,
            "project": _STR,
            "owner": _STR,
            "edge_id": _STR,
            "error": _STR,
            "moved_to": _STR,
            "state": {
                "type": "string",
                "enum": ["creating", "running", "paused", "stopping", "stopped", "failed"],
            },
            "created_at": _NUM,
            "started_at": _NUM,
            "expires_at": _NUM,
            "spec": {"$ref": "#/components/schemas/SandboxSpec"},
        },
    },
    "ExecRequest": {
        "type": "object",
        "required": ["cmd"],
        "properties": {
            "cmd": _CMD,
            "env": _MAP,
            "cwd": _STR,
            "user": _STR,
            "timeout": _NUM,
            "stdin": _STR,
            "encoding": {"type": "string", "enum": ["utf-8", "base64"]},
            "files": {"type": "array", "items": {"$ref": "#/components/schemas/CallFile"}},
            "outputs": {"type": "array", "items": _STR},
            "memory_mb": _INT,
        },
    },
    "CallFile": {
        "type": "object",
        "required": ["path", "data"],
        "properties": {"path": _STR, "data": _STR, "mode": _INT},
    },
    "ExecResult": {
        "type": "object",
        "properties": {
            "exit_code": _INT,
            "signal": _INT,
            "timed_out": {"type": "boolean"},
            "duration_ms": _NUM,
            "stdout": _STR,
            "stderr": _STR,
            "truncated": {"type": "boolean"},
            "oom_killed": {"type": "boolean"},
            "files": {"type": "array", "items": {"$ref": "#/components/schemas/CallFile"}},
        },
    },
    "BatchRequest": {
        "type": "object",
        "required": ["action"],
        "additionalProperties": False,
        "properties": {
            "action": {"type": "string", "enum": ["pause", "resume", "kill"]},
            "ids": {"type": "array", "items": _STR, "maxItems": 1000},
            "project": _STR,
        },
        "description": "exactly one of ids and project",
    },
    "BatchResults": {
        "type": "object",
        "properties": {
            "action": _STR,
            "results": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["id", "ok"],
                    "properties": {
                        "id": _STR,
                        "ok": {"type": "boolean"},
                        "sandbox": {"$ref": "#/components/schemas/SandboxInfo"},
                        "error": {"type": "object", "properties": {"code": _STR, "message": _STR}},
                    },
                },
            },
        },
    },
    "SnapshotInfo": {
        "type": "object",
        "required": ["id", "project", "backend", "mode", "size_bytes"],
        "properties": {
            "id": _STR,
            "name": _STR,
            "project": _STR,
            "owner": _STR,
            "source_sandbox": _STR,
            "backend": _STR,
            "mode": {"type": "string", "enum": ["full", "filesystem"]},
            "size_bytes": _INT,
            "created_at": _NUM,
            "edge_id": _STR,
            "spec": {"$ref": "#/components/schemas/SandboxSpec"},
        },
    },
    "Object": {"type": "object"},
}

_BODIES = {
    ("POST", "/v1/sandboxes"): "SandboxSpec",
    ("POST", "/v1/sandboxes:batch"): "BatchRequest",
    ("PUT", "/v1/sandboxes/{sandbox_id}/network"): "NetworkPolicy",
    ("POST", "/v1/sandboxes/{sandbox_id}/exec"): "ExecRequest",
    ("POST", "/v1/sandboxes/{sandbox_id}/shells/{name}/run"): "ExecRequest",
}
_RESULTS = {
    "/v1/sandboxes/{sandbox_id}": "SandboxInfo",
    "/v1/sandboxes": "SandboxInfo",
    "/v1/sandboxes:batch": "BatchResults",
    "/v1/sandboxes/{sandbox_id}/timeout": "SandboxInfo",
    "/v1/sandboxes/{sandbox_id}/network": "SandboxInfo",
    "/v1/sandboxes/{sandbox_id}/exec": "ExecResult",
    "/v1/sandboxes/{sandbox_id}/shells/{name}/run": "ExecResult",
}
_CREATED = ("/v1/sandboxes", "/v1/keys", "/v1/sandboxes/{sandbox_id}/snapshots")
_ERRORS = {
    "400": "invalid argument",
    "401": "missing or invalid API key",
    "403": "role too low",
    "404": "not found",
    "409": "invalid state",
    "413": "payload too large",
    "429": "quota exceeded",
    "503": "unavailable",
    "504": "timed out",
}


def document(routes: list[tuple[str, str, Any]], version: str) -> dict[str, Any]:
    paths: dict[str, dict[str, Any]] = {}
    for method, path, handler in routes:
        oa_path = re.sub(r"\{(\w+):[^}]*\}", r"{\1}", path)
        methods = ["get", "post", "put", "delete", "patch"] if method == "*" else [method.lower()]
        for m in methods:
            op: dict[str, Any] = {
                "operationId": f"{handler.__name__.rstrip('_')}_{m}",
                "summary": (handler.__doc__ or handler.__name__).strip().splitlines()[0],
                "parameters": [
                    {"name": n, "in": "path", "required": True, "schema": _STR}
                    for n in re.findall(r"\{(\w+)", oa_path)
                ],
                "responses": {
                    "200" if not (m == "post" and oa_path in _CREATED) else "201": {
                        "description": "success",
                        "content": {
                            "application/json": {
                                "schema": {
                                    "$ref": "#/components/schemas/"
                                    + _RESULTS.get(oa_path, "Object")
                                }
                            }
                        },
                    },
                    **{
                        code: {
                            "description": d,
                            "content": {
                                "application/json": {
                                    "schema": {"$ref": "#/components/schemas/Error"}
                                }
                            },
                        }
                        for code, d in _ERRORS.items()
                    },
                },
            }
            if path.startswith("/v1/"):
                op["security"] = [{"apiKey": []}]
            body = _BODIES.get((method, path))
            if body:
                op["requestBody"] = {
                    "required": True,
                    "content": {
                        "application/json": {"schema": {"$ref": f"#/components/schemas/{body}"}}
                    },
                }
            paths.setdefault(oa_path, {})[m] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "OpenDsec API", "version": version},
        "paths": paths,
        "components": {
            "schemas": SCHEMAS,
            "securitySchemes": {"apiKey": {"type": "http", "scheme": "bearer"}},
        },
    }
