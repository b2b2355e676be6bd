"""Benchmark 2: the worker hooks of one model-runner step, kvcompose vs vLLM's MultiConnector.

Both sides run the same two children (the NIXL plugin's NixlConnector, which is vLLM's worker,
and the CPU-offload plugin's connector, whose portable worker runs on CPU; vLLM's own
SimpleCPUOffload worker needs CUDA) over the same engine-shaped KV caches, driven by the test
kit's :class:`~kvcompose.testing.worker.WorkerHarness`: bind metadata, start load, per layer
``wait_for_layer_load`` + ``save_kv_layer`` for 32 layers, ``wait_for_save``, transfer results,
stats, events, worker metadata, clear. Only the composite differs.
"""

from __future__ import annotations

import operator
import time
from typing import Any

from kvcompose_tools.bench.measure import interleave_units, paired, ratio, repeats_for
from kvcompose_tools.bench.report import Case, Result, Target

LAYERS = 32
BLOCK = 32  # NIXL's worker checks the CPU attention backend's block size (a multiple of 32)
#: kvcompose/MultiConnector of each repeat's two samples: the spread of the targeted ratio.
PER_REPEAT = "kvcompose/MultiConnector per repeat"

COMPOSITION = """
version: 1
connectors:
  - name: pd
    type: nixl
    role: consumer
    options: {side_channel_host: 127.0.0.1, side_channel_port: 5698, progress_delay_us: 100, ucx_error_handling: none}
  - name: host
    type: cpu-offload
    options: {cpu_bytes: 16MiB}
rules: {load: first-wins, store: all, metadata: merge}
"""


def kv_configs() -> dict[str, dict[str, Any]]:
    """The two sides' ``kv_transfer_config``: kvcompose's, and vLLM's MultiConnector over the same children."""
    from kvcompose.compose import loads
    from kvcompose.vllm.args import kv_transfer_config, vllm_multiconnector

    composed = kv_transfer_config(loads(COMPOSITION, filename="<bench>"))
    return {"MultiConnector": vllm_multiconnector(composed), "kvcompose": composed}


def run(quick: bool = False, repeats: int | None = None, layers: int = LAYERS) -> Result:
    """Time one worker step of each side, alternating per step; ratio kvcompose / MultiConnector."""
    from kvcompose.testing.worker import WorkerHarness

    reps = repeats or repeats_for(quick, full=9)
    per_repeat = 50 if quick else 200
    harnesses = {
        name: WorkerHarness(cfg, num_layers=layers, block_size=BLOCK, num_blocks=64)
        for name, cfg in kv_configs().items()
    }
    try:
        metas = {name: h.idle_metadata() for name, h in harnesses.items()}

        def unit(name: str) -> Any:
            h, meta = harnesses[name], metas[name]

            def one() -> float:
                t0 = time.perf_counter()
                h.step(meta)
                return time.perf_counter() - t0

            return one

        for name in harnesses:  # warm-up
            for _ in range(20):
                unit(name)()
        samples = interleave_units({name: unit(name) for name in harnesses}, reps, per_repeat)
    finally:
        for h in harnesses.values():
            h.shutdown()
    label = f"{layers} layers"
    return Result(
        "worker_hooks",
        "Worker step: the connector hooks of one model-runner step",
        "us/step",
        1e6,
        [
            Case(
                label,
                samples,
                {"steps_per_repeat": per_repeat},
                {PER_REPEAT: paired(samples, "kvcompose", "MultiConnector", operator.truediv)},
            )
        ],
        [ratio(label, samples, "kvcompose", "MultiConnector")],
        Target("<=", 0.9, "kvcompose", "MultiConnector"),
        reps,
        quick,
        [
            "both sides run the same children (vLLM's NIXL worker via the nixl plugin, the cpu-offload plugin's "
            "portable worker) through the test kit's WorkerHarness; only the composite differs",
            "a step: bind, start_load_kv, per layer wait_for_layer_load + save_kv_layer, wait_for_save, "
            "get_transfer_results, load errors, stats, KV events, worker metadata, clear (no transfer queued)",
        ],
        {"layers": layers, "block_size": BLOCK},
    )
