"""Benchmark 1: time per scheduler step with NIXL + a CPU tier, kvcompose vs vLLM's MultiConnector.

Each side is vLLM's real ``Scheduler`` (``kvcompose.testing.harness``) on the decode instance,
kept at N live requests by a deterministic arrival stream, the same for every side:

* ``remote``: a decode-side remote prefill (``do_remote_prefill`` with the prefill instance's
  block ids); NIXL loads it, the worker reports it loaded in the same step;
* ``plain``: a fresh prompt computed locally (the CPU tier stores its blocks);
* ``repeat``: the prompt of a ``plain`` request old enough to have left the device prefix cache,
  so the CPU tier loads it back.

A step is ``schedule()`` plus ``update_from_output()``; only those two calls are timed, not the
building of the worker's output between them. The worker's output acknowledges the CPU tier's
stores of that step (the portable worker's report, in each composite's own metadata format).

Sides: ``nixl`` (vLLM's bare NixlConnector), ``MultiConnector`` (vLLM's, over vLLM's
NixlConnector and SimpleCPUOffloadConnector), ``kvcompose`` (the same two composed from YAML,
i.e. the plugins' subclasses: vLLM's scheduler code plus the plugins' small overrides), and
``kvcompose-vllm`` (the same composition with vLLM's own two classes as the children, kvcompose's
``type: vllm``: the composite alone, no plugin code).

The own-cost case per size (issue 54) alternates ``MultiConnector``, ``kvcompose-vllm`` and
``kvcompose`` one step at a time for thousands of rounds, each side following each as often
(:func:`~kvcompose_tools.bench.measure.alternated_steps`),
and reports the paired per-step estimator: the median over rounds of one side's step less
another's, per live request. ``kvcompose-vllm - MultiConnector`` is the composite's own cost
(target: at most 1 us a request from 16 requests); ``kvcompose - kvcompose-vllm`` is what the
plugins' overrides cost (reported, no target).

A second case per size weighs the P/D trust checks (issue 51, docs/security.md): ``trust-on``
is the kvcompose side with a deployment key, its ``remote`` arrivals carrying the params a
prefill scheduler with the same key returned for the prompt (signed by the nixl plugin, through
JSON as a proxy passes them), the decode verifying each; ``trust-off`` is the same without a key
on either instance (the field checks run either way). The decode checks a request's params when
vLLM adds it (``add_request`` -> ``on_new_request``), so these two sides time ``add_request``
too, and the case reports what ``add_request`` costs per P/D request on each.
"""

from __future__ import annotations

import json
import math
import os
import random
import secrets
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from kvcompose_tools.bench.measure import (
    Ratio,
    Samples,
    alternated_steps,
    interleave_units,
    median_interval,
    paired,
    per_step_cost,
    pick,
    quartiles,
    ratio,
    repeats_for,
)
from kvcompose_tools.bench.report import AllTargets, Case, CaseTarget, Result

SIZES = (1, 16, 128, 1024)
QUICK_SIZES = (1, 16, 128)
BLOCK = 16
PROMPT_TOKENS = 128
MIX = ("remote", "plain", "repeat")
#: The trust case's sides: the kvcompose side with the deployment key (prefill signs, decode
#: verifies) and without it.
TRUST_ON, TRUST_OFF = "trust-on", "trust-off"
TRUST_SIDES = (TRUST_OFF, TRUST_ON)
#: The environment variable the keyed compositions name (a fresh key is put there when it is unset).
KEY_ENV = "KVCOMPOSE_BENCH_PD_KEY"
#: Issue 51's target for the decode's check, as decided (a check that binds the prompt cannot be
#: constant): at most this much per P/D request on the scheduler, per prompt token plus a fixed part.
TRUST_NS_PER_TOKEN = 10
TRUST_US_PER_REQUEST = 10
TRUST_BUDGET_US = TRUST_US_PER_REQUEST + TRUST_NS_PER_TOKEN * PROMPT_TOKENS / 1000
#: The target's baseline: trust-off's ``add_request`` per P/D request plus the budget.
TRUST_BUDGET = f"trust-off+{TRUST_BUDGET_US:g}us"
TRUST_COST = "(trust-on - trust-off) add_request/P/D request (us)"
TRUST_STEP_COST = "(trust-on - trust-off) step/P/D request (us)"


