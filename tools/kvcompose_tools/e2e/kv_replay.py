"""Replay KV event batches into vllm-router's own indexer, with no engine behind it.

vllm-router's ``kv_aware`` policy (regular mode) subscribes to each worker's ``--kv-event-source``
(a ZMQ endpoint it connects to), indexes the ``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared`` it receives, and for each request credits the prefix it finds held by a
worker (``credited_prefix_tokens`` in its debug log). :func:`replay` starts that real router
binary in front of two stand-in workers (:class:`StandInWorker`: they answer what the router
asks of a worker, and nothing runs on them), publishes the given batches on a ZMQ PUB socket as
vLLM's publisher does (``[topic, seq, msgpack payload]``), sends each prompt (token ids, so the
router needs no tokenizer) and returns the router's decisions.

The batches are the raw msgpack payloads of vLLM's ``KVEventBatch``: recorded from a real engine
(:class:`kvcompose_tools.e2e.events.EventListener` keeps them, :func:`save_recording` writes
them) or encoded here from vLLM's own event types (:func:`encode`).
"""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from kvcompose_tools.e2e.ports import free_ports
from kvcompose_tools.e2e.processes import NodeError, start_group, stop_group
from kvcompose_tools.e2e.router import ANSI, ROUTER_MODULE

HOST = "127.0.0.1"
#: The served model's name the stand-ins report and the requests and ``--kv-event-model`` carry.
MODEL = "replay"
#: The router's line for each ``kv_aware`` placement (src/policies/kv_aware.rs in vllm-router
#: 0.1.17, its debug level).
DECISION = re.compile(
    r'KV prefix decision outcome="(?P<outcome>[^"]*)" worker="(?P<worker>[^"]*)" '
    r"input_tokens=(?P<input>\d+) new_prefill_tokens=(?P<new>\d+) credited_prefix_tokens=(?P<credited>\d+)"
)
#: How long :func:`replay` waits for the router's subscriber to take in a first batch.
PROBE_S = 5.0
#: The router's line for each event batch its subscriber took in (src/kv_index/subscriber.rs).
SEQUENCE = re.compile(r"kv_index live sequence advanced source=\S+ rank=\d+ seq=(?P<seq>\d+)")


@dataclass(frozen=True)
class Decision:
    """One ``kv_aware`` placement as the router logged it."""

    outcome: str
    worker: str
    input_tokens: int
    new_prefill_tokens: int
    credited_prefix_tokens: int


def encode(events: Sequence[Any], ts: float | None = None) -> bytes:
    """A batch of vLLM's own event objects as vLLM's ZMQ publisher encodes it."""
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch

    return msgspec.msgpack.Encoder().encode(KVEventBatch(ts=time.time() if ts is None else ts, events=list(events)))


def decode(payload: bytes) -> list[Any]:
    """A recorded payload's events, as vLLM's own types."""
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch

    return list(msgspec.msgpack.Decoder(type=KVEventBatch).decode(payload).events)


def without_stores(payloads: Sequence[bytes], medium: str) -> list[bytes]:
    """The payloads less every store on ``medium``: what a relay that lost that tier's stores
    passes on (the control of a test that credits the tier)."""
    from vllm.distributed.kv_events import BlockStored

    def kept(e: Any) -> bool:
        return not (isinstance(e, BlockStored) and e.medium == medium)

    return [encode([e for e in decode(p) if kept(e)]) for p in payloads]


def save_recording(path: Path, payloads: Sequence[bytes], prompts: Sequence[Sequence[int]], **about: Any) -> None:
    """Write a recording: the payloads (base64) in the order they were published, the prompts
    whose blocks they describe, and ``about`` (what engine, which composition, block size)."""
    doc = {
        "about": about,
        "prompts": [list(p) for p in prompts],
        "batches": [base64.b64encode(p).decode() for p in payloads],
    }
    path.write_text(json.dumps(doc, indent=1) + "\n")


