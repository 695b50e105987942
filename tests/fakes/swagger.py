"""Check HTTP requests against a Swagger 2.0 document (the subset Firecracker's spec uses).

Paths with ``{param}`` templates, per-method operations, ``in: path`` and ``in: body``
parameters (``required``), and schemas with ``$ref``, ``type`` (object, string, integer,
number, boolean, array), ``enum``, ``required``, ``properties``, ``items``, ``minimum``,
``maximum`` and ``additionalProperties``. Unknown object properties are errors unless
``additionalProperties`` allows them: Firecracker rejects unknown fields, so a typo in
the driver must fail here too.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml

SPEC_NAME = "firecracker-api.yaml"


def find_spec() -> Path | None:
    """``$DSEC_FIRECRACKER_SPEC``, else ``shared/specs/firecracker-api.yaml`` beside the
    checkout or one of its parents (CI lays ``shared/`` beside the clone)."""
    env = os.environ.get("DSEC_FIRECRACKER_SPEC")
    if env:
        return Path(env)
    here = Path(__file__).resolve()
    for parent in here.parents:
        candidate = parent / "shared" / "specs" / SPEC_NAME
        if candidate.is_file():
            return candidate
    return None


class Spec:
    def __init__(self, doc: dict[str, Any]) -> None:
        if doc.get("swagger") != "2.0":
            raise ValueError("not a Swagger 2.0 document")
        self.doc = doc
        self.version = str(doc.get("info", {}).get("version", ""))
        self._paths = [
            (re.compile("^" + re.sub(r"\{[^/}]+\}", "[^/]+", tpl) + "$"), tpl, ops)
            for tpl, ops in doc["paths"].items()
        ]

    @classmethod
    def load(cls, path: Path) -> Spec:
        return cls(yaml.safe_load(path.read_text()))

    def check_request(self, method: str, path: str, body: object | None) -> list[str]:
        """Every way the request breaks the spec (empty when it conforms)."""
        found = [(tpl, ops) for rx, tpl, ops in self._paths if rx.match(path)]
        if not found:
            return [f"{path}: no such path in the spec"]
        tpl, ops = found[0]
        op = ops.get(method.lower())
        if op is None:
            return [f"{method} {tpl}: the spec has no such operation"]
        errors: list[str] = []
        params = op.get("parameters", [])
        body_params = [p for p in params if p.get("in") == "body"]
        if body is None:
            errors += [
                f"{method} {tpl}: body parameter {p['name']!r} is required"
                for p in body_params
                if p.get("required")
            ]
        elif not body_params:
            errors.append(f"{method} {tpl}: takes no body")
        else:
            errors += self.check(body_params[0]["schema"], body, "body")
        return errors

    def resolve(self, schema: dict[str, Any]) -> dict[str, Any]:
        while "$ref" in schema:
            ref = schema["$ref"]
            if not ref.startswith("#/definitions/"):
                raise ValueError(f"unsupported $ref {ref!r}")
            schema = self.doc["definitions"][ref.split("/")[-1]]
        return schema

    def check(self, schema: dict[str, Any], value: object, where: str) -> list[str]:
        schema = self.resolve(schema)
        kind = schema.get("type")
        if kind is None and "properties" in schema:
            kind = "object"
        checks = {
            "object": lambda v: isinstance(v, dict),
            "array": lambda v: isinstance(v, list),
            "string": lambda v: isinstance(v, str),
            "boolean": lambda v: isinstance(v, bool),
            "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
            "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
        }
        if kind is not None:
            if kind not in checks:
                raise ValueError(f"{where}: unsupported schema type {kind!r}")
            if not checks[kind](value):
                return [f"{where}: expected {kind}, got {type(value).__name__} {value!r}"]
        errors: list[str] = []
        if "enum" in schema and value not in schema["enum"]:
            errors.append(f"{where}: {value!r} is not one of {schema['enum']}")
        if isinstance(value, int | float) and not isinstance(value, bool):
            if "minimum" in schema and value < schema["minimum"]:
                errors.append(f"{where}: {value} is below the minimum {schema['minimum']}")
            if "maximum" in schema and value > schema["maximum"]:
                errors.append(f"{where}: {value} is above the maximum {schema['maximum']}")
        if isinstance(value, list) and "items" in schema:
            for i, item in enumerate(value):
                errors += self.check(schema["items"], item, f"{where}[{i}]")
        if isinstance(value, dict):
            errors += self._check_object(schema, value, where)
        return errors

    def _check_object(self, schema: dict[str, Any], value: dict[str, Any], where: str) -> list[str]:
        props: dict[str, Any] = schema.get("properties", {})
        errors = [f"{where}: missing required {r!r}" for r in schema.get("required", [])
                  if r not in value]  # fmt: skip
        extra = schema.get("additionalProperties", False)
        for key, item in value.items():
            if key in props:
                errors += self.check(props[key], item, f"{where}.{key}")
            elif isinstance(extra, dict):
                errors += self.check(extra, item, f"{where}.{key}")
            elif extra is not True:
                errors.append(f"{where}: unknown property {key!r}")
        return errors
