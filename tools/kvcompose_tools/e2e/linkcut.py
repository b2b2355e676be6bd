"""The link between a prefill and a decode host cut during P/D traffic, then restored.

:func:`cut_and_restore` drives a 1P1D stack behind vLLM's router whose two servers run in hosts
of their own (:mod:`kvcompose_tools.e2e.hosts`): it checks the pair answers, cuts the path between the
two hosts (:meth:`~kvcompose_tools.e2e.hosts.Host.cut`: silent, both ways; the router still reaches
both), sends requests through the router while the path is cut, restores it after ``cut_s``
(longer than the prefill's lease, so that the prefill frees the blocks nobody read), and then
checks what the issue asks of each ``ucx_error_handling`` setting:

* every request sent during the cut ends, with an answer or an HTTP error, within ``bound_s``
  of being sent (:data:`HANG_S` by default); none hangs;
* both servers' KV cache usage (``vllm:kv_cache_usage_perc``) is back to 0 afterwards;
* the pair answers again once the path is back: requests served over NIXL.

The outcome is a :class:`CutReport`; :meth:`CutReport.problems` lists what broke those rules
(empty: all held).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvcompose_tools.e2e.flow import routed_request, token_prompt
from kvcompose_tools.e2e.load import LATE_READ_REQUEST, LEASE_EXPIRY, REFUSED_READ, RELEASED_UNREAD

#: A request sent while the path is cut must end (answer or error) within this many seconds.
HANG_S = 120.0
#: How long KV usage may take to reach 0 once the path is back (the lease has run out by then).
SETTLE_S = 60.0
USAGE = "vllm:kv_cache_usage_perc"


@dataclass
class Outcome:
    """One request sent while the path was cut: when it was sent (seconds after the cut), how
    long it took, and its answer's tokens or the error it ended with."""

    sent_s: float
    took_s: float | None = None
    tokens: list[int] | None = None
    error: str | None = None

    @property
    def ended(self) -> bool:
        return self.took_s is not None

    def describe(self) -> str:
        if not self.ended:
            return f"sent at +{self.sent_s:.1f} s: no end"
        what = "answered" if self.error is None else "error: " + _http_status(self.error)
        return f"sent at +{self.sent_s:.1f} s: {what} after {self.took_s:.1f} s"


@dataclass
class CutReport:
    cut_s: float
    bound_s: float
    during: list[Outcome] = field(default_factory=list)
    #: seconds after the restore until both servers' KV usage read 0 (None: not within SETTLE_S)
    usage_zero_after_s: float | None = None
    usage_left: dict[str, float] = field(default_factory=dict)
    #: requests after the restore: (tokens, NIXL bytes) or the error
    after: list[tuple[list[int], int] | str] = field(default_factory=list)
    #: during the test: the prefill's leases that expired unread (``Releasing expired KV
    #: blocks``), the requests whose released blocks a decode read (``Potentially invalid KV
    #: blocks``, the prefill's log), of those the reads the decode's nixl child refused for ending
    #: after the lease (``NIXL read refused``), and the ones it did not refuse
    expired: int = 0
    late_reads: int = 0
    refused: int = 0
    unrefused: int = 0
    #: the pair's first requests before the cut that failed: a fresh pair's first read can end
    #: after a short lease (docs/e2e.md, cold start) and be refused; the pair is wired after it
    first_failed: list[str] = field(default_factory=list)

    def problems(self) -> list[str]:
        out = []
        for o in self.during:
            if not o.ended or (o.took_s or 0.0) > self.bound_s:
                out.append(f"a request {o.describe()} (bound {self.bound_s:.0f} s)")
        if self.usage_zero_after_s is None:
            out.append(f"KV usage not back to 0 within {SETTLE_S:.0f} s of the restore: {self.usage_left}")
        for a in self.after:
            if isinstance(a, str):
                out.append(f"a request after the restore failed: {a[:300]}")
            elif a[1] <= 0:
                out.append("a request after the restore moved nothing over NIXL")
        if not self.after:
            out.append("no request after the restore")
        if self.unrefused:
            out.append(
                f"the decode used {self.unrefused} read(s) of blocks the prefill had released "
                f"({self.late_reads} read(s) of released blocks, {self.refused} refused)"
            )
        return out

    def lines(self) -> list[str]:
        rows = [f"before the cut, failed first request(s): {e}" for e in self.first_failed]
        rows.append(f"path cut {self.cut_s:.0f} s")
        rows += [f"  during: {o.describe()}" for o in self.during]
        zero = "never" if self.usage_zero_after_s is None else f"{self.usage_zero_after_s:.1f} s after the restore"
        rows.append(f"  KV usage 0 on both: {zero}")
        rows.append(
            f"  prefill: {self.expired} lease(s) expired unread, {self.late_reads} read(s) of released blocks; "
            f"decode refused {self.refused}"
        )
        rows += [
            "  after: " + (a[:200] if isinstance(a, str) else f"answered, {a[1]:,} B over NIXL") for a in self.after
        ]
        return rows


def _http_status(error: str) -> str:
    i = error.find("HTTP ")
    return error[i : i + 8] if i >= 0 else error.split(";")[0][:120]


