"""Benchmark 5l: a prefill killed mid-run, and what the fleet's pool saves the conversations that move (issue 62).

A 2P2D fleet of the native examples behind vllm-router under ``consistent_hash`` (each
conversation kept on one prefill and one decode: its history is where it was computed), one side
per pool of :data:`kvcompose_tools.e2e.fleet.POOLS`. :func:`~kvcompose_tools.e2e.fleet.kill_scenario`
sends each conversation a few turns, one at a time, kills (SIGKILL) the prefill that served the
first conversation's last turn, and goes on until every conversation has had two more turns
(a turn the router fails inside its health window is sent again).

Per conversation that moved (its turns before the kill were computed on the killed prefill), its
first turn on the survivor: the prompt tokens the survivor computed, against what no live
instance held where another can load it. The decode that answered the previous turn keeps that
turn's prompt in its host tier, in whole blocks (the examples' tier stores prompts only: vLLM's
``offload_prompt_only``, the type's ``prompt_only``, default true; the answer's blocks stay in its
device cache, which no tier serves), and so does the shared directory with ``shared``. So the
tokens the move cost are ``computed - (prompt - held)`` (``computed``: the prompt tokens the
prefill and the decode that served the turn computed); the target is none. Every turn's answer
is checked against one engine's, asked the same prompts (token ids).

The same figures serve benchmark 5m (:mod:`kvcompose_tools.bench.fleet_join`), where the change
is a third decode joining the router mid-run and a conversation moved when it lands there.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcompose_tools.bench.fleet import interleaved
from kvcompose_tools.bench.measure import Samples
from kvcompose_tools.bench.multi_turn import WORKLOADS, Workload
from kvcompose_tools.bench.pd_ttft import engine_lock
from kvcompose_tools.bench.report import Case, Result
from kvcompose_tools.e2e.fleet import POOLS, Scenario

#: The routing policy: it keeps a conversation where its history is, so the kill is what moves it.
POLICY = "consistent_hash"
#: Conversations, turns before the kill, turns after it, tokens each answer.
CONVERSATIONS, BEFORE, AFTER, MAX_TOKENS = 6, 3, 2, 16
RUNS = {"tiny": 1, "medium": 3}


@dataclass
class Moved:
    """One conversation's first turn after the change moved it (to the surviving prefill, or to
    the decode that joined)."""

    session: str
    prompt_tokens: int
    #: whole-block tokens of the previous turn's prompt: what a live instance's host tier held
    held: int
    #: prompt tokens the turn's prefill and decode computed
    computed: int

    @property
    def recomputed(self) -> int:
        """Tokens of the history computed again (0: all a live instance held was loaded)."""
        return max(0, self.computed - (self.prompt_tokens - self.held))


@dataclass
class ChangeRun:
    """One pool's run: the server killed or joined, the conversations that moved, the turns the
    router failed, the answers."""

    pool: str
    changed: str
    moved: list[Moved]
    failed_turns: int
    turns: int
    equal: int
    differing: list[str] = field(default_factory=list)

    def figures(self) -> dict[str, Any]:
        return {
            "changed": self.changed,
            "moved": len(self.moved),
            "recomputed_tokens": sum(m.recomputed for m in self.moved),
            "held_tokens": sum(m.held for m in self.moved),
            "per_conversation": [
                {"session": m.session, "prompt": m.prompt_tokens, "held": m.held, "computed": m.computed}
                for m in self.moved
            ],
            "failed_turns": self.failed_turns,
            "answers": f"{self.equal} of {self.turns} equal",
            "differing": self.differing,
        }


def moved_turns(scenario: Scenario, block_size: int) -> list[Moved]:
    """Each conversation the change moved (its last turn before a kill on the killed prefill; its
    first turn after a join on the joined decode): its first served turn after the change, with
    the previous served turn's prompt in whole blocks (what its decode's host tier stored of it)."""
    out = []
    for session in dict.fromkeys(t.session for t in scenario.turns):
        served = [t for t in scenario.of(session) if t.served is not None]
        before = [t for t in served if t.after_s is None]
        after = [t for t in served if t.after_s is not None]
        if not before or not after:
            continue
        last, first = before[-1].served, after[0].served
        assert last is not None and first is not None
        if last.prefill != scenario.killed and first.decode != scenario.joined:
            continue
        held = len(before[-1].prompt) // block_size * block_size
        computed = (first.prefill_computed_tokens or 0) + first.computed_tokens
        out.append(Moved(session, len(after[0].prompt), held, int(computed)))
    return out


def change_run(change: str, pool: str, model: str, logs: Path, workload: Workload, baseline: Any) -> ChangeRun:
    """One fleet with ``pool``: the ``change`` (``kill`` or ``join``) scenario, its moved
    conversations, its answers against ``baseline``."""
    from kvcompose_tools.e2e.fleet import Fleet, first_prompt, join_scenario, kill_scenario
    from kvcompose_tools.e2e.spec import BLOCK_SIZE

    spec = {"num_gpu_blocks": workload.device_blocks, "max_model_len": workload.max_model_len}
    standby = int(change == "join")
    fleet = Fleet(model, logs, policy=POLICY, host_tier="native", pool=pool, standby=standby, **spec)
    try:
        fleet.start()
        first = {f"conv-{i}": first_prompt(11 + i) for i in range(CONVERSATIONS)}
        scenario = (kill_scenario if change == "kill" else join_scenario)(
            fleet, first, MAX_TOKENS, before=BEFORE, after=AFTER
        )
    finally:
        fleet.close()
    served = [t for t in scenario.turns if t.served is not None]
    differing = []
    for t in served:
        (want,) = baseline.generate([t.prompt], MAX_TOKENS)
        assert t.served is not None
        if t.served.token_ids != want["token_ids"]:
            differing.append(f"{t.session} turn {scenario.of(t.session).index(t) + 1}")
    return ChangeRun(
        pool,
        scenario.killed or scenario.joined,
        moved_turns(scenario, BLOCK_SIZE),
        failed_turns=len(scenario.turns) - len(served),
        turns=len(served),
        equal=len(served) - len(differing),
        differing=differing,
    )


def runner(change: str) -> Callable[..., Result]:
    """The benchmark runner's ``run`` for the ``change`` scenario (``kill`` or ``join``)."""

    def run(
        quick: bool = False,
        repeats: int | None = None,
        echo: Callable[[str], None] = print,
        work: Path | None = None,
        model: str = "tiny",
    ) -> Result:
        """Each pool's ``repeats`` (else :data:`RUNS`) runs, interleaved."""
        return change_runs(change, quick, repeats, echo, work, model)

    return run


