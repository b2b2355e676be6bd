"""A burst of P/D requests sent at once, as vLLM's disaggregated proxy sends them, and what the
servers' logs say about the prefill's leases meanwhile.

:func:`send_burst` sends ``requests`` requests at once, each the proxy's two calls: the prefill
server with ``max_tokens: 1`` and ``kv_transfer_params: {"do_remote_decode": true}``, then the
decode server with the ``kv_transfer_params`` the prefill returned, ``max_tokens`` tokens with
``ignore_eos`` (every answer that long). A decode that holds fewer requests than the burst queues
the rest; each waits for free blocks after its prefill finished, and the prefill holds their
blocks meanwhile under its lease. :class:`Outcome` is one request; a request that did not get
``max_tokens`` tokens back is failed, never answered.

:func:`lease_lines` reads the servers' logs (:class:`LeaseLines`): the prefill's lease expiries
and its late-read lines (``Potentially invalid KV blocks``: a decode's read notification for
blocks the prefill had released), the decode's refusals (the nixl plugin's ``NIXL read
refused``) and its releases without a read. :meth:`LeaseLines.unmatched` is the late-read lines
that no refusal or release on the decode accounts for: reads of released blocks that the decode
used.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvcompose_tools.e2e.flow import token_prompt
from kvcompose_tools.e2e.load import (
    LATE_READ_REQUEST,
    LEASE_EXPIRY,
    LEASE_EXPIRY_REQUEST,
    REFUSED_READ,
    RELEASED_UNREAD,
)
from kvcompose_tools.e2e.stream import address, send

#: How long one call of a request may take (a queued decode of the full burst waits ~70 s).
CALL_TIMEOUT_S = 600.0
#: Seed of the burst's prompts: request ``i`` of a burst asks ``token_prompt(SEED + i, ...)``.
SEED = 70_000
#: Late-read lines on the prefill that one refused read accounts for: the read's own notification
#: and the one vLLM's decode sends for a failed read.
LINES_PER_REFUSAL = 2


@dataclass
class Outcome:
    """One request of a burst: seconds its prefill and decode calls took, the decode's tokens,
    and what went wrong (``None``: answered with every token asked)."""

    index: int
    prefill_s: float | None = None
    decode_s: float | None = None
    tokens: int = 0
    error: str | None = None

    @property
    def answered(self) -> bool:
        """Answered with tokens and no error (a request that never ended is not)."""
        return self.error is None and self.tokens > 0


@dataclass
class Burst:
    """A burst's outcomes and its wall time."""

    outcomes: list[Outcome]
    wall_s: float

    @property
    def answered(self) -> int:
        return sum(o.answered for o in self.outcomes)

    @property
    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.answered]

    @property
    def longest_decode_s(self) -> float:
        """The longest decode call (its wait for free blocks, the read and the answer); 0 without any."""
        return max((o.decode_s for o in self.outcomes if o.decode_s is not None), default=0.0)


def post(url: str, body: dict[str, Any], timeout_s: float = CALL_TIMEOUT_S) -> dict[str, Any]:
    """``POST /v1/completions`` to the server at ``url``; its JSON answer. Raises ``RuntimeError``
    (``HTTP 500: ...``) on an answer other than 200, or none (:func:`~kvcompose_tools.e2e.stream.send`)."""
    reply = send(address(url), body, timeout_s=timeout_s)
    if reply.answer is None:
        raise RuntimeError(reply.detail)
    return reply.answer


def proxy_request(
    prefill_url: str, decode_url: str, model: str, prompt: list[int], max_tokens: int, out: Outcome
) -> None:
    """One request the proxy's way (module docstring), into ``out``."""
    t0 = time.monotonic()
    sent: float | None = None  # when the decode call went out
    try:
        base = {"model": model, "prompt": prompt, "temperature": 0}
        p = post(prefill_url, {**base, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
        out.prefill_s = time.monotonic() - t0
        params = p.get("kv_transfer_params")
        if not params:
            raise RuntimeError("the prefill returned no kv_transfer_params")
        sent = time.monotonic()
        d = post(decode_url, {**base, "max_tokens": max_tokens, "ignore_eos": True, "kv_transfer_params": params})
        out.decode_s = time.monotonic() - sent
        out.tokens = int((d.get("usage") or {}).get("completion_tokens", 0))
        if out.tokens != max_tokens:
            raise RuntimeError(f"{out.tokens} of {max_tokens} tokens")
    except Exception as exc:  # an outcome here, not a crash: HTTP errors, timeouts, short answers
        if out.decode_s is None and sent is not None:
            out.decode_s = time.monotonic() - sent
        out.error = f"{type(exc).__name__}: {exc}"[:300]


def send_burst(
    prefill_url: str,
    decode_url: str,
    model: str,
    requests: int,
    prompt_tokens: int,
    max_tokens: int,
    seed: int = SEED,
) -> Burst:
    """``requests`` requests at once (a thread each), every prompt new; their outcomes in order."""
    outcomes = [Outcome(i) for i in range(requests)]
    threads = [
        threading.Thread(
            target=proxy_request,
            args=(prefill_url, decode_url, model, token_prompt(seed + i, prompt_tokens), max_tokens, o),
            name=f"burst-{i}",
            daemon=True,
        )
        for i, o in enumerate(outcomes)
    ]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return Burst(outcomes, time.monotonic() - t0)


@dataclass
class LeaseLines:
    """What the servers logged about leases (module docstring); per prefill request id where the
    lines name one."""

    expiries: int = 0
    #: prefill request id -> its late-read lines on the prefill
    late: Counter[str] = field(default_factory=Counter)
    #: prefill request id -> reads the decode refused for it
    refused: Counter[str] = field(default_factory=Counter)
    #: prefill request id -> releases without a read the decode logged for it
    released: Counter[str] = field(default_factory=Counter)
    #: prefill request id -> its lease expiries on the prefill
    expired: Counter[str] = field(default_factory=Counter)

    @property
    def late_reads(self) -> int:
        return sum(self.late.values())

    @property
    def refusals(self) -> int:
        return sum(self.refused.values())

    def refused_while_held(self) -> dict[str, int]:
        """Prefill request id -> reads the decode refused although the prefill never released the
        blocks (no expiry logged for them): valid reads lost, what issue 43 was about."""
        return {rid: n for rid, n in self.refused.items() if not self.expired[rid]}

    def unmatched(self) -> dict[str, int]:
        """Prefill request id -> its late-read lines that the decode's lines do not account for
        (a refusal accounts for :data:`LINES_PER_REFUSAL`, a release without a read for one)."""
        out = {}
        for rid, n in self.late.items():
            left = n - LINES_PER_REFUSAL * self.refused[rid] - self.released[rid]
            if left > 0:
                out[rid] = left
        return out


def lease_lines(prefill_log: str, decode_log: str) -> LeaseLines:
    """:class:`LeaseLines` from the text of the prefill's and the decode's logs."""
    return LeaseLines(
        prefill_log.count(LEASE_EXPIRY),
        Counter(LATE_READ_REQUEST.findall(prefill_log)),
        Counter(REFUSED_READ.findall(decode_log)),
        Counter(RELEASED_UNREAD.findall(decode_log)),
        Counter(LEASE_EXPIRY_REQUEST.findall(prefill_log)),
    )


def errors(outcomes: Sequence[Outcome], keep: int = 3) -> list[str]:
    """The first ``keep`` distinct errors of ``outcomes``."""
    seen: list[str] = []
    for o in outcomes:
        if o.error is not None and o.error not in seen:
            seen.append(o.error)
    return seen[:keep]
