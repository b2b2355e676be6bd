"""The plugin manager: entry points, selection and blocking by environment, duplicates, tracing."""

from __future__ import annotations

import logging

import pytest
from vllm.distributed.kv_events import BlockRemoved, KVConnectorKVEvents, KVEventAggregator

from kvcompose import hookimpl
from kvcompose.catalog import ConnectorType
from kvcompose.plugins import PluginError, Plugins
from kvcompose.vllm.metadata import ComposedKVEvents


def test_entry_points_provide_the_builtin_types() -> None:
    assert {"nixl", "cpu-offload"} <= set(Plugins(env={}).connector_types)


def test_env_blocks_a_plugin() -> None:
    types = Plugins(env={"KVCOMPOSE_PLUGINS": "-nixl"}).connector_types
    assert "nixl" not in types and "cpu-offload" in types


def test_env_selects_plugins() -> None:
    types = Plugins(env={"KVCOMPOSE_PLUGINS": "cpu-offload"}).connector_types
    assert set(types) == {"cpu-offload"}


def test_env_selecting_a_missing_plugin_is_a_clear_error() -> None:
    with pytest.raises(PluginError, match="no installed distribution provides an entry point of that name"):
        Plugins(env={"KVCOMPOSE_PLUGINS": "mooncake"})


def test_two_plugins_offering_one_type_name_is_an_error() -> None:
    class Dup(ConnectorType):
        name = "nixl"

    class Plugin:
        __name__ = "dup-plugin"

        @hookimpl
        def kvcompose_connector_types(self) -> list[ConnectorType]:
            return [Dup()]

    with pytest.raises(PluginError, match="connector type 'nixl' is provided twice: by kvcompose-nixl .* and by dup-plugin"):
        Plugins(env={}, extra=[Plugin()]).connector_types


def test_trace_logs_hook_calls(caplog: pytest.LogCaptureFixture) -> None:
    import os

    os.environ["KVCOMPOSE_TRACE"] = "1"
    try:
        plugins = Plugins(env={})
        with caplog.at_level(logging.INFO, logger="kvcompose.trace"):
            plugins.connector_types  # noqa: B018
            from kvcompose.compose import loads

            loads("version: 1\nconnectors: [{name: host, type: cpu-offload}]\n", plugins)
    finally:
        del os.environ["KVCOMPOSE_TRACE"]
    assert "kvcompose_check" in caplog.text


def test_worker_kv_events_are_kept_per_child_and_aggregated() -> None:
    a, b = KVEventAggregator(1), KVEventAggregator(1)
    a.add_events([BlockRemoved(block_hashes=[1], medium="CPU")])
    b.add_events([BlockRemoved(block_hashes=[2], medium="CPU")])
    class Box(KVConnectorKVEvents):
        def __init__(self, agg: KVEventAggregator) -> None:
            self.agg = agg

        def add_events(self, events): self.agg.add_events(events)  # noqa: E704
        def aggregate(self): return self  # noqa: E704
        def increment_workers(self, count=1): self.agg.increment_workers(count)  # noqa: E704
        def get_all_events(self): return self.agg.get_all_events()  # noqa: E704
        def get_number_of_workers(self): return self.agg.get_number_of_workers()  # noqa: E704
        def clear_events(self): self.agg.clear_events()  # noqa: E704

    x = ComposedKVEvents({"host": Box(a)})
    y = ComposedKVEvents({"host": Box(b), "pd": Box(KVEventAggregator(1))})
    merged = x.merge(y)
    assert set(merged.children) == {"host", "pd"}
    assert [e.block_hashes for e in merged.children["host"].get_all_events()] == [[1], [2]]
