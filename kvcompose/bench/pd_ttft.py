"""Benchmark 5b: decode time-to-first-token through kvcompose vs a bare NixlConnector, real engines.

One prefill engine (the shipped ``examples/pd-prefill.yaml``) stays up; decode engines start one
at a time beside it (the machine runs at most two engines), alternating between the sides:

* ``NixlConnector``: the NIXL connector alone, as the decode engine's ``--kv-transfer-config``:
  exactly the child entry the composite hands its ``pd`` child (vLLM's ``NixlConnector`` class
  through the nixl plugin's module path, with the same options), no composite around it;
* ``kvcompose``: the shipped ``examples/pd-decode.yaml`` (host-memory tier + NIXL child, composed).

Every request goes the proxy way (:func:`kvcompose.e2e.flow.decode_request`): prefill with
``do_remote_decode`` and one token, then decode with prefill's ``kv_transfer_params``; decode
pulls the prompt's KV over NIXL. A sample is the decode engine's own time from the request's
arrival to its first token (vLLM's ``first_token_latency``), so the pull, the scheduling and
the connector hooks are in it, the client's IPC is not. Every prompt is new (no prefix hit on
either engine); the first request after each decode start (the NIXL handshake) is not counted.

Why the baseline goes through the nixl plugin's module path: vLLM's NIXL agent polls without
sleeping, so an idle decode engine's worker burns a whole core (measured: ~100% CPU at idle) and
on this 2-core machine that, not the connector, would set the baseline's TTFT. The plugin's
``progress_delay_us`` (100 us, as in the examples) gives both sides the same NIXL agent; its
other overrides are the side-channel options and a check for remote prefills without blocks.

The engines need ``/tmp/kvcompose-engines.lock`` (see :func:`engine_lock`): the benchmark takes
it itself unless the process already holds it (started under ``flock``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvcompose.bench.measure import Samples, ratio
from kvcompose.bench.report import Case, Result, Target
from kvcompose.e2e.node import EngineNode, EngineSpec, engine_env, free_ports, wait_all_ready

EXAMPLES = Path(__file__).resolve().parent.parent.parent / "examples"
LOCK_PATH = "/tmp/kvcompose-engines.lock"
SIDES = ("NixlConnector", "kvcompose")
PROMPT_TOKENS = 600  # 18 full 32-token blocks and a partial one
PER_ROUND = 5  # measured requests per decode engine start
ROUNDS = 2  # decode engine starts per side; the side order flips every round


@dataclass
class BenchSpec(EngineSpec):
    """An :class:`EngineSpec` that may carry a ``kv_transfer_config`` as is (one bare connector)."""

    kv_config: dict[str, Any] | None = None

    def kv_transfer_config(self) -> dict[str, Any] | None:
        if self.kv_config is not None:
            return dict(self.kv_config)
        return super().kv_transfer_config()


class BenchNode(EngineNode):
    """An :class:`EngineNode` whose process runs :func:`node_main` (a :class:`BenchSpec`).

    ``EngineNode`` starts ``kvcompose.e2e.node``, which builds only kvcompose compositions; the
    pipe protocol, waits and shutdown are ``EngineNode``'s.
    """

    def __init__(self, spec: BenchSpec, log_dir: Path, extra_env: dict[str, str] | None = None) -> None:
        # EngineNode.__init__ with this module as the entry point.
        self.spec = spec
        self.log_path = log_dir / f"{spec.name}.log"
        log_dir.mkdir(parents=True, exist_ok=True)
        read_fd, write_fd = os.pipe()
        env = engine_env(extra_env)
        env["KVCOMPOSE_NODE_FD"] = str(write_fd)
        self._log = open(self.log_path, "w")
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", __name__, json.dumps(asdict(spec))],
            stdin=subprocess.PIPE, stdout=self._log, stderr=subprocess.STDOUT, env=env,
            pass_fds=(write_fd,), start_new_session=True, text=True,
        )
        os.close(write_fd)
        self._replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, args=(read_fd,), daemon=True)
        self._reader.start()
        self.stage = "starting"
        self.ready_info: dict[str, Any] | None = None


def node_main(argv: list[str]) -> int:
    """The engine process: ``kvcompose.e2e.node``'s loop, for a :class:`BenchSpec`."""
    from kvcompose.e2e import node

    spec = BenchSpec(**json.loads(argv[0]))
    fd = int(os.environ.pop("KVCOMPOSE_NODE_FD"))
    os.set_inheritable(fd, False)
    out = os.fdopen(fd, "w", buffering=1)
    os.environ.update(node.ENGINE_ENV)

    def reply(msg: dict[str, Any]) -> None:
        out.write(json.dumps(msg) + "\n")

    try:
        node._serve(spec, reply)
    except Exception as exc:
        reply({"event": "failed", "error": f"{type(exc).__name__}: {exc}"})
        raise
    return 0


# ---------------------------------------------------------------------------- the engine lock


def _holds(path: str) -> bool:
    """Whether this process has ``path`` open already (``flock FILE cmd`` hands its fd down)."""
    real = os.path.realpath(path)
    with contextlib.suppress(OSError):
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/self/fd/{fd}") == real:
                    return True
    return False


@contextlib.contextmanager
def engine_lock(path: str = LOCK_PATH, echo: Callable[[str], None] = print) -> Iterator[None]:
    """Hold the machine's engine lock (at most two engines machine-wide) while engines run.

    Started under ``flock FILE`` the process holds it already: a second ``flock`` on a new open
    file would wait for itself, so it is not taken again.
    """
    if _holds(path):
        yield
        return
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            echo(f"   waiting for {path} (another process runs engines) ...")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# ---------------------------------------------------------------------------- the benchmark