@dataclass(frozen=True)
class Arrival:
    """One request of the stream; ``kind`` is one of :data:`MIX`."""

    rid: str
    kind: str
    prompt: tuple[int, ...]
    max_tokens: int


def arrivals(seed: int, repeat_gap: int) -> Iterator[Arrival]:
    """An endless, deterministic request stream cycling through :data:`MIX`.

    A ``repeat`` reuses the prompt of a ``plain`` request at least ``repeat_gap`` arrivals old
    (a fresh prompt until there is one).
    """
    rng = random.Random(seed)
    plain: list[tuple[int, tuple[int, ...]]] = []
    k = 0
    while True:
        kind = MIX[k % len(MIX)]
        prompt = tuple(rng.randrange(3, 500) for _ in range(PROMPT_TOKENS))
        if kind == "repeat":
            old = [p for j, p in plain if j <= k - repeat_gap]
            if old:
                prompt = old[rng.randrange(len(old))]
        elif kind == "plain":
            plain.append((k, prompt))
            # A bounded window of candidates: the newest plain prompts, reaching 64 past the gap.
            del plain[: -(repeat_gap // len(MIX) + 64)]
        yield Arrival(f"{kind}-{k}", kind, prompt, rng.randint(8, 40))
        k += 1


def kv_config(side: str, cpu_bytes: int) -> dict[str, Any]:
    """The decode instance's ``KVTransferConfig`` kwargs for one side."""
    nixl = {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}
    cpu = {
        "kv_connector": "SimpleCPUOffloadConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": cpu_bytes},
    }
    if side == "nixl":
        return nixl
    if side == "MultiConnector":
        return {
            "kv_connector": "MultiConnector",
            "kv_role": "kv_consumer",
            "kv_connector_extra_config": {"connectors": [nixl, cpu]},
        }
    if side in COMPOSED:
        from kvcompose.compose import loads
        from kvcompose.vllm.args import kv_transfer_config

        if side == VLLM_CHILDREN:
            text = COMPOSITION_VLLM.format(cpu_bytes=cpu_bytes)
        else:
            text = COMPOSITION.format(cpu_bytes=cpu_bytes, key=key_option(side == TRUST_ON))
        return kv_transfer_config(loads(text, filename="<bench>"))
    raise ValueError(f"unknown side {side!r}")


def key_option(keyed: bool) -> str:
    """The nixl child's ``key_env`` option (in a flow mapping), a fresh key in :data:`KEY_ENV` if unset."""
    if not keyed:
        return ""
    os.environ.setdefault(KEY_ENV, secrets.token_hex(32))
    return f", key_env: {KEY_ENV}"


COMPOSITION = """
version: 1
connectors:
  - name: pd
    type: nixl
    role: consumer
    options: {{side_channel_host: 127.0.0.1, side_channel_port: 5699{key}}}
  - name: host
    type: cpu-offload
    options: {{cpu_bytes: {cpu_bytes}}}
rules: {{load: first-wins, store: all, metadata: merge}}
"""
#: The side whose decode composes vLLM's own two classes (kvcompose's ``type: vllm``), with
#: MultiConnector's options and :data:`COMPOSITION`'s rules: the composite without the plugins.
VLLM_CHILDREN = "kvcompose-vllm"
COMPOSITION_VLLM = """
version: 1
connectors:
  - name: pd
    type: vllm
    role: consumer
    options: {{kv_connector: NixlConnector}}
  - name: host
    type: vllm
    options: {{kv_connector: SimpleCPUOffloadConnector, kv_connector_extra_config: {{cpu_bytes_to_use: {cpu_bytes}}}}}
rules: {{load: first-wins, store: all, metadata: merge}}
"""
#: The sides whose decode is a kvcompose composite (of :data:`COMPOSITION`, or
#: :data:`COMPOSITION_VLLM` for :data:`VLLM_CHILDREN`); their children are named ``pd`` and ``host``.
COMPOSED = ("kvcompose", VLLM_CHILDREN, *TRUST_SIDES)
#: The trust sides' prefill instance: the nixl child alone, signing with the key when it has one.
PREFILL = """
version: 1
connectors:
  - name: pd
    type: nixl
    role: producer
    options: {{side_channel_host: 127.0.0.1, side_channel_port: 5698{key}}}
"""


class Prefill:
    """The prefill instance's scheduler: a ``remote`` arrival's params are what it returns for the
    prompt (the nixl plugin stamps and, with a key, signs them), through JSON as a proxy passes
    them. Each prompt's blocks are released (the decode's read reported) at the next one."""

    def __init__(self, keyed: bool) -> None:
        from kvcompose.compose import loads
        from kvcompose.testing.harness import make_kv_cache_config, make_scheduler, make_vllm_config
        from kvcompose.vllm.args import kv_transfer_config

        text = PREFILL.format(key=key_option(keyed))
        cfg = make_vllm_config(
            kv_transfer_config(loads(text, filename="<bench prefill>")),
            block_size=BLOCK,
            max_num_seqs=4,
            max_num_batched_tokens=2048,
            max_model_len=1024,
        )
        self.sched = make_scheduler(cfg, make_kv_cache_config(64, block_size=BLOCK))
        self.read: set[str] = set()

    def params(self, rid: str, prompt: tuple[int, ...]) -> dict[str, Any]:
        """The ``kv_transfer_params`` the prefill returns for ``prompt`` as request ``rid``."""
        from kvcompose.testing.harness import prefill_request, step

        self.sched.add_request(prefill_request(len(prompt), block_size=BLOCK, request_id=rid, prompt=prompt))
        _, eco = step(self.sched, finished_sending=self.read or None)
        self.read = {rid}
        (params,) = [o.kv_transfer_params for e in eco.values() for o in e.outputs if o.request_id == rid]
        return json.loads(json.dumps(params))  # type: ignore[no-any-return]


def _store_ack(side: str, meta: Any) -> Any:
    """The worker's report that this step's CPU-tier stores are done, in the side's format."""
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiKVConnectorWorkerMetadata
    from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadWorkerMetadata

    from kvcompose.vllm.metadata import ComposedWorkerMetadata

    if side == "nixl":
        return None
    cpu = meta.children["host"] if side in COMPOSED else meta.metadata[1]
    if cpu is None or cpu.store_event < 0:
        return None
    done = SimpleCPUOffloadWorkerMetadata({cpu.store_event: 1})
    if side in COMPOSED:
        return ComposedWorkerMetadata({"pd": None, "host": done})
    return MultiKVConnectorWorkerMetadata((None, done))


class Driver:
    """One side's scheduler, kept at ``n`` live requests; :meth:`step` returns the timed seconds.

    The trust sides' ``remote`` arrivals carry their :class:`Prefill`'s params, and their steps
    count the ``add_request`` calls before them (where the decode checks the params)."""

    def __init__(self, side: str, n: int, seed: int = 0) -> None:
        from kvcompose.testing.harness import make_kv_cache_config, make_scheduler, make_vllm_config

        self.side, self.n = side, n
        blocks_per_req = -(-(PROMPT_TOKENS + 40) // BLOCK)
        num_blocks = (blocks_per_req + 1) * n + 64
        page = 2 * BLOCK * 16 * 2  # K and V, one head of 16, fp16 (make_kv_cache_config's shape)
        cpu_bytes = 4 * num_blocks * page * 2  # the host pool holds 4x the device pool
        cfg = make_vllm_config(
            kv_config(side, cpu_bytes),
            block_size=BLOCK,
            max_num_seqs=n,
            max_num_batched_tokens=n + 2048,
            max_model_len=1024,
        )
        self.sched = make_scheduler(cfg, make_kv_cache_config(num_blocks, block_size=BLOCK))
        # Old enough to have been pushed out of the device prefix cache by newer prompts.
        self.stream = arrivals(seed, repeat_gap=n + num_blocks // (PROMPT_TOKENS // BLOCK))
        self.kinds: dict[str, str] = {}
        self.reported: set[str] = set()
        self.counts: Counter[str] = Counter()
        self.prefill = Prefill(side == TRUST_ON) if side in TRUST_SIDES else None
        self.steps = 0
        #: Seconds in ``add_request`` this step, and of each P/D arrival since :meth:`take_pd_adds`.
        self.add_s = 0.0
        self.pd_add_s: list[float] = []

    def _add(self, a: Arrival) -> None:
        from kvcompose.testing.harness import decode_request, make_request

        if a.kind == "remote" and self.prefill is not None:
            params = self.prefill.params(f"prefill-{a.rid}", a.prompt)
            req = make_request(
                len(a.prompt),
                block_size=BLOCK,
                request_id=a.rid,
                prompt=a.prompt,
                max_tokens=a.max_tokens,
                kv_transfer_params=params,
            )
        elif a.kind == "remote":
            req = decode_request(
                len(a.prompt), block_size=BLOCK, request_id=a.rid, prompt=a.prompt, max_tokens=a.max_tokens
            )
        else:
            req = make_request(
                len(a.prompt), block_size=BLOCK, request_id=a.rid, prompt=a.prompt, max_tokens=a.max_tokens
            )
        self.kinds[a.rid] = a.kind
        self.counts["arrived:" + a.kind] += 1
        t0 = time.perf_counter()
        self.sched.add_request(req)
        took = time.perf_counter() - t0
        self.add_s += took
        if a.kind == "remote":
            self.pd_add_s.append(took)

    def take_pd_adds(self) -> float:
        """The median seconds of ``add_request`` of the P/D arrivals since the last call (nan: none
        arrived): a repeat's few arrivals, one of them interrupted, would move a mean by microseconds."""
        median = statistics.median(self.pd_add_s) if self.pd_add_s else math.nan
        self.pd_add_s = []
        return median

    def step(self) -> float:
        """One engine step; returns the seconds spent in ``schedule()`` + ``update_from_output()``
        (the trust sides: and in the ``add_request`` calls before them)."""
        from vllm.v1.request import RequestStatus

        from kvcompose.testing.harness import model_runner_output

        sched = self.sched
        self.steps += 1
        self.add_s = 0.0
        while len(sched.requests) < self.n:
            self._add(next(self.stream))
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        # The worker finishes every load it was given this step (a fast worker).
        loaded = {
            r
            for r, req in sched.requests.items()
            if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and r not in self.reported
        }
        for r in loaded:
            self.counts["loaded:" + ("nixl" if self.kinds[r] == "remote" else "cpu")] += 1
        self.reported |= loaded
        running = [sched.requests[r] for r in out.num_scheduled_tokens]
        self.counts["scheduled_tokens"] += out.total_num_scheduled_tokens
        mro = model_runner_output(
            running, finished_recving=loaded or None, worker_meta=_store_ack(self.side, out.kv_connector_metadata)
        )
        t2 = time.perf_counter()
        eco = sched.update_from_output(out, mro)
        t3 = time.perf_counter()
        for e in eco.values():
            for o in e.outputs:
                if o.finish_reason is not None:
                    self.counts["finished"] += 1
                    self.reported.discard(o.request_id)
            self._count_refusals(e.scheduler_stats)
        return (t1 - t0) + (t3 - t2) + (self.add_s if self.prefill is not None else 0.0)

    def _count_refusals(self, stats: Any) -> None:
        """The P/D params the decode's nixl child refused, by reason, from the composite's
        stats (what vLLM's ``vllm:kvcompose_refused_params`` counts)."""
        data = ((getattr(stats, "kv_connector_stats", None) or {}).get("kvcompose:loads") or {}).get("data") or {}
        for reasons in data.get("refused_params", {}).values():
            for reason, count in reasons.items():
                self.counts["refused:" + reason] += count


def steps_per_repeat(n: int, quick: bool) -> int:
    """Enough steps that one sample is milliseconds long, not a single timer tick."""
    base = max(8, 2048 // max(n, 1))
    return max(4, base // 4) if quick else base


def warmup_steps(quick: bool) -> int:
    """Steps before timing: past the first finishes, so arrivals, loads and stores are all flowing."""
    return 48 if quick else 96


#: The step ratio's target against MultiConnector with the same children, by batch size: kvcompose
#: does the rules' work on top of the same calls, so equal is out of reach at small batches
#: (docs/performance.md, "Benchmarks at a glance").
SMALL_BATCH = 16
SMALL_BATCH_RATIO = 1.03
LARGE_BATCH_RATIO = 1.01
#: The composite's own cost of a step, per live request, in each repeat (issue 44: at most
#: :data:`OWN_COST_TARGET_US` at 16-1024 requests, on the median of nine repeats).
OWN_COST = "(kvcompose-MultiConnector)/request (us)"
OWN_COST_TARGET_US = 1.0
#: The own-cost case (issue 54): its sides, alternated one step at a time for this many rounds
#: (:data:`QUICK_OWN_ROUNDS` with ``--quick``), and the paired per-step estimator's two figures.
OWN_SIDES = ("MultiConnector", VLLM_CHILDREN, "kvcompose")
OWN_ROUNDS = 2000
QUICK_OWN_ROUNDS = 300
COMPOSITE_OWN = f"({VLLM_CHILDREN}-MultiConnector)/request, per step (us)"
PLUGINS_OWN = f"(kvcompose-{VLLM_CHILDREN})/request, per step (us)"
#: Issue 54's target: the composite's own cost (:data:`COMPOSITE_OWN`, the median over rounds) at
#: most this many microseconds a live request, from :data:`SMALL_BATCH` requests.
COMPOSITE_OWN_TARGET_US = 1.0
#: The own-cost case's target as a ratio: the estimator's median over the target (<= 1: met).
OWN_SUBJECT = "composite own (us/request)"
OWN_BUDGET = f"{COMPOSITE_OWN_TARGET_US:g} us"


def step_target(sizes: tuple[int, ...], trust: bool = False, own: bool = False) -> AllTargets:
    """kvcompose/MultiConnector at or under 1.03 up to 16 requests, 1.01 from 128, per size run;
    with ``trust``, per size also trust-on's ``add_request`` per P/D request at most trust-off's
    plus :data:`TRUST_BUDGET_US`; with ``own``, per size from :data:`SMALL_BATCH` also the
    composite's own cost at most :data:`COMPOSITE_OWN_TARGET_US` a request (:func:`own_case`)."""
    items = tuple(
        CaseTarget(
            "<=",
            SMALL_BATCH_RATIO if n <= SMALL_BATCH else LARGE_BATCH_RATIO,
            "kvcompose",
            "MultiConnector",
            f"{n} reqs",
        )
        for n in sizes
    )
    if trust:
        items += tuple(CaseTarget("<=", 1.0, TRUST_ON, TRUST_BUDGET, trust_label(n)) for n in sizes)
    if own:
        items += tuple(CaseTarget("<=", 1.0, OWN_SUBJECT, OWN_BUDGET, own_label(n)) for n in sizes if n >= SMALL_BATCH)
    return AllTargets(
        "<=",
        SMALL_BATCH_RATIO,
        "kvcompose",
        "MultiConnector",
        items=items,
        summary=f"kvcompose/MultiConnector <= {SMALL_BATCH_RATIO:g} at 1-{SMALL_BATCH} requests, "
        f"<= {LARGE_BATCH_RATIO:g} from 128"
        + (
            f"; trust-on's add_request per P/D request <= trust-off's + {TRUST_BUDGET_US:g} us "
            f"({TRUST_NS_PER_TOKEN} ns x {PROMPT_TOKENS} tokens + {TRUST_US_PER_REQUEST} us)"
            if trust
            else ""
        )
        + (
            f"; composite own ({VLLM_CHILDREN} - MultiConnector, median of paired steps) "
            f"<= {COMPOSITE_OWN_TARGET_US:g} us/request from {SMALL_BATCH} requests"
            if own
            else ""
        ),
    )


def trust_label(n: int) -> str:
    return f"trust, {n} reqs"


def trust_case(n: int, quick: bool, reps: int) -> tuple[Case, list[Ratio]]:
    """The trust sides at ``n`` live requests, interleaved per step: their steps (``add_request``
    included), and ``add_request`` per P/D arrival in each repeat. The keyed side must have
    verified every arrival: a refused set would be cheaper, and wrong."""
    drivers = {s: Driver(s, n) for s in TRUST_SIDES}
    for d in drivers.values():
        for _ in range(warmup_steps(quick)):
            d.step()
        d.take_pd_adds()
    k = steps_per_repeat(n, quick)
    per_request = {s: Samples() for s in drivers}

    def unit(side: str, d: Driver) -> Callable[[], float]:
        calls = 0

        def one() -> float:
            nonlocal calls
            took = d.step()
            calls += 1
            if calls % k == 0:  # a repeat's last step
                per_request[side].values.append(d.take_pd_adds())
            return took

        return one

    samples = interleave_units({s: unit(s, d) for s, d in drivers.items()}, reps, k)
    counts = {s: dict(sorted(d.counts.items())) for s, d in drivers.items()}
    refused = {s: {r: v for r, v in c.items() if r.startswith("refused:")} for s, c in counts.items()}
    if any(refused.values()):
        raise RuntimeError(f"the trust case's decode refused P/D params: {refused}")
    label = trust_label(n)
    on, off = per_request[TRUST_ON], per_request[TRUST_OFF]
    budget = TRUST_BUDGET_US * 1e-6
    ratios = [
        ratio(label, samples, TRUST_ON, TRUST_OFF),
        Ratio(label, TRUST_ON, TRUST_BUDGET, on.min / (off.min + budget), on.median / (off.median + budget), False),
    ]
    remote_per_step = drivers[TRUST_ON].counts["arrived:remote"] / drivers[TRUST_ON].steps
    derived = {
        TRUST_COST: paired(per_request, TRUST_ON, TRUST_OFF, lambda s, b: (s - b) * 1e6),
        TRUST_STEP_COST: paired(samples, TRUST_ON, TRUST_OFF, lambda s, b: (s - b) / remote_per_step * 1e6),
    }
    extra = {
        "running": n,
        "steps_per_repeat": k,
        "work": counts,
        "add_request_per_pd_request_us": {s: [v * 1e6 for v in x.values] for s, x in per_request.items()},
        "pd_requests_per_step": remote_per_step,
    }
    return Case(label, samples, extra, derived), ratios


def own_label(n: int) -> str:
    return f"own cost, {n} reqs"


def own_case(n: int, quick: bool, rounds: int) -> tuple[Case, list[Ratio], str]:
    """The own-cost case at ``n`` live requests: :data:`OWN_SIDES` alternated one step at a time
    for ``rounds`` rounds; the paired per-step estimator of the composite's own cost
    (:data:`COMPOSITE_OWN`) and of the plugins' overrides (:data:`PLUGINS_OWN`), each the median
    over rounds. Returns the case, its target's ratio (the composite's median over
    :data:`COMPOSITE_OWN_TARGET_US`) and a line for the notes."""
    drivers = {s: Driver(s, n) for s in OWN_SIDES}
    for d in drivers.values():
        for _ in range(warmup_steps(quick)):
            d.step()
    steps = alternated_steps({s: d.step for s, d in drivers.items()}, rounds)
    rounds = len(steps["MultiConnector"])  # rounded up to whole cycles of the rounds' orders
    label = own_label(n)
    counts = {s: dict(sorted(d.counts.items())) for s, d in drivers.items()}
    same_work = all(c == counts["MultiConnector"] for c in counts.values())
    derived = {
        COMPOSITE_OWN: per_step_cost(steps, VLLM_CHILDREN, "MultiConnector", n),
        PLUGINS_OWN: per_step_cost(steps, "kvcompose", VLLM_CHILDREN, n),
    }
    spread = {
        name: {"median": d.median, "iqr": list(quartiles(d.values)), "median_ci95": list(median_interval(d.values))}
        for name, d in derived.items()
    }
    own = derived[COMPOSITE_OWN].median / COMPOSITE_OWN_TARGET_US
    ratios = [Ratio(label, OWN_SUBJECT, OWN_BUDGET, own, own, False)]

    def said(name: str) -> str:
        x = spread[name]
        return (
            f"{x['median']:+.2f} us/request (median CI95 [{x['median_ci95'][0]:+.2f}, {x['median_ci95'][1]:+.2f}], "
            f"IQR [{x['iqr'][0]:+.2f}, {x['iqr'][1]:+.2f}])"
        )

    verdict = ("met" if own <= 1.0 else "MISSED") if n >= SMALL_BATCH else f"no target under {SMALL_BATCH} requests"
    line = (
        f"{label}, {rounds} paired steps: composite own ({VLLM_CHILDREN} - MultiConnector) {said(COMPOSITE_OWN)}, "
        f"target <= {COMPOSITE_OWN_TARGET_US:g}: {verdict}; plugins' overrides (kvcompose - {VLLM_CHILDREN}) "
        f"{said(PLUGINS_OWN)}" + ("" if same_work else "; WORK DIFFERS between the sides (see 'work')")
    )
    extra = {"running": n, "rounds": rounds, "work": counts, "same_work": same_work, "estimator": spread}
    return Case(label, {s: Samples(v) for s, v in steps.items()}, extra, derived), ratios, line


def run(
    quick: bool = False,
    sizes: tuple[int, ...] | None = None,
    repeats: int | None = None,
    sides: tuple[str, ...] = ("nixl", "MultiConnector", "kvcompose"),
    trust: bool = True,
    own: bool = True,
    rounds: int | None = None,
) -> Result:
    """Time a step at each size for every side, interleaved; ratio kvcompose / MultiConnector.
    With ``own``, then the own-cost case at the same size (:func:`own_case`, ``rounds`` paired
    steps: :data:`OWN_ROUNDS`, :data:`QUICK_OWN_ROUNDS` with ``quick``); with ``trust``, then
    the trust case (:func:`trust_case`)."""
    sizes = tuple(sizes or pick(SIZES, quick, QUICK_SIZES))
    reps = repeats or repeats_for(quick, full=9)
    rounds = rounds or (QUICK_OWN_ROUNDS if quick else OWN_ROUNDS)
    own_lines: list[str] = []
    cases: list[Case] = []
    ratios = []
    for n in sizes:
        drivers = {s: Driver(s, n) for s in sides}
        for d in drivers.values():
            for _ in range(warmup_steps(quick)):
                d.step()
        k = steps_per_repeat(n, quick)
        samples = interleave_units({s: d.step for s, d in drivers.items()}, reps, k)
        label = f"{n} reqs"
        counts = {s: dict(sorted(d.counts.items())) for s, d in drivers.items()}
        derived: dict[str, Samples] = {}
        if "kvcompose" in samples and "MultiConnector" in samples:
            ratios.append(ratio(label, samples, "kvcompose", "MultiConnector"))
            derived[OWN_COST] = paired(samples, "kvcompose", "MultiConnector", lambda s, b: (s - b) / n * 1e6)
        if "kvcompose" in samples and "nixl" in samples:
            ratios.append(ratio(label, samples, "kvcompose", "nixl"))
        cases.append(Case(label, samples, {"running": n, "steps_per_repeat": k, "work": counts}, derived))
        if own:
            case, own_ratios, line = own_case(n, quick, rounds)
            cases.append(case)
            ratios += own_ratios
            own_lines.append(line)
        if trust:
            case, trust_ratios = trust_case(n, quick, reps)
            cases.append(case)
            ratios += trust_ratios
    notes = [
        "a step = schedule() + update_from_output() of vLLM's real Scheduler; mix: 1/3 remote prefills "
        "(NIXL loads), 1/3 fresh prompts (the CPU tier stores), 1/3 repeated old prompts (the CPU tier loads)",
        "MultiConnector runs vLLM's NixlConnector and SimpleCPUOffloadConnector; kvcompose runs the plugins' "
        "subclasses of the same classes (scheduler code unchanged, plus the NIXL plugin's empty-remote-blocks check)",
        "MultiConnector asks every child for matched tokens; kvcompose's first-wins stops at the winner "
        "(the CPU tier is not probed for a remote prefill), so its ratio can be below 1",
        "'work' in the JSON counts loads per tier and scheduled tokens: equal for the two composites",
        f"{OWN_COST}: kvcompose's step less MultiConnector's of the same repeat, per live request "
        f"(issue 44's target: <= {OWN_COST_TARGET_US:g} us at 16-1024 requests on the median)",
    ]
    if own:
        notes += [
            f"own cost cases (issue 54): MultiConnector, {VLLM_CHILDREN} (the same composition as kvcompose, "
            "its children vLLM's own NixlConnector and SimpleCPUOffloadConnector as type: vllm, no plugin code) "
            f"and kvcompose, alternated one step at a time for {rounds} rounds (rounded up to "
            "whole cycles of orders in which each side follows each, itself included, equally often: with the "
            "order flipped every other round the middle side would never follow itself, and pay for the others' "
            "cache misses); "
            "per round one side's step less another's over the live requests, the figure their median "
            "(the columns' [min, max] are single rounds'; the CI95 and IQR below are the estimator's spread); "
            f"the ratio {OWN_SUBJECT}/{OWN_BUDGET} is that median over the target (best = median)",
            *own_lines,
        ]
    if trust:
        notes += [
            "trust cases: the kvcompose side with a deployment key (trust-on: each remote arrival carries the params "
            "a keyed prefill scheduler signed for its prompt, the decode verifies them) and without one (trust-off); "
            "their steps include the add_request calls before them, where the decode checks the params",
            f"{TRUST_COST}: per repeat, the median add_request of the P/D arrivals, trust-on less trust-off; "
            f"{TRUST_STEP_COST}: the steps' difference over the P/D arrivals per step (noisier); "
            f"target (issue 51): trust-on <= {TRUST_BUDGET} per P/D request, i.e. the check's cost at most "
            f"{TRUST_NS_PER_TOKEN} ns x {PROMPT_TOKENS} prompt tokens + {TRUST_US_PER_REQUEST} us",
        ]
    return Result(
        "scheduler_step",
        "Scheduler step (schedule + update_from_output), decode instance",
        "us/step",
        1e6,
        cases,
        ratios,
        step_target(sizes, trust, own),
        reps,
        quick,
        notes,
        {
            "sizes": list(sizes),
            "prompt_tokens": PROMPT_TOKENS,
            "block_size": BLOCK,
            "mix": list(MIX),
            **({"own_rounds": rounds} if own else {}),
        },
    )
