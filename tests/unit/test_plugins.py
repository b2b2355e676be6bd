"""The plugin manager: entry points, selection and blocking by environment, duplicates, tracing."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from vllm.distributed.kv_events import BlockRemoved, KVConnectorKVEvents, KVEventAggregator

from kvcompose import hookimpl
from kvcompose.catalog import ConnectorType
from kvcompose.compose import loads
from kvcompose.plugins import PluginError, Plugins
from kvcompose.testing.harness import make_request
from kvcompose.vllm.metadata import ComposedKVEvents


def test_entry_points_provide_the_builtin_types() -> None:
    assert {"nixl", "cpu-offload"} <= set(Plugins(env={}).connector_types)


def test_env_blocks_a_plugin() -> None:
    types = Plugins(env={"KVCOMPOSE_PLUGINS": "-nixl"}).connector_types
    assert "nixl" not in types and "cpu-offload" in types


def test_env_selects_plugins() -> None:
    types = Plugins(env={"KVCOMPOSE_PLUGINS": "cpu-offload"}).connector_types
    # the plugin's two types; built-ins (the generic vllm type) always load
    assert set(types) == {"cpu-offload", "native-offload", "vllm"}


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

    match = "connector type 'nixl' is provided twice: by kvcompose-nixl .* and by dup-plugin"
    with pytest.raises(PluginError, match=match):
        Plugins(env={}, extra=[Plugin()]).connector_types  # noqa: B018


ONE_CHILD = "version: 1\nconnectors: [{name: host, type: cpu-offload}]\n"
TRACE = "kvcompose.trace"


def _trace_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == TRACE]


def test_a_plugin_is_credited_with_what_it_provides() -> None:
    class Mine(ConnectorType):
        name = "mine"
        summary = "a test type"

    class Plugin:
        __name__ = "my-plugin"

        @hookimpl
        def kvcompose_connector_types(self) -> list[ConnectorType]:
            return [Mine()]

    rows = {(r.kind, r.name): r.provider for r in Plugins(env={}, extra=[Plugin()]).provided()}
    assert rows[("type", "mine")] == "my-plugin"
    assert rows[("type", "nixl")].startswith("kvcompose-nixl ")
    assert rows[("load", "first-wins")] == "kvcompose (built-in)"


def test_a_registration_hook_that_raises_is_an_error_naming_the_plugin() -> None:
    class Plugin:
        __name__ = "broken-plugin"

        @hookimpl
        def kvcompose_rules(self) -> list[object]:
            raise ValueError("boom")

    with pytest.raises(PluginError, match="broken-plugin failed in kvcompose_rules: ValueError: boom"):
        Plugins(env={}, extra=[Plugin()]).rules  # noqa: B018


def test_a_registration_hook_returning_a_non_iterable_is_an_error_naming_the_plugin() -> None:
    class Plugin:
        __name__ = "scalar-plugin"

        @hookimpl
        def kvcompose_connector_types(self) -> object:
            return 42

    with pytest.raises(PluginError, match="scalar-plugin returned 42 from kvcompose_connector_types"):
        Plugins(env={}, extra=[Plugin()]).connector_types  # noqa: B018


def test_trace_logs_every_hook_call(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("KVCOMPOSE_TRACE", "1")
    with caplog.at_level(logging.INFO, logger=TRACE):
        loads(ONE_CHILD, Plugins(env={}))
    text = "\n".join(_trace_lines(caplog))
    # pluggy's own trace lines: the hook calls went through its hook caller.
    for hook in ("kvcompose_connector_types", "kvcompose_rules", "kvcompose_check"):
        assert f"{hook} [hook]" in text and f"finish {hook} -->" in text
    # Each registration-hook call is announced with the plugin it asks.
    assert "kvcompose_connector_types from plugin nixl (kvcompose-nixl " in text
    assert "kvcompose_rules from plugin kvcompose.rules.load (kvcompose (built-in))" in text


def test_no_trace_without_the_variable(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv("KVCOMPOSE_TRACE", raising=False)
    with caplog.at_level(logging.DEBUG, logger=TRACE):
        loads(ONE_CHILD, Plugins(env={}))
    assert _trace_lines(caplog) == []


RECORD_TWO = """
version: 1
connectors:
  - {name: a, type: record, options: {matched_tokens: 32, is_async: true}}
  - {name: b, type: record, options: {matched_tokens: 0}}