run = runner("kill")


def change_runs(
    change: str, quick: bool, repeats: int | None, echo: Callable[[str], None], work: Path | None, model: str
) -> Result:
    """Each pool's runs of the ``change`` scenario (``kill`` or ``join``), interleaved."""
    from kvcompose_tools.e2e.model import make_model, model_config
    from kvcompose_tools.e2e.node import wait_all_ready
    from kvcompose_tools.e2e.server import ServerNode
    from kvcompose_tools.e2e.spec import EngineSpec

    path = str(make_model(0, config=model_config(model)))
    workload = WORKLOADS[model]
    runs = repeats or (1 if quick else RUNS[model])
    logs = Path(work or tempfile.mkdtemp(prefix=f"kvcompose-bench-fleet-{change}-"))
    t0 = time.monotonic()
    with engine_lock(echo=echo):
        blocks, length = 4 * workload.device_blocks, workload.max_model_len
        baseline = ServerNode(EngineSpec("baseline", path, num_gpu_blocks=blocks, max_model_len=length), logs)
        try:
            wait_all_ready([baseline])
            sides = [f"{POLICY}@{pool}" for pool in POOLS]

            def one(side: str, side_logs: Path) -> ChangeRun:
                return change_run(change, side.split("@")[1], path, side_logs, workload, baseline)

            done, failures = interleaved(sides, runs, logs, one, lambda r: str(r.figures()), echo)
        finally:
            baseline.close()
    return summarize(done, runs, quick, logs, time.monotonic() - t0, model, failures, change)


#: Per change: the benchmark's name, what happened, the title's words.
CHANGES = {
    "kill": ("fleet-kill", "the kill", "a prefill killed mid-run"),
    "join": ("fleet-join", "the join", "a third decode joining mid-run"),
}


def summarize(
    done: dict[str, list[ChangeRun]],
    runs: int,
    quick: bool,
    logs: Path,
    wall_s: float,
    model: str,
    failures: list[str],
    change: str = "kill",
) -> Result:
    """Cases (``done`` by side, ``POLICY@POOL``): history tokens recomputed by the moved
    conversations, what a live host tier held of it, turns the router failed (samples: each run's)."""
    name, after, words = CHANGES[change]
    figs = {side: [r.figures() for r in rs] for side, rs in done.items() if rs}
    cases = [
        Case(kind, {side: Samples([float(f[key]) for f in fs]) for side, fs in figs.items()})
        for kind, key in (
            (f"history tokens recomputed after {after}", "recomputed_tokens"),
            ("history tokens a live instance held", "held_tokens"),
            ("turns the router failed", "failed_turns"),
        )
    ]
    notes = [
        f"{side}: {statistics.median(f['moved'] for f in fs)} conversations moved a run (median); "
        f"answers: {', '.join(f['answers'] for f in fs)}; differing: {[d for f in fs for d in f['differing']]}"
        for side, fs in figs.items()
    ]
    notes += [f"failed: {f}" for f in failures]
    fleet = "2P2D, a third decode joining," if change == "join" else "2P2D"
    notes.append(f"{fleet} on one host, {model} model, {POLICY}; {runs} interleaved run(s); logs: {logs}")
    title = f"2P2D behind vllm-router: {words}, with and without the fleet's pool ({model})"
    config = {"wall_s": round(wall_s, 1), "model": model, "policy": POLICY, "pools": list(POOLS)}
    return Result(name, title, "tokens | turns", 1.0, cases, [], None, runs, quick, notes, config)
