"""Benchmark 5c: range loads on a P/D decode instance, multi-turn conversations, real engines.

A decode instance composed of ``host`` (the cpu-offload host-memory prefix tier) and ``pd``
(NIXL from the prefill instance) serves a conversation's next turn in one of three ways
(:data:`COMPOSITIONS`):

* ``pd-first``: ``[pd, host]``, ``load: first-wins``: NIXL pulls the whole prompt every turn;
* ``host-first``: ``[host, pd]``, ``load: first-wins``: host loads the prefix it holds and the
  decode instance computes the rest of the prompt itself (NIXL only when host has nothing);
* ``ranges``: ``[host, pd]``, ``load: ranges``: host loads its prefix, NIXL pulls the rest.

The workload (:func:`make_workload`): :data:`CONVERSATIONS` conversations of :data:`TURNS` turns.
A turn's prompt is the previous turn's prompt, the previous answer (the decode's output token
ids, :data:`ANSWER_TOKENS` of them) and a new user message of a seeded length in
:data:`MESSAGE_TOKENS`. Turns go round-robin over the conversations (turn 1 of every
conversation, then turn 2, ...). Each request goes the proxy way: prefill on the prefill engine
(``do_remote_decode``, one token), then decode with the prefill's ``kv_transfer_params``.

The decode engine's own (device) prefix cache is dropped before every decode request
(``reset_prefix_cache``; the connectors keep what they hold). Otherwise it would hold the
conversation and the host tier would never be asked; a small device cache (``num_gpu_blocks``)
would also push conversations out, but how much of a prefix survives there then depends on the
LRU order and on the mixed lengths, so each composition would get a different, partial share
of its prefix from the device cache, and under ``pd-first`` the device hits would cut the NIXL
pull as well. With the cache dropped, every prompt's prefix can only come from the connectors:
the three compositions differ in exactly the split being measured. The host tier's
``cpu_bytes`` (:data:`CPU_BYTES`) holds every conversation (checked before the run).

One prefill engine (``examples/pd-prefill.yaml``) and one decode engine per composition are up
at once (four engines, 1 GiB of KV each), and the workload goes in lockstep
(:func:`serve_lockstep`): each request is sent to every decode engine back to back, the first
one rotating, so the compositions share the machine's moments. The first composition served
makes the prompts (its answers go into the next turns' prompts); every other composition and
pass sends the very same prompts, and every answer must equal the first one (seeded model,
greedy decoding): a difference is reported as a failure. The engines stay up between passes, so
a second pass meets host tiers that already hold every conversation (the same conversations
asked again): its figures are printed per pass, and the totals hold both.

Figures per composition, from the decode engine's counters around each request
(:func:`kvcompose.e2e.flow.decode_request`): NIXL bytes, tokens each child loaded, prompt tokens
the decode engine computed, and the decode engine's TTFT (arrival to first token: the loads,
any local prefill, the first step; the prefill instance's time is the same for all three and
is left out).

Those TTFTs still come from different engine processes (a sequential design, one decode engine
restarted per composition, showed the machine's drift as 3.8 ms between two compositions doing
identical work). Every request also has a twin (:func:`twin_prompt`): a prompt of the same length
that no tier has seen, sent to the same decode engine right before or after it (the order flips
every request), which every composition pulls whole over NIXL. A composition's TTFT / its twins'
TTFT is an interleaved ratio inside one engine (``pd-first``'s is the control: its requests and
twins do the same work), and ``ranges``' against another's cancels what is left of the drift. Twins
enter no
other figure; their answers are checked like the requests'.

Targets, each on the ratio of ``ranges`` to another composition:

* NIXL bytes, ``ranges / pd-first <= 1 - host fraction``. The host fraction is counted in what
  NIXL moves, whole blocks: host-loaded blocks / the prompts' blocks (the partial last block
  included, which NIXL pulls whole). The same fraction in tokens (host-loaded tokens / prompt
  tokens) is slightly larger, since every prompt's partial last block costs NIXL a whole block
  under both compositions; ``1 - that`` would sit below what even an exact split can reach.
* host-loaded tokens, ``ranges / host-first >= 1``: host loads the whole prefix it holds, as it
  does when it alone loads (without this, loading nothing from host would meet the NIXL target);
* decode-computed prompt tokens: at most one block (:data:`BLOCK_SIZE` tokens) per request under
  ``ranges`` (shown as the largest per request, over one block);
* TTFT median: ``ranges`` at most the better (lower median) of the other two (raw medians;
  the twin-normalised ratios are shown beside them, and judged by no target).

The engines need ``/tmp/kvcompose-engines.lock`` (taken as in :mod:`kvcompose.bench.pd_ttft`).
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcompose.bench.measure import Ratio, Samples, ratio
from kvcompose.bench.pd_ttft import engine_lock
from kvcompose.bench.report import AllTargets, Case, CaseTarget, Result
from kvcompose.e2e.node import BLOCK_SIZE, MAX_MODEL_LEN
from kvcompose.examples import EXAMPLES

PREFILL_YAML = EXAMPLES / "pd-prefill.yaml"

CONVERSATIONS = 8
TURNS = 4
#: A new user message's length in tokens, drawn per turn (inclusive). Four turns of at most
#: 200 tokens plus three answers stay under the engines' ``max_model_len`` (1024).
MESSAGE_TOKENS = (64, 200)
ANSWER_TOKENS = 16
SEED = 20260
#: Seeds of the twin requests' prompts (see :func:`twin_prompt`).
TWIN_SEED = 7_000_000
#: Passes over the compositions: the first in :data:`COMPOSITIONS` order, the second reversed.
PASSES = 2
#: The decode instance's host tier (as in examples/pd-decode.yaml): far more than the workload's
#: KV (8 conversations of at most 28 blocks of 32 KiB: about 7 MiB).
CPU_BYTES = 256 * 2**20

#: Name -> (children in YAML order, load rule). ``ranges`` is the subject.
COMPOSITIONS: dict[str, tuple[tuple[str, ...], str]] = {
    "pd-first": (("pd", "host"), "first-wins"),
    "host-first": (("host", "pd"), "first-wins"),
    "ranges": (("host", "pd"), "ranges"),
}
SUBJECT = "ranges"

_CHILDREN = {
    "host": f"""\
  - name: host            # host-memory prefix tier
    type: cpu-offload
    options: {{cpu_bytes: {CPU_BYTES // 2**20}MiB}}
""",
    "pd": """\
  - name: pd              # P/D transfer over NIXL (port: overridden with a free one)
    type: nixl
    role: consumer
    options:
      backends: [UCX]
      side_channel_host: 127.0.0.1
      side_channel_port: 5601
      progress_delay_us: 100
      ucx_error_handling: none
""",
}


def decode_composition(name: str) -> str:
    """The decode instance's composition ``name`` (:data:`COMPOSITIONS`), modelled on
    ``examples/pd-decode.yaml``."""
    children, load = COMPOSITIONS[name]
    return (
        f"# {name}: decode instance, children {', '.join(children)}, load: {load}\n"
        "version: 1\nconnectors:\n"
        + "".join(_CHILDREN[c] for c in children)
        + f"rules: {{load: {load}, store: all, metadata: merge}}\n"
    )


# ---------------------------------------------------------------------------- the workload


@dataclass(frozen=True)
class Workload:
    """The conversations' new user messages (``messages[conversation][turn]``, token ids)."""

    messages: tuple[tuple[tuple[int, ...], ...], ...]
    answer_tokens: int = ANSWER_TOKENS

    @property
    def conversations(self) -> int:
        return len(self.messages)

    @property
    def turns(self) -> int:
        return len(self.messages[0])

    def order(self) -> list[tuple[int, int]]:
        """``(conversation, turn)`` in the order sent: turn 0 of every conversation, then turn 1, ..."""
        return [(c, t) for t in range(self.turns) for c in range(self.conversations)]

    def prompt(self, conversation: int, turn: int, answers: Mapping[tuple[int, int], Sequence[int]]) -> list[int]:
        """The prompt of ``turn``: every earlier message followed by its answer, then this turn's
        message. ``answers[(conversation, k)]`` must be there for every ``k < turn``."""
        out: list[int] = []
        for k in range(turn):
            out += self.messages[conversation][k]
            out += answers[(conversation, k)]
        return out + list(self.messages[conversation][turn])

    def longest_prompt(self) -> int:
        """The longest prompt any answers can make (every answer at its full length)."""
        return max(sum(map(len, m)) + (len(m) - 1) * self.answer_tokens for m in self.messages)

    def kv_blocks(self) -> int:
        """Blocks a tier needs to hold every conversation whole (last prompt and its answer)."""
        return sum(-(-(sum(map(len, m)) + len(m) * self.answer_tokens) // BLOCK_SIZE) for m in self.messages)


def make_workload(
    conversations: int = CONVERSATIONS,
    turns: int = TURNS,
    lengths: tuple[int, int] = MESSAGE_TOKENS,
    seed: int = SEED,
    answer_tokens: int = ANSWER_TOKENS,
    max_model_len: int = MAX_MODEL_LEN,
) -> Workload:
    """Seeded messages of mixed lengths (uniform in ``lengths``, inclusive); refuses a workload
    whose longest conversation would not fit ``max_model_len`` with its last answer."""
    from kvcompose.e2e.flow import token_prompt

    rng = random.Random(seed)
    messages = tuple(
        tuple(tuple(token_prompt(rng.randrange(2**31), rng.randint(*lengths))) for _ in range(turns))
        for _ in range(conversations)
    )
    w = Workload(messages, answer_tokens)
    if w.longest_prompt() + answer_tokens > max_model_len:
        raise ValueError(
            f"the longest conversation reaches {w.longest_prompt()} prompt tokens + {answer_tokens} answer "
            f"tokens, over max_model_len {max_model_len}: fewer turns or shorter messages"
        )
    return w


# ---------------------------------------------------------------------------- one request's figures


@dataclass
class Served:
    """One request of one run, as the decode engine's counters saw it."""

    composition: str
    run: int
    conversation: int
    turn: int
    prompt_tokens: int
    host_tokens: int
    pd_tokens: int
    nixl_bytes: int
    computed_tokens: int
    ttft_s: float
    token_ids: list[int]
    prefill_s: float = 0.0
    logprobs: list[float] = field(default_factory=list)
    #: a twin request (:func:`twin_prompt`): not part of the workload's figures
    twin: bool = False

    @property
    def key(self) -> tuple[int, int, bool]:
        return (self.conversation, self.turn, self.twin)

    @property
    def prompt_blocks(self) -> int:
        return -(-self.prompt_tokens // BLOCK_SIZE)


def p90(values: Sequence[float]) -> float:
    """The 90th percentile (linear between the closest ranks)."""
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=10, method="inclusive")[-1]


@dataclass
class Totals:
    """One composition's figures over all its requests."""

    requests: int
    prompt_tokens: int
    prompt_blocks: int
    host_tokens: int
    pd_tokens: int
    nixl_bytes: int
    computed_tokens: int
    computed_max: int
    ttft: Samples
    #: run -> the median TTFT of that run (the spread between runs shows the machine's drift)
    ttft_by_run: dict[int, float] = field(default_factory=dict)
    #: the TTFTs of the twins (:func:`twin_prompt`), sent interleaved with the requests
    twin_ttft: Samples | None = None

    @classmethod
    def of(cls, served: Sequence[Served]) -> Totals:
        """The figures of the workload's requests in ``served``; its twins give ``twin_ttft``."""
        twins = [s.ttft_s for s in served if s.twin]
        served = [s for s in served if not s.twin]
        return cls(
            requests=len(served),
            prompt_tokens=sum(s.prompt_tokens for s in served),
            prompt_blocks=sum(s.prompt_blocks for s in served),
            host_tokens=sum(s.host_tokens for s in served),
            pd_tokens=sum(s.pd_tokens for s in served),
            nixl_bytes=sum(s.nixl_bytes for s in served),
            computed_tokens=sum(s.computed_tokens for s in served),
            computed_max=max(s.computed_tokens for s in served),
            ttft=Samples([s.ttft_s for s in served]),
            ttft_by_run={
                run: statistics.median(s.ttft_s for s in served if s.run == run)
                for run in sorted({s.run for s in served})
            },
            twin_ttft=Samples(twins) if twins else None,
        )

    @property
    def host_fraction_tokens(self) -> float:
        """Host-loaded tokens / prompt tokens."""
        return self.host_tokens / self.prompt_tokens

    @property
    def host_fraction_blocks(self) -> float:
        """Host-loaded blocks / the prompts' blocks (the partial last block counted whole)."""
        return self.host_tokens / BLOCK_SIZE / self.prompt_blocks

    def to_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "prompt_blocks": self.prompt_blocks,
            "host_loaded_tokens": self.host_tokens,
            "pd_loaded_tokens": self.pd_tokens,
            "nixl_bytes": self.nixl_bytes,
            "decode_computed_tokens": self.computed_tokens,
            "decode_computed_max_per_request": self.computed_max,
            "ttft_s": {**self.ttft.to_json(), "p90": p90(self.ttft.values)},
            "ttft_median_s_by_run": {str(k): v for k, v in self.ttft_by_run.items()},
            "twin_ttft_s": None if self.twin_ttft is None else self.twin_ttft.to_json(),
        }


# ---------------------------------------------------------------------------- targets and result


NIXL_CASE = "NIXL bytes"
HOST_CASE = "host-loaded tokens"
COMPUTED_CASE = "decode-computed tokens"
COMPUTED_MAX_CASE = "decode-computed tokens, most in one request"
TTFT_CASE = "TTFT"
#: Each composition's TTFT against its twins' (same engine, interleaved), and ranges' against the others'.
TWIN_CASE = "TTFT / whole-NIXL twin"
PAIRED_CASE = "TTFT / twin, against the other's"
ONE_BLOCK = f"1 block ({BLOCK_SIZE} tokens)"


@dataclass
class RangesResult(Result):
    """:class:`Result` with figures in several units: its own table, the totals in the JSON,
    and the answer check (a mismatch fails the result whatever the ratios)."""

    totals: dict[str, Totals] = field(default_factory=dict)
    mismatches: list[str] = field(default_factory=list)
    compared: int = 0

    @property
    def target_met(self) -> bool | None:
        met = super().target_met
        return False if self.mismatches else met

    def to_json(self) -> dict[str, Any]:
        out = super().to_json()
        if isinstance(self.target, AllTargets):
            assert out["target"] is not None
            out["target"]["met"] = self.target_met
            out["target"]["targets"] = [
                {
                    "case": t.case,
                    "op": t.op,
                    "value": t.value,
                    "subject": t.subject,
                    "baseline": t.baseline,
                    "why": t.why,
                    "met": t.verdict(self.ratios),
                }
                for t in self.target.items
            ]
        out["totals"] = {name: t.to_json() for name, t in self.totals.items()}
        out["answers"] = {"compared": self.compared, "identical": not self.mismatches, "mismatches": self.mismatches}
        return out

    def _ratio(self, case: str, baseline: str) -> Ratio | None:
        return next((r for r in self.ratios if r.case == case and r.baseline == baseline), None)

    def _pair(self, case: str, subject: str, baseline: str) -> str:
        r = next((r for r in self.ratios if (r.case, r.subject, r.baseline) == (case, subject, baseline)), None)
        return "-" if r is None else f"{r.by_min:.3f} / {r.by_median:.3f}"

    def _mark(self, r: Ratio) -> str:
        if not isinstance(self.target, AllTargets) or not self.target.applies(r):
            return ""
        return " ok" if self.target.met(r) else " MISS"

    def table(self) -> str:
        head = [
            "composition",
            "NIXL MiB",
            "host-loaded tok",
            "NIXL-loaded tok",
            "decode-computed tok",
            "max/request",
            "TTFT ms min",
            "median",
            "p90",
            "TTFT/twin best/med",
        ]
        rows: list[list[str]] = []
        for name, t in self.totals.items():
            rows.append(
                [
                    name,
                    f"{t.nixl_bytes / 2**20:.2f}",
                    str(t.host_tokens),
                    str(t.pd_tokens),
                    str(t.computed_tokens),
                    str(t.computed_max),
                    f"{t.ttft.min * 1e3:.1f}",
                    f"{t.ttft.median * 1e3:.1f}",
                    f"{p90(t.ttft.values) * 1e3:.1f}",
                    self._pair(TWIN_CASE, name, "twin"),
                ]
            )
        subject = self.totals.get(SUBJECT)
        for base, t in self.totals.items():
            if base == SUBJECT or subject is None:
                continue

            def cell(case: str, a: float, b: float, base: str = base) -> str:
                r = self._ratio(case, base)
                if r is not None:
                    return f"{r.by_median:.3f}{self._mark(r)}"
                return "-" if b == 0 else f"{a / b:.3f}"

            rows.append(
                [
                    f"{SUBJECT}/{base}",
                    cell(NIXL_CASE, subject.nixl_bytes, t.nixl_bytes),
                    cell(HOST_CASE, subject.host_tokens, t.host_tokens),
                    "-" if t.pd_tokens == 0 else f"{subject.pd_tokens / t.pd_tokens:.3f}",
                    cell(COMPUTED_CASE, subject.computed_tokens, t.computed_tokens),
                    "-" if t.computed_max == 0 else f"{subject.computed_max / t.computed_max:.3f}",
                    f"{subject.ttft.min / t.ttft.min:.3f}",
                    cell(TTFT_CASE, subject.ttft.median, t.ttft.median),
                    f"{p90(subject.ttft.values) / p90(t.ttft.values):.3f}",
                    self._pair(PAIRED_CASE, SUBJECT, base),
                ]
            )
        widths = [max(len(x) for x in col) for col in zip(head, *rows)]
        fmt = lambda cells: "  ".join(x.ljust(w) for x, w in zip(cells, widths)).rstrip()  # noqa: E731
        m = self.machine
        verdict = {True: "met", False: "NOT MET", None: "no figure"}[self.target_met]
        lines = [
            f"== {self.title}",
            f"   {m['cores']} cores ({m['usable_cores']} usable), {m['cpu']}, load {m['loadavg_1m']:.2f}; "
            f"{self.config.get('requests_per_run', '?')} requests per run"
            f"{' (+ as many twins)' if any(t.twin_ttft for t in self.totals.values()) else ''}, "
            f"{self.repeats} lockstep pass(es)"
            f"{' (quick)' if self.quick else ''}; targets {verdict}",
            fmt(head),
            fmt(["-" * w for w in widths]),
        ]
        lines += [fmt(r) for r in rows]
        if isinstance(self.target, AllTargets):
            for t in self.target.items:
                r = next((r for r in self.ratios if t.applies(r)), None)
                got = "no figure" if r is None else f"{r.by_median:.4g}{self._mark(r)}"
                lines.append(f"   target {t} ({t.why}): {got}")
        if any(len(t.ttft_by_run) > 1 for t in self.totals.values()):
            lines.append(
                "   TTFT median per pass, ms: "
                + "; ".join(
                    f"{name} " + " ".join(f"{v * 1e3:.1f}" for v in t.ttft_by_run.values())
                    for name, t in self.totals.items()
                )
            )
        if self.mismatches:
            lines.append(
                f"   answers: FAILED, {len(self.mismatches)} of {self.compared} differ from the first run's: "
                + "; ".join(self.mismatches[:5])
                + (" ..." if len(self.mismatches) > 5 else "")
            )
        else:
            lines.append(
                f"   answers: identical across compositions and runs ({self.compared} requests, twins included)"
            )
        lines += [f"   note: {n}" for n in self.notes]
        return "\n".join(lines)


def compare_answers(served: Sequence[Served], reference: Mapping[tuple[int, int, bool], Sequence[int]]) -> list[str]:
    """Every request (twins too) whose answer differs from the reference run's."""
    return [
        f"{s.composition} run {s.run} conversation {s.conversation} turn {s.turn + 1}{' (twin)' if s.twin else ''}"
        for s in served
        if list(s.token_ids) != list(reference[s.key])
    ]


def build_result(
    served: Sequence[Served],
    reference: Mapping[tuple[int, int, bool], Sequence[int]],
    runs: int,
    quick: bool = False,
    config: dict[str, Any] | None = None,
    notes: Sequence[str] = (),
) -> RangesResult:
    """Totals, ratios of ``ranges`` to the two others, the targets and the answer check, from
    the requests served (every composition's runs) and the reference answers."""
    names = [n for n in COMPOSITIONS if any(s.composition == n for s in served)]
    totals = {n: Totals.of([s for s in served if s.composition == n]) for n in names}
    sub = totals[SUBJECT]
    others = [n for n in names if n != SUBJECT]
    ttft = {n: t.ttft for n, t in totals.items()}
    ratios: list[Ratio] = []
    for base in others:
        b = totals[base]
        if b.nixl_bytes:
            q = sub.nixl_bytes / b.nixl_bytes
            ratios.append(Ratio(NIXL_CASE, SUBJECT, base, q, q, False))
        if b.computed_tokens:
            q = sub.computed_tokens / b.computed_tokens
            ratios.append(Ratio(COMPUTED_CASE, SUBJECT, base, q, q, False))
        if b.host_tokens:
            q = sub.host_tokens / b.host_tokens
            ratios.append(Ratio(HOST_CASE, SUBJECT, base, q, q, True))
        ratios.append(ratio(TTFT_CASE, ttft, SUBJECT, base))
    paired = {}
    for name, t in totals.items():
        if t.twin_ttft is not None:
            paired[name] = ratio(TWIN_CASE, {name: t.ttft, "twin": t.twin_ttft}, name, "twin")
            ratios.append(paired[name])
    for base in others:
        if SUBJECT in paired and base in paired:
            a, b = paired[SUBJECT], paired[base]
            ratios.append(Ratio(PAIRED_CASE, SUBJECT, base, a.by_min / b.by_min, a.by_median / b.by_median, False))
    worst = sub.computed_max / BLOCK_SIZE
    ratios.append(Ratio(COMPUTED_MAX_CASE, SUBJECT, ONE_BLOCK, worst, worst, False))
    targets: list[CaseTarget] = []
    if "pd-first" in totals:
        frac = sub.host_fraction_blocks
        targets.append(
            CaseTarget(
                "<=",
                (sub.prompt_blocks - sub.host_tokens / BLOCK_SIZE) / sub.prompt_blocks,
                SUBJECT,
                "pd-first",
                NIXL_CASE,
                f"1 - host fraction {frac:.3f}, host-loaded blocks / prompt blocks; "
                f"in tokens {sub.host_fraction_tokens:.3f}",
            )
        )
    if "host-first" in totals:
        targets.append(
            CaseTarget(
                ">=",
                1.0,
                SUBJECT,
                "host-first",
                HOST_CASE,
                "host loads as much as when it alone loads",
            )
        )
    targets.append(CaseTarget("<=", 1.0, SUBJECT, ONE_BLOCK, COMPUTED_MAX_CASE, "one block per request"))
    if others:
        better = min(others, key=lambda n: totals[n].ttft.median)
        targets.append(CaseTarget("<=", 1.0, SUBJECT, better, TTFT_CASE, f"{better}: the lower median of the others"))
    cases = [
        Case(
            name,
            {name: t.ttft, **({} if t.twin_ttft is None else {"twin": t.twin_ttft})},
            {"totals": t.to_json(), "per_request": [_request_json(s) for s in served if s.composition == name]},
        )
        for name, t in totals.items()
    ]
    return RangesResult(
        "pd_ranges",
        "P/D range loads on the decode instance: host prefix + NIXL rest vs one child per request",
        "ms",
        1e3,
        cases,
        ratios,
        AllTargets("<=", 1.0, SUBJECT, "the others", tuple(targets)),
        runs,
        quick,
        list(notes),
        dict(config or {}),
        totals=totals,
        mismatches=compare_answers(served, reference),
        compared=len(served),
    )


def _request_json(s: Served) -> dict[str, Any]:
    return {
        "run": s.run,
        "conversation": s.conversation,
        "turn": s.turn + 1,
        "prompt_tokens": s.prompt_tokens,
        "host_tokens": s.host_tokens,
        "pd_tokens": s.pd_tokens,
        "nixl_bytes": s.nixl_bytes,
        "computed_tokens": s.computed_tokens,
        "ttft_ms": round(s.ttft_s * 1e3, 3),
        "prefill_ms": round(s.prefill_s * 1e3, 3),
        **({"twin": True} if s.twin else {}),
    }


# ---------------------------------------------------------------------------- the engines


def twin_prompt(conversation: int, turn: int, length: int) -> list[int]:
    """The twin of a workload request: a prompt of the same length that no tier has seen, so
    every composition pulls it whole over NIXL (the same for every composition and run)."""
    from kvcompose.e2e.flow import token_prompt

    return token_prompt(TWIN_SEED + 1000 * conversation + turn, length)


def serve_lockstep(
    decodes: Mapping[str, Any],
    run: int,
    prefill: Any,
    workload: Workload,
    answers: dict[tuple[int, int], list[int]],
    twins: bool = True,
) -> list[Served]:
    """Send the workload once to every decode engine (composition name -> engine node), request
    by request: each request goes to all of them back to back, the first one rotating, so every
    composition meets the machine's same moments (its drift cancels out of their ratios).

    ``answers`` holds the reference answers the prompts are made of; an empty dict is filled
    with the first composition's own as it goes (the first run makes the prompts). With
    ``twins`` each request is paired with its twin (:func:`twin_prompt`), the two sent one after
    the other in an order that flips every request.
    """
    names = list(decodes)
    out: list[Served] = []
    for i, (c, t) in enumerate(workload.order()):
        prompt = workload.prompt(c, t, answers)
        pair = [(prompt, False)] + ([(twin_prompt(c, t, len(prompt)), True)] if twins else [])
        for name in names[i % len(names) :] + names[: i % len(names)]:
            for ids, twin in pair if i % 2 == 0 else pair[::-1]:
                out.append(serve_one(name, run, c, t, twin, ids, prefill, decodes[name], workload.answer_tokens))
            if not answers.get((c, t)):
                answers[(c, t)] = next(s.token_ids for s in out[::-1] if not s.twin)
    return out


def serve_one(
    composition: str,
    run: int,
    conversation: int,
    turn: int,
    twin: bool,
    prompt: list[int],
    prefill: Any,
    decode: Any,
    max_tokens: int,
) -> Served:
    """Prefill (``do_remote_decode``), drop the decode's device cache, decode with the params."""
    from kvcompose.e2e.flow import COMPUTED, decode_request, drop_prefix_cache, tokens_key

    t0 = time.perf_counter()
    (p,) = prefill.generate([prompt], 1, [{"do_remote_decode": True}])
    prefill_s = time.perf_counter() - t0
    drop_prefix_cache(decode)
    d = decode_request(decode, prompt, max_tokens, p["kv_transfer_params"])
    return Served(
        composition,
        run,
        conversation,
        turn,
        len(prompt),
        int(d.counters.get(tokens_key("host"), 0)),
        int(d.counters.get(tokens_key("pd"), 0)),
        d.nixl_bytes,
        int(d.counters.get(COMPUTED, 0)),
        d.ttft_s,
        list(d.token_ids),
        prefill_s,
        list(d.logprobs),
        twin,
    )


#: The first P/D request after a decode engine starts waits for NIXL's handshake, UCX's first
#: connection and the engine's first-forward work: 7-30 s on a quiet 2-core machine, over two
#: minutes beside another engine's start (the cold start of the open cold-start issue). The
#: warm-up absorbs it, so its requests get far longer than a measured request's deadline.
WARM_UP_TIMEOUT_S = 600.0


def warm_up(prefill: Any, decode: Any) -> float:
    """Two requests outside the workload: the NIXL handshake, and each composition's load path
    for a next turn (a prompt whose first blocks the host tier holds). Returns the first one's
    seconds (the cold start)."""
    from kvcompose.e2e.flow import drop_prefix_cache, pd_request, token_prompt

    first = token_prompt(999_001, 150)
    t0 = time.monotonic()
    pd_request(prefill, decode, first, 4, timeout_s=WARM_UP_TIMEOUT_S)
    cold = time.monotonic() - t0
    drop_prefix_cache(decode)
    pd_request(prefill, decode, first + token_prompt(999_002, 100), 4, timeout_s=WARM_UP_TIMEOUT_S)
    return cold


def _decode_spec(name: str, run: int, model: str, directory: Path, port: int) -> Any:
    from kvcompose.e2e.node import EngineSpec

    path = directory / f"decode-{name}.yaml"
    if not path.exists():
        path.write_text(decode_composition(name))
    return EngineSpec(f"decode-{name}-{run}", model, str(path), side_channel_port=port)


def measure(
    workload: Workload, passes: int, model: str, logs: Path, echo: Callable[[str], None]
) -> tuple[list[Served], dict[tuple[int, int, bool], list[int]], dict[str, list[float]]]:
    """One prefill engine and one decode engine per composition, all up at once (four engines,
    each with :data:`~kvcompose.e2e.node.ENGINE_ENV`'s 1 GiB of KV); ``passes`` lockstep passes
    over the workload (:func:`serve_lockstep`).

    Returns every request served, the reference answers (the first served of each request) and
    the engines' start time. The caller holds the engine lock.
    """
    from kvcompose.e2e.node import EngineNode, EngineSpec, free_ports, wait_all_ready

    served: list[Served] = []
    answers: dict[tuple[int, int], list[int]] = {}  # what the prompts are made of
    reference: dict[tuple[int, int, bool], list[int]] = {}
    ports = free_ports(1 + len(COMPOSITIONS))
    nodes = [EngineNode(EngineSpec("prefill", model, str(PREFILL_YAML), side_channel_port=ports[0]), logs)]
    try:
        for name, port in zip(COMPOSITIONS, ports[1:]):
            nodes.append(EngineNode(_decode_spec(name, 1, model, logs, port), logs))
        prefill, decodes = nodes[0], dict(zip(COMPOSITIONS, nodes[1:]))
        t0 = time.monotonic()
        wait_all_ready(nodes)
        starts = {name: [round(time.monotonic() - t0, 1)] for name in decodes}
        for name, decode in decodes.items():
            echo(f"   {name}: first request after start {warm_up(prefill, decode):.0f} s (warm-up, not measured)")
        for run in range(1, passes + 1):
            got = serve_lockstep(decodes, run, prefill, workload, answers)
            for s in got:
                reference.setdefault(s.key, s.token_ids)
            served += got
            for name in decodes:
                t = Totals.of([s for s in got if s.composition == name])
                twin_ms = t.twin_ttft.median * 1e3 if t.twin_ttft else float("nan")
                echo(
                    f"   {name} pass {run}: NIXL {t.nixl_bytes / 2**20:.2f} MiB, host-loaded {t.host_tokens} tok, "
                    f"NIXL-loaded {t.pd_tokens} tok, decode-computed {t.computed_tokens} tok "
                    f"(max {t.computed_max}), TTFT median {t.ttft.median * 1e3:.1f} ms (twins {twin_ms:.1f}); "
                    f"{len(compare_answers([x for x in got if x.composition == name], reference))} answers differ"
                )
    finally:
        for node in nodes:
            node.close()
    return served, reference, starts


def run(
    quick: bool = False,
    passes: int | None = None,
    echo: Callable[[str], None] = print,
    work: Path | None = None,
    workload: Workload | None = None,
) -> Result:
    """The three decode compositions over one multi-turn workload; ratios of ``ranges`` to each."""
    from kvcompose.e2e.model import kv_bytes_per_token, make_model

    n = passes or (1 if quick else PASSES)
    w = workload or make_workload()
    logs = Path(work or tempfile.mkdtemp(prefix="kvcompose-bench-ranges-"))
    model = make_model(0)
    block_bytes = BLOCK_SIZE * kv_bytes_per_token(model)
    if w.kv_blocks() * block_bytes > CPU_BYTES:
        raise ValueError(f"the workload needs {w.kv_blocks()} blocks in the host tier, over cpu_bytes {CPU_BYTES}")
    with engine_lock(echo=echo):
        served, reference, starts = measure(w, n, str(model), logs, echo)
    lengths = [len(m) for conv in w.messages for m in conv]
    return build_result(
        served,
        reference,
        n,
        quick,
        {
            "conversations": w.conversations,
            "turns": w.turns,
            "message_tokens": list(MESSAGE_TOKENS),
            "message_tokens_drawn": lengths,
            "answer_tokens": w.answer_tokens,
            "seed": SEED,
            "requests_per_run": w.conversations * w.turns,
            "lockstep": True,
            "block_bytes": block_bytes,
            "cpu_bytes": CPU_BYTES,
            "decode_engine_start_s": starts,
            "engine_logs": str(logs),
        },
        [
            f"workload: {w.conversations} conversations x {w.turns} turns, round-robin; a turn's prompt = the "
            f"previous prompt + its answer ({w.answer_tokens} tokens, greedy) + a new message of "
            f"{MESSAGE_TOKENS[0]}-{MESSAGE_TOKENS[1]} tokens (seeded); prefill then decode with its params",
            "the decode engine's device prefix cache is dropped before every request (reset_prefix_cache): "
            "a prompt's prefix can only come from the host tier; one prefill engine (examples/pd-prefill.yaml) "
            "and one decode engine per composition, all up at once; each request goes to every decode back to "
            "back, the first one rotating (lockstep: the compositions share the machine's moments)",
            "pd-first: [pd, host] first-wins; host-first: [host, pd] first-wins; ranges: [host, pd] ranges. "
            "Totals over every run; TTFT: the decode engine's arrival to first token (loads, local prefill, "
            "first step), prefill instance's time left out",
            "ratio cells are ranges/other of the totals (TTFT: of the medians; best-sample ratios in the JSON)",
            "TTFT/twin: each request against its twin (a never-seen prompt of the same length, pulled whole over "
            "NIXL) sent next to it to the same engine, order flipping; best-sample / median ratio. In the "
            "ranges/other rows: ranges' TTFT/twin over the other's (the engines' drift cancelled)",
        ],
    )
