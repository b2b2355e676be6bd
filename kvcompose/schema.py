"""JSON Schema of the composition file, with each installed connector type's options."""

from __future__ import annotations

from typing import Any

import msgspec

from kvcompose.config import Composition, schema_hook
from kvcompose.plugins import Plugins, get_plugins


def json_schema(plugins: Plugins | None = None) -> dict[str, Any]:
    plugins = plugins or get_plugins()
    types = plugins.connector_types
    option_types = [t.options for t in types.values()]
    (root, *opts), defs = msgspec.json.schema_components(
        [Composition, *option_types], schema_hook=schema_hook, ref_template="#/$defs/{name}"
    )
    child = defs["ChildSpec"]
    child["properties"]["type"]["enum"] = sorted(types)
    child["allOf"] = [
        {"if": {"properties": {"type": {"const": name}}}, "then": {"properties": {"options": opt}}}
        for name, opt in zip(types, opts)
    ]
    rule_names: dict[str, list[str]] = {}
    for kind, name in plugins.rules:
        rule_names.setdefault(kind, []).append(name)
    for kind, names in rule_names.items():
        defs["RulesSpec"]["properties"][kind] = {
            "anyOf": [
                {"enum": sorted(names)},
                {"type": "object", "properties": {"use": {"enum": sorted(names)}}, "required": ["use"]},
            ],
        }
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "kvcompose composition",
        **root,
        "$defs": defs,
    }
