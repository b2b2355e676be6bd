"""The steady P/D load of the load-failure benchmark, sent as vLLM's disaggregated proxy sends it.

Each client thread loops until stopped: the prefill server with ``max_tokens: 1`` and
``do_remote_decode``, then the decode server, streamed, with the ``kv_transfer_params`` the
prefill returned. Both calls carry ``X-Request-Id: <rid>``, so the decode's engine request id is
``cmpl-<rid>-0-<8 hex>`` (vLLM's completion server prefixes ``cmpl-`` and adds the choice and a
random suffix) and its log lines name the request the client sent. A decode that fails the
request (HTTP error, an error event or no token in the stream) is retried once, as a proxy with
one retry would, and the retry's first token is recorded too.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvcompose_tools.e2e.flow import token_prompt
from kvcompose_tools.e2e.server import completion_body
from kvcompose_tools.e2e.stream import send

#: A hang guard: longer than any pause the benchmark makes.
TIMEOUT_S = 180.0
#: The other traffic the prefill serves, one short plain request this often: vLLM's prefill reaps
#: expired leases only in its steps, so with every client waiting on a stopped decode it would
#: release nothing (its other decodes' traffic makes those steps in a deployment).
TICK_S = 0.5


@dataclass
class Sent:
    """One request of the load: when it went out and what came back (seconds on the load's clock)."""

    rid: str
    seed: int
    sent_at: float
    ttft_s: float | None = None  # send (prefill) to the decode's first token
    done_at: float | None = None
    tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    error: str | None = None
    #: With an error: the retry's send-to-first-token, from the first send (None: the retry failed too).
    retry_ttft_s: float | None = None

    @property
    def answered(self) -> bool:
        return self.error is None and self.tokens > 0

    @property
    def tpot_s(self) -> float | None:
        """Seconds per output token after the first."""
        if not self.answered or self.ttft_s is None or self.done_at is None or self.tokens < 2:
            return None
        return (self.done_at - self.sent_at - self.ttft_s) / (self.tokens - 1)


def request_body(model: str, seed: int, prompt_tokens: int, max_tokens: int) -> dict[str, Any]:
    """A greedy completion of ``seed``'s prompt, ``max_tokens`` long whatever the model says."""
    return {**completion_body(model, token_prompt(seed, prompt_tokens), max_tokens), "ignore_eos": True}


def pd_once(
    prefill: tuple[str, int], decode: tuple[str, int], body: dict[str, Any], rid: str, t0: float
) -> tuple[float | None, list[int], str | None]:
    """One request through the proxy flow: (seconds from ``t0``, a ``time.monotonic()``, to the
    decode's first token, its token ids, an error or None). The decode's reply is read by
    :func:`~kvcompose_tools.e2e.stream.send`: an HTTP error, an error event, no token or no
    ``data: [DONE]`` is an error, as vLLM answers a failed KV load with one of those."""
    headers = {"X-Request-Id": rid}
    first = {**body, "stream": False, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    prefilled = send(prefill, first, headers=headers, timeout_s=TIMEOUT_S)
    if prefilled.answer is None:
        return None, [], f"prefill {prefilled.kind}: {prefilled.detail}"
    params = prefilled.answer.get("kv_transfer_params")
    decode_body = {**body, "stream": True, "kv_transfer_params": params}
    reply = send(decode, decode_body, headers=headers, t0=t0, timeout_s=TIMEOUT_S)
    if reply.kind != "answered":
        return None, [], f"{reply.kind}: {reply.detail}"
    return reply.ttft_s, reply.token_ids, None


class Clients:
    """``count`` clients sending the load until :meth:`stop`; every request in :attr:`sent`."""

    def __init__(
        self,
        prefill: tuple[str, int],
        decode: tuple[str, int],
        model: str,
        tag: str,
        count: int,
        prompt_tokens: int,
        max_tokens: int,
        seed: int = 0,
    ) -> None:
        self._prefill, self._decode, self._model, self._tag = prefill, decode, model, tag
        self._prompt_tokens, self._max_tokens, self._seed = prompt_tokens, max_tokens, seed
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._n = 0
        self.sent: list[Sent] = []
        self.t0 = time.monotonic()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(count)]
        self._threads.append(threading.Thread(target=self._tick, daemon=True))
        for t in self._threads:
            t.start()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def _next(self) -> Sent:
        with self._lock:
            self._n += 1
            s = Sent(f"{self._tag}-{self._n}", self._seed * 1_000_000 + self._n, self.now())
            self.sent.append(s)
            return s

    def _run(self) -> None:
        while not self._stop.is_set():
            s = self._next()
            body = request_body(self._model, s.seed, self._prompt_tokens, self._max_tokens)
            start = time.monotonic()
            s.ttft_s, s.token_ids, s.error = pd_once(self._prefill, self._decode, body, s.rid, start)
            s.tokens, s.done_at = len(s.token_ids), self.now()
            if s.error is not None:  # one retry, as a proxy with one retry sends it
                ttft, ids, err = pd_once(self._prefill, self._decode, body, s.rid + "-retry", start)
                s.retry_ttft_s = ttft if err is None else None

    def _tick(self) -> None:
        body = completion_body(self._model, token_prompt(0, 5), 1)  # under one block: no KV to keep
        while not self._stop.wait(TICK_S):  # a tick's reply is not measured
            send(self._prefill, body, headers={"X-Request-Id": f"{self._tag}-tick"}, timeout_s=TIMEOUT_S)

    def stop(self, progress: Callable[[], None] | None = None) -> None:
        """Stop sending; returns once every request in flight has its answer."""
        self._stop.set()
        for t in self._threads:
            t.join(TIMEOUT_S * 2 + 10)
            if progress is not None:
                progress()
