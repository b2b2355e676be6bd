"""Benchmark 5c's figures: each request as the decode engine's counters saw it, the totals per
composition, the targets and the result."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvcompose_tools.bench.measure import Ratio, Samples, ratio
from kvcompose_tools.bench.pd_ranges.compositions import COMPOSITIONS, SUBJECT
from kvcompose_tools.bench.report import AllTargets, Case, CaseTarget, Result
from kvcompose_tools.e2e.spec import BLOCK_SIZE
from kvcompose_tools.e2e.stats import quantile

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
            "ttft_s": {**self.ttft.to_json(), "p90": quantile(self.ttft.values, 0.9)},
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
                    f"{quantile(t.ttft.values, 0.9) * 1e3:.1f}",
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
                    f"{quantile(subject.ttft.values, 0.9) / quantile(t.ttft.values, 0.9):.3f}",
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
