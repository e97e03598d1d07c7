"""What the API server does with an InferenceService before storing it, as far as tests can do it here.

1. defaulting (the CRD's `default`s, via pagoda.operator.crd.with_defaults);
2. OpenAPI validation of the openAPIV3Schema with jsonschema, plus strict field validation (kubectl's
   default `--validate=strict`: unknown fields are errors, not silently pruned);
3. the CEL `x-kubernetes-validations` rules, evaluated for real with cel-python on the defaulted
   object (`self` bound to the node that carries the rule).
Not done: CEL cost estimation, ratcheting, transition rules (`oldSelf`; the CRD has none).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import celpy
import jsonschema
from pagoda.operator import crd

FORBIDDEN_IN_STRUCTURAL = {"$ref", "definitions", "dependencies", "additionalItems", "patternProperties",
                           "id", "$schema"}


def strict(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with `additionalProperties: false` wherever unknown fields would be pruned."""
    node = copy.deepcopy(schema)
    if node.get("type") == "object" and "properties" in node and not node.get(
            "x-kubernetes-preserve-unknown-fields"):
        node.setdefault("additionalProperties", False)
        node["properties"] = {k: strict(v) for k, v in node["properties"].items()}
    if isinstance(node.get("items"), dict):
        node["items"] = strict(node["items"])
    return node


def schema_errors(obj: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft7Validator(strict(crd.schema()))
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)]


def _rule_sites(schema: dict[str, Any], value: Any, where: str) -> Iterator[tuple[str, dict[str, Any], Any]]:
    for rule in schema.get("x-kubernetes-validations", []):
        yield where, rule, value
    if isinstance(value, dict):
        for name, child in schema.get("properties", {}).items():
            if name in value:
                yield from _rule_sites(child, value[name], f"{where}.{name}")
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            yield from _rule_sites(schema["items"], item, f"{where}[{i}]")


_ENV = celpy.Environment()


def cel_errors(spec: dict[str, Any], spec_schema: dict[str, Any] | None = None) -> list[str]:
    """Every CEL rule of spec's schema (default: the InferenceService's) that the defaulted spec breaks,
    as '<path>: <message>'."""
    spec_schema = crd.schema()["properties"]["spec"] if spec_schema is None else spec_schema
    errors = []
    for where, rule, value in _rule_sites(spec_schema, crd.with_defaults(spec, spec_schema), "spec"):
        program = _ENV.program(_ENV.compile(rule["rule"]))
        result = program.evaluate({"self": celpy.json_to_cel(value)})
        if not (isinstance(result, celpy.celtypes.BoolType) and bool(result)):  # False or an eval error
            errors.append(f"{where}: {rule['message']}")
    return errors


def admission_errors(obj: dict[str, Any]) -> list[str]:
    """Schema errors first; CEL runs only on schema-valid objects (as the API server does)."""
    return schema_errors(obj) or cel_errors(obj.get("spec", {}))


def foreign_admission_errors(obj: dict[str, Any], schema: dict[str, Any]) -> list[str]:
    """The same checks against another resource's schema (one written from its published CRD)."""
    validator = jsonschema.Draft7Validator(strict(schema))
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)]
    return errors or cel_errors(obj.get("spec", {}), schema["properties"]["spec"])


def all_rules(schema: dict[str, Any] | None = None) -> Iterator[str]:
    schema = crd.schema() if schema is None else schema
    for rule in schema.get("x-kubernetes-validations", []):
        yield rule["rule"]
    for child in schema.get("properties", {}).values():
        yield from all_rules(child)
    if isinstance(schema.get("items"), dict):
        yield from all_rules(schema["items"])


def structural_problems(node: dict[str, Any], where: str = "") -> list[str]:
    """Kubernetes' structural-schema rules (apiextensions: "Specifying a structural schema")."""
    problems = []
    if "type" not in node and not (node.get("x-kubernetes-int-or-string")
                                   or node.get("x-kubernetes-preserve-unknown-fields")):
        problems.append(f"{where or '<root>'}: no type")
    if "properties" in node and "additionalProperties" in node:
        problems.append(f"{where}: properties and additionalProperties together")
    if node.get("uniqueItems"):
        problems.append(f"{where}: uniqueItems: true")
    problems += [f"{where}: forbidden keyword {k}" for k in FORBIDDEN_IN_STRUCTURAL & set(node)]
    if "default" in node:
        try:
            jsonschema.Draft7Validator(strict(node)).validate(node["default"])
        except jsonschema.ValidationError as exc:
            problems.append(f"{where}: default does not validate: {exc.message}")
    if node.get("x-kubernetes-list-type") == "map":
        items = node.get("items", {})
        missing = set(node.get("x-kubernetes-list-map-keys", [])) - set(items.get("required", []))
        if items.get("type") != "object" or missing:
            problems.append(f"{where}: list-type map needs object items with required keys {missing}")
    for name, child in node.get("properties", {}).items():
        problems += structural_problems(child, f"{where}.{name}")
    if isinstance(node.get("items"), dict):
        problems += structural_problems(node["items"], f"{where}[]")
    if isinstance(node.get("additionalProperties"), dict):
        problems += structural_problems(node["additionalProperties"], f"{where}{{}}")
    return problems
