"""``kvcompose schema``: each installed type's options, with the descriptions editors show."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvcompose.cli import main
from kvcompose.plugins import get_plugins


@pytest.fixture
def schema(capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    """The schema exactly as the command prints it."""
    assert main(["schema"]) == 0
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


def options_schema(schema: dict[str, Any], type_name: str) -> dict[str, Any]:
    """The (dereferenced) ``options`` schema that applies when ``type:`` is ``type_name``."""
    branches = schema["$defs"]["ChildSpec"]["allOf"]
    (branch,) = [c for c in branches if c["if"]["properties"]["type"]["const"] == type_name]
    options = branch["then"]["properties"]["options"]
    ref = options.get("$ref")
    return schema["$defs"][ref.rsplit("/", 1)[1]] if ref else options


@pytest.mark.parametrize("type_name", ["nixl", "cpu-offload"])
def test_every_builtin_option_has_a_description(schema: dict[str, Any], type_name: str) -> None:
    """Both built-in plugins describe options the same way (``msgspec.Meta(description=...)``),
    so every option reaches editors with its text, not just its type."""
    fields = get_plugins().connector_types[type_name].options.__struct_fields__
    properties = options_schema(schema, type_name)["properties"]
    assert set(properties) == set(fields)
    missing = [name for name, prop in properties.items() if not prop.get("description")]
    assert not missing, f"{type_name} options without a description in the schema: {missing}"


def test_descriptions_are_the_plugins_words(schema: dict[str, Any]) -> None:
    assert "kv_offload_backend" in options_schema(schema, "cpu-offload")["properties"]["backend"]["description"]
    assert "preference order" in options_schema(schema, "nixl")["properties"]["backends"]["description"]
