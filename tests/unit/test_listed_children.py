"""The rendered ``--kv-transfer-config`` holds the children twice: the composition (what the rules act
on) and the ``connectors`` list (what vLLM instantiates). Read back, the two must agree entry by
entry, in order; a hand edit of either is refused with the entry, the field and both values.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from kvcompose.cli import main
from kvcompose.compose import loads
from kvcompose.errors import CompositionError
from kvcompose.vllm.args import CHILDREN_KEY, EXTRA_KEY, kv_transfer_config
from kvcompose.vllm.children import composite_of

COMPOSITION = """\
version: 1
connectors:
  - name: host
    type: cpu-offload
  - name: disk-a
    type: vllm
    options:
      kv_connector: ExampleConnector
      kv_connector_extra_config: {shared_storage_path: /tmp/kv-a}
  - name: disk-b
    type: vllm
    options:
      kv_connector: ExampleConnector
      kv_connector_extra_config: {shared_storage_path: /tmp/kv-b}
"""
ORDER = "the list's order differs from the composition's"
REGENERATE = "edit the YAML file and render the value again"


@pytest.fixture(scope="module")
def rendered() -> dict[str, Any]:
    """What ``kvcompose vllm-args`` prints, as vLLM parses it."""
    return json.loads(json.dumps(kv_transfer_config(loads(COMPOSITION, filename="tiers.yaml"))))


def listed(config: dict[str, Any]) -> list[dict[str, Any]]:
    return config["kv_connector_extra_config"][CHILDREN_KEY]  # type: ignore[no-any-return]


def refused(config: dict[str, Any]) -> str:
    """The one problem the composite's reader (:func:`composite_of`) refuses ``config`` with."""
    with pytest.raises(CompositionError) as err:
        composite_of(config["kv_connector_extra_config"])
    [problem] = err.value.problems
    return str(err.value)


def test_an_untouched_config_reads_back_its_entries(rendered: dict[str, Any]) -> None:
    assert list(composite_of(rendered["kv_connector_extra_config"]).entries) == listed(rendered)


def test_two_swapped_entries_are_refused_naming_the_first_that_differs(rendered: dict[str, Any]) -> None:
    config = copy.deepcopy(rendered)
    entries = listed(config)
    entries[0], entries[1] = entries[1], entries[0]
    assert refused(config) == (
        "--kv-transfer-config: kv_connector_extra_config.connectors[0].kv_connector: is 'ExampleConnector', but "
        "child 0 of the composition (host, type cpu-offload) renders 'SimpleCPUOffloadConnector' (it is the entry "
        f"of child 1 (disk-a): {ORDER}; the composition and the connectors list must stay as `kvcompose vllm-args` "
        f"wrote them; {REGENERATE})"
    )


def test_two_swapped_entries_of_one_class_are_told_apart_by_their_config(rendered: dict[str, Any]) -> None:
    config = copy.deepcopy(rendered)
    entries = listed(config)
    entries[1], entries[2] = entries[2], entries[1]
    text = refused(config)
    assert text.startswith(
        "--kv-transfer-config: kv_connector_extra_config.connectors[1].kv_connector_extra_config.shared_storage_path: "
        "is '/tmp/kv-b', but child 1 of the composition (disk-a, type vllm) renders '/tmp/kv-a' "
        f"(it is the entry of child 2 (disk-b): {ORDER}"
    )


def test_a_renamed_connector_is_refused_with_both_names(rendered: dict[str, Any]) -> None:
    config = copy.deepcopy(rendered)
    listed(config)[2]["kv_connector"] = "LMCacheConnectorV1"
    text = refused(config)
    assert text.startswith(
        "--kv-transfer-config: kv_connector_extra_config.connectors[2].kv_connector: is 'LMCacheConnectorV1', "
        "but child 2 of the composition (disk-b, type vllm) renders 'ExampleConnector' ("
    )
    assert text.endswith(f"{REGENERATE})") and ORDER not in text


def test_a_changed_type_is_refused(rendered: dict[str, Any]) -> None:
    """The composition's host tier made vLLM's own class (type vllm): its entry still loads the
    plugin's subclass, from the plugin's module."""
    config = copy.deepcopy(rendered)
    host = config["kv_connector_extra_config"][EXTRA_KEY]["composition"]["connectors"][0]
    host["type"], host["options"] = "vllm", {"kv_connector": "SimpleCPUOffloadConnector"}
    assert refused(config).startswith(
        "--kv-transfer-config: kv_connector_extra_config.connectors[0].kv_connector_module_path: "
        "is 'kvcompose_cpu_offload.connector', but child 0 of the composition (host, type vllm) leaves it unset ("
    )
    config = copy.deepcopy(rendered)
    listed(config)[0]["kv_connector_module_path"] = "my_fork.cpu_offload"
    assert "connectors[0].kv_connector_module_path: is 'my_fork.cpu_offload', but child 0" in refused(config)


def test_a_changed_role_is_refused(rendered: dict[str, Any]) -> None:
    config = copy.deepcopy(rendered)
    listed(config)[1]["kv_role"] = "kv_producer"
    assert "connectors[1].kv_role: is 'kv_producer', but child 1 of the composition (disk-a, type vllm) renders " in (
        refused(config)
    )


def test_a_missing_entry_is_refused_with_both_counts(rendered: dict[str, Any]) -> None:
    config = copy.deepcopy(rendered)
    del listed(config)[1]
    assert refused(config).startswith(
        "--kv-transfer-config: kv_connector_extra_config.connectors: lists 2 connectors, but the composition "
        "beside it has 3 (host, disk-a, disk-b) ("
    )


def test_an_entry_that_is_not_an_object_is_refused(rendered: dict[str, Any]) -> None:
    config = copy.deepcopy(rendered)
    listed(config)[0] = "SimpleCPUOffloadConnector"
    assert "connectors[0]: is not an object, but child 0 of the composition (host, type cpu-offload)" in refused(config)


def test_the_composite_refuses_a_hand_edited_config_before_loading_a_class(rendered: dict[str, Any]) -> None:
    """``composite_of`` of the vLLM adapter, which every class-level answer and the composite's
    constructor read the children through."""
    from vllm.config.kv_transfer import KVTransferConfig

    from kvcompose.vllm import children

    config = copy.deepcopy(rendered)
    entries = listed(config)
    entries[0], entries[2] = entries[2], entries[0]
    with pytest.raises(CompositionError, match=r"connectors\[0\]\.kv_connector: is 'ExampleConnector'"):
        children.composite_of(KVTransferConfig(**config).kv_connector_extra_config)
    assert len(children.composite_of(KVTransferConfig(**rendered).kv_connector_extra_config).configs) == 3


def test_import_refuses_a_hand_edited_config(rendered: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    """The composition would be imported, and the edit of the list vLLM ran lost without a word."""
    config = copy.deepcopy(rendered)
    listed(config)[1]["kv_connector_extra_config"]["shared_storage_path"] = "/mnt/elsewhere"
    assert main(["import", json.dumps(config)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "the command line: kv_connector_extra_config.connectors[1].kv_connector_extra_config.shared_storage_path: "
        "is '/mnt/elsewhere', but child 1 of the composition (disk-a, type vllm) renders '/tmp/kv-a' ("
    )
    assert main(["import", json.dumps(rendered)]) == 0
