"""An engine node: one ``vllm.LLM`` in its own process, driven by JSON commands.

The parent (:class:`EngineNode`) starts ``python -m kvcompose.e2e.node``, which builds the engine
from an :class:`EngineSpec` and answers one JSON line per command on a private pipe (vLLM's own
logging goes to a log file, so it cannot corrupt the replies). Every wait has a deadline, and
:meth:`EngineNode.close` kills the whole process group, engine core included.

Each engine lives in its own process because vLLM keeps process-global state (the OMP thread
pool, Prometheus registry, environment read at import), and because the dead-peer test kills a
prefill engine outright.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvcompose.catalog import Plan
    from kvcompose.e2e.hosts import Host

#: vLLM block size the nodes use; the tiny model's KV block is 32 KiB at this size.
BLOCK_SIZE = 32
MAX_MODEL_LEN = 1024
#: Environment every engine gets: a 1 GiB KV budget; one reserved core so the worker's OMP
#: thread count, and thus float rounding, does not change with the connector (otherwise logprobs
#: drift from the baseline at ~1e-6 on 2 cores); and no torch.compile. With ``enforce_eager``
#: the one thing vLLM compiles on the CPU platform is its logprobs helper
#: (``batched_count_greater_than``), lazily, inductor on the first request that asks for
#: logprobs: 4-19 s on this machine, up to 46 s with two engines compiling at once, inside
#: whichever request comes first. Every check here asks for logprobs, and that wait is vLLM's
#: own first-request cost, not the connectors' (``docs/e2e.md``, cold start).
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "TORCHDYNAMO_DISABLE": "1"}
START_TIMEOUT_S = 300.0
CALL_TIMEOUT_S = 120.0


def log_tail(path: Path, lines: int = 40, skip: re.Pattern[str] | None = None) -> str:
    """The last ``lines`` lines of an engine's log ('' while there is none), without the lines
    ``skip`` matches."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    kept = text if skip is None else [line for line in text if not skip.search(line)]
    return "\n".join(kept[-lines:])


def engine_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment for an engine process: :data:`ENGINE_ENV` on top, and no
    inherited NIXL side-channel variables (each engine gets its port from its composition)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_NIXL_SIDE_CHANNEL")}
    env.update(ENGINE_ENV)
    env.update(extra or {})
    return env


class NodeError(RuntimeError):
    """An engine node failed to start, died, or did not answer in time; carries its log tail."""


@dataclass
class EngineSpec:
    """What one engine process runs.

    ``composition`` is a kvcompose YAML file (``None``: no connector, a baseline engine).
    ``side_channel_port`` and ``nixl_options`` override the ``nixl`` children's options, so that
    a shipped example can run with a free port or with the handshake check off. ``kv_config`` is a
    ``KVTransferConfig`` as is, instead of a composition (a benchmark's bare-connector baseline).
    """

    name: str
    model: str
    composition: str | None = None
    side_channel_port: int | None = None
    nixl_options: dict[str, Any] = field(default_factory=dict)
    #: vLLM's ``kv_load_failure_policy``: "fail" (vLLM's default) or "recompute".
    kv_load_failure_policy: str | None = None
    num_gpu_blocks: int = 256
    seed: int = 0
    kv_config: dict[str, Any] | None = None
    #: vLLM's ``KVEventsConfig`` as a dict (:func:`kvcompose.e2e.events.kv_events_config`): the
    #: engine publishes its KV cache events, the connector's included.
    kv_events: dict[str, Any] | None = None
    #: Tensor-parallel workers (one process each). On vLLM's CPU platform TP > 1 also needs each
    #: worker's OpenMP threads bound to cores of its own: :meth:`env`.
    tensor_parallel_size: int = 1

    def kv_transfer_config(self) -> dict[str, Any] | None:
        """The ``KVTransferConfig`` kwargs: ``kv_config``, or the composition's with this spec's
        overrides."""
        if self.kv_config is not None:
            return dict(self.kv_config)
        if self.composition is None:
            return None
        return composed_kv_transfer_config(
            Path(self.composition), self.side_channel_port, self.nixl_options, self.kv_load_failure_policy
        )

    def llm_kwargs(self) -> dict[str, Any]:
        """``vllm.LLM`` keyword arguments (the same engine settings the HTTP servers get)."""
        return {
            # With the model's tokenizer: text prompts and chat work, and token-id prompts as before
            # (EOS is config.json's id either way).
            "model": self.model,
            "load_format": "safetensors",
            "dtype": "float32",
            "max_model_len": MAX_MODEL_LEN,
            "enforce_eager": True,
            "block_size": BLOCK_SIZE,
            "seed": self.seed,
            "num_gpu_blocks_override": self.num_gpu_blocks,
            "disable_log_stats": False,  # the Prometheus counters the checks read
            **({"kv_events_config": self.kv_events} if self.kv_events is not None else {}),
            **({"tensor_parallel_size": self.tensor_parallel_size} if self.tensor_parallel_size > 1 else {}),
        }

    def env(self) -> dict[str, str]:
        """Environment this engine needs beyond :data:`ENGINE_ENV`: with TP > 1, one core per
        worker (``VLLM_CPU_OMP_THREADS_BIND`` ``0|1|...``; vLLM's CPU default binds by NUMA node
        and leaves a 2-core host's second worker nothing)."""
        if self.tensor_parallel_size <= 1:
            return {}
        return {OMP_BIND_ENV: "|".join(str(i) for i in range(self.tensor_parallel_size))}


