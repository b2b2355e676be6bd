"""``kvcompose demo --http --prefills 2``: 2P2D behind vLLM's router, prefills routed by their KV events.

Two prefill and two decode servers of the shipped pair (:class:`~kvcompose_tools.e2e.fleet.Fleet`,
``kv_aware`` with session affinity), two conversations of three turns, then the prefill holding
the first one is killed and each conversation goes on for two turns
(:func:`~kvcompose_tools.e2e.fleet.kill_scenario`). A table shows, per turn, the prefill that
computed it and how many prompt tokens it computed, the decode that answered and what it loaded,
and whether the answer equals a single engine's (an offline baseline asked the same prompts in
the same order). Exit status 0 when every served answer is equal and nothing failed after the
router's health window.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import TextIO

from kvcompose_tools.e2e.demo import verdict
from kvcompose_tools.e2e.fleet import Fleet, Scenario, first_prompt, kill_scenario
from kvcompose_tools.e2e.model import LOGPROB_TOLERANCE, make_model, model_config
from kvcompose_tools.e2e.node import EngineNode, wait_all_ready
from kvcompose_tools.e2e.processes import NodeError
from kvcompose_tools.e2e.spec import EngineSpec

MAX_TOKENS = 16
#: After this long from the kill a failed turn counts against the run: the router's health
#: window (:data:`~kvcompose.serving.HEALTH_ARGS`) and a check's timeout.
DETECT_S = 6.0


def run(out: TextIO = sys.stdout, model_name: str = "tiny", host_tier: str = "simple", work: Path | None = None) -> int:
    """Run the fleet demo (see the module's text); its exit status."""
    started = time.monotonic()
    model = make_model(0, config=model_config(model_name))
    logs = Path(work or tempfile.mkdtemp(prefix="kvcompose-demo-fleet-"))
    print(f"model: {model} (seeded random weights)\nengine logs: {logs}", file=out)
    print("starting baseline (offline engine), prefill-1, prefill-2, decode-1, decode-2 ...", file=out, flush=True)
    baseline = EngineNode(EngineSpec("baseline", str(model)), logs)
    fleet = Fleet(model, logs, policy="kv_aware", host_tier=host_tier)
    try:
        wait_all_ready([baseline])
        fleet.start()
        assert fleet.router is not None
        print(f"vLLM's router {fleet.router.url}: kv_aware over the prefills' KV events (relayed in 16-token "
              "blocks), decodes kept per X-Session-ID", file=out, flush=True)  # fmt: skip
        first = {"conv-a": first_prompt(1), "conv-b": first_prompt(2)}
        scenario = kill_scenario(fleet, first, MAX_TOKENS)
        return _report(scenario, baseline, out, LOGPROB_TOLERANCE[model_name], started)
    except NodeError as exc:
        print(f"demo: {exc}", file=out)
        return 1
    finally:
        fleet.close()
        baseline.close()


def _report(scenario: Scenario, baseline: EngineNode, out: TextIO, tolerance: float, started: float) -> int:
    header = f"{'turn':<10} {'prompt':>6}  {'prefill (computed)':<22} {'decode':<9} {'loaded on decode':<24} output"
    print("\n" + header + "\n" + "-" * len(header), file=out)
    ok = True
    count = dict.fromkeys({t.session for t in scenario.turns}, 0)  # turns served so far
    shown_kill = False
    for t in scenario.turns:
        label = f"{t.session} {count[t.session] + 1}"
        count[t.session] += t.served is not None
        if t.after_s is not None and not shown_kill:
            print(f"-- {scenario.killed} killed (SIGKILL) --", file=out)
            shown_kill = True
        if t.served is None:
            late = (t.after_s or 0) > DETECT_S
            ok = ok and not late
            when = f"{t.after_s:.1f} s after the kill" if t.after_s is not None else ""
            print(f"{label:<10} {len(t.prompt):>6}  failed by the router {when}{' (late)' if late else ''}", file=out)
            continue
        s = t.served
        (want,) = baseline.generate([t.prompt], MAX_TOKENS)
        equal, why = verdict(s, want, tolerance)
        ok = ok and equal
        loaded = ", ".join(f"{c} {n}" for c, n in s.loaded.items()) or "none"
        prefill = f"{s.prefill} ({s.prefill_computed_tokens})"
        print(f"{label:<10} {s.prompt_tokens:>6}  {prefill:<22} {s.decode:<9} {loaded:<24} "
              f"{'equal' if equal else 'DIFFERS'}{why}", file=out)  # fmt: skip
    served = [t for t in scenario.turns if t.served is not None]
    failed = len(scenario.turns) - len(served)
    print(f"\n{len(served)} turns served, {failed} failed by the router within its health window after the kill; "
          f"answers {'all equal' if ok else 'NOT all equal'} to the single-engine baseline; "
          f"wall time {time.monotonic() - started:.0f} s", file=out)  # fmt: skip
    return 0 if ok else 1
