"""Benchmark 3: the cost of reaching the children, per call: call plan vs direct loop vs pluggy.

The same two children (the test kit's ``record`` connectors, whose ``save_kv_layer`` appends to
a list) are reached three ways with the same arguments:

* ``call plan``: the composed connector's own ``save_kv_layer`` (its callables resolved once, at
  composition build, as the adapter does for every per-layer hook);
* ``direct loop``: ``for c in children: c.save_kv_layer(...)``, the floor;
* ``pluggy``: a pluggy hook with one hookimpl per child, what a per-call ``pm.hook`` dispatch
  would cost.

The children's own work is identical across the three, so the ratios are the dispatch alone
plus that shared work.
"""

from __future__ import annotations

from typing import Any

import pluggy

from kvcompose_tools.bench.measure import interleave, ratio, repeats_for, time_per_call
from kvcompose_tools.bench.report import Case, Result

COMPOSITION = """
version: 1
connectors:
  - {name: a, type: record}
  - {name: b, type: record}
"""

_spec = pluggy.HookspecMarker("kvcompose_bench")
_impl = pluggy.HookimplMarker("kvcompose_bench")


class _Spec:
    @_spec
    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any) -> None:
        """Every child saves the layer."""


class _ChildPlugin:
    """One child behind a hookimpl."""

    def __init__(self, child: Any) -> None:
        self.child = child

    @_impl
    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any) -> None:
        self.child.save_kv_layer(layer_name, kv_layer, attn_metadata)


def run(quick: bool = False, repeats: int | None = None) -> Result:
    """Time one ``save_kv_layer`` fan-out to two children, three ways, interleaved."""
    import kvcompose.testing.types
    from kvcompose.plugins import get_plugins
    from kvcompose.testing.worker import WorkerHarness

    plugins = get_plugins()
    added = not plugins.pm.is_registered(kvcompose.testing.types)
    if added:
        plugins.register(kvcompose.testing.types, name="kvcompose.testing.types")
    try:
        h = WorkerHarness.from_yaml(COMPOSITION, num_layers=1)
    finally:
        if added:
            plugins.unregister(kvcompose.testing.types)
    composite = h.connector
    children = [h.child("a"), h.child("b")]
    pm = pluggy.PluginManager("kvcompose_bench")
    pm.add_hookspecs(_Spec)
    for c in children:
        pm.register(_ChildPlugin(c))
    layer, kv = h.layer_names[0], h.kv_caches[h.layer_names[0]]
    hook = pm.hook.save_kv_layer

    def plan() -> None:
        composite.save_kv_layer(layer, kv, None)

    def direct() -> None:
        for c in children:
            c.save_kv_layer(layer, kv, None)

    def via_pluggy() -> None:
        hook(layer_name=layer, kv_layer=kv, attn_metadata=None)

    calls = 20_000 if quick else 100_000

    def timed(fn: Any) -> Any:
        def sample(_r: int) -> float:
            t = time_per_call(fn, calls)
            for c in children:
                c.calls.clear()  # keep memory flat; the clearing is not timed
            return t

        return sample

    reps = repeats or repeats_for(quick, full=9)
    try:
        samples = interleave(
            {"direct loop": timed(direct), "call plan": timed(plan), "pluggy": timed(via_pluggy)}, reps
        )
    finally:
        h.shutdown()
    label = "save_kv_layer, 2 children"
    return Result(
        "dispatch",
        "Dispatch to two children, per call",
        "ns/call",
        1e9,
        [Case(label, samples, {"calls_per_repeat": calls})],
        [ratio(label, samples, "call plan", "direct loop"), ratio(label, samples, "pluggy", "direct loop")],
        None,
        reps,
        quick,
        [
            "the composed connector resolves hooks to plain callables at build time; pluggy dispatch is kept "
            "for registration, discovery and tracing, never per call",
            "each child's save_kv_layer appends one tuple to a list (the same work under all three)",
        ],
        {"children": 2},
    )
