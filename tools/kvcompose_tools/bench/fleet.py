"""Benchmark 5k: a 2P2D fleet behind vLLM's router, one side per routing policy (issue 53).

Two prefill and two decode servers of the shipped examples on this host
(:class:`kvcompose_tools.e2e.fleet.Fleet`) behind vllm-router in P/D mode, under each of
:data:`kvcompose.router.POLICIES`:

* ``round_robin``: neither the prefill nor the decode kept;
* ``consistent_hash``: both by a hash of the conversation's ``X-Session-ID``;
* ``kv_aware``: the prefill by the prompt tokens it would compute, from the prefills' composed KV
  events (device and host tier, relayed in 16-token blocks), the decode kept per session by the
  router's soft affinity (moved to a less loaded decode: "rebind");
* ``kv_aware+hash``: the prefill as ``kv_aware``, the decode by ``consistent_hash``.

Per side the same seeded conversations as benchmark 5h (:data:`~kvcompose_tools.bench.multi_turn.WORKLOADS`:
streamed chats, ``X-Session-ID`` per conversation, a few clients at once), after a short warm-up.
Which prefill and decode served a turn is read from its answer's ``id``: the router sends both
servers the request id ``___prefill_addr_HOST:PORT___decode_addr_HOST:PORT_UUID``, which vLLM's
server puts in the answer (:func:`served_by`). Per side run: the share of turns 2+ served by the
prefill and the decode that served the conversation's previous turn (where its history is), the
prompt tokens each prefill computed, the tokens the host tiers served (vLLM's
``prompt_tokens_cached_by_source{source=host}``, prefills and decodes), bytes over NIXL, TTFT
p50/p90 of turns 2+, requests/s, and the answers against a single engine's (token ids). Runs are
interleaved, the sides' order flipping every run; a ratio's ordering is claimed only where every
run lies on one side of 1.

The fleet's pool (issue 62): a side ``POLICY@POOL`` runs the native examples with a pool of
:data:`kvcompose_tools.e2e.fleet.POOLS` (``off``: none; ``peers``: vLLM's p2p tier, each
prefill's pool naming the other servers; ``shared``: one ``fs`` directory); ``POLICY`` alone is
issue 53's side, the shipped cpu-offload examples. The issue's sides are :data:`POOL_SIDES`;
``KVCOMPOSE_BENCH_SIDES`` (comma-separated) picks others, the routing sides of issue 53
(:data:`ROUTING_SIDES`) among them. Per side also the
fewest prompt tokens the fleet could compute (:func:`minimum_tokens`): each prompt's tokens past
what the fleet computed before it (any earlier prompt and its answer, a shared system prompt
included), exactly and in whole blocks (vLLM reuses whole blocks only, and never a prompt's last
token).
"""

from __future__ import annotations

import os
import re
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from kvcompose.router import POLICIES
from kvcompose_tools.bench.measure import Samples, paired, ratio
from kvcompose_tools.bench.multi_turn import WORKLOADS, Answers, Workload, baseline_answers, chat, mismatches, ordering
from kvcompose_tools.bench.pd_ttft import engine_lock
from kvcompose_tools.bench.report import Case, Result
from kvcompose_tools.e2e.fleet import POOLS
from kvcompose_tools.e2e.flow import CACHED_BY_SOURCE, COMPUTED, NIXL_BYTES, delta
from kvcompose_tools.e2e.load import Load, chat_load
from kvcompose_tools.e2e.stats import quantile

T = TypeVar("T")