def placed(spec: EngineSpec, host: Host | None) -> EngineSpec:
    """``spec`` as it runs in ``host`` (:mod:`kvcompose.e2e.hosts`): its ``nixl`` children's side
    channel on the host's address, unless the spec names one; as it is without a host."""
    if host is None:
        return spec
    return replace(spec, nixl_options={"side_channel_host": host.address, **spec.nixl_options})


def composed_kv_transfer_config(
    composition: Path,
    side_channel_port: int | None = None,
    nixl_options: dict[str, Any] | None = None,
    kv_load_failure_policy: str | None = None,
) -> dict[str, Any]:
    """What ``kvcompose vllm-args`` renders for ``composition``, with nixl option overrides."""
    from kvcompose.vllm.args import kv_transfer_config

    return kv_transfer_config(composed_plan(composition, side_channel_port, nixl_options, kv_load_failure_policy))


def composed_plan(
    composition: Path,
    side_channel_port: int | None = None,
    nixl_options: dict[str, Any] | None = None,
    load_failure: str | None = None,
) -> Plan:
    """The composition's :class:`~kvcompose.compose.Plan`, its ``nixl`` children's options
    overridden (a free side-channel port, the handshake check off, ...) and, when given, its
    ``load_failure`` (vLLM's ``kv_load_failure_policy``)."""
    from kvcompose.compose import build, load
    from kvcompose.config import from_builtins, to_builtins

    plan = load(composition)
    overrides = dict(nixl_options or {})
    if side_channel_port is not None:
        overrides["side_channel_port"] = side_channel_port
    if overrides or load_failure is not None:
        data = to_builtins(plan.composition)
        for child in data["connectors"]:
            if child["type"] == "nixl":
                child["options"] = {**child.get("options", {}), **overrides}
        if load_failure is not None:
            data["load_failure"] = load_failure
        plan = build(from_builtins(data, str(composition)))
    return plan


# ---------------------------------------------------------------------------- parent side


