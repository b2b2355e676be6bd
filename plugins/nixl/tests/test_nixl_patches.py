"""vLLM's private names the nixl type uses (kvcompose_nixl.patches): present in the installed
vLLM's classes, named in docs/versions.md, and missing ones stop the connector at start by name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import NixlPullConnectorScheduler
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_scheduler import NixlPushConnectorScheduler

from kvcompose.testing.harness import scheduler_for
from kvcompose_nixl import patches
from kvcompose_nixl.patches import MissingName, check

DOCS = Path(__file__).parents[3] / "docs" / "versions.md"


def test_the_docs_table_names_every_checked_name_and_no_other() -> None:
    section = DOCS.read_text().split("## vLLM's private names the nixl type uses")[1].split("\n## ")[0]
    documented = set(re.findall(r"^\| [a-z ]+ \| `([^`]+)` \|", section, re.M))
    assert documented == patches.every_name()


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
        check(half, patches.SCHEDULER)


def test_a_missing_name_stops_the_connector_by_name() -> None:
    class Renamed:
        side_channel_host = "127.0.0.1"
        side_channel_port = 5600

    with pytest.raises(MissingName, match=r"_nixl_handshake_listener \(replaced by the guarded listener"):
        check(Renamed(), patches.SCHEDULER)


def test_no_other_module_of_the_plugin_assigns_a_name_on_vllms_or_nixls_objects() -> None:
    """Every patch is in kvcompose_nixl/patches.py: elsewhere an attribute is assigned only on
    ``self`` (directly), on the transfer results the connector returns (vLLM's public fields), or, by
    ``setattr``, kvcompose's own attributes on vLLM's step metadata (``meta``)."""
    import ast

    package = Path(patches.__file__).parent
    found = []
    for path in sorted(package.glob("*.py")):
        if path.name == "patches.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                # self.x, not self._worker.x: a worker's attribute is vLLM's
                if not (isinstance(node.value, ast.Name) and node.value.id in {"self", "results"}):
                    found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
                if ast.unparse(node.args[0]) != "meta":
                    found.append(f"{path.name}:{node.lineno}: setattr({ast.unparse(node.args[0])}, ...)")
    assert found == []