#: Issue 53's sides: each policy, the shipped examples (``simple`` host tier), no pool.
ROUTING_SIDES = POLICIES
#: Issue 62's sides: three policies, each with the native examples and no pool, the peer pool, the
#: shared directory.
POOL_POLICIES = ("round_robin", "consistent_hash", "kv_aware+hash")
POOL_SIDES = tuple(f"{p}@{pool}" for pool in POOLS for p in POOL_POLICIES)
SIDES_ENV = "KVCOMPOSE_BENCH_SIDES"
#: (subject, baseline): each routing by the prefills' events over each policy without them; each
#: pool over no pool under its policy; round_robin with a pool against consistent_hash (the
#: issue's target: the pool frees routing from finding the cache).
PAIRS = (
    *((s, b) for s in ("kv_aware+hash", "kv_aware") for b in ("round_robin", "consistent_hash")),
    *((f"{p}@{pool}", f"{p}@off") for pool in POOLS[1:] for p in POOL_POLICIES),
    *((f"round_robin@{pool}", c) for pool in POOLS[1:] for c in ("consistent_hash@off", f"consistent_hash@{pool}")),
)
#: The request id vllm-router 0.1.17 sends prefill and decode in P/D mode (vllm_pd_router.rs:1700).
ROUTED_ID = re.compile(r"___prefill_addr_(?P<prefill>[^_]+)___decode_addr_(?P<decode>[^_]+)_")
HOST_CACHED = f"{CACHED_BY_SOURCE}host}}"
#: vllm-router's time to prepare a ``kv_aware`` placement (render the prompt through a server, look
#: up the index), before the prefill request is sent: part of every turn's TTFT under kv_aware.
PREPARE = "vllm_router_pd_kv_prepare_seconds"
#: Runs per side: five for the medium model (the issue's), two for the tiny one.
RUNS = {"tiny": 2, "medium": 5}


def side_of(name: str) -> tuple[str, str, str]:
    """``(policy, host tier, pool)`` of a side's name: ``POLICY`` (the shipped cpu-offload
    examples) or ``POLICY@POOL`` (the native ones); a ValueError for another."""
    policy, at, pool = name.partition("@")
    if policy not in POLICIES or (at and pool not in POOLS):
        raise ValueError(f"fleet side {name!r}: POLICY or POLICY@POOL, of {', '.join(POLICIES)} and {', '.join(POOLS)}")
    return policy, "native" if at else "simple", pool or "off"


