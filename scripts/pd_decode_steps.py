"""The scheduler's side of one P/D decode, timed: bare NixlConnector, kvcompose, kvcompose-pd-only.

A decode of ``pd_ttft`` (600 tokens, 32-token blocks, one token) as vLLM's real ``Scheduler``
runs it (``kvcompose.testing.harness``): the request arrives and waits for its NIXL pull for
``--waits`` steps that schedule nothing, the pull is reported, the first token is scheduled,
and three steps free it. Only ``schedule()`` and ``update_from_output()`` run, no worker, so what
differs between the sides is each connector's scheduler half (with its stats, which vLLM asks
for every step). The sides alternate, ``--reps`` rounds of 50 decodes each; the median per
decode is printed, and that of its first-token step alone.

``--before REV`` adds a side whose cpu-offload child is the plugin's connector as it was at git
revision ``REV`` (an A/B of a change to it in one process).

    .venv/bin/python scripts/pd_decode_steps.py --before HEAD~1
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvcompose import hookimpl
from kvcompose.plugins import get_plugins
from kvcompose.testing.harness import decode_request, model_runner_output, scheduler_for, yaml_kv_transfer_config
from kvcompose_tools.bench.pd_ttft import PROMPT_TOKENS, composition_file, nixl_alone
from kvcompose_tools.bench.serve import pd_only

BLOCK = 32
CONNECTOR = "plugins/cpu_offload/kvcompose_cpu_offload/connector.py"


def decodes(scheduler: Any, n: int, waits: int) -> tuple[float, float]:
    """Seconds per decode, and of them in its first-token step, over ``n`` decodes."""
    took = first = 0.0
    for _ in range(n):
        req = decode_request(PROMPT_TOKENS, block_size=BLOCK, max_tokens=1)
        t0 = time.perf_counter()
        scheduler.add_request(req)
        for _ in range(waits):
            scheduler.update_from_output(scheduler.schedule(), model_runner_output([]))
        out = scheduler.schedule()
        scheduler.update_from_output(out, model_runner_output([], finished_recving={req.request_id}))
        t1 = time.perf_counter()
        out = scheduler.schedule()
        running = [scheduler.requests[r] for r in out.num_scheduled_tokens]
        if not running:
            raise RuntimeError("the decode was not scheduled after its pull")
        scheduler.update_from_output(out, model_runner_output(running))
        first += time.perf_counter() - t1
        for _ in range(3):
            scheduler.update_from_output(scheduler.schedule(), model_runner_output([]))
        took += time.perf_counter() - t0
    return took / n, first / n


#: The type of the ``--before`` side's host tier: the cpu-offload type, its class from the copy.
BEFORE_TYPE = "cpu-offload-before"


class _BeforeType:
    """Contributes :data:`BEFORE_TYPE`: the plugin's cpu-offload type with its module path pointed at
    the copy, so the composition and the children list vLLM reads name the same class (the
    composite refuses a list edited by hand)."""

    def __init__(self, module: str) -> None:
        base = type(get_plugins().connector_types["cpu-offload"])
        self.type = type("CpuOffloadBefore", (base,), {"name": BEFORE_TYPE, "vllm_module_path": module})()

    @hookimpl
    def kvcompose_connector_types(self) -> list[Any]:
        return [self.type]


def before_config(composition: Path, rev: str, into: Path) -> dict[str, Any]:
    """``composition``'s config with its cpu-offload child's class taken from the plugin's connector at ``rev``."""
    source = subprocess.run(["git", "show", f"{rev}:{CONNECTOR}"], check=True, capture_output=True, text=True).stdout
    (into / "cpu_offload_before.py").write_text(source)
    sys.path.insert(0, str(into))
    get_plugins().register(_BeforeType("cpu_offload_before"), name=BEFORE_TYPE)
    text = composition.read_text()
    assert "type: cpu-offload\n" in text
    return yaml_kv_transfer_config(text.replace("type: cpu-offload\n", f"type: {BEFORE_TYPE}\n"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=11)
    parser.add_argument("--waits", type=int, default=10, help="steps a decode waits for its pull")
    parser.add_argument("--before", metavar="REV", help="also the cpu-offload connector at this git revision")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        composed = composition_file(d / "kvcompose", 5601)
        configs = {
            "NixlConnector": nixl_alone(composed),
            "kvcompose": yaml_kv_transfer_config(composed),
            "kvcompose-pd-only": yaml_kv_transfer_config(pd_only(composition_file(d / "pd", 5602), d / "pd")),
        }
        if args.before:
            configs[f"kvcompose at {args.before}"] = before_config(composed, args.before, d)
        schedulers = {side: scheduler_for(c, num_blocks=256, block_size=BLOCK) for side, c in configs.items()}
        times: dict[str, list[tuple[float, float]]] = {side: [] for side in schedulers}
        for _ in range(args.reps):
            for side, scheduler in schedulers.items():
                times[side].append(decodes(scheduler, 50, args.waits))
    base = statistics.median(t for t, _ in times["NixlConnector"])
    for side, pairs in times.items():
        med = statistics.median(t for t, _ in pairs)
        first = statistics.median(f for _, f in pairs)
        print(
            f"{side:28s} {med * 1e6:5.0f} us a decode ({args.waits} waiting steps), x{med / base:.2f};"
            f" its first-token step {first * 1e6:4.0f} us"
        )


if __name__ == "__main__":
    main()
