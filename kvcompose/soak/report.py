"""A soak run's report: what was sent and what came back, what the engines hold once it is quiet,
which processes died, and a sample of answers against a single-engine baseline; every check that
failed is a line of :attr:`SoakReport.problems` (``kvcompose soak`` exits 1 when there is one)."""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from kvcompose.soak.drive import FINAL, OUTCOMES, Outcome
from kvcompose.soak.plan import HANG_UP_PATHS, Request
from kvcompose.soak.stack import GAUGES, ROLES, Sample

#: Answers that differ from the baseline by at most this much in a token's logprob are "close"
#: (batch shapes differ between a loaded server and the baseline, and with them float rounding).
LOGPROB_TOLERANCE = 1e-3


def quantile(values: list[float], q: float) -> float:
    if len(values) < 2:
        return values[0] if values else 0.0
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


@dataclass
class Comparison:
    """The sample of answered requests against the baseline."""

    compared: int = 0
    bit_equal: int = 0
    tokens_equal: int = 0
    max_logprob_gap: float = 0.0
    differing: list[int] = field(default_factory=list)  # request indices whose tokens differ


@dataclass
class SoakReport:
    options: dict[str, Any]
    faults: list[str]
    events: list[str]
    wall_s: float
    requests: dict[str, int]  # by final outcome: answered, hung-up, gave-up
    hang_ups: dict[str, int]  # by path: router, direct
    attempts: dict[str, int]  # every attempt by outcome (retries included)
    first_errors: list[str]
    failed_during_outages: int
    latency_p50_s: float
    latency_p99_s: float
    quiet: dict[str, dict[str, float]]  # role -> GAUGES once quiet
    settle_s: float
    counters: dict[str, dict[str, float]]  # server process -> COUNTERS at its last reading
    prefill_held_after_decode_kill: float  # max prefill KV usage in the seconds after the kill
    lease_releases: int  # requests whose blocks the prefill released on NIXL lease expiry (its log)
    breaker_changes: list[str]
    processes: list[str]
    comparison: Comparison
    problems: list[str]
    logs: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def render(self) -> str:
        r, a = self.requests, self.attempts
        c = self.comparison
        aborted = {
            role: sum(v["aborted_mid_load"] for p, v in self.counters.items() if p.startswith(role)) for role in ROLES
        }
        lines = [
            f"soak: {sum(r.values())} P/D requests, {self.options['concurrency']} at a time, "
            f"seed {self.options['seed']}, {self.wall_s:.0f} s",
            "",
            "faults injected:",
            *(f"  - {f}" for f in self.faults),
            "timeline:",
            *(f"  {e}" for e in self.events),
            "",
            "requests:",
            f"  answered           {r['answered']:6d}   latency p50 {self.latency_p50_s * 1e3:.0f} ms, "
            f"p99 {self.latency_p99_s * 1e3:.0f} ms",
            f"  hung up by client  {r['hung-up']:6d}   ({self.hang_ups['router']} through the router at a random "
            f"moment, {self.hang_ups['direct']} on decode mid NIXL pull); aborted while their KV was loading "
            f"(vllm:kvcompose_aborted_loads): decode {aborted['decode']:g}, prefill {aborted['prefill']:g}",
            f"  gave up            {r['gave-up']:6d}   (failed on every retry)",
            f"attempts ({sum(a.values())}; a client sends a failed request again after a pause):",
            f"  failed cleanly     {a['http-error']:6d}   (an HTTP error; {self.failed_during_outages} while a "
            "server was down or being taken back)",
            f"  dropped            {a['dropped']:6d}   (no HTTP answer: a direct request to a dead server)",
            f"  hung               {a['hung']:6d}   (no answer in time)",
        ]
        lines += [f"    e.g. {e}" for e in self.first_errors]
        lines += [
            "",
            f"after the load, quiet within {self.settle_s:.0f} s (every gauge must be 0; read after a "
            "sub-block probe request, since vLLM publishes them only in steps that run):",
        ]
        for role, gauges in self.quiet.items():
            lines.append("  " + role.ljust(8) + "  ".join(f"{k} {v:g}" for k, v in gauges.items()))
        held = self.prefill_held_after_decode_kill
        lines.append(
            f"  prefill KV usage in the 30 s after the decode was killed: up to {held:.1%} (its running "
            "requests, and the blocks it held for the dead decode until their NIXL lease expired)"
        )
        lines.append(
            f"  prefill released the blocks of {self.lease_releases} request(s) on NIXL lease expiry "
            '(vLLM\'s log: "Releasing expired KV blocks ... retrieved by 0 remote worker(s)")'
        )
        lines += ["", "per server process (counters since it started):"]
        for proc, values in self.counters.items():
            lines.append("  " + proc.ljust(10) + "  ".join(f"{k} {v:g}" for k, v in values.items()))
        lines += ["", "processes:", *(f"  {p}" for p in self.processes)]
        changes = Counter(self.breaker_changes)
        lines.append(
            "breaker on the flaky child: "
            + (", ".join(f"{k} {n}x" for k, n in changes.items()) if changes else "never opened")
        )
        lines += [
            "",
            f"outputs vs the single-engine baseline: {c.compared} answered requests compared, token ids equal "
            f"{c.tokens_equal}/{c.compared}, bit for bit {c.bit_equal}/{c.compared}, largest logprob gap "
            f"{c.max_logprob_gap:.1e}",
            f"logs: {self.logs}",
            "",
            "result: " + ("PASS" if not self.problems else "FAIL"),
            *(f"  - {p}" for p in self.problems),
        ]
        return "\n".join(lines)


def count(outcomes: list[Outcome]) -> dict[str, int]:
    """Attempts by outcome."""
    got = Counter(o.kind for o in outcomes)
    return {k: got.get(k, 0) for k in OUTCOMES}


def finals(outcomes: list[Outcome]) -> dict[int, Outcome]:
    """Each request's last attempt."""
    out: dict[int, Outcome] = {}
    for o in sorted(outcomes, key=lambda o: (o.index, o.attempt)):
        out[o.index] = o
    return out


def by_request(outcomes: list[Outcome]) -> dict[str, int]:
    """Requests by final outcome: answered, hung-up, or gave-up (no attempt got through)."""
    got = Counter(o.kind if o.kind in FINAL else "gave-up" for o in finals(outcomes).values())
    return {k: got.get(k, 0) for k in ("answered", "hung-up", "gave-up")}


def hang_ups(requests: list[Request]) -> dict[str, int]:
    """The plan's hang-ups by path (``router``, ``direct``), zeros included."""
    return {path: sum(1 for r in requests if r.hang_up and r.hang_up.path == path) for path in HANG_UP_PATHS}


def during(outcomes: list[Outcome], outages: list[tuple[str, float, float]], slack_s: float = 15.0) -> int:
    """Failed requests sent while a server was down, restarting, or being taken back by the router
    (``slack_s`` after it was healthy)."""
    return sum(
        1
        for o in outcomes
        if o.kind == "http-error"
        and any(start - o.latency_s <= o.sent_at <= end + slack_s for _, start, end in outages)
    )


def quiet_problems(quiet: dict[str, dict[str, float]]) -> list[str]:
    out = [f"{role}: no reading once quiet (server not answering)" for role in ROLES if role not in quiet]
    for role, gauges in quiet.items():
        left = {k: v for k, v in gauges.items() if k in GAUGES and v}
        if left:
            out.append(f"{role}: not back to 0 once quiet: {left}")
    return out


def last_counters(samples: list[Sample], keys: tuple[str, ...]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for s in samples:
        out[s.process] = {k: s.values[k] for k in keys}
    return out
