"""A soak run's report: what was sent and what came back, what the engines hold once it is quiet,
which processes died, and a sample of answers against a single-engine baseline; every check that
failed is a line of :attr:`SoakReport.problems` (``kvcompose soak`` exits 1 when there is one)."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from kvcompose_tools.e2e.load import LATE_READ_REQUEST
from kvcompose_tools.e2e.stats import quantile
from kvcompose_tools.e2e.stream import OUTCOMES
from kvcompose_tools.soak.drive import FINAL, Injector, Outcome
from kvcompose_tools.soak.plan import HANG_UP_PATHS, Request
from kvcompose_tools.soak.stack import GAUGES, ROLES, Sample

#: Answers that differ from the baseline by at most this much in a token's logprob are "close"
#: (batch shapes differ between a loaded server and the baseline, and with them float rounding).
LOGPROB_TOLERANCE = 1e-3
#: How long after a server is healthy again the router may take to send it requests (its health
#: checks every 2 s, its circuit breaker's 5 s retry, requests already backing off).
OUTAGE_SLACK_S = 15.0
#: The most time to first token an answered request may take outside the outages. For this
#: 2-core machine, CPU engines and the tiny model: medians are 0.2-0.6 s here, so 5 s is a
#: stall (a decode waiting on a NIXL handshake or lease), not load. Retune it on other hardware.
TTFT_BOUND_S = 5.0
#: After the decode's kill plus the prefill's NIXL lease: requests the router still prefilled for
#: the dead decode before its health checks (every 2 s) took it out, the prefill's own time for
#: them on a loaded host, and the reaper's next step.
LEASE_SLACK_S = 15.0
#: vLLM's log line header (``vllm/logger.py``): ``(EngineCore pid=3627) WARNING 11-26 05:12:02
#: [file.py:12] message``; the time is month-day hour:min:sec, local time, without a year.
LOG_HEADER = re.compile(r"\([^()]* pid=\d+\) [A-Z]+ (\d\d)-(\d\d) (\d\d):(\d\d):(\d\d) ")
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")  # vLLM colours its header when told to (VLLM_LOGGING_COLOR=1)


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
    cut_off_during_outages: int  # streams broken off mid-answer while a server was down (the rest: problems)
    latency_p50_s: float
    latency_p99_s: float
    ttft_p50_s: float  # time to first streamed token, answered attempts
    ttft_p99_s: float
    ttft_max_s: float
    ttft_slow: int  # answered outside the outages with TTFT above TTFT_BOUND_S (each a problem)
    ttft_in_outages: int  # answered while a server was down or being taken back: not held to the bound
    ttft_slow_in_outages: int  # of those, above the bound
    quiet: dict[str, dict[str, float]]  # role -> GAUGES once quiet
    settle_s: float
    counters: dict[str, dict[str, float]]  # server process -> COUNTERS at its last reading
    prefill_held_after_decode_kill: float  # max prefill KV usage in the seconds after the kill
    lease_releases: int  # requests whose blocks the prefill released on NIXL lease expiry (its log)
    lease_releases_unplanned: int  # of those, logged outside the lease after a planned cause (each a problem)
    late_reads: int  # decode reads notified after the prefill's lease expired (its log; each a problem)
    refused_reads: int  # decode reads its nixl child refused for ending after the lease (recomputed or failed)
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
        where = (
            f", prefill and decode on hosts of their own, link {self.options['link']}"
            if self.options.get("hosts")
            else ""
        )
        lines = [
            f"soak: {sum(r.values())} P/D requests, {self.options['concurrency']} at a time, "
            f"seed {self.options['seed']}{where}, {self.wall_s:.0f} s",
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
            f"time to first token (streamed): p50 {self.ttft_p50_s * 1e3:.0f} ms, p99 {self.ttft_p99_s * 1e3:.0f} ms, "
            f"max {self.ttft_max_s * 1e3:.0f} ms; above {TTFT_BOUND_S:g} s: {self.ttft_slow} outside the outages "
            f"(must be 0), {self.ttft_slow_in_outages} of {self.ttft_in_outages} answered while a server was down "
            "or being taken back (not held to it)",
            f"attempts ({sum(a.values())}; a client sends a failed request again after a pause):",
            f"  failed cleanly     {a['http-error']:6d}   (an HTTP error; {self.failed_during_outages} while a "
            "server was down or being taken back)",
            f"  dropped            {a['dropped']:6d}   (no HTTP answer: a direct request to a dead server)",
            f"  cut off            {a['cut-off']:6d}   (the stream ended before [DONE]; {self.cut_off_during_outages} "
            "while a server was down or being taken back, as when the decode dies mid-answer)",
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
            '(vLLM\'s log: "Releasing expired KV blocks ... retrieved by 0 remote worker(s)"); '
            f"{self.lease_releases_unplanned} outside the lease after the decode's kill, a pause or the link's cut "
            "(must be 0)"
        )
        lines.append(
            f"  decode reads after the prefill's lease expired, not refused: {self.late_reads} (must be 0; vLLM's "
            'log: "Potentially invalid KV blocks for unrecognized request ... They may have expired."); refused by '
            f'the decode\'s nixl child: {self.refused_reads} ("NIXL read refused", nothing computed from them)'
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


def in_outage(o: Outcome, outages: list[tuple[str, float, float]], slack_s: float = OUTAGE_SLACK_S) -> bool:
    """Whether attempt ``o`` overlaps an outage: a server down, restarting, or being taken back by
    the router (until ``slack_s`` after it was healthy)."""
    return any(start - o.latency_s <= o.sent_at <= end + slack_s for _, start, end in outages)


def during(
    outcomes: list[Outcome],
    outages: list[tuple[str, float, float]],
    slack_s: float = OUTAGE_SLACK_S,
    kind: str = "http-error",
) -> int:
    """Failed attempts (``kind``) sent while a server was down, restarting, or being taken back by
    the router (``slack_s`` after it was healthy)."""
    return sum(1 for o in outcomes if o.kind == kind and in_outage(o, outages, slack_s))


def cut_off_problems(outcomes: list[Outcome], outages: list[tuple[str, float, float]]) -> list[str]:
    """A line when a stream through the router broke off mid-answer outside the outages: with every
    server up, nothing should end an answer the router has begun (HTTP 200 sent) before ``[DONE]``."""
    cut = [o for o in outcomes if o.kind == "cut-off" and not in_outage(o, outages)]
    if not cut:
        return []
    return [f"{len(cut)} stream(s) broke off before [DONE] while every server was up, e.g. {cut[0].detail}"]


@dataclass
class FirstTokens:
    """The answered attempts' times to first token, and the check on them (:func:`first_tokens`)."""

    p50_s: float
    p99_s: float
    max_s: float
    bound_s: float
    slow: list[Outcome]  # outside the outages, above the bound
    in_outages: int  # overlapping an outage: not held to the bound
    slow_in_outages: int

    def problems(self) -> list[str]:
        """A line when an answered request outside the outages waited longer than the bound."""
        if not self.slow:
            return []
        worst = sorted(self.slow, key=lambda o: -(o.ttft_s or 0.0))[:3]
        named = ", ".join(f"request {o.index} {o.ttft_s:.1f} s (sent at {o.sent_at:.1f} s)" for o in worst)
        return [
            f"{len(self.slow)} answered request(s) outside the outages waited over {self.bound_s:g} s for their "
            f"first token: {named}"
        ]


