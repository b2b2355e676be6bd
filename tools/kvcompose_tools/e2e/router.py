"""vLLM's router in front of a prefill and a decode server: the serving stack's single entry point.

:class:`RouterNode` starts ``python -m vllm_router.launch_router --vllm-pd-disaggregation
--kv-connector nixl`` (the ``vllm-router`` package, kvcompose's ``serve`` extra; a Rust binary
inside a wheel) on 127.0.0.1. A client sends one ordinary OpenAI request to the router; for
``--kv-connector nixl`` the router (``src/routers/http/vllm_pd_router.rs`` in vllm-project/router)

1. sends it to a prefill server with ``max_tokens: 1`` (``max_completion_tokens`` and
   ``min_tokens`` capped at 1 too), ``stream: false`` and ``kv_transfer_params:
   {"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
   "remote_block_ids": null, "remote_host": null, "remote_port": null}``
   (``build_prefill_kv_transfer_params``);
2. sends the original request to a decode server with ``kv_transfer_params`` set to the one in
   prefill's answer, unchanged (``build_decode_kv_transfer_params``), and both with the same
   ``X-Request-Id``;
3. returns decode's answer (its JSON re-encoded, which can move a logprob's double by one ulp:
   :func:`kvcompose_tools.e2e.flow.same_output`).

kvcompose does not reimplement any of that: the demo and the tests only talk to the router, and
read what the engines did from their own ``/metrics``.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcompose.discovery import Registrar, healthy
from kvcompose.router import SESSION_HEADER
from kvcompose.serving import router_args
from kvcompose_tools.e2e.discovery import router_flags, wait_added
from kvcompose_tools.e2e.metrics import parse_metrics
from kvcompose_tools.e2e.ports import free_ports
from kvcompose_tools.e2e.processes import CALL_TIMEOUT_S, NodeError, ProcessNode
from kvcompose_tools.e2e.server import (
    HOST,
    HttpClient,
    ServerNode,
    chat_body,
    completion_body,
    parse_chat,
    parse_completion,
)

if TYPE_CHECKING:
    from kvcompose_tools.e2e.hosts import Host

ROUTER_MODULE = "vllm_router.launch_router"
#: The ``vllm-router`` release this code was checked against (pinned in pyproject's ``serve``
#: extra and installed by scripts/setup.sh).
ROUTER_VERSION = "0.1.17"
#: The router's own start (it checks every worker's /health before it listens) takes about a
#: second; the deadline leaves room for a loaded 2-core machine.
READY_TIMEOUT_S = 60.0
#: Log lines of each server behind the router that a failed request's error quotes.
WORKER_LINES = 15
#: How long the router waits for the servers' ``/health`` at start, and how often it checks
#: (seconds): the servers passed are already up (its defaults: 600 s, every 30 s).
STARTUP = (60, 1)
#: Terminal colour codes (the router's tracing output has them whatever NO_COLOR says).
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def router_argv(
    prefill_urls: list[str],
    decode_urls: list[str],
    port: int,
    metrics_port: int,
    policy: str = "round_robin",
    host: str = HOST,
    prefill_events: dict[str, str] | None = None,
) -> list[str]:
    """The router's command line (:func:`kvcompose.serving.router_args`, as ``deploy/kubernetes/``
    runs it): vLLM P/D mode over NIXL, bound to ``host`` (127.0.0.1, or a host's address).

    ``policy`` picks a prefill and a decode server per request. ``round_robin`` (the default
    here): with one prefill and one decode there is nothing to choose, and unlike the router's
    default ``cache_aware`` it keeps no prefix tree of its own. ``consistent_hash`` keeps a
    conversation on one decode server: the router hashes the request's ``X-Session-ID`` header
    (:data:`SESSION_HEADER`) onto a ring of the workers, so every turn of a session reaches the
    decode whose host tier holds the earlier turns. ``kv_aware``
    (:func:`kvcompose.router.pd_router_args`) picks the prefill by the KV events each publishes
    (``prefill_events``: prefill URL -> ``tcp://`` endpoint) and prefers a session's decode
    (``kv_aware+hash``: keeps it, by hash). The Prometheus exporter gets a free port of its own
    (its default, 29000, would collide between two stacks on one host). Workers are checked every
    second at start (:data:`STARTUP`).
    """
    flags = router_args(prefill_urls, decode_urls, policy, prefill_events, (host, port), (host, metrics_port), STARTUP)
    return [sys.executable, "-m", ROUTER_MODULE, *flags]


class RouterNode(ProcessNode):
    """One router process in front of ``prefills`` and ``decodes`` (anything with a ``url``: a
    :class:`~kvcompose_tools.e2e.server.ServerNode`), choosing among them by ``policy``
    (:func:`router_argv`; ``prefill_events`` for ``kv_aware``; ``args``: more router flags); its log is
    ``<name>.log`` in ``log_dir``, beside the engines'; ``host``: it runs in that host
    (:mod:`kvcompose_tools.e2e.hosts`), bound to its address; ``discovery``: the servers reach it
    by registering (:mod:`kvcompose.discovery`, while each answers `/health`), and :meth:`join` adds one while it runs.
    Call :meth:`wait_ready`, then send requests; :meth:`close` stops it."""

    def __init__(
        self,
        prefills: Sequence[Any],
        decodes: Sequence[Any],
        model: str,
        log_dir: Path,
        port: int | None = None,
        policy: str = "round_robin",
        name: str = "router",
        args: Sequence[str] = (),
        host: Host | None = None,
        prefill_events: dict[str, str] | None = None,
        discovery: bool = False,
    ) -> None:
        if importlib.util.find_spec("vllm_router") is None:
            raise NodeError(
                f"the vllm-router package is not installed: pip install 'vllm-router=={ROUTER_VERSION}' "
                "(kvcompose's serve extra; scripts/setup.sh installs it)"
            )
        self.model = model
        self.port, metrics_port = free_ports(2) if port is None else (port, free_ports(1)[0])
        bind = host.address if host else HOST
        self.url = f"http://{bind}:{self.port}"
        urls = [p.url for p in prefills], [d.url for d in decodes]
        self.argv = router_argv(*urls, self.port, metrics_port, policy, bind, prefill_events)
        self.argv += args
        discovery_address = f"{bind}:{free_ports(1)[0]}" if discovery else None
        if discovery_address:
            self.argv += router_flags(discovery_address)
        super().__init__(
            name,
            name,
            self.argv,
            log_dir,
            host,
            host.environ() if host else None,
            stdin=subprocess.DEVNULL,
        )
        self._http = HttpClient(self.name, self.url, self._state)
        # The router's own Prometheus exporter (``vllm_router_*``).
        self._metrics = HttpClient(f"{self.name} metrics", f"http://{bind}:{metrics_port}", self._state)
        self._workers = [*prefills, *decodes]
        self._prefills = list(prefills)
        #: the servers' registrations (``discovery``): the router routes to these only
        self.registrar = Registrar(discovery_address, health=healthy) if discovery_address else None
        if self.registrar:
            for kind, nodes in (("prefill", prefills), ("decode", decodes)):
                for node in nodes:
                    self.registrar.add(kind, node.url)

    def _state(self) -> str:
        """The router's state and log tail, then what each server behind it started here did last:
        a request that hangs or fails in the router is most often explained there."""
        rc = self.proc.poll()
        state = "running" if rc is None else f"exited (rc={rc})"
        out = f"router {state}, log {self.log_path}:\n{self.log_tail()}"
        for w in self._workers:
            if isinstance(w, ServerNode):
                out += f"\n--- {w.name}: {w.report(WORKER_LINES)}"
        return out

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Until the router answers ``GET /health``; a :class:`NodeError` naming its log when it
        exits or is not up within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise NodeError(f"router exited (rc={self.proc.returncode}) while starting; {self._state()}")
            if self._http.healthy(1.0):
                break
            if time.monotonic() >= deadline:
                raise NodeError(f"router not ready after {timeout:.0f} s; {self._state()}")
            time.sleep(0.2)
        for w in self._workers if self.registrar else ():
            wait_added(self.log_path, "prefill" if w in self._prefills else "decode", w.url)

    def join(self, kind: str, node: Any) -> None:
        """Register one more ``kind`` server (``prefill`` or ``decode``) with a running router
        started with ``discovery``, and wait until the router says it added it."""
        if self.registrar is None:
            raise NodeError(f"{self.name}: a server joins a router started with discovery only")
        self.registrar.add(kind, node.url)
        self._workers.append(node)
        wait_added(self.log_path, kind, node.url)

    def generate(
        self,
        prompts: list[list[int]] | list[str],
        max_tokens: int,
        timeout: float = CALL_TIMEOUT_S,
        session: str | None = None,
    ) -> list[dict[str, Any]]:
        """One ``/v1/completions`` request per prompt (token ids, or text the servers tokenize),
        through the router (prefill, then decode); dicts shaped like the offline node's
        (:func:`~kvcompose_tools.e2e.server.parse_completion`), with ``prompt_token_ids``. ``session``
        goes in :data:`SESSION_HEADER` (what ``consistent_hash`` routes by)."""
        results = []
        for prompt in prompts:
            t0 = time.perf_counter()
            body = completion_body(self.model, prompt, max_tokens)
            answer = self._http.post("/v1/completions", body, timeout, _session(session))
            results.append(parse_completion(answer, time.perf_counter() - t0))
        return results

    def chat(
        self,
        messages: list[dict[str, str]],
        max_tokens: int,
        timeout: float = CALL_TIMEOUT_S,
        session: str | None = None,
    ) -> dict[str, Any]:
        """One ``/v1/chat/completions`` request through the router; the dict of
        :func:`~kvcompose_tools.e2e.server.parse_chat` (token ids, logprobs, the reply's text, the
        prompt's token ids as decode rendered them). ``session``: as in :meth:`generate`."""
        t0 = time.perf_counter()
        body = chat_body(self.model, messages, max_tokens)
        answer = self._http.post("/v1/chat/completions", body, timeout, _session(session))
        return parse_chat(answer, time.perf_counter() - t0)

    def router_metrics(self) -> dict[str, float]:
        """The router's own counters and summaries (``vllm_router_*``), keyed as
        :func:`~kvcompose_tools.e2e.metrics.parse_metrics` keys vLLM's."""
        return parse_metrics(self._metrics.request("GET", "/metrics").decode(), prefix="vllm_router_")

    #: What close() waits for the router to exit before it kills the group.
    close_grace_s = 5.0

    def close(self, grace_s: float | None = None) -> None:
        if self.registrar is not None:
            self.registrar.close()
        super().close(grace_s)

    def log_tail(self, lines: int = 40) -> str:
        """The log's last lines, without the terminal colours the router writes even to a file."""
        return ANSI.sub("", super().log_tail(lines))


def _session(session: str | None) -> dict[str, str]:
    return {SESSION_HEADER: session} if session is not None else {}