def chosen_sides(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The sides :data:`SIDES_ENV` names (comma-separated), else :data:`POOL_SIDES`."""
    text = (os.environ if environ is None else environ).get(SIDES_ENV, "")
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    for name in names:
        side_of(name)
    return names or POOL_SIDES


def minimum_tokens(load: Load, tokenizer: Any, block_size: int) -> tuple[int, int]:
    """The fewest prompt tokens a fleet could compute for ``load``'s served turns, in the order
    they were sent: each prompt's tokens past its longest common prefix with anything computed
    before it (every earlier prompt with its answer's ids: a conversation's history, and a
    system prompt that conversations share), exactly and in whole blocks of ``block_size`` (a
    cache hit is whole blocks), never the prompt's last token. A lower bound: a turn sent while
    an earlier one still ran is credited with it."""
    from kvcompose_tools.e2e.chat import render

    exact = whole = 0
    computed: list[list[int]] = []
    for t in sorted(load.turns, key=lambda t: t.sent_s):
        if t.error is not None:
            continue
        prompt = render(tokenizer, t.messages)
        common = min(max((_common(prompt, known) for known in computed), default=0), len(prompt) - 1)
        exact += len(prompt) - common
        whole += len(prompt) - min(common // block_size, (len(prompt) - 1) // block_size) * block_size
        computed.append(prompt + t.token_ids)
    return exact, whole


def _common(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def served_by(response_id: str) -> tuple[str, str] | None:
    """``(prefill HOST:PORT, decode HOST:PORT)`` that served an answer, from its ``id``; None when
    the id is not the router's P/D one."""
    m = ROUTED_ID.search(response_id)
    return (m["prefill"], m["decode"]) if m else None


@dataclass
class SideRun:
    """One side's run: the conversations' load and each server's counters across it."""

    #: the side's name (:func:`side_of`)
    policy: str
    load: Load
    #: server name -> its counters' change across the conversations
    moved: dict[str, dict[str, float]]
    #: HOST:PORT -> server name
    names: dict[str, str]
    answers: Answers = field(default_factory=Answers)
    #: the router's own counters after the conversations (its :data:`PREPARE` summary)
    router: dict[str, float] = field(default_factory=dict)
    #: :func:`minimum_tokens` of the load (exact, whole blocks)
    minimum: tuple[int, int] = (0, 0)

    def placements(self) -> dict[tuple[int, int], tuple[str, str] | None]:
        """(conversation, turn) -> (prefill, decode) names, of every served turn."""
        out: dict[tuple[int, int], tuple[str, str] | None] = {}
        for t in self.load.turns:
            if t.error is None:
                where = served_by(t.response_id)
                out[(t.conversation, t.turn)] = None if where is None else (self.names[where[0]], self.names[where[1]])
        return out

    def said(self) -> str:
        """The run's figures in one line, as the benchmark says each run."""
        f = self.figures()
        return (
            f"turns 2+ at home {f['home_share']} (prefill {f['same_prefill_share']}), "
            f"computed {f['computed_tokens']} {f['computed_by_prefill']} (decodes {f['computed_by_decodes']}; "
            f"minimum {f['minimum_tokens']}, in whole blocks {f['minimum_whole_blocks']}: "
            f"{f['over_minimum']}x), cached by source {f['cached_by_source']}, host {f['host_tokens']} tokens, "
            f"NIXL {f['nixl_bytes']} B, turns 2+ TTFT p50 {f['later_ttft_p50_s']} p90 {f['later_ttft_p90_s']} s, "
            f"{f['requests_per_s']} req/s, failed {f['failed']}, router's kv preparation "
            f"{f['prepare_mean_s']} s a request, answers: {f['answers']}"
        )

    def figures(self) -> dict[str, Any]:
        where = self.placements()
        later = [(c, t) for (c, t) in where if t > 0 and (c, t - 1) in where]
        pairs = [(where[k], where[(k[0], k[1] - 1)]) for k in later]
        home = [1 for now, before in pairs if now is not None and now == before]
        same_prefill = [1 for now, before in pairs if now is not None and before is not None and now[0] == before[0]]
        ttft = [t.ttft_s for t in self.load.turns if t.turn > 0 and t.ttft_s is not None]
        prefills = sorted(n for n in self.moved if n.startswith("prefill"))
        decodes = sorted(n for n in self.moved if n.startswith("decode"))
        served = [t for t in self.load.turns if t.error is None]
        computed = int(sum(self.moved[n].get(COMPUTED, 0) for n in prefills))
        # vLLM's sources per role: on a decode NIXL's P/D loads count as its own source.
        sources: dict[str, dict[str, int]] = {"prefills": {}, "decodes": {}}
        for name, counters in self.moved.items():
            into = sources["prefills" if name in prefills else "decodes"]
            for key, n in counters.items():
                if key.startswith(CACHED_BY_SOURCE):
                    source = key[len(CACHED_BY_SOURCE) : -1]
                    into[source] = into.get(source, 0) + int(n)
        return {
            "turns_2plus": len(later),
            "home_share": round(len(home) / len(later), 3) if later else None,
            "same_prefill_share": round(len(same_prefill) / len(later), 3) if later else None,
            "unplaced": sum(v is None for v in where.values()),
            "computed_by_prefill": {n: int(self.moved[n].get(COMPUTED, 0)) for n in prefills},
            "computed_tokens": computed,
            "computed_by_decodes": int(sum(self.moved[n].get(COMPUTED, 0) for n in decodes)),
            "minimum_tokens": self.minimum[0],
            "minimum_whole_blocks": self.minimum[1],
            "over_minimum": round(computed / self.minimum[1], 3) if self.minimum[1] else None,
            "cached_by_source": sources,
            "host_tokens": int(sum(m.get(HOST_CACHED, 0) for m in self.moved.values())),
            "nixl_bytes": int(sum(self.moved[n].get(NIXL_BYTES, 0) for n in decodes)),
            "later_ttft_p50_s": round(quantile(ttft, 0.5), 4) if ttft else None,
            "later_ttft_p90_s": round(quantile(ttft, 0.9), 4) if ttft else None,
            "requests_per_s": round(len(served) / self.load.wall_s, 3) if self.load.wall_s else 0.0,
            "failed": len(self.load.turns) - len(served),
            "prepare_mean_s": round(self.router[f"{PREPARE}_sum"] / self.router[f"{PREPARE}_count"], 4)
            if self.router.get(f"{PREPARE}_count")
            else None,
            "answers": self.answers.summary(),
        }


def interleaved(
    sides: Sequence[str],
    runs: int,
    logs: Path,
    one: Callable[[str, Path], T],
    said: Callable[[T], str],
    echo: Callable[[str], None],
) -> tuple[dict[str, list[T]], list[str]]:
    """Each side's ``runs`` runs, the sides' order flipping every run: ``one(side, its log folder)``
    runs a side once (each side's logs kept apart, for reading after); a side that raises (a
    server that did not start) ends only that run, said and listed in the failures returned."""
    done: dict[str, list[T]] = {side: [] for side in sides}
    failures: list[str] = []
    for r in range(runs):
        for side in sides if r % 2 == 0 else sides[::-1]:
            side_logs = logs / f"run{r + 1}-{side}"
            side_logs.mkdir(parents=True, exist_ok=True)
            try:
                result = one(side, side_logs)
            except Exception as exc:  # the other sides go on
                failures.append(f"run {r + 1} {side}: {type(exc).__name__}: {exc}"[:2000])
                echo(f"   run {r + 1} {side}: FAILED, the other sides go on: {failures[-1]}")
                continue
            done[side].append(result)
            echo(f"   run {r + 1} {side}: {said(result)}")
    return done, failures


def side_run(side: str, model: str, tokenizer: Any, logs: Path, seed: int, workload: Workload) -> SideRun:
    """Start side's 2P2D fleet (:func:`side_of`), warm it, run the conversations, stop it."""
    from kvcompose_tools.e2e.fleet import Fleet
    from kvcompose_tools.e2e.spec import BLOCK_SIZE

    policy, host_tier, pool = side_of(side)
    spec = {"num_gpu_blocks": workload.device_blocks, "max_model_len": workload.max_model_len}
    fleet = Fleet(model, logs, policy=policy, host_tier=host_tier, pool=pool, **spec)
    try:
        fleet.start()
        assert fleet.router is not None
        # Each server's first use (handshakes, first READs, first passes): not measured.
        chat_load(fleet.router.url, model, tokenizer, seed=seed + 999, conversations=4, turns=2, clients=2)
        servers = fleet.servers()
        before = {s.name: s.metrics() for s in servers}
        load = chat(fleet.router.url, model, tokenizer, seed, workload)
        moved = {s.name: delta(before[s.name], s.metrics()) for s in servers}
        names = {s.url.removeprefix("http://"): s.name for s in servers}
        minimum = minimum_tokens(load, tokenizer, BLOCK_SIZE)
        return SideRun(side, load, moved, names, router=fleet.router.router_metrics(), minimum=minimum)
    finally:
        fleet.close()


def run(
    quick: bool = False,
    repeats: int | None = None,
    echo: Callable[[str], None] = print,
    work: Path | None = None,
    model: str = "tiny",
    sides: tuple[str, ...] | None = None,
) -> Result:
    """Every side's (``sides``, else :func:`chosen_sides`) ``repeats`` (else :data:`RUNS`)
    interleaved runs; the table, the ratios of :data:`PAIRS` and whether every run lies on one
    side of 1."""
    policies = sides or chosen_sides()
    from kvcompose_tools.e2e.chat import load_tokenizer
    from kvcompose_tools.e2e.model import make_model, model_config

    path = str(make_model(0, config=model_config(model)))
    workload = WORKLOADS[model]
    runs = repeats or (1 if quick else RUNS[model])
    logs = Path(work or tempfile.mkdtemp(prefix="kvcompose-bench-fleet-"))
    tokenizer = load_tokenizer(path)
    t0 = time.monotonic()
    with engine_lock(echo=echo):
        baseline = baseline_answers(path, tokenizer, logs, 0, workload)
        echo(f"   baseline (one engine, no P/D): {len(baseline.served)} answers, {len(baseline.failed)} failed")

        def one(side: str, side_logs: Path) -> SideRun:
            done = side_run(side, path, tokenizer, side_logs, 0, workload)
            done.answers = mismatches(done.load, baseline)
            return done

        done, failures = interleaved(policies, runs, logs, one, SideRun.said, echo)
    result = summarize(done, runs, quick, logs, time.monotonic() - t0, model)
    result.notes += [f"failed: {f}" for f in failures]
    return result


def answers_total(runs: list[SideRun]) -> str:
    """Every run's answers against the baseline's, added up (:meth:`Answers.summary`'s words)."""
    total = Answers(
        equal=sum(r.answers.equal for r in runs),
        near_ties=[t for r in runs for t in r.answers.near_ties],
        wrong=[w for r in runs for w in r.answers.wrong],
        not_compared=sum(r.answers.not_compared for r in runs),
    )
    return total.summary()


#: The figures whose median over the runs each policy's note gives.
MEDIANS = (
    "home_share",
    "same_prefill_share",
    "host_tokens",
    "nixl_bytes",
    "later_ttft_p90_s",
    "prepare_mean_s",
    "over_minimum",
    "computed_by_decodes",
)


def summarize(done: dict[str, list[SideRun]], runs: int, quick: bool, logs: Path, wall_s: float, model: str) -> Result:
    """Cases: turns 2+ TTFT p50, prompt tokens computed, requests/s (samples: each run's); per
    case the per-run ratios of each of :data:`PAIRS` and their ordering."""
    figs = {p: [r.figures() for r in rs] for p, rs in done.items() if rs}
    kinds = (
        ("turns 2+ TTFT p50", "later_ttft_p50_s", False),
        ("prompt tokens computed", "computed_tokens", False),
        ("requests/s", "requests_per_s", True),
    )
    cases, ratios, orderings = [], [], {}
    for kind, key, higher in kinds:
        samples = {p: Samples([float(f[key] or 0.0) for f in fs]) for p, fs in figs.items()}
        ran = [(s, b) for s, b in PAIRS if s in samples and b in samples]
        derived = {f"{s}/{b} per run": paired(samples, s, b, lambda x, y: x / y if y else float("inf")) for s, b in ran}
        orderings[kind] = {name.removesuffix(" per run"): ordering(v) for name, v in derived.items()}
        cases.append(Case(kind, samples, {"runs": figs} if key == "later_ttft_p50_s" else {}, derived))
        ratios += [ratio(kind, samples, s, b, higher_is_better=higher) for s, b in ran if samples[b].min > 0]
    per_policy = {p: {k: statistics.median(float(f[k] or 0.0) for f in fs) for k in MEDIANS} for p, fs in figs.items()}
    notes = [
        f"{p}: turns 2+ on the previous turn's prefill and decode {v['home_share']:.0%} "
        f"(prefill {v['same_prefill_share']:.0%}), prefills computed {v['over_minimum']}x the whole-block minimum "
        f"(decodes {v['computed_by_decodes']:,.0f} tokens), host tiers served {v['host_tokens']:,.0f} tokens, "
        f"NIXL {v['nixl_bytes']:,.0f} B, turns 2+ TTFT p90 {v['later_ttft_p90_s']} s, the router's kv_aware "
        f"preparation {v['prepare_mean_s'] * 1000:.0f} ms a request (medians of {len(figs[p])} runs); "
        f"answers over the runs: {answers_total(done[p])}"
        for p, v in per_policy.items()
    ]
    notes += [f"ordering, {kind}: {o}" for kind, o in orderings.items()]
    notes.append(f"2P2D on one host, {model} model; {runs} interleaved run(s); logs: {logs}")
    return Result(
        name="fleet",
        title=f"2P2D behind vllm-router: routing policies and the fleet's pool ({model})",
        unit="s | tokens | req/s",
        scale=1.0,
        cases=cases,
        ratios=ratios,
        repeats=runs,
        quick=quick,
        notes=notes,
        config={"model": model, "orderings": orderings, "per_policy": per_policy, "wall_s_runs": round(wall_s, 1)},
    )