def first_tokens(
    outcomes: list[Outcome],
    outages: list[tuple[str, float, float]],
    bound_s: float = TTFT_BOUND_S,
    slack_s: float = OUTAGE_SLACK_S,
) -> FirstTokens:
    """TTFT p50, p99 and max over the answered attempts; those outside the outages (with ``slack_s``,
    as :func:`during`) whose TTFT is above ``bound_s``; those overlapping an outage counted apart."""
    answered = [o for o in outcomes if o.kind == "answered" and o.ttft_s is not None]
    times = sorted(o.ttft_s for o in answered if o.ttft_s is not None)
    inside = [o for o in answered if in_outage(o, outages, slack_s)]
    return FirstTokens(
        p50_s=quantile(times, 0.5),
        p99_s=quantile(times, 0.99),
        max_s=times[-1] if times else 0.0,
        bound_s=bound_s,
        slow=[o for o in answered if (o.ttft_s or 0.0) > bound_s and not in_outage(o, outages, slack_s)],
        in_outages=len(inside),
        slow_in_outages=sum(1 for o in inside if (o.ttft_s or 0.0) > bound_s),
    )


@dataclass(frozen=True)
class LogLine:
    """A line of a server's log: when vLLM logged it (local time; None when the line has no vLLM
    header to read it from) and its text."""

    at: datetime | None
    text: str


def log_time(line: str, near: datetime) -> datetime | None:
    """The local time in ``line``'s vLLM header (:data:`LOG_HEADER`); None without one. The header
    has no year: the year is the one that puts the time nearest ``near`` (a run over New Year)."""
    m = LOG_HEADER.search(ANSI_ESCAPE.sub("", line))
    if m is None:
        return None
    month, day, hour, minute, second = (int(g) for g in m.groups())
    candidates = []
    for year in (near.year - 1, near.year, near.year + 1):
        try:
            candidates.append(datetime(year, month, day, hour, minute, second))
        except ValueError:  # 02-29 outside a leap year, or not a date at all
            continue
    return min(candidates, key=lambda t: abs(t - near), default=None)


def process_logs(logs: Path, role: str) -> list[Path]:
    """The logs of every process of ``role`` in start order: ``<role>.log``, then each restart's
    ``<role>-<n>.log`` by ``n`` (:meth:`~kvcompose_tools.soak.stack.Stack.restart`)."""

    def started(path: Path) -> tuple[int, str]:
        n = path.stem[len(role) + 1 :]
        return (0 if path.stem == role else int(n) if n.isdigit() else 1 << 30), path.name

    return sorted(logs.glob(f"{role}*.log"), key=started)