"""


def test_trace_logs_the_composed_connectors_child_calls(
    kvcompose_scheduler: Callable[..., Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Set after the fixture made the process-wide plugin manager, so tracing does not outlive
    # this test there; the composition reads the variable when it is resolved, below.
    monkeypatch.setenv("KVCOMPOSE_TRACE", "1")
    with caplog.at_level(logging.INFO, logger=TRACE):
        conn = kvcompose_scheduler(RECORD_TWO).connector
        assert conn.get_num_new_matched_tokens(make_request(64), 0) == (32, True)
    assert "a.get_num_new_matched_tokens -> (32, True)" in _trace_lines(caplog)


def test_worker_kv_events_are_kept_per_child_and_aggregated() -> None:
    a, b = KVEventAggregator(1), KVEventAggregator(1)
    a.add_events([BlockRemoved(block_hashes=[1], medium="CPU")])
    b.add_events([BlockRemoved(block_hashes=[2], medium="CPU")])

    class Box(KVConnectorKVEvents):
        def __init__(self, agg: KVEventAggregator) -> None:
            self.agg = agg

        def add_events(self, events: list[Any]) -> None:
            self.agg.add_events(events)

        def aggregate(self) -> Box:
            return self

        def increment_workers(self, count: int = 1) -> None:
            self.agg.increment_workers(count)

        def get_all_events(self) -> list[Any]:
            return self.agg.get_all_events()

        def get_number_of_workers(self) -> int:
            return self.agg.get_number_of_workers()

        def clear_events(self) -> None:
            self.agg.clear_events()

    x = ComposedKVEvents({"host": Box(a)})
    y = ComposedKVEvents({"host": Box(b), "pd": Box(KVEventAggregator(1))})
    merged = x.merge(y)
    assert set(merged.children) == {"host", "pd"}
    assert [e.block_hashes for e in merged.children["host"].get_all_events()] == [[1], [2]]


def broken_distribution(root: Path, module: str, source: str, value: str | None = None) -> Path:
    """A distribution ``kvcompose-broken 1.2`` in ``root`` (put it on ``sys.path``), whose entry point
    ``broken`` in the ``kvcompose`` group names ``value`` (default: ``module``), written from ``source``."""
    (root / f"{module}.py").write_text(source)
    info = root / "kvcompose_broken-1.2.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvcompose-broken\nVersion: 1.2\n")
    (info / "entry_points.txt").write_text(f"[kvcompose]\nbroken = {value or module}\n")
    return root


BROKEN = [
    ("import kvcompose_no_such_module\n", None, "ModuleNotFoundError: No module named 'kvcompose_no_such_module'"),
    ("raise RuntimeError('needs a GPU')\n", None, "RuntimeError: needs a GPU"),
    ("def broken(:\n", None, "SyntaxError: "),
    ("", "{module}:plugin", "AttributeError: "),
]


@pytest.mark.parametrize(("source", "value", "error"), BROKEN, ids=["import", "raises", "syntax", "attribute"])
def test_a_plugin_that_fails_to_load_is_an_error_naming_its_distribution(
    source: str, value: str | None, error: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = f"kvcompose_broken_{tmp_path.name}".replace("-", "_")
    value = value.format(module=module) if value else None
    monkeypatch.syspath_prepend(str(broken_distribution(tmp_path, module, source, value)))
    with pytest.raises(PluginError) as err:
        Plugins(env={})
    said = str(err.value)
    assert "\n" not in said
    assert said.startswith(
        f"plugin 'broken' ({value or module}) of the distribution kvcompose-broken 1.2 failed to load: "
    )
    assert error in said
    assert said.endswith("(fix or reinstall kvcompose-broken, uninstall it, or skip it with KVCOMPOSE_PLUGINS=-broken)")
    # What the error says to do works, and selecting it names it too.
    assert "nixl" in Plugins(env={"KVCOMPOSE_PLUGINS": "-broken"}).connector_types
    with pytest.raises(PluginError, match="kvcompose-broken 1.2 failed to load"):
        Plugins(env={"KVCOMPOSE_PLUGINS": "broken"})


def test_a_plugin_that_does_not_fit_the_hooks_is_an_error_naming_its_distribution(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = "kvcompose_broken_misfit"
    source = "from kvcompose import hookimpl\n\n@hookimpl\ndef kvcompose_connector_types(gpu):\n    return []\n"
    monkeypatch.syspath_prepend(str(broken_distribution(tmp_path, module, source)))
    try:
        with pytest.raises(
            PluginError,
            match=r"^plugin 'broken' \(kvcompose_broken_misfit\) of the distribution "
            r"kvcompose-broken 1.2 does not fit kvcompose's hooks: .*'gpu'",
        ):
            Plugins(env={})
    finally:
        sys.modules.pop(module, None)
