"""The load: clients sending the plan's requests, and the fault injector.

Clients are threads, :attr:`SoakOptions.concurrency` of them, each taking the next request of the
plan until none is left. A request is sent through the router; when it fails (a server is down or
restarting and the router answers an error) the client sends it again after a pause, doubling
from half a second up to :data:`MAX_BACKOFF_S`, as a client with retries would, at most
:data:`MAX_ATTEMPTS` times. So the run's requests all reach a healthy stack in the end, and a
fault planned "after N requests" falls in traffic, not in a burst of retries.

Requests the plan marks as hung up are sent one of two ways, alternately: through the router,
the client closing the connection at a random moment (what a user closing a tab does; the router
stops at the stage it reached); or as the proxy flow directly against the servers (prefill with
``do_remote_decode``, then decode with prefill's ``kv_transfer_params``), the client hanging up
milliseconds after decode has the request, while decode waits for its NIXL pull: vLLM's server
aborts a request whose client went away, mid-transfer.

Requests are streamed (``"stream": true``): a client reads the server-sent events (``data: {...}``
lines, then ``data: [DONE]``), so it sees its first token's time (:attr:`Outcome.ttft_s`) as a
user does, and keeps the token ids and logprobs of every chunk for the baseline comparison. The
direct hang-up's prefill leg is not streamed: its answer's ``kv_transfer_params`` are needed.

Every attempt's outcome is one of :data:`~kvcompose_tools.e2e.stream.OUTCOMES` (the request and its
reading: :func:`~kvcompose_tools.e2e.stream.send`); nothing a server does stops the run.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from kvcompose_tools.e2e.server import completion_body, parse_completion
from kvcompose_tools.e2e.stream import Reply, send
from kvcompose_tools.soak.plan import Request

#: The outcomes (:data:`~kvcompose_tools.e2e.stream.OUTCOMES`) a request ends with; the others are tried again.
FINAL = ("answered", "hung-up")
MAX_BACKOFF_S = 8.0
#: About four minutes of retrying at the longest pause: longer than a server's restart.
MAX_ATTEMPTS = 32


@dataclass
class Outcome:
    """One attempt at one request."""

    index: int
    attempt: int
    kind: str
    sent_at: float  # seconds since the load started
    latency_s: float
    path: str  # "router" or "direct"
    detail: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    #: Seconds from sending to the first streamed token (None: not answered, or not streamed).
    ttft_s: float | None = None


class Urls(Protocol):
    """Where the requests go (:class:`~kvcompose_tools.soak.stack.Stack`)."""

    def address(self, role: str) -> tuple[str, int]: ...


class Load:
    """The clients: :meth:`run` sends every request of ``requests``."""

    def __init__(self, requests: list[Request], urls: Urls, model: str, max_tokens: int) -> None:
        self._requests = requests
        self._urls = urls
        self._model = model
        self._max_tokens = max_tokens
        self._next = 0
        self._lock = threading.Lock()
        self.outcomes: list[Outcome] = []
        self._latencies: list[float] = []
        self.t0 = time.monotonic()
        #: Every request of the plan has its final outcome (:meth:`run` returned).
        self.done = False

    @property
    def sent(self) -> int:
        """Requests taken by a client so far (retries not counted)."""
        return self._next

    def _take(self) -> Request | None:
        with self._lock:
            if self._next >= len(self._requests):
                return None
            self._next += 1
            return self._requests[self._next - 1]

    def _typical_latency(self) -> float:
        with self._lock:
            return statistics.median(self._latencies[-200:]) if self._latencies else 0.5

    def _attempt(self, r: Request) -> tuple[str, Reply]:
        body = {**completion_body(self._model, r.prompt, self._max_tokens), "stream": True}
        if r.hang_up is None:
            return "router", send(self._urls.address("router"), body)
        if r.hang_up.path == "router":
            return "router", send(
                self._urls.address("router"), body, hang_up_after=r.hang_up.at * self._typical_latency()
            )
        # The proxy flow by hand, hanging up on decode while it pulls; the prefill leg's answer
        # carries the kv_transfer_params, so it is not streamed.
        prefill = send(
            self._urls.address("prefill"),
            {**body, "stream": False, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
        )
        if prefill.answer is None:
            return "direct", prefill
        decode_body = {**body, "kv_transfer_params": prefill.answer.get("kv_transfer_params")}
        return "direct", send(self._urls.address("decode"), decode_body, hang_up_after=r.hang_up.at)

    def _client(self) -> None:
        while (r := self._take()) is not None:
            for attempt in range(MAX_ATTEMPTS):
                sent = time.monotonic()
                path, (kind, detail, answer, ttft) = self._attempt(r)
                latency = time.monotonic() - sent
                out = Outcome(r.index, attempt, kind, sent - self.t0, latency, path, detail, ttft_s=ttft)
                if answer is not None:
                    parsed = parse_completion(answer, latency)
                    out.token_ids, out.logprobs = parsed["token_ids"], parsed["logprobs"]
                with self._lock:
                    self.outcomes.append(out)
                    if kind == "answered":
                        self._latencies.append(latency)
                if kind in FINAL:
                    break
                time.sleep(min(MAX_BACKOFF_S, 0.5 * 2**attempt))

    def run(self, concurrency: int, progress: Callable[[], None] | None = None) -> None:
        """Send every request with ``concurrency`` clients; ``progress`` is called every second."""
        self.t0 = time.monotonic()
        threads = [threading.Thread(target=self._client, daemon=True) for _ in range(concurrency)]
        for t in threads:
            t.start()
        while alive := [t for t in threads if t.is_alive()]:
            alive[0].join(1.0)
            if progress is not None:
                progress()
        self.done = True


class Servers(Protocol):
    """What the injector needs of the stack (:class:`~kvcompose_tools.soak.stack.Stack`)."""

    def kill(self, role: str) -> None: ...

    def restart(self, role: str) -> None: ...

    def cut_link(self) -> None: ...

    def restore_link(self) -> None: ...

    def pause(self, role: str) -> None: ...

    def resume(self, role: str) -> None: ...


#: After a link's restore or a server's resume, the longest wait for the pair to serve again: TCP
#: retransmits on a stalled connection at doubling intervals, so the first one after a long cut (or
#: a long stop of one end) comes seconds to a cut's length after the path is back (docs/e2e.md,
#: "A cut path between the prefill and the decode host").
BACK_S = 120.0
#: The outage name of a link cut in :attr:`Injector.outages`.
LINK = "link"
#: The outage name of a pause of ``role`` in :attr:`Injector.outages` (a kill's is the role's own).
PAUSED = "{role} paused"


class Fault(NamedTuple):
    """One planned fault: once ``at`` requests were sent, ``kind`` (kill, pause or cut) of
    ``target`` (a server's role, or :data:`LINK`)."""

    at: int
    kind: str
    target: str


class Injector:
    """Kills each ``(count, role)`` server of ``kills`` (SIGKILL) once ``load`` has sent ``count``
    requests, then restarts it (returning once it is healthy); pauses each ``(count, role)`` of
    ``pauses`` (SIGSTOP on its process group) for ``pause_s``, then resumes it (SIGCONT) and waits
    until a request sent after the resume is answered; with ``cut`` = ``(count, seconds)``, cuts
    the link between prefill and decode that long, restores it and waits likewise. What happened
    and when is in :attr:`events`, the outages in :attr:`outages`, the kills', the pauses' and
    the cut's wall-clock times in :attr:`kills`, :attr:`pauses` and :attr:`cuts`."""

    def __init__(
        self,
        load: Load,
        servers: Servers,
        kills: list[tuple[int, str]],
        cut: tuple[int, float] | None = None,
        pauses: list[tuple[int, str]] | None = None,
        pause_s: float = 0.0,
    ) -> None:
        self._load = load
        self._servers = servers
        faults = [Fault(at, "kill", role) for at, role in kills]
        faults += [Fault(at, "pause", role) for at, role in pauses or []]
        faults += [Fault(cut[0], "cut", LINK)] if cut else []
        self._faults = sorted(faults)
        self._cut_s = cut[1] if cut else 0.0
        self._pause_s = pause_s
        self.events: list[str] = []
        self.error: BaseException | None = None
        #: (server, a paused server (:data:`PAUSED`) or :data:`LINK`; down at, back at), load seconds
        self.outages: list[tuple[str, float, float]] = []
        #: (server, ``time.time()`` just before its SIGKILL, once its replacement was healthy; the
        #: SIGKILL's again while it restarts): what its peers' log times are read against.
        self.kills: list[tuple[str, float, float]] = []
        #: (server, ``time.time()`` just before its SIGSTOP, just after its SIGCONT).
        self.pauses: list[tuple[str, float, float]] = []
        #: ``time.time()`` at the cut and at the restore.
        self.cuts: list[tuple[float, float]] = []
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self) -> None:
        self._thread.join()

    def _now(self) -> float:
        return time.monotonic() - self._load.t0

    def _run(self) -> None:
        try:
            for fault in self._faults:
                while self._load.sent < fault.at:
                    time.sleep(0.02)
                if fault.kind == "cut":
                    self._cut()
                elif fault.kind == "pause":
                    self._pause(fault.target)
                else:
                    self._kill(fault.target)
        except BaseException as exc:  # reported by the run; the clients go on
            self.error = exc
            self.events.append(f"{self._now():7.1f} s  fault injection failed: {exc}")

    def _kill(self, name: str) -> None:
        killed, wall = self._now(), time.time()
        self.kills.append((name, wall, wall))
        self._servers.kill(name)
        self.events.append(f"{killed:7.1f} s  {name} killed (SIGKILL) after {self._load.sent} requests sent")
        self._servers.restart(name)
        self.kills[-1] = (name, wall, time.time())
        back = self._now()
        self.outages.append((name, killed, back))
        self.events.append(f"{back:7.1f} s  {name} restarted and healthy ({back - killed:.1f} s down)")

    def _pause(self, name: str) -> None:
        paused, wall = self._now(), time.time()
        self._servers.pause(name)
        try:
            self.events.append(f"{paused:7.1f} s  {name} paused (SIGSTOP) after {self._load.sent} requests sent")
            time.sleep(self._pause_s)
        finally:
            self._servers.resume(name)  # never leave a server stopped, whatever failed
        resumed = self._now()
        self.pauses.append((name, wall, time.time()))
        self.events.append(f"{resumed:7.1f} s  {name} resumed (SIGCONT) after {resumed - paused:.1f} s")
        self._back(PAUSED.format(role=name), paused, resumed, f"{name}'s resume")

    def _cut(self) -> None:
        cut, wall = self._now(), time.time()
        self._servers.cut_link()
        try:
            self.events.append(f"{cut:7.1f} s  link prefill-decode cut after {self._load.sent} requests sent")
            time.sleep(self._cut_s)
        finally:
            self._servers.restore_link()
        restored = self._now()
        self.cuts.append((wall, time.time()))
        self.events.append(f"{restored:7.1f} s  link restored ({restored - cut:.1f} s cut)")
        self._back(LINK, cut, restored, "link's restore")

    def _back(self, name: str, down: float, up: float, what: str) -> None:
        """The outage ``name`` from ``down`` until a request sent after ``up`` (the ``what``) was
        answered; a failed injection when none was within :data:`BACK_S`."""
        back = self._served_after(up)
        self.outages.append((name, down, up if back is None else back))
        if back is None:
            raise RuntimeError(f"no request sent after the {what} was answered within {BACK_S:.0f} s")
        self.events.append(f"{back:7.1f} s  the pair serves again: a request sent after the {what} answered")

    def _served_after(self, restored: float) -> float | None:
        """When the first request sent after ``restored`` was answered (load seconds); None when
        none was within :data:`BACK_S`, or the load ended first."""
        deadline = time.monotonic() + BACK_S
        while time.monotonic() < deadline:
            answered = [
                o.sent_at + o.latency_s
                for o in list(self._load.outcomes)
                if o.kind == "answered" and o.sent_at >= restored
            ]
            if answered:
                return min(answered)
            if self._load.done:
                return None
            time.sleep(0.2)
        return None
