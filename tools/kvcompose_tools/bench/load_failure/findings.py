"""What one phase of the load-failure benchmark showed, from the client's records and the decode's
log: no engine needed (tools/tests/bench/test_bench_load_failure.py).

A phase is one decode policy under the steady load with one pause of the decode. Its requests
fall in four groups: ``refused`` (the decode's nixl child refused their read: the
``NIXL read refused`` lines, matched by the ``X-Request-Id`` the client sent), ``before`` (sent
in the window before the pause and done before it), ``caught`` (in flight across the pause, not
refused) and ``after`` (sent in the window after the resume: what the decode's recompute, if
any, costs the others).
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvcompose_tools.bench.load_failure.client import Sent

#: The decode's nixl child refusing a read (``kvcompose_nixl.lease.REFUSED``): group ``rid`` is the
#: client's ``X-Request-Id`` (vLLM's engine id is ``cmpl-<X-Request-Id>-<choice>-<8 hex>``).
REFUSED = re.compile(r"NIXL read refused: cmpl-(?P<rid>\S+?)-\d+-[0-9a-f]{8} \(prefill request")
#: vLLM's scheduler applying ``kv_load_failure_policy``: fail, then recompute.
FAILING = re.compile(r"Failing (\d+) request\(s\) due to KV load failure")
RECOVERED = re.compile(r"Recovered from KV load failure: (\d+) request\(s\) rescheduled")


def refused_rids(log: str) -> list[str]:
    """The client request ids of the reads the decode refused, in log order."""
    return [m.group("rid") for m in REFUSED.finditer(log)]


def policy_counts(log: str) -> dict[str, int]:
    """Requests vLLM failed and rescheduled for a failed KV load, as its scheduler logged them."""
    return {
        "vllm_failed": sum(int(n) for n in FAILING.findall(log)),
        "vllm_rescheduled": sum(int(n) for n in RECOVERED.findall(log)),
    }


def _q(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) by nearest rank; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def latency(sent: Iterable[Sent]) -> dict[str, Any]:
    """Answered requests' TTFT p50/p90/max and TPOT p50 (seconds)."""
    ok = [s for s in sent if s.answered]
    ttft = [s.ttft_s for s in ok if s.ttft_s is not None]
    tpot = [t for t in (s.tpot_s for s in ok) if t is not None]
    return {
        "n": len(ok),
        "ttft_p50_s": _r(_q(ttft, 0.5)),
        "ttft_p90_s": _r(_q(ttft, 0.9)),
        "ttft_max_s": _r(max(ttft, default=None)),
        "tpot_p50_s": _r(statistics.median(tpot) if tpot else None),
    }


@dataclass
class Phase:
    """One policy under the load, one pause of the decode from ``paused_at`` to ``resumed_at``
    (seconds on the load's clock), the groups judged over ``window_s`` either side."""

    policy: str
    run: int
    sent: list[Sent]
    decode_log: str
    paused_at: float
    resumed_at: float
    window_s: float

    def refused(self) -> list[Sent]:
        """The client's requests whose read the decode refused (a retry's id counts as its request)."""
        ids = {rid.removesuffix("-retry") for rid in refused_rids(self.decode_log)}
        return [s for s in self.sent if s.rid in ids]

    def unmatched(self) -> list[str]:
        """Refused reads that name no request of this load (must be none)."""
        mine = {s.rid for s in self.sent}
        return [rid for rid in refused_rids(self.decode_log) if rid.removesuffix("-retry") not in mine]

    def groups(self) -> dict[str, list[Sent]]:
        refused = {s.rid for s in self.refused()}
        rest = [s for s in self.sent if s.rid not in refused]
        done = lambda s: s.done_at if s.done_at is not None else float("inf")  # noqa: E731
        return {
            "refused": self.refused(),
            "before": [s for s in rest if self.paused_at - self.window_s <= s.sent_at and done(s) < self.paused_at],
            "caught": [s for s in rest if s.sent_at < self.resumed_at and done(s) >= self.paused_at],
            "after": [s for s in rest if self.resumed_at <= s.sent_at < self.resumed_at + self.window_s],
        }

    def figures(self) -> dict[str, Any]:
        """Counts and latencies of the phase, JSON-ready."""
        g = self.groups()
        refused = g["refused"]
        ok = [s for s in refused if s.answered]
        # How long after the resume a refused request got its first token (answered, or by the retry).
        first = [s.sent_at + s.ttft_s - self.resumed_at for s in ok if s.ttft_s is not None]
        retried = [s.sent_at + s.retry_ttft_s - self.resumed_at for s in refused if not s.answered and s.retry_ttft_s]
        return {
            "policy": self.policy,
            "run": self.run + 1,  # as the progress lines count runs
            "sent": len(self.sent),
            "answered": sum(s.answered for s in self.sent),
            "failed": sum(not s.answered for s in self.sent),
            "answered_by_retry": sum(1 for s in self.sent if not s.answered and s.retry_ttft_s is not None),
            "refused": len(refused),
            "refused_answered": len(ok),
            "refused_unmatched": len(self.unmatched()),
            "refused_ttft_s": sorted(round(s.ttft_s, 2) for s in ok if s.ttft_s is not None),
            "refused_first_token_after_resume_s": sorted(round(x, 2) for x in first),
            "refused_retry_first_token_after_resume_s": sorted(round(x, 2) for x in retried),
            "caught": len(g["caught"]),
            "caught_failed": sum(not s.answered for s in g["caught"]),
            "before": latency(g["before"]),
            "after": latency(g["after"]),
            "pause_s": round(self.resumed_at - self.paused_at, 1),
            **policy_counts(self.decode_log),
        }


def _cell(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, list):
        return ", ".join(f"{v:g}" for v in x) or "-"
    return f"{x:.3f}" if isinstance(x, float) else str(x)


#: The counts table's columns: (heading, how a phase's figures give it).
COLUMNS: tuple[tuple[str, Any], ...] = (
    ("policy", lambda f: f["policy"]),
    ("run", lambda f: f["run"]),
    ("sent", lambda f: f["sent"]),
    ("answered", lambda f: f["answered"]),
    ("failed", lambda f: f["failed"]),
    ("refused (answered)", lambda f: f"{f['refused']} ({f['refused_answered']})"),
    ("refused: first token after resume s", lambda f: f["refused_first_token_after_resume_s"]),
    ("failed: retry's first token after resume s", lambda f: f["refused_retry_first_token_after_resume_s"]),
    ("TTFT p50 before / after s", lambda f: f"{_cell(f['before']['ttft_p50_s'])} / {_cell(f['after']['ttft_p50_s'])}"),
    ("TTFT p90 before / after s", lambda f: f"{_cell(f['before']['ttft_p90_s'])} / {_cell(f['after']['ttft_p90_s'])}"),
    ("TPOT p50 before / after ms", lambda f: f"{_ms(f['before']['tpot_p50_s'])} / {_ms(f['after']['tpot_p50_s'])}"),
)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def counts_table(figures: Sequence[dict[str, Any]]) -> str:
    """A Markdown table, one row per phase (:meth:`Phase.figures`)."""
    head = [h for h, _ in COLUMNS]
    rows = [[_cell(get(f)) for _, get in COLUMNS] for f in figures]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)
