"""An engine node: one ``vllm.LLM`` in its own process, driven by JSON commands.

The parent (:class:`EngineNode`) starts ``python -m kvcompose_tools.e2e.node``, which builds the engine
from an :class:`EngineSpec` and answers one JSON line per command on a private pipe (vLLM's own
logging goes to a log file, so it cannot corrupt the replies). Every wait has a deadline, and
:meth:`EngineNode.close` kills the whole process group, engine core included.

Each engine lives in its own process because vLLM keeps process-global state (the OMP thread
pool, Prometheus registry, environment read at import), and because the dead-peer test kills a
prefill engine outright.
"""

from __future__ import annotations

import functools
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcompose_tools.e2e.affinity import engine_up
from kvcompose_tools.e2e.metrics import flatten_metrics
from kvcompose_tools.e2e.processes import CALL_TIMEOUT_S, NodeError, ProcessNode
from kvcompose_tools.e2e.spec import ENGINE_ENV, EngineSpec, engine_env, placed

if TYPE_CHECKING:
    from kvcompose_tools.e2e.hosts import Host

#: How long :func:`wait_all_ready` waits for every engine to come up.
START_TIMEOUT_S = 300.0


# ---------------------------------------------------------------------------- parent side


class EngineNode(ProcessNode):
    """Handle on one engine process. Start several, then :func:`wait_all_ready`. ``host``: the
    process runs in that host (:mod:`kvcompose_tools.e2e.hosts`), with its network settings."""

    def __init__(
        self, spec: EngineSpec, log_dir: Path, extra_env: dict[str, str] | None = None, host: Host | None = None
    ) -> None:
        spec = placed(spec, host)
        self.spec = spec
        read_fd, write_fd = os.pipe()
        env = engine_env({**(host.env() if host else {}), **spec.env(), **(extra_env or {})})
        env["KVCOMPOSE_NODE_FD"] = str(write_fd)
        self._env = env
        argv = [sys.executable, "-m", "kvcompose_tools.e2e.node", json.dumps(asdict(spec))]
        super().__init__(
            spec.name,
            f"{spec.name} engine",
            argv,
            log_dir,
            host,
            env,
            stdin=subprocess.PIPE,
            pass_fds=(write_fd,),
            text=True,
        )
        os.close(write_fd)
        self._replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, args=(read_fd,), daemon=True)
        self._reader.start()
        self.stage = "starting"
        self.ready_info: dict[str, Any] | None = None

    def _read(self, fd: int) -> None:
        with os.fdopen(fd, "r") as pipe:
            for line in pipe:
                self._replies.put(json.loads(line))
        self._replies.put(None)  # the process closed its end: it exited

    def _next(self, deadline: float, what: str) -> dict[str, Any]:
        while True:
            try:
                msg = self._replies.get(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() >= deadline:
                    raise NodeError(f"{self.spec.name}: no answer to {what} in time\n{self.log_tail()}") from None
                continue
            if msg is None:
                raise NodeError(
                    f"{self.spec.name}: process exited (rc={self.proc.wait(5)}) during {what}\n{self.log_tail()}"
                )
            if msg.get("event") == "stage":
                self.stage = msg["stage"]
                continue
            return msg

    def poll_ready(self, timeout: float = 0.0) -> bool:
        """True once the engine is up; raises :class:`NodeError` if it died starting."""
        if self.ready_info is not None:
            return True
        try:
            msg = self._next(time.monotonic() + timeout, "start")
        except NodeError:
            if self.proc.poll() is None:  # still starting
                return False
            raise
        if msg.get("event") != "ready":
            raise NodeError(f"{self.spec.name}: failed to start: {msg.get('error')}\n{self.log_tail()}")
        self.ready_info = msg
        self.stage = "ready"
        engine_up(self.proc, self._env)
        return True

    def call(self, op: str, timeout: float = CALL_TIMEOUT_S, **args: Any) -> Any:
        """Run one command in the engine process and return its result."""
        if self.proc.poll() is not None:
            raise NodeError(f"{self.spec.name}: process has exited (rc={self.proc.returncode})\n{self.log_tail()}")
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        msg = self._next(time.monotonic() + timeout, op)
        if "error" in msg:
            raise NodeError(f"{self.spec.name}: {op} failed: {msg['error']}")
        return msg["result"]

    def generate(
        self,
        prompts: list[list[int]],
        max_tokens: int,
        kv_transfer_params: list[dict[str, Any] | None] | None = None,
        timeout: float = CALL_TIMEOUT_S,
        detokenize: bool = False,
        ignore_eos: bool = False,
    ) -> list[dict[str, Any]]:
        """Greedy generation with 1 logprob per token; one dict per prompt (see ``_generate``).
        ``detokenize``: also the answer's ``text``, by vLLM's own detokenizer (what a server's
        reply holds). ``ignore_eos``: every answer ``max_tokens`` long."""
        extra = {"detokenize": True} if detokenize else {}
        if ignore_eos:
            extra["ignore_eos"] = True
        return self.call(
            "generate",
            timeout=timeout,
            prompts=prompts,
            max_tokens=max_tokens,
            kv_transfer_params=kv_transfer_params,
            **extra,
        )

    def metrics(self) -> dict[str, float]:
        """The engine's Prometheus counters, flattened (see :func:`flatten_metrics`)."""
        return self.call("metrics")

    def reset_prefix_cache(self, connectors: bool = False) -> bool:
        """Drop the engine's own (device) prefix cache; the connectors keep what they hold, unless
        ``connectors``: then each child that implements vLLM's ``reset_cache`` drops its cache too
        (the host tier does; a connector without ``reset_cache``, such as ExampleConnector's files
        on disk, keeps it)."""
        return self.call("reset_prefix_cache", reset_connector=connectors)

    def next_request_id(self) -> int:
        """The id ``vllm.LLM`` gives the next prompt it is sent: its request counter, which each
        prompt of a :meth:`generate` takes in turn (a prompt vLLM refuses too). vLLM's push mode
        matches a decode's registration to the prefill's request of the same id, its random
        suffix aside: two offline engines in push P/D must be sent prompts in step."""
        return self.call("next_request_id")

    def ask_exit(self) -> None:
        """Ask the engine process to exit (it shuts its engine down)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
        self.proc.stdin.flush()


def wait_all_ready(
    nodes: list[EngineNode],
    timeout: float = START_TIMEOUT_S,
    progress: Callable[[list[EngineNode], float], None] | None = None,
    every_s: float = 5.0,
) -> None:
    """Wait until every node is up, calling ``progress(nodes, elapsed)`` every ``every_s``."""
    start = time.monotonic()
    last = start
    while True:
        pending = [n for n in nodes if not n.poll_ready(0.2)]
        elapsed = time.monotonic() - start
        if not pending:
            return
        if elapsed > timeout:
            raise NodeError(
                f"engines not ready after {timeout:.0f} s: "
                + ", ".join(f"{n.spec.name} ({n.stage})" for n in pending)
                + "\n"
                + pending[0].log_tail()
            )
        if progress is not None and time.monotonic() - last >= every_s:
            last = time.monotonic()
            progress(nodes, elapsed)


# ---------------------------------------------------------------------------- child side


def _generate(
    llm: Any,
    prompts: list[list[int]],
    max_tokens: int,
    kv_transfer_params: list[dict[str, Any] | None] | None,
    detokenize: bool = False,
    ignore_eos: bool = False,
) -> list[dict[str, Any]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = []
    for i in range(len(prompts)):
        kv = kv_transfer_params[i] if kv_transfer_params else None
        params.append(
            SamplingParams(
                max_tokens=max_tokens,
                temperature=0,
                detokenize=detokenize,
                logprobs=1,
                ignore_eos=ignore_eos,
                extra_args={"kv_transfer_params": kv} if kv is not None else None,
            )
        )
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    results = []
    for o in outs:
        comp = o.outputs[0]
        logprobs = [lp[t].logprob for t, lp in zip(comp.token_ids, comp.logprobs or [])]
        stats = getattr(o, "metrics", None)
        results.append(
            {
                "token_ids": list(comp.token_ids),
                "logprobs": logprobs,
                "finish_reason": comp.finish_reason,
                "kv_transfer_params": o.kv_transfer_params,
                "text": comp.text if detokenize else None,
                # From arrival in this engine to its first token (RequestStateStats).
                "ttft_s": getattr(stats, "first_token_latency", None),
                # Inside the engine core (its clock): queued -> scheduled (a remote load's wait)
                # and scheduled -> first token (the step that computes it).
                "phases_s": _phases(stats),
                # Prompt tokens served from a prefix cache, the engine's own or a connector's.
                "num_cached_tokens": o.num_cached_tokens,
                "wall_s": wall,
            }
        )
    return results


#: A request's phases inside the engine core (:func:`_phases`): ``waiting``, queued to scheduled
#: (a remote load's pull and the steps polling it), and ``first_step``, scheduled to its first
#: token (the step that computes it).
PHASES = ("waiting", "first_step")


def _phases(stats: Any) -> dict[str, float] | None:
    """A request's engine-core :data:`PHASES` from vLLM's ``RequestStateStats`` (None without them)."""
    queued, scheduled, first = (getattr(stats, k, 0.0) for k in ("queued_ts", "scheduled_ts", "first_token_ts"))
    if not (queued and scheduled and first):
        return None
    return dict(zip(PHASES, (scheduled - queued, first - scheduled)))


def _serve(spec: EngineSpec, reply: Callable[[dict[str, Any]], None]) -> None:
    reply({"event": "stage", "stage": "importing vllm"})
    from vllm import LLM
    from vllm.config import KVEventsConfig, KVTransferConfig

    kwargs = spec.llm_kwargs()
    ktc = spec.kv_transfer_config()
    if ktc is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(**ktc)
    if spec.kv_events is not None:
        kwargs["kv_events_config"] = KVEventsConfig(**spec.kv_events)
    reply({"event": "stage", "stage": "building engine"})
    t0 = time.monotonic()
    llm = LLM(**kwargs)
    reply({"event": "ready", "start_s": round(time.monotonic() - t0, 1), "pid": os.getpid()})
    ops: dict[str, Callable[..., Any]] = {
        "generate": functools.partial(_generate, llm),
        "metrics": lambda: flatten_metrics(llm.get_metrics()),
        "reset_prefix_cache": lambda reset_connector=False: bool(
            llm.reset_prefix_cache(reset_connector=reset_connector)
        ),
        "next_request_id": lambda: llm.request_counter.counter,
    }
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        if op == "exit":
            break
        try:
            reply({"result": ops[op](**cmd)})
        except Exception as exc:  # reported to the parent, which decides
            reply({"error": f"{type(exc).__name__}: {exc}"})


def main(argv: list[str]) -> int:
    spec = EngineSpec(**json.loads(argv[0]))
    fd = int(os.environ.pop("KVCOMPOSE_NODE_FD"))
    os.set_inheritable(fd, False)  # the engine core must not hold the reply pipe open
    out = os.fdopen(fd, "w", buffering=1)
    os.environ.update(ENGINE_ENV)

    def reply(msg: dict[str, Any]) -> None:
        out.write(json.dumps(msg) + "\n")

    try:
        _serve(spec, reply)
    except Exception as exc:
        reply({"event": "failed", "error": f"{type(exc).__name__}: {exc}"})
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
