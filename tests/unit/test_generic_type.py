"""The generic ``vllm`` connector type: options passed through, class resolved, rules' answers."""

from __future__ import annotations

import json

import pytest

from kvcompose.compose import loads
from kvcompose.errors import CompositionError
from kvcompose.generic import module_class, unverified
from kvcompose.rules.params import Owners

EXAMPLE = """\
version: 1
connectors:
  - name: host
    type: cpu-offload
  - name: disk
    type: vllm
    options:
      kv_connector: {connector}
      kv_connector_extra_config: {extra}
rules:
  {rules}
"""
#: A store rule that leaves the generic child out of the save hooks.
HOST_STORES = "load: ranges\n  store: {use: only, children: [host]}"


def plan_of(  # noqa: ANN201
    connector: str = "ExampleConnector",
    extra: str = "{shared_storage_path: /tmp/kv}",
    rules: str = "load: ranges",
    import_modules: bool = False,
    **more: str,
):
    text = EXAMPLE.format(connector=connector, extra=extra, rules=rules)
    for key, value in more.items():
        text = text.replace(
            "      kv_connector_extra_config:", f"      {key}: {value}\n      kv_connector_extra_config:"
        )
    return loads(text, filename="tiers.yaml", import_modules=import_modules)


def test_renders_the_connector_and_its_extra_config_as_they_are() -> None:
    disk = plan_of(kv_buffer_device="cpu").child("disk")
    assert disk.vllm_config() == {
        "kv_connector": "ExampleConnector",
        "kv_buffer_device": "cpu",
        "kv_connector_extra_config": {"shared_storage_path": "/tmp/kv"},
        "kv_role": "kv_both",
    }


def test_check_says_what_the_child_does_and_that_its_config_is_passed_as_is() -> None:
    text = "\n".join(plan_of().explain())
    assert (
        "vLLM's ExampleConnector, loaded by vLLM's registry; kv_connector_extra_config {\"shared_storage_path\": "
        in text
    )
    assert "passed to vLLM as is" in text
    assert "disk loads only when nothing above it did (it cannot load a range)" in text
    # params: owners has no declared key of the generic child and says what it does instead
    assert "disk declare no keys: a key no child declares goes to the first child in YAML order" in text


def test_an_unknown_name_is_located_with_a_did_you_mean_and_the_registered_names() -> None:
    with pytest.raises(CompositionError) as err:
        plan_of("ExampelConnector")
    text = str(err.value)
    assert text.startswith("tiers.yaml:8:21: connectors[1].options.kv_connector: vLLM knows no connector named")
    assert "did you mean ExampleConnector?" in text
    for registered in ("LMCacheConnectorV1", "MooncakeStoreConnector", "NixlConnector", "OffloadingConnector"):
        assert registered in text


def test_an_unrelated_unknown_name_lists_the_registered_names() -> None:
    with pytest.raises(CompositionError, match=r"vLLM registers: DecodeBenchConnector, ExampleConnector"):
        plan_of("Zzz")


def test_the_extra_config_must_be_a_mapping() -> None:
    with pytest.raises(CompositionError, match=r"tiers.yaml:9:34: connectors\[1\].options.kv_connector_extra_config: "):
        plan_of(extra="[shared_storage_path]")


def test_a_module_path_must_hold_the_class_when_imports_are_allowed() -> None:
    with pytest.raises(CompositionError, match=r"kvcompose_nixl.connector has no class 'NixlConnectr'.*did you mean"):
        plan_of("NixlConnectr", kv_connector_module_path="kvcompose_nixl.connector", import_modules=True)
    with pytest.raises(CompositionError, match=r"kvcompose.compose.Plan is not a vLLM KV connector class"):
        plan_of("Plan", kv_connector_module_path="kvcompose.compose", import_modules=True)
    # Not allowed to import (the CLI's default), the class is left unchecked, not refused.
    plan = plan_of("Plan", kv_connector_module_path="kvcompose.compose")
    assert unverified(plan) == ([plan.child("disk")], "not imported: importing a module runs its code")


def test_a_module_that_cannot_be_imported_here_is_left_unverified_or_refused_when_imported() -> None:
    """Its package may be installed only where vLLM serves (LMCache's, Mooncake's): unimported, the
    plan names it as unverified; asked to import it, the failure is located at the module path."""
    module = "lmcache.integration.vllm.lmcache_connector_v1"
    plan = plan_of("LMCacheConnectorV1Dynamic", kv_connector_module_path=module)
    assert [c.name for c in unverified(plan)[0]] == ["disk"]
    assert module_class(plan.child("disk")) == module + ".LMCacheConnectorV1Dynamic"
    with pytest.raises(CompositionError) as err:
        plan_of("LMCacheConnectorV1Dynamic", kv_connector_module_path=module, import_modules=True)
    [problem] = err.value.problems
    assert problem.path == ("connectors", 1, "options", "kv_connector_module_path")
    assert problem.message == f"importing {module} failed: ModuleNotFoundError: No module named 'lmcache'"


def test_declared_range_loads_and_param_keys_reach_the_rules() -> None:
    plan = plan_of(range_loads="true", param_keys="[disk_handle]")
    disk = plan.child("disk")
    assert disk.type.range_loads and disk.type.param_keys == frozenset({"disk_handle"})
    assert not plan.child("host").type.param_keys
    assert "disk loads what it holds of the rest" in "\n".join(plan.explain())
    # A key only the generic child declares is its own, even when a child above returns it.
    owners = Owners(plan.children)
    assert owners.merge([{"disk_handle": "host's"}, {"disk_handle": "disk's"}]) == {"disk_handle": "disk's"}


def test_undeclared_keys_go_to_the_first_child_in_yaml_order() -> None:
    plan = plan_of()
    assert Owners(plan.children).merge([None, {"k": 1}]) == {"k": 1}
    assert Owners(plan.children).merge([{"k": 0}, {"k": 1}]) == {"k": 0}


def test_range_alignment_needs_range_loads() -> None:
    with pytest.raises(CompositionError, match="range_alignment only applies with range_loads: true"):
        plan_of(range_alignment="64")


def test_vllms_cpu_offload_as_a_generic_child_cannot_be_left_out_of_the_save_hooks() -> None:
    with pytest.raises(CompositionError) as e:
        plan_of("SimpleCPUOffloadConnector", "{}", HOST_STORES)
    [p] = e.value.problems
    assert p.path == ("rules", "store")
    assert p.message.startswith("the store rule leaves disk out of the save hooks, but it is vLLM's SimpleCPUOffload")
    assert p.hint == "list disk in store.children, or use `store: all`"


def test_needs_save_hooks_declares_what_the_name_does_not_say() -> None:
    assert plan_of("SimpleCPUOffloadConnector", "{}", HOST_STORES, needs_save_hooks="false").child("disk")
    assert plan_of(rules=HOST_STORES).child("disk")
    with pytest.raises(CompositionError, match="but it is declared needs_save_hooks: true"):
        plan_of(rules=HOST_STORES, needs_save_hooks="true")
    assert "needs_save_hooks" not in json.dumps(plan_of(needs_save_hooks="true").child("disk").vllm_config())


def test_the_schema_offers_the_type() -> None:
    from kvcompose.schema import json_schema

    assert "ExampleConnector" not in json.dumps(json_schema())  # names come from vLLM, not the schema
    assert "kv_connector_extra_config" in json.dumps(json_schema())
