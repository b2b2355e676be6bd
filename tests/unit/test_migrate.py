"""``kvcompose import``: MultiConnector JSON from vLLM's, Ray Serve's and Dynamo's docs, round-tripped.

Each config is copied from the page named next to it. Round trip: import -> YAML -> the
composition -> ``vllm-args``' config -> import again gives the same children, and every child
the generic ``vllm`` type carries comes back as the very entry it came from.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from kvcompose.compose import build
from kvcompose.config import from_builtins, load_text
from kvcompose.errors import CompositionError
from kvcompose.plugins import get_plugins
from kvcompose.vllm import dropin, migrate
from kvcompose.vllm.args import EXTRA_KEY, kv_transfer_config

#: vLLM, docs/features/disagg_prefill.md ("MultiConnector: ... such as:"), as the page shows it.
VLLM_DISAGG_PREFILL = (
    '--kv-transfer-config \'{"kv_connector":"MultiConnector","kv_role":"kv_both",'
    '"kv_connector_extra_config":{"connectors":[{"kv_connector":"NixlConnector","kv_role":"kv_both"},'
    '{"kv_connector":"ExampleConnector","kv_role":"kv_both","kv_connector_extra_config":'
    '{"shared_storage_path":"local_storage"}}]}}\''
)
#: vLLM, docs/features/disagg_prefill.md ("OffloadingConnector: ..."): one connector, no composite.
VLLM_OFFLOADING = (
    '--kv-transfer-config \'{"kv_connector":"OffloadingConnector","kv_role":"kv_both",'
    '"kv_connector_extra_config":{"block_size": 64, "cpu_bytes_to_use": 1000000000}}\''
)
#: Dynamo, examples/backends/vllm/launch/disagg_lmcache.sh (the prefill worker; the LMCache
#: integration page, docs/backends/vllm/LMCache_Integration.md, shows the same as a KVTransferConfig):
#: Dynamo's PdConnector, a MultiConnector subclass, over LMCache then NIXL.
DYNAMO_DISAGG_LMCACHE = """\
python3 -m dynamo.vllm \\
    --model "$MODEL" \\
    --disaggregation-mode prefill \\
    --kv-transfer-config '{"kv_connector":"PdConnector","kv_role":"kv_both","kv_connector_extra_config":\
{"connectors":[{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"},\
{"kv_connector":"NixlConnector","kv_role":"kv_both"}]},"kv_connector_module_path":"kvbm.vllm_integration.connector"}'
"""
#: Ray Serve, doc/source/serve/llm/user-guides/kv-cache-offloading.md ("Compose multiple KV transfer
#: backends with MultiConnector"): LMCache for local offloading, then NIXL, as Python.
RAY_LMCACHE_NIXL: dict[str, Any] = {
    "kv_connector": "MultiConnector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {
        "connectors": [
            {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"},
            {"kv_connector": "NixlConnector", "kv_role": "kv_both", "backends": ["UCX"]},
        ]
    },
}
#: vLLM's own MultiConnector test configuration of the NIXL + OffloadingConnector pair, the tiers the
#: llm-d tiered-prefix-cache guide stacks: each child its own extra config.
NIXL_OFFLOADING = {
    "kv_connector": "MultiConnector",
    "kv_role": "kv_consumer",
    "kv_load_failure_policy": "recompute",
    "kv_connector_extra_config": {
        "connectors": [
            {"kv_connector": "NixlConnector", "kv_role": "kv_consumer", "kv_buffer_device": "cpu"},
            {
                "kv_connector": "SimpleCPUOffloadConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"cpu_bytes_to_use": 67108864},
            },
            {
                "kv_connector": "OffloadingConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"cpu_bytes_to_use": 1000000000},
            },
        ]
    },
}


def imported(text: str) -> tuple[dict[str, Any], str]:
    cfg = migrate.parse(text)
    data = dropin.composition_data(cfg, get_plugins().connector_types)
    return cfg, migrate.to_yaml(data, "the docs", migrate.left_behind(cfg))


def round_trip(text: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[Any]]:
    """(children imported, children imported back from vllm-args' config, the original entries)."""
    cfg, out = imported(text)
    plan = build(load_text(out, "imported.yaml"))
    again = json.loads(json.dumps(kv_transfer_config(plan)))
    del again["kv_connector_extra_config"][EXTRA_KEY]  # the children's configs alone, as MultiConnector reads them
    back = dropin.composition_data(again, get_plugins().connector_types)
    return yaml.safe_load(out)["connectors"], back["connectors"], dropin.entries(cfg)


@pytest.mark.parametrize("text", [VLLM_DISAGG_PREFILL, DYNAMO_DISAGG_LMCACHE, json.dumps(NIXL_OFFLOADING)])
def test_documented_configs_round_trip(text: str) -> None:
    first, back, entries = round_trip(text)
    assert first == back
    plan = build(from_builtins({"version": 1, "connectors": first}))
    for child, entry, rendered in zip(
        first, entries, kv_transfer_config(plan)["kv_connector_extra_config"]["connectors"], strict=True
    ):
        if child["type"] == "vllm":
            assert rendered == entry


def test_vllm_docs_multiconnector_becomes_nixl_and_example() -> None:
    _, out = imported(VLLM_DISAGG_PREFILL)
    assert yaml.safe_load(out)["connectors"] == [
        {"name": "nixl", "type": "nixl", "role": "both"},
        {
            "name": "example",
            "type": "vllm",
            "role": "both",
            "options": {
                "kv_connector": "ExampleConnector",
                "kv_connector_extra_config": {"shared_storage_path": "local_storage"},
            },
        },
    ]
    assert out.startswith("# Imported by `kvcompose import` from the docs.\n")


def test_built_in_types_where_they_apply() -> None:
    children, _, _ = round_trip(json.dumps(NIXL_OFFLOADING))
    assert [(c["name"], c["type"], c["role"]) for c in children] == [
        ("nixl", "nixl", "consumer"),
        ("simple-cpu-offload", "cpu-offload", "both"),
        ("offloading", "vllm", "both"),  # vLLM's OffloadingConnector: no built-in type stands for it
    ]
    assert children[0]["options"] == {"buffer_device": "cpu"}
    assert children[1]["options"] == {"cpu_bytes": 67108864}
    data = dropin.composition_data(NIXL_OFFLOADING, get_plugins().connector_types)
    assert data["load_failure"] == "recompute"


def test_dynamo_pd_connector_children_are_composed_and_the_composite_named() -> None:
    cfg, out = imported(DYNAMO_DISAGG_LMCACHE)
    assert [(c["name"], c["type"]) for c in yaml.safe_load(out)["connectors"]] == [
        ("lm-cache", "vllm"),
        ("nixl", "nixl"),
    ]
    assert (
        "the composite PdConnector from kvbm.vllm_integration.connector (kvcompose's composite takes its place)" in out
    )


def test_a_single_connector_is_a_one_child_composition() -> None:
    _, out = imported(VLLM_OFFLOADING)
    assert yaml.safe_load(out)["connectors"] == [
        {
            "name": "offloading",
            "type": "vllm",
            "role": "both",
            "options": {
                "kv_connector": "OffloadingConnector",
                "kv_connector_extra_config": {"block_size": 64, "cpu_bytes_to_use": 1000000000},
            },
        }
    ]


def test_a_key_vllm_would_refuse_is_located_with_the_fix() -> None:
    """Ray's page puts NIXL's ``backends`` beside ``kv_role``; KVTransferConfig has no such field."""
    with pytest.raises(CompositionError) as err:
        dropin.composition_data(RAY_LMCACHE_NIXL, get_plugins().connector_types)
    text = str(err.value)
    assert "kv_connector_extra_config.connectors[1].backends: unknown key 'backends'" in text
    assert "goes inside the entry's kv_connector_extra_config" in text


def test_the_corrected_ray_config_imports() -> None:
    fixed = json.loads(json.dumps(RAY_LMCACHE_NIXL))
    nixl = fixed["kv_connector_extra_config"]["connectors"][1]
    nixl["kv_connector_extra_config"] = {"backends": nixl.pop("backends")}
    first, back, _ = round_trip(json.dumps(fixed))
    assert first == back
    assert first[1] == {"name": "nixl", "type": "nixl", "role": "both"}  # ["UCX"] is vLLM's default


@pytest.mark.parametrize(
    "text",
    [
        '{"kv_connector":"NixlConnector","kv_role":"kv_both"}',
        '\'{"kv_connector":"NixlConnector","kv_role":"kv_both"}\'',
        '--kv-transfer-config=\'{"kv_connector":"NixlConnector","kv_role":"kv_both"}\'',
        "vllm serve m --port 1 \\\n  --kv-transfer-config \\\n"
        '  \'{"kv_connector":"NixlConnector","kv_role":"kv_both"}\' --seed 0',
    ],
)
def test_parse_takes_the_json_as_the_user_has_it(text: str) -> None:
    assert migrate.parse(text) == {"kv_connector": "NixlConnector", "kv_role": "kv_both"}


def test_bad_json_is_located() -> None:
    with pytest.raises(CompositionError, match=r"cfg.json:2:1: \(top level\): not valid JSON: Expecting property name"):
        migrate.parse('{"kv_connector": "MultiConnector",\n}', "cfg.json")


def test_names_follow_the_connector() -> None:
    assert dropin.child_name("NixlConnector") == "nixl"
    assert dropin.child_name("MooncakeStoreConnector") == "mooncake-store"
    assert dropin.child_name("LMCacheConnectorV1") == "lm-cache"
    assert dropin.child_name("P2pNcclConnector") == "p2p-nccl"
    two = {
        "kv_connector": "MultiConnector",
        "kv_connector_extra_config": {"connectors": [{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}] * 2},
    }
    data = dropin.composition_data(two, get_plugins().connector_types)
    assert [c["name"] for c in data["connectors"]] == ["nixl", "nixl-2"]


@pytest.mark.parametrize("extra", [["connectors"], "connectors", 3, True])
@pytest.mark.parametrize("connector", ["MultiConnector", "NixlConnector"])
def test_an_extra_config_that_is_not_an_object_is_located(connector: str, extra: object) -> None:
    cfg = {"kv_connector": connector, "kv_connector_extra_config": extra}
    with pytest.raises(CompositionError, match=r"^cfg.json: kv_connector_extra_config: expected a JSON object, got "):
        dropin.composition_data(cfg, get_plugins().connector_types, "cfg.json")


def test_a_kv_role_that_is_not_text_is_located() -> None:
    child = {"kv_connector": "NixlConnector", "kv_role": ["kv_both"]}
    cfg = {"kv_connector": "MultiConnector", "kv_connector_extra_config": {"connectors": [child]}}
    with pytest.raises(CompositionError, match=r"connectors\[0\]\.kv_role: unknown kv_role \['kv_both'\]"):
        dropin.composition_data(cfg, get_plugins().connector_types)
    cfg = {**cfg, "kv_role": {"x": 1}, "kv_connector_extra_config": {"connectors": [{"kv_connector": "NixlConnector"}]}}
    with pytest.raises(CompositionError, match=r": kv_role: unknown kv_role \{'x': 1\}"):
        dropin.composition_data(cfg, get_plugins().connector_types)


def test_an_embedded_composition_that_is_not_an_object_is_located() -> None:
    cfg = {"kv_connector": "MultiConnector", "kv_connector_extra_config": {EXTRA_KEY: {"composition": 5}}}
    with pytest.raises(
        CompositionError, match=rf"kv_connector_extra_config\.{EXTRA_KEY}\.composition: expected a JSON"
    ):
        dropin.composition_data(cfg, get_plugins().connector_types)


def test_a_config_nested_too_deeply_is_refused() -> None:
    with pytest.raises(CompositionError, match="nested more than 32 levels deep"):
        migrate.parse('{"kv_connector":"NixlConnector","kv_connector_extra_config":{"x":' + "[" * 40 + "]" * 40 + "}}")
    with pytest.raises(CompositionError, match="nested more than 32 levels deep"):
        migrate.parse("[" * 100_000 + "]" * 100_000)