DECODE_YAML = EXAMPLES / "pd-decode.yaml"


def nixl_alone(port: int) -> dict[str, Any]:
    """The decode composition's NIXL child as a connector of its own: the child entry
    ``kvcompose vllm-args`` renders for ``pd`` (class, module path, options), with the composite's role."""
    from kvcompose.e2e.node import composed_kv_transfer_config

    composed = composed_kv_transfer_config(DECODE_YAML, port)
    (entry,) = [c for c in composed["kv_connector_extra_config"]["connectors"] if c["kv_connector"] == "NixlConnector"]
    return {**entry, "kv_role": composed["kv_role"]}


def decode_spec(side: str, model: str, port: int) -> BenchSpec:
    """The decode engine of ``side``, its NIXL side channel on ``port``."""
    if side == "kvcompose":
        return BenchSpec(f"decode-{side}", model, str(DECODE_YAML), side_channel_port=port)
    if side == "NixlConnector":
        return BenchSpec(f"decode-{side}", model, kv_config=nixl_alone(port))
    raise ValueError(f"unknown side {side!r}")


def run(quick: bool = False, rounds: int = ROUNDS, per_round: int = PER_ROUND,
        echo: Callable[[str], None] = print, work: Path | None = None) -> Result:
    """Decode TTFT per side, decode engines alternating beside one prefill engine."""
    from kvcompose.e2e.flow import decode_request, token_prompt
    from kvcompose.e2e.model import make_model

    if quick:  # only when asked for by name: `kvcompose bench --quick` leaves this one out
        rounds = 1
    logs = Path(work or tempfile.mkdtemp(prefix="kvcompose-bench-ttft-"))
    model = str(make_model(0))
    samples = {s: Samples() for s in SIDES}
    work_done: dict[str, Counter[str]] = {s: Counter() for s in SIDES}
    starts: dict[str, list[float]] = {s: [] for s in SIDES}
    seed = iter(range(10_000, 20_000))  # a new prompt for every request
    (p_port,) = free_ports(1)
    with engine_lock(echo=echo):
        prefill = BenchNode(BenchSpec("prefill", model, str(EXAMPLES / "pd-prefill.yaml"), p_port), logs)
        nodes = [prefill]
        try:
            wait_all_ready([prefill])

            def request(decode: EngineNode, side: str, counted: bool) -> None:
                prompt = token_prompt(next(seed), PROMPT_TOKENS)
                (p,) = prefill.generate([prompt], 1, [{"do_remote_decode": True}])
                s = decode_request(decode, prompt, 1, p["kv_transfer_params"])
                if s.nixl_bytes <= 0 or s.computed_tokens >= PROMPT_TOKENS:
                    raise RuntimeError(f"{side}: the prompt's KV was not pulled over NIXL "
                                       f"(bytes {s.nixl_bytes}, computed {s.computed_tokens}); see {decode.log_path}")
                if counted:
                    samples[side].values.append(s.ttft_s)
                    work_done[side]["requests"] += 1
                    work_done[side]["nixl_bytes"] += s.nixl_bytes
                    work_done[side]["computed_tokens"] += s.computed_tokens

            for r in range(rounds):
                for side in SIDES if r % 2 == 0 else SIDES[::-1]:
                    decode = BenchNode(decode_spec(side, model, free_ports(1)[0]), logs)
                    nodes.append(decode)
                    t0 = time.monotonic()
                    wait_all_ready([decode])
                    starts[side].append(time.monotonic() - t0)
                    request(decode, side, counted=False)  # NIXL handshake with the prefill engine
                    for _ in range(per_round):
                        request(decode, side, counted=True)
                    decode.close()
                    nodes.remove(decode)
                    echo(f"   round {r + 1}/{rounds} {side}: TTFT ms "
                         + " ".join(f"{v * 1e3:.1f}" for v in samples[side].values[-per_round:]))
        finally:
            for n in nodes:
                n.close()
    label = f"{PROMPT_TOKENS}-token prompt"
    return Result(
        "pd_ttft", "Decode time to first token over NIXL: kvcompose vs a bare NixlConnector", "ms", 1e3,
        [Case(label, samples, {"work": {s: dict(c) for s, c in work_done.items()},
                               "decode_start_s": {s: [round(x, 1) for x in v] for s, v in starts.items()}})],
        [ratio(label, samples, "kvcompose", "NixlConnector")],
        Target("<=", 1.02, "kvcompose", "NixlConnector"), rounds * per_round, quick,
        ["one prefill engine (examples/pd-prefill.yaml); decode engines one at a time beside it, the side "
         "order flipping every round; a sample is one request's TTFT inside the decode engine "
         "(arrival to first token: NIXL pull, scheduling, connector hooks)",
         "NixlConnector: the decode composition's NIXL child alone (vLLM's NixlConnector via the nixl plugin, "
         "same options: its NIXL agent sleeps between polls; vLLM's own busy-spins a core here); kvcompose: "
         "examples/pd-decode.yaml (host-memory tier asked first, then NIXL; the host tier also stores the pulled blocks)",
         f"every prompt new ({PROMPT_TOKENS} tokens); the first request after each decode start (NIXL "
         "handshake) is not counted; 'work' in the JSON: NIXL bytes and computed tokens per side"],
        {"prompt_tokens": PROMPT_TOKENS, "rounds": rounds, "per_round": per_round, "engine_logs": str(logs)})


if __name__ == "__main__":
    sys.exit(node_main(sys.argv[1:]))
