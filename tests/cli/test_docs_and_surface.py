"""Docs keep up with the hooks and rules; the composite keeps up with vLLM's connector interface."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

from kvcompose import hookspecs
from kvcompose.cli import main
from kvcompose.plugins import get_plugins
from kvcompose.vllm.connector import KVComposeConnector

DOCS = Path(__file__).parents[2] / "docs"
HOOKS = [name for name, fn in inspect.getmembers(hookspecs, inspect.isfunction) if name.startswith("kvcompose_")]


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hook_is_documented(hook: str) -> None:
    fn = getattr(hookspecs, hook)
    assert inspect.getdoc(fn), f"{hook} has no docstring"
    args = ", ".join(inspect.signature(fn).parameters)
    assert f"### {hook}({args})" in (DOCS / "plugins.md").read_text(), f"docs/plugins.md lacks '### {hook}({args})'"


def test_every_builtin_rule_and_type_is_documented() -> None:
    text = (DOCS / "rules.md").read_text()
    yaml_text = (DOCS / "yaml.md").read_text()
    for row in get_plugins().provided():
        if row.provider != "kvcompose (built-in)":
            continue
        if row.kind == "type":
            assert f"### `type: {row.name}`" in yaml_text, f"connector type {row.name} missing from docs/yaml.md"
            continue
        assert f"**`{row.name}`**" in text, f"rule {row.kind} {row.name} missing from docs/rules.md"
        assert f"`{row.kind}`" in text


# vLLM's own guard for MultiConnector exempts these; the base versions are correct for a composite.
NOT_OVERRIDDEN = {"role", "has_connector_metadata"}


def test_composite_overrides_every_public_base_method() -> None:
    missing = [
        name
        for name in dir(KVConnectorBase_V1)
        if not name.startswith("_")
        and name not in NOT_OVERRIDDEN
        and getattr(KVComposeConnector, name) is getattr(KVConnectorBase_V1, name)
        and inspect.getattr_static(KVComposeConnector, name) is inspect.getattr_static(KVConnectorBase_V1, name)
    ]
    assert not missing, f"vLLM grew connector methods the composite does not forward: {missing}"


def test_vllm_args_load_the_composite(capsys: pytest.CaptureFixture[str]) -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    assert main(["vllm-args", "examples/pd-decode.yaml"]) == 0
    cfg = json.loads(capsys.readouterr().out)
    ktc = KVTransferConfig(**cfg)
    assert KVConnectorFactory.get_connector_class(ktc) is KVComposeConnector
    # vLLM's checks that look for the literal MultiConnector and its children still see them.
    assert ktc.has_connector("NixlConnector") and ktc.has_connector("SimpleCPUOffloadConnector")
    assert KVConnectorFactory.supports_hma_config(ktc)


@pytest.mark.parametrize("policy", [None, "fail", "recompute"])
def test_load_failure_renders_vllms_policy(policy: str | None) -> None:
    from kvcompose.compose import loads
    from kvcompose.vllm.args import kv_transfer_config

    text = "version: 1\nconnectors: [{name: host, type: cpu-offload}]\n"
    plan = loads(text + (f"load_failure: {policy}\n" if policy else ""))
    ktc = KVTransferConfig(**kv_transfer_config(plan))
    assert ktc.kv_load_failure_policy == (policy or "fail")
    assert any(line.startswith("a failed load: ") and (policy or "default") in line for line in plan.explain())


def test_general_plugin_registration_is_idempotent() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvcompose.vllm.register import REGISTERED_NAME, register

    register()
    register()
    assert KVConnectorFactory.get_connector_class_by_name(REGISTERED_NAME) is KVComposeConnector


def test_plugins_lists_types_and_rules_with_providers(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "type nixl" in out and "kvcompose-nixl" in out
    assert "type cpu-offload" in out and "kvcompose-cpu-offload" in out
    assert "load first-wins" in out and "kvcompose (built-in)" in out


def test_schema_has_each_types_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    child = schema["$defs"]["ChildSpec"]
    assert {"nixl", "cpu-offload"} <= set(child["properties"]["type"]["enum"])
    assert any(c["if"]["properties"]["type"]["const"] == "cpu-offload" for c in child["allOf"])


def test_check_prints_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "examples/pd-decode.yaml"]) == 0
    out = capsys.readouterr().out
    assert "1. host (cpu-offload, both)" in out and "2. pd (nixl, consumer)" in out
    assert "host loads the prefix it holds; then pd pulls the rest from the prefill instance" in out
    assert "host-buffer copies" not in out  # explain's detail
    assert main(["explain", "examples/pd-decode.yaml"]) == 0
    assert "host-buffer copies: pd" in capsys.readouterr().out


def test_every_option_of_every_installed_type_is_in_the_yaml_reference() -> None:
    """docs/yaml.md's tables name each option the schema of a type it documents declares
    (``type: vllm`` passes vLLM's own keys through and declares none; the test kit's types are
    documented in docs/testing.md)."""
    import msgspec

    text = (DOCS / "yaml.md").read_text()
    plugins = get_plugins()
    shipped = {r.name for r in plugins.provided() if r.kind == "type" and f"### `type: {r.name}`" in text}
    assert {"nixl", "cpu-offload", "vllm"} <= shipped
    missing = [
        f"{name}.{field.name}"
        for name, ctype in plugins.connector_types.items()
        if name in shipped
        for field in msgspec.structs.fields(ctype.options)
        if f"`{field.name}`" not in text
    ]
    assert not missing, f"options missing from docs/yaml.md: {missing}"