def logged(logs: Path, role: str, text: str, near: datetime) -> list[LogLine]:
    """The lines that contain ``text`` in the logs of every process of ``role``
    (:func:`process_logs`), with their times (:func:`log_time`)."""
    out: list[LogLine] = []
    for path in process_logs(logs, role):
        for line in path.read_text(errors="replace").splitlines():
            if text in line:
                out.append(LogLine(log_time(line, near), line.strip()))
    return out


#: A planned cause of lease expiries: a moment (a kill, a hang-up) or a span (a cut, a pause).
Cause = datetime | tuple[datetime, datetime]


def unplanned_expiries(
    expiries: list[LogLine],
    causes: Sequence[Cause],
    lease_s: float,
    slack_s: float = LEASE_SLACK_S,
) -> list[LogLine]:
    """The lease expiries no planned cause explains: logged before every cause (to its second: the
    log's times are whole seconds) or later than ``lease_s + slack_s`` after its end, or whose time
    cannot be read. A prefill lets a lease expire only when no decode reads the blocks: the
    requests it prefilled for a decode that was then killed, those whose client hung up at the
    router while the prefill computed them (the router then never sends the decode request), and
    those whose decode could not reach it while the link was cut or while either server was paused
    (a stopped decode reads nothing; a stopped prefill's reaper runs out the leases of the reads it
    held up on its first steps after the resume). ``causes``: the decode kills' and those hang-ups'
    wall-clock times, the link cuts' (cut, restore) and the pauses' (stop, resume) spans."""
    spans = [c if isinstance(c, tuple) else (c, c) for c in causes]

    def planned(at: datetime | None) -> bool:
        return at is not None and any(
            start.replace(microsecond=0) <= at <= end + timedelta(seconds=lease_s + slack_s) for start, end in spans
        )

    return [e for e in expiries if not planned(e.at)]


def planned_causes(injector: Injector, outcomes: list[Outcome], load_started: float) -> list[Cause]:
    """What :func:`unplanned_expiries` reads lease expiries against: the clients that hung up at
    the router (:func:`router_hang_ups`), and from its start until its end the decode's kills
    (until its replacement is healthy: a direct request, the proxy flow by hand, retried while the
    decode is down is prefilled first at every try), the link's cuts (the restore) and both
    servers' pauses (the resume)."""
    causes: list[Cause] = [
        (datetime.fromtimestamp(a), datetime.fromtimestamp(b)) for name, a, b in injector.kills if name == "decode"
    ]
    causes += router_hang_ups(outcomes, load_started)
    causes += [(datetime.fromtimestamp(a), datetime.fromtimestamp(b)) for a, b in injector.cuts]
    causes += [(datetime.fromtimestamp(a), datetime.fromtimestamp(b)) for _, a, b in injector.pauses]
    return causes


def router_hang_ups(outcomes: list[Outcome], load_started: float) -> list[datetime]:
    """When each client that hung up through the router did (wall clock; ``load_started``: the
    ``time.time()`` the outcomes' ``sent_at`` counts from)."""
    return [
        datetime.fromtimestamp(load_started + o.sent_at + o.latency_s)
        for o in outcomes
        if o.kind == "hung-up" and o.path == "router"
    ]


def used_late_reads(late_reads: list[LogLine], refused: Collection[str]) -> list[LogLine]:
    """The prefill's late-read lines for reads the decode did not refuse (``refused``: the prefill
    request ids of the decode's :data:`~kvcompose_tools.e2e.load.REFUSED_READ` lines): those a decode
    may have computed from."""
    out = []
    for line in late_reads:
        m = LATE_READ_REQUEST.search(line.text)
        if m is None or m.group(1) not in refused:
            out.append(line)
    return out


def lease_problems(late_reads: list[LogLine], unplanned: list[LogLine], lease_s: float) -> list[str]:
    """A line for the decode reads after a lease expired (each may have computed from blocks reused
    by another request) and one for the lease expiries outside every planned cause's window."""
    out = []
    if late_reads:
        out.append(
            f"{len(late_reads)} decode read(s) after the prefill's NIXL lease expired (the decode may have "
            f"computed from blocks reused by another request): {late_reads[0].text}"
        )
    if unplanned:
        when = ", ".join("time unreadable" if e.at is None else e.at.strftime("%H:%M:%S") for e in unplanned[:5])
        out.append(
            f"{len(unplanned)} NIXL lease expiry(ies) on the prefill outside the {lease_s:g} s (+ {LEASE_SLACK_S:g} s) "
            "after the decode was killed, a server paused, the link cut or a client hung up at the router "
            f"(at {when}): a decode that never read a request's blocks"
        )
    return out


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