def load_recording(path: Path) -> tuple[list[bytes], list[list[int]], dict[str, Any]]:
    """A recording's payloads, prompts and description (:func:`save_recording`)."""
    doc = json.loads(path.read_text())
    return [base64.b64decode(b) for b in doc["batches"]], doc["prompts"], doc["about"]


class _Handler(BaseHTTPRequestHandler):
    server: _StandInServer

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        pass

    def _send(self, code: int, obj: Any) -> None:
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self.server.paths.append(("GET", self.path))
        if self.path.startswith("/health"):
            self._send(200 if self.server.healthy else 503, {})
        elif self.path.startswith("/v1/models"):
            self._send(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
        else:  # /get_server_info, /kv_event_sources: the router falls back to its static sources
            self._send(404, {"error": f"{self.path} is not served by a stand-in"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        self.server.paths.append(("POST", self.path))
        prompt = body.get("prompt")
        if self.path == "/v1/completions" and isinstance(prompt, list):
            self.server.served += 1
            usage = {"prompt_tokens": len(prompt), "completion_tokens": 1, "total_tokens": len(prompt) + 1}
            choice = {"index": 0, "text": "", "finish_reason": "length", "logprobs": None}
            self._send(200, {"id": "replay", "object": "text_completion", "created": 0, "model": MODEL,
                             "choices": [choice], "usage": usage})  # fmt: skip
        else:
            self._send(404, {"error": f"{self.path} with this body is not served by a stand-in"})


class _StandInServer(ThreadingHTTPServer):
    paths: list[tuple[str, str]]
    served: int
    healthy: bool


class StandInWorker:
    """An HTTP server on 127.0.0.1 that answers what vllm-router asks of a worker (``/health``,
    ``/v1/models``, a ``/v1/completions`` with token ids) and runs nothing; :attr:`healthy` False
    makes its ``/health`` answer 503."""

    def __init__(self) -> None:
        self._server = _StandInServer((HOST, 0), _Handler)
        self._server.paths = []
        self._server.served = 0
        self._server.healthy = True
        self.url = f"http://{HOST}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name=f"stand-in {self.url}", daemon=True)
        self._thread.start()

    @property
    def served(self) -> int:
        """Completions this worker answered."""
        return self._server.served

    @property
    def healthy(self) -> bool:
        """Whether its ``/health`` answers 200 (else 503)."""
        return self._server.healthy

    @healthy.setter
    def healthy(self, value: bool) -> None:
        self._server.healthy = value

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def router_argv(
    workers: Sequence[str], source: str, endpoint: str, port: int, metrics_port: int, block_size: int
) -> list[str]:
    """vllm-router in regular mode, ``kv_aware``, one static event source (``source`` = the
    worker URL whose events ``endpoint`` publishes)."""
    argv = [sys.executable, "-m", ROUTER_MODULE, "--host", HOST, "--port", str(port), "--worker-urls", *workers]
    argv += ["--policy", "kv_aware", "--kv-event-source", f"{source}={endpoint}"]
    argv += ["--kv-event-block-size", str(block_size), "--kv-event-model", MODEL]
    argv += ["--prometheus-host", HOST, "--prometheus-port", str(metrics_port), "--log-level", "debug"]
    argv += ["--worker-startup-check-interval", "1", "--worker-startup-timeout-secs", "30"]
    return argv


@dataclass
class Replay:
    """What a replay saw: the router's decisions, one per prompt, and its log."""

    decisions: list[Decision]
    log: str
    #: Event batches of the replay the router's subscriber took in (the empty first one not counted).
    batches_seen: int
    #: The worker URLs: ``workers[0]`` is the one the events belong to.
    workers: list[str]


@contextmanager
def _router(argv: list[str], log_path: Path) -> Iterator[subprocess.Popen[Any]]:
    with log_path.open("w") as log:
        proc = start_group("router", argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            yield proc
        finally:
            stop_group(proc, 5.0)


def _log(path: Path) -> str:
    return ANSI.sub("", path.read_text(errors="replace"))


def _post(url: str, body: dict[str, Any], timeout: float) -> None:
    import urllib.request

    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as answer:
        answer.read()


def _wait(what: str, done: Any, proc: subprocess.Popen[Any], log_path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if proc.poll() is not None:
            raise NodeError(f"router exited (rc={proc.returncode}) before {what}; log:\n{_log(log_path)[-3000:]}")
        if time.monotonic() >= deadline:
            raise NodeError(f"router: no {what} after {timeout:.0f} s; log:\n{_log(log_path)[-3000:]}")
        time.sleep(0.1)


def replay(
    payloads: Sequence[bytes],
    prompts: Sequence[Sequence[int]],
    log_dir: Path,
    *,
    block_size: int,
    topic: str = "",
    timeout: float = 60.0,
) -> Replay:
    """Publish ``payloads`` (vLLM ``KVEventBatch`` msgpack, in order) as the first worker's
    events on ``topic``, then send each prompt of ``prompts`` through a real vllm-router
    (``kv_aware``, regular mode, ``--kv-event-block-size block_size``) in front of two stand-in
    workers; the router's decisions, in the order of the prompts.

    The batches go out once, with sequence numbers from 1, after an empty batch the router took
    in (or, when it takes in none, :data:`PROBE_S` of trying: then nothing is indexed and the
    decisions show it); :attr:`Replay.batches_seen` counts the batches it took in.
    """
    import urllib.error

    import zmq

    workers = [StandInWorker(), StandInWorker()]
    port, metrics_port, zmq_port = free_ports(3)
    endpoint = f"tcp://{HOST}:{zmq_port}"
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.bind(endpoint)
    log_path = log_dir / "router-replay.log"
    urls = [w.url for w in workers]
    argv = router_argv(urls, urls[0], endpoint, port, metrics_port, block_size)
    try:
        with _router(argv, log_path) as proc:
            import urllib.request

            def healthy() -> bool:
                try:
                    with urllib.request.urlopen(f"http://{HOST}:{port}/health", timeout=1):
                        return True
                except (urllib.error.URLError, OSError):
                    return False

            _wait("health", healthy, proc, log_path, timeout)

            def taken() -> list[int]:
                return [int(m["seq"]) for m in SEQUENCE.finditer(_log(log_path))]

            # An empty batch first, until the router takes it in: a ZMQ subscriber misses what
            # was sent before it connected, and a recording replayed from its middle would leave
            # the first stores' children unanchored. On a topic the router does not subscribe to,
            # nothing is ever taken in: then the batches go out once all the same.
            probe = encode([])
            give_up = time.monotonic() + PROBE_S
            while not taken() and time.monotonic() < give_up:
                pub.send_multipart([topic.encode(), (0).to_bytes(8, "big"), probe])
                time.sleep(0.1)
            for seq, payload in enumerate(payloads, start=1):  # vLLM's frames: topic, sequence, batch
                pub.send_multipart([topic.encode(), seq.to_bytes(8, "big"), payload])
            if taken():
                _wait("the last batch", lambda: max(taken()) >= len(payloads), proc, log_path, timeout)
            base = len(DECISION.findall(_log(log_path)))
            for i, prompt in enumerate(prompts):
                body = {"model": MODEL, "prompt": list(prompt), "max_tokens": 1}
                _post(f"http://{HOST}:{port}/v1/completions", body, timeout)
                want = base + i + 1

                def decided(n: int = want) -> bool:
                    return len(DECISION.findall(_log(log_path))) >= n

                _wait(f"the decision for prompt {i}", decided, proc, log_path, timeout)
            log = _log(log_path)
            decisions = [
                Decision(m["outcome"], m["worker"], int(m["input"]), int(m["new"]), int(m["credited"]))
                for m in DECISION.finditer(log)
            ][base:]
            return Replay(decisions, log, max(0, len(SEQUENCE.findall(log)) - 1), urls)
    finally:
        pub.close(linger=0)
        for w in workers:
            w.close()