def cut_and_restore(
    router: Any,
    prefill: Any,
    decode: Any,
    prefill_host: Any,
    decode_host: Any,
    cut_s: float,
    requests: int = 2,
    after: int = 2,
    bound_s: float = HANG_S,
    seed: int = 61_000,
    prompt_tokens: int = 200,
    max_tokens: int = 4,
    echo: Callable[[str], None] | None = None,
) -> CutReport:
    """Cut the path between ``prefill_host`` and ``decode_host`` for ``cut_s``, with ``requests``
    requests sent through ``router`` right after the cut, restore it, then send ``after`` more;
    see the module docstring. The path is restored whatever happens."""
    say = echo or (lambda _line: None)
    report = CutReport(cut_s, bound_s)
    logged = _log_counts(prefill, decode)
    _wire(router, decode, seed, prompt_tokens, max_tokens, report)
    outcomes = [Outcome(0.0) for _ in range(requests)]
    threads: list[threading.Thread] = []
    prefill_host.cut(decode_host)
    t_cut = time.monotonic()
    say(f"path between {prefill_host.name} and {decode_host.name} cut")
    try:
        for i, o in enumerate(outcomes):
            o.sent_s = time.monotonic() - t_cut
            t = threading.Thread(
                target=_send,
                args=(router, token_prompt(seed + 1 + i, prompt_tokens), max_tokens, bound_s, o),
                daemon=True,
            )
            t.start()
            threads.append(t)
            time.sleep(0.5)
        time.sleep(max(0.0, cut_s - (time.monotonic() - t_cut)))
    finally:
        prefill_host.restore(decode_host)
    t_back = time.monotonic()
    say(f"path restored after {t_back - t_cut:.1f} s")
    for o, t in zip(outcomes, threads):
        t.join(max(0.0, t_cut + o.sent_s + bound_s + 5.0 - time.monotonic()))
    report.during = outcomes
    decode.answered_elsewhere(sum(1 for o in outcomes if o.ended and o.error is None))
    report.usage_zero_after_s, report.usage_left = _usage_zero([prefill, decode], t_back)
    for j in range(after):
        try:
            s = routed_request(router, [decode], token_prompt(seed + 100 + j, prompt_tokens), max_tokens, children=())
            report.after.append((list(s.token_ids), s.nixl_bytes))
        except Exception as exc:  # the report says what broke
            report.after.append(f"{type(exc).__name__}: {exc}")
    now = _log_counts(prefill, decode)
    late, refused = now[1] - logged[1], now[2] - logged[2]
    report.expired, report.late_reads, report.refused = now[0] - logged[0], len(late), len(late & refused)
    report.unrefused = len(late - refused)
    for line in report.lines():
        say(line)
    return report


def _wire(router: Any, decode: Any, seed: int, prompt_tokens: int, max_tokens: int, report: CutReport) -> None:
    """Requests before the cut until one is answered over NIXL (three at most): the pair's
    handshake and first read happen before the cut, not during it."""
    for k in range(FIRST_TRIES):
        try:
            if routed_request(
                router, [decode], token_prompt(seed - k, prompt_tokens), max_tokens, children=()
            ).nixl_bytes:
                return
            report.first_failed.append("answered with nothing over NIXL")
        except Exception as exc:  # a fresh pair's first read refused after a short lease: HTTP 500
            report.first_failed.append(f"{type(exc).__name__}: {exc}"[:300])
    raise RuntimeError(f"the pair never answered over NIXL before the cut: {report.first_failed}")


#: Requests :func:`_wire` sends before the cut at most.
FIRST_TRIES = 3


def _log_counts(prefill: Any, decode: Any) -> tuple[int, set[str], set[str]]:
    """The prefill's lease expiries, the prefill requests whose released blocks were read, and
    those whose read the decode refused or never made, from the servers' logs so far."""

    def text(node: Any) -> str:
        path = getattr(node, "log_path", None)
        return path.read_text(errors="replace") if path is not None and path.exists() else ""

    p, d = text(prefill), text(decode)
    return (
        p.count(LEASE_EXPIRY),
        set(LATE_READ_REQUEST.findall(p)),
        set(REFUSED_READ.findall(d)) | set(RELEASED_UNREAD.findall(d)),
    )


def _send(router: Any, prompt: list[int], max_tokens: int, timeout: float, o: Outcome) -> None:
    t0 = time.monotonic()
    try:
        (answer,) = router.generate([prompt], max_tokens, timeout=timeout)
        o.tokens = list(answer.get("token_ids", []))
    except Exception as exc:  # an HTTP error (or the client's timeout) is an outcome here
        o.error = f"{type(exc).__name__}: {exc}"
    o.took_s = time.monotonic() - t0


def _usage_zero(servers: Sequence[Any], since: float) -> tuple[float | None, dict[str, float]]:
    """Seconds after ``since`` until every server's KV usage reads 0; else None and the last read."""
    last: dict[str, float] = {}
    deadline = since + SETTLE_S
    while True:
        for s in servers:
            try:
                last[s.name] = float(s._scrape(10.0).get(USAGE, -1.0))
            except Exception:  # a server that does not answer its metrics now: not 0
                last[s.name] = -1.0
        if all(v == 0.0 for v in last.values()):
            return time.monotonic() - since, last
        if time.monotonic() >= deadline:
            return None, last
        time.sleep(0.5)
