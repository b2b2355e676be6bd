"""Plugin module: the test kit's connector types (``record``, ``record-range``, ``record-pd``,
``faulty``).

Nothing here imports vLLM until a fault is declared (the calls it may name are the composite's):
the classes vLLM instantiates live in :mod:`kvcompose.testing.connectors`.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import msgspec

from kvcompose import hookimpl
from kvcompose.catalog import Child, ConnectorType, Options

if TYPE_CHECKING:
    from kvcompose.plugins import Plugins


class RecordOptions(Options):
    matched_tokens: int | None = 0
    is_async: bool = False
    delay_free: bool = False
    params: dict[str, Any] | None = None
    #: What the connector class answers to vLLM 0.33's ``supports_sleep_mode``.
    sleep_mode: bool = True


@functools.cache
def fault_calls() -> frozenset[str]:
    """Every engine call a fault may name: the calls the composed connector forwards to a child's
    own implementation (so each one fires, and every forwarded call can fail)."""
    from kvcompose.vllm.calls import TO_EVERY_CHILD, Calls  # vLLM, only once a fault is declared

    return frozenset({*(name for name in Calls.__annotations__ if name != "active"), *TO_EVERY_CHILD})


FaultAction = Literal["raise", "none", "stall", "fail-load"]


class Fault(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One injected fault: ``action`` on ``call`` (for ``requests`` only, when given)."""

    call: str
    #: raise: raise FaultInjected. none: return None. stall: sleep ``seconds``, then answer.
    #: fail-load: (on get_transfer_results) report the requests' loads finished and failed, and
    #: their blocks from get_block_ids_with_load_errors.
    action: FaultAction
    requests: list[str] = []
    seconds: float = 0.05
    #: Behave for this many matching calls first, then fire: with ``times``, a child that is
    #: healthy, fails for a while, and is healthy again.
    after: int = 0
    #: Fire this many times, then behave (None: every time).
    times: int | None = None

    def __post_init__(self) -> None:
        if self.call not in fault_calls():
            raise ValueError(f"call {self.call!r} is not a connector call; expected one of {sorted(fault_calls())}")
        if self.action == "fail-load" and self.call != "get_transfer_results":
            raise ValueError("action fail-load is reported by get_transfer_results; set call: get_transfer_results")
        if self.seconds < 0 or self.after < 0 or (self.times is not None and self.times < 1):
            raise ValueError("seconds and after must be >= 0 and times >= 1")


class FaultyOptions(RecordOptions):
    faults: list[Fault] = []


class RecordType(ConnectorType):
    name = "record"
    summary = "test double: answers as scripted, records every engine call"
    options: ClassVar[type[Options]] = RecordOptions

    def vllm_config(self, child: Child) -> dict[str, Any]:
        o = child.options
        assert isinstance(o, RecordOptions)
        extra = {
            "name": child.name,
            **{
                k: v
                for k, v in msgspec.to_builtins(o).items()
                if k in ("matched_tokens", "is_async", "delay_free", "params", "sleep_mode")
            },
        }
        return {
            "kv_connector": "RecordConnector",
            "kv_connector_module_path": "kvcompose.testing.connectors",
            "kv_connector_extra_config": extra,
        }

    def describe(self, child: Child) -> str:
        return f"records calls; answers {child.options.matched_tokens} matched tokens"  # type: ignore[attr-defined]


class RecordRangeType(RecordType):
    name = "record-range"
    summary = "test double that can load a range (ConnectorType.range_loads) for load: ranges"
    range_loads = True


class RecordPDType(RecordType):
    name = "record-pd"
    summary = "test double of a P/D transport: owns the NIXL-style kv_transfer_params keys"
    owns_handshake = True
    owns_host_buffer_ops = True
    param_keys = frozenset(
        {"do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id", "remote_host", "remote_port"}
    )


class FaultyType(RecordType):
    name = "faulty"
    summary = "test double: a record connector that raises, returns None, stalls or fails loads on demand"
    range_loads = True  # it loads (and fails) exactly the blocks of the range it is given
    options: ClassVar[type[Options]] = FaultyOptions

    def vllm_config(self, child: Child) -> dict[str, Any]:
        cfg = super().vllm_config(child)
        cfg["kv_connector"] = "FaultyConnector"
        cfg["kv_connector_extra_config"]["faults"] = msgspec.to_builtins(child.options.faults)  # type: ignore[attr-defined]
        return cfg

    def describe(self, child: Child) -> str:
        faults = child.options.faults  # type: ignore[attr-defined]
        return f"records calls; injects {len(faults)} fault(s): " + ", ".join(f"{f.action} on {f.call}" for f in faults)


@hookimpl
def kvcompose_connector_types() -> list[ConnectorType]:
    return [RecordType(), RecordRangeType(), RecordPDType(), FaultyType()]


#: The plugin name under which :func:`registered` registers this module.
PLUGIN_NAME = "kvcompose.testing.types"


@contextmanager
def registered(plugins: Plugins | None = None) -> Iterator[Plugins]:
    """Within: these types in ``plugins`` (default: the process-wide manager, the one vLLM's
    composed connector uses), so this process can check and render a composition that uses
    them. Left as found: types an outer scope registered stay registered."""
    from kvcompose.plugins import get_plugins

    plugins = plugins or get_plugins()
    module = sys.modules[__name__]
    if plugins.pm.is_registered(module):
        yield plugins
        return
    plugins.register(module, name=PLUGIN_NAME)
    try:
        yield plugins
    finally:
        plugins.unregister(module)


#: The entry-point name under which :func:`install_entry_point` offers these types.
ENTRY_POINT = "kit-types"


def install_entry_point(site: Path) -> dict[str, str]:
    """Offer these types to other processes as an installed plugin would: a distribution in
    ``site`` whose ``kvcompose`` entry point is this module. Returns the environment to add to a
    process's (``PYTHONPATH`` with ``site`` first): a real engine started with it can run
    ``type: faulty`` (the kit's fixtures register the types only in the test's own process)."""
    dist = site / "kvcompose_kit_types-0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kvcompose-kit-types\nVersion: 0\n")
    (dist / "entry_points.txt").write_text(f"[kvcompose]\n{ENTRY_POINT} = {__name__}\n")
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)}