class EngineNode:
    """Handle on one engine process. Start several, then :meth:`wait_ready` on each. ``host``:
    the process runs in that host (:mod:`kvcompose.e2e.hosts`), with its network settings."""

    def __init__(
        self, spec: EngineSpec, log_dir: Path, extra_env: dict[str, str] | None = None, host: Host | None = None
    ) -> None:
        spec = placed(spec, host)
        self.spec = spec
        self.host = host
        self.log_path = log_dir / f"{spec.name}.log"
        log_dir.mkdir(parents=True, exist_ok=True)
        read_fd, write_fd = os.pipe()
        env = engine_env({**(host.env() if host else {}), **spec.env(), **(extra_env or {})})
        env["KVCOMPOSE_NODE_FD"] = str(write_fd)
        self._log = open(self.log_path, "w")
        self.started_at = time.monotonic()
        self._env = env
        argv = [sys.executable, "-m", "kvcompose.e2e.node", json.dumps(asdict(spec))]
        self.proc = start_group(
            f"{spec.name} engine",
            host.command(argv) if host else argv,
            stdin=subprocess.PIPE,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
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

    @property
    def name(self) -> str:
        return self.spec.name

    def generate(
        self,
        prompts: list[list[int]],
        max_tokens: int,
        kv_transfer_params: list[dict[str, Any] | None] | None = None,
        timeout: float = CALL_TIMEOUT_S,
        detokenize: bool = False,
    ) -> list[dict[str, Any]]:
        """Greedy generation with 1 logprob per token; one dict per prompt (see ``_generate``).
        ``detokenize``: also the answer's ``text``, by vLLM's own detokenizer (what a server's
        reply holds)."""
        extra = {"detokenize": True} if detokenize else {}
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

    def log_tail(self, lines: int = 40) -> str:
        return log_tail(self.log_path, lines)

    def kill(self) -> None:
        """SIGKILL the engine's whole process group now (the dead-peer tests use this)."""
        signal_group(self.proc, signal.SIGKILL)
        self.proc.wait(30)

    def close(self, grace_s: float = 10.0) -> None:
        """Ask the engine to exit, then kill its process group if it has not within ``grace_s``."""
        stop_group(self.proc, grace_s, ask=self._ask_exit)
        self._log.close()

    def _ask_exit(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
        self.proc.stdin.flush()


#: The process groups :func:`start_group` started and :func:`stop_group` has not stopped yet, by
#: leader pid, with a name for messages: what an interrupted command stops
#: (:func:`stopped_on_interrupt`).
_RUNNING: dict[int, tuple[str, subprocess.Popen[Any]]] = {}


def start_group(name: str, argv: list[str], **popen: Any) -> subprocess.Popen[Any]:
    """Start ``argv`` as the leader of a process group of its own (vLLM's engine core and API
    server children join it), so that :func:`stop_group` reaches all of them and a terminal's
    Ctrl-C reaches only this process, which then stops them (:func:`stopped_on_interrupt`).

    The group stays in this process's session: Linux schedules each session as a group of its
    own (autogroup), and an idle vLLM worker's ``sched_yield`` busy-wait then yields only inside
    its own engine's group, keeping the core vLLM binds every engine's worker to from the other
    engine's worker (docs/e2e.md, stalls under load)."""
    proc: subprocess.Popen[Any] = subprocess.Popen(argv, process_group=0, **popen)
    _RUNNING[proc.pid] = (name, proc)
    return proc


#: Set to 1 (``make test`` does, for the engine tests), the kit calls :func:`spread_group` on
#: every engine it starts once it is up. Off by default: the benchmarks and the demo measure
#: vLLM's own thread layout, and spreading costs decode TTFT there (docs/e2e.md, cold start).
SPREAD_ENV = "KVCOMPOSE_SPREAD_ENGINE_THREADS"


#: vLLM's CPU platform variable that names each worker's cores; unset or ``auto``, vLLM picks them.
OMP_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def engine_up(proc: subprocess.Popen[Any], env: Mapping[str, str]) -> None:
    """What the kit does to an engine's processes once it is up: :func:`spread_group` where
    :data:`SPREAD_ENV` asks for it and vLLM's auto-bind placed the engine (``env``, the engine's
    environment, names no cores in :data:`OMP_BIND_ENV`).

    An engine whose cores were named keeps them: a TP-2 decode with a core per worker, spread,
    often missed vLLM's fixed 5 s NIXL handshake timeout, bound it did not (docs/e2e.md, cold
    start)."""
    if os.environ.get(SPREAD_ENV) == "1" and env.get(OMP_BIND_ENV, "auto") == "auto":
        spread_group(proc)


def spread_group(proc: subprocess.Popen[Any]) -> int:
    """Let every thread of ``proc``'s process group (started by :func:`start_group`) run on every
    CPU this process may use; the number of threads changed.

    vLLM's CPU platform binds each engine's worker main (OpenMP) thread to the cores its auto-bind
    picks and confines the worker's other threads, the NIXL agent's among them, to its reserved
    CPU. Its auto-bind does not know about the other engines on the host, so on a 2-core host
    every engine lands on the same two single cores, and a new P/D pair's first READ then often
    stalls until the prefill's lease expires (measured in docs/e2e.md, cold start). The
    engines' thread counts are fixed by then, so their answers do not change.
    """
    cpus = os.sched_getaffinity(0)
    changed = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if os.getpgid(int(entry.name)) != proc.pid:
                continue
            tids = [int(t) for t in os.listdir(f"/proc/{entry.name}/task")]
        except OSError:  # ended meanwhile, or not ours to read
            continue
        for tid in tids:
            try:
                if os.sched_getaffinity(tid) != cpus:
                    os.sched_setaffinity(tid, cpus)
                    changed += 1
            except OSError:
                continue
    return changed


def signal_group(proc: subprocess.Popen[Any], sig: int) -> None:
    """Send ``sig`` to the process group of ``proc`` (a process this package started with its own
    group); a group already gone is not an error."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def stop_group(proc: subprocess.Popen[Any], grace_s: float, ask: Callable[[], None] | None = None) -> None:
    """Stop ``proc`` and its process group: ``ask`` it to exit (default: SIGTERM to the group),
    wait ``grace_s``, then SIGKILL the group either way (vLLM's engine core is a child that can
    outlive its parent)."""
    if proc.poll() is None:
        try:
            if ask is None:
                signal_group(proc, signal.SIGTERM)
            else:
                ask()
            proc.wait(grace_s)
        except (OSError, subprocess.TimeoutExpired):
            pass
    signal_group(proc, signal.SIGKILL)
    proc.wait(30)
    _RUNNING.pop(proc.pid, None)


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM) arrived; every process group started here is already stopped."""

    def __init__(self, signum: int, stopped: list[str]) -> None:
        super().__init__(signum, stopped)
        self.signum = signum
        self.stopped = stopped

    def message(self, command: str) -> str:
        """What the command prints about it."""
        why = signal.Signals(self.signum).name
        if not self.stopped:
            return f"kvcompose {command}: interrupted ({why}); no engine or router process was running"
        return (
            f"kvcompose {command}: interrupted ({why}); stopped the {len(self.stopped)} engine/router "
            f"process groups it started: {', '.join(self.stopped)}"
        )


@contextlib.contextmanager
def stopped_on_interrupt(grace_s: float = 5.0) -> Iterator[None]:
    """Within: SIGINT or SIGTERM first stops every process group :func:`start_group` started and
    that is still running (SIGTERM, then SIGKILL after ``grace_s``), then raises
    :class:`Interrupted` naming them, so the code unwinds past processes that are already gone.

    Their own process groups keep a terminal's Ctrl-C from reaching the engines, so this process
    is the one that must stop them. Further signals are ignored while it does (a second Ctrl-C
    would otherwise cut the cleanup short and leave engines behind).
    """

    def stop_all(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stopped = []
        for name, proc in list(_RUNNING.values()):
            stop_group(proc, grace_s)
            stopped.append(f"{name} (pid {proc.pid})")
        raise Interrupted(signum, stopped)

    previous = {sig: signal.signal(sig, stop_all) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


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


def flatten_metrics(metrics: list[Any]) -> dict[str, float]:
    """``name{labels}`` -> value for counters and gauges; histograms as ``name_sum``/``name_count``.

    The ``engine`` and ``model_name`` labels are dropped; the HTTP variant parses ``/metrics``
    into the same keys.
    """
    out: dict[str, float] = {}
    for m in metrics:
        if hasattr(m, "sum") and hasattr(m, "count"):
            out[metric_key(m.name + "_sum", m.labels)] = float(m.sum)
            out[metric_key(m.name + "_count", m.labels)] = float(m.count)
        elif isinstance(getattr(m, "value", None), (int, float)):
            out[metric_key(m.name, m.labels)] = float(m.value)
    return out


def metric_key(name: str, labels: dict[str, str]) -> str:
    """``name{k=v,...}`` with sorted labels, less the per-instance ``engine``/``model_name``."""
    kept = ",".join(f"{k}={v}" for k, v in sorted(labels.items()) if k not in ("engine", "model_name"))
    return f"{name}{{{kept}}}" if kept else name


# ---------------------------------------------------------------------------- child side


def _generate(
    llm: Any,
    prompts: list[list[int]],
    max_tokens: int,
    kv_transfer_params: list[dict[str, Any] | None] | None,
    detokenize: bool = False,
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


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports on 127.0.0.1 that are free now, from below the kernel's
    ephemeral range.

    A port the kernel hands out for ``bind(0)`` is one it may hand out again the next moment:
    an engine starting beside another opens dozens of sockets on ephemeral ports (UCX's tcp
    listeners, ZMQ), and one took a side-channel port picked that way before its engine bound
    it. Ports below the range are never given out implicitly.
    """
    import random
    import socket

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    ports: list[int] = []
    for port in random.sample(range(max(1024, low - 12_000), low), k=min(400, low - 1024)):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == n:
            return ports
    raise NodeError(f"no {n} free TCP ports below {low} on 127.0.0.1")


@contextlib.contextmanager
def pd_pair(
    prefill_composition: str | Path,
    decode_composition: str | Path,
    model: str | Path,
    log_dir: Path,
    progress: Callable[[list[EngineNode], float], None] | None = None,
    **decode_overrides: Any,
) -> Iterator[tuple[EngineNode, EngineNode]]:
    """A prefill and a decode engine from two composition files, started in parallel, each with
    its own free side-channel port; both are killed on exit. ``decode_overrides`` go to the
    decode :class:`EngineSpec` (e.g. ``kv_load_failure_policy="recompute"``)."""
    p_port, d_port = free_ports(2)
    nodes: list[EngineNode] = []
    try:
        nodes.append(EngineNode(EngineSpec("prefill", str(model), str(prefill_composition), p_port), log_dir))
        nodes.append(
            EngineNode(EngineSpec("decode", str(model), str(decode_composition), d_port, **decode_overrides), log_dir)
        )
        wait_all_ready(nodes, progress=progress)
        yield nodes[0], nodes[1]
    finally:
        for n in nodes:
            n.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
