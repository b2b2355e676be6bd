"""vLLM's private names the nixl type uses (kvcompose_nixl.vllm_names): present in the installed
vLLM's classes, named in docs/versions.md, and missing ones stop the connector at start by name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import NixlPullConnectorScheduler
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_scheduler import NixlPushConnectorScheduler

from kvcompose.testing.harness import scheduler_for
from kvcompose_nixl import vllm_names
from kvcompose_nixl.vllm_names import MissingName, check

DOCS = Path(__file__).parents[3] / "docs" / "versions.md"


def test_the_docs_table_names_every_checked_name_and_no_other() -> None:
    section = DOCS.read_text().split("## vLLM's private names the nixl type uses")[1].split("\n## ")[0]
    documented = set(re.findall(r"^\| [a-z ]+ \| `([^`]+)` \|", section, re.M))
    assert documented == vllm_names.every_name()


def test_the_installed_vllms_scheduler_halves_have_every_scheduler_name() -> None:
    """The scheduler halves' names are instance attributes: a real connector is built (a check
    that fails raises at the build, so building is the test)."""
    for ktc in (
        {
            "kv_connector": "NixlConnector",
            "kv_role": "kv_consumer",
            "kv_connector_module_path": "kvcompose_nixl.connector",
        },
        {
            "kv_connector": "NixlPushConnector",
            "kv_role": "kv_consumer",
            "kv_connector_module_path": "kvcompose_nixl.connector",
        },
    ):
        scheduler = scheduler_for(ktc, block_size=16)
        half = scheduler.connector.connector_scheduler
        assert isinstance(half, (NixlPullConnectorScheduler, NixlPushConnectorScheduler))
        check(half, vllm_names.SCHEDULER)


def test_a_missing_name_stops_the_connector_by_name() -> None:
    class Renamed:
        side_channel_host = "127.0.0.1"
        side_channel_port = 5600

    with pytest.raises(MissingName, match=r"_nixl_handshake_listener \(replaced by the guarded listener"):
        check(Renamed(), vllm_names.SCHEDULER)
