"""Benchmark 5b: decode time-to-first-token through kvcompose vs a bare NixlConnector, real engines.

One engine pair at a time (the machine runs at most two engines), each engine both a prefill
and a decode instance (``kv_both``), each prefilling for the other, started :data:`STARTS` times
with the samples pooled (where an engine's threads land is drawn at each start):

* ``kvcompose``: :data:`COMPOSITION`, the shipped examples' decode composition (host-memory tier
  asked first, then NIXL) with the NIXL child in both roles;
* ``NixlConnector``: that composition's NIXL child alone as the engine's ``--kv-transfer-config``
  (vLLM's ``NixlConnector`` class through the nixl plugin's module path, the same options), no
  composite around it.

A second pair runs after the first: ``NixlConnector`` vs ``kvcompose-pd-only``, the composite
with its NIXL child alone, which separates the composite's own cost from the host tier's work.

A request goes the proxy way (:func:`kvcompose.e2e.flow.decode_request`): prefill on one engine
with ``do_remote_decode`` and one token, then decode on the other with the prefill's
``kv_transfer_params``; the decode engine pulls the prompt's KV over NIXL. A sample is the decode
engine's own time from the request's arrival to its first token (vLLM's ``first_token_latency``):
the pull, the scheduling and the connector hooks are in it, the client's IPC is not. The sides
alternate request by request (the order flipping every repeat), so both share the machine's
moments of load. NIXL READ is one-sided (the decode engine reads the prefill engine's memory), so
which engine prefilled does not enter the decode's time beyond the finished-notification, once
the prefill engine is idle again: the decode is sent :data:`SETTLE_S` after the prefill answered.
Every prompt is new; one request each way before timing does the NIXL handshakes.

Why the baseline goes through the nixl plugin's module path: vLLM's NIXL agent polls without
sleeping, so an idle engine's worker burns a whole core (measured here: ~100% CPU at idle) and on
this 2-core machine that, not the connector, would set the baseline's TTFT. The plugin's
``progress_delay_us`` (100 us, as in the examples) gives both sides the same NIXL agent; its
other overrides are the side-channel options and a check for remote prefills without blocks.

The engines need ``/tmp/kvcompose-engines.lock`` (see :func:`engine_lock`): the benchmark takes
it itself unless the process already holds it (started under ``flock``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kvcompose.bench.measure import Samples, interleave, ratio, repeats_for
from kvcompose.bench.report import Case, Result, Target
from kvcompose.e2e.node import EngineNode, EngineSpec, free_ports, wait_all_ready

LOCK_PATH = "/tmp/kvcompose-engines.lock"
SIDES = ("NixlConnector", "kvcompose")
#: Engine pairs, one after the other (two engines at a time): (baseline, subject).
PAIRS = (SIDES, ("NixlConnector", "kvcompose-pd-only"))
PROMPT_TOKENS = 600  # 18 full 32-token blocks and a partial one
REPEATS = 20  # measured requests per side and engine start (quick: the minimum, 5); single TTFTs swing 10x here
#: Engine starts per pair (quick: one), their samples pooled. Where an engine's threads land is
#: drawn at each start, and on this 2-core host one engine of a pair could run steadily slower
#: than the other whatever its connector (the control's own ratio 0.72-1.19 over nine runs of
#: one start; docs/performance.md 5b): pooling starts averages that draw out.
STARTS = 3
#: Pause between a prefill's answer and its decode: the prefill engine's own work after a request
#: (its free, the NIXL notification, its host tier's stores) is done before the decode is timed.
#: Here both engines share two cores, so without it that work landed in one side's TTFT at random
#: (one engine of a pair twice as slow as the other, whichever its connector; docs/performance.md
#: 5b); between two hosts it would not. The decode's TTFT is timed inside its engine, so the
#: pause is not in it.
SETTLE_S = 0.1


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

#: The kvcompose engine: ``examples/pd-decode.yaml`` with the NIXL child in both roles, so the
#: same engine can also prefill for the other one.
#: The NIXL child both compositions share (its side-channel port filled in per engine).
NIXL_CHILD = """\
  - name: pd
    type: nixl
    role: both
    options:
      backends: [UCX]
      side_channel_host: 127.0.0.1
      side_channel_port: {port}
      progress_delay_us: 100
      ucx_error_handling: none
"""
COMPOSITION = (
    """\
version: 1
connectors:
  - name: host
    type: cpu-offload
    options: {{cpu_bytes: 256MiB}}
"""
    + NIXL_CHILD
    + "rules: {{load: first-wins, store: all, metadata: merge}}\n"
)


#: Side ``kvcompose-pd-only`` (the second pair of :data:`PAIRS`): the same composite with its NIXL child
#: alone, to tell the composite's own cost from the host tier's work (its lookups and stores).
PD_ONLY = "version: 1\nconnectors:\n" + NIXL_CHILD


def composition_file(directory: Path, port: int, text: str = COMPOSITION) -> Path:
    """A composition (:data:`COMPOSITION`) with its NIXL side channel on ``port``, under ``directory``."""
    path = directory / "pd-both.yaml"
    directory.mkdir(parents=True, exist_ok=True)
    path.write_text(text.format(port=port))
    return path


def nixl_alone(
    composition: Path, side_channel_port: int | None = None, nixl_options: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The composition's NIXL child as a connector of its own: the child entry ``kvcompose
    vllm-args`` renders for it (class, module path, options, with an engine's overrides as in
    :class:`~kvcompose.e2e.node.EngineSpec`), with the composite's role."""
    from kvcompose.e2e.node import composed_kv_transfer_config

    composed = composed_kv_transfer_config(composition, side_channel_port, nixl_options)
    (entry,) = [c for c in composed["kv_connector_extra_config"]["connectors"] if c["kv_connector"] == "NixlConnector"]
    return {**entry, "kv_role": composed["kv_role"]}


def engine_spec(side: str, model: str, directory: Path, port: int) -> EngineSpec:
    """The engine of ``side``, its NIXL side channel on ``port`` (its composition under ``directory``)."""
    composition = composition_file(directory / side, port, PD_ONLY if side == "kvcompose-pd-only" else COMPOSITION)
    if side in ("kvcompose", "kvcompose-pd-only"):
        return EngineSpec(side, model, str(composition))
    if side == "NixlConnector":
        return EngineSpec(side, model, kv_config=nixl_alone(composition))
    raise ValueError(f"unknown side {side!r}")


def measure_pair(
    sides: tuple[str, str], reps: int, model: str, logs: Path, seed: Iterator[int], start: int = 0
) -> tuple[dict[str, Samples], dict[str, dict[str, int]], float]:
    """Start one engine per side, then time ``reps`` decodes on each, alternating request by request.

    ``start`` counts the pair's starts: odd starts launch the sides in the other order. Returns
    the TTFT samples, the work done per side (requests, NIXL bytes, computed tokens) and the
    engines' start time. The caller holds the engine lock.
    """
    from kvcompose.e2e.flow import decode_request, token_prompt

    order = sides[::-1] if start % 2 else sides
    nodes = {
        side: EngineNode(engine_spec(side, model, logs / f"start-{start}", port), logs / f"start-{start}")
        for side, port in zip(order, free_ports(len(order)))
    }
    work_done: dict[str, Counter[str]] = {s: Counter() for s in sides}
    try:
        t0 = time.monotonic()
        wait_all_ready(list(nodes.values()))
        started_s = time.monotonic() - t0

        def request(side: str) -> float:
            """Prefill on the other engine, decode on ``side``; the decode's TTFT."""
            (other,) = [n for s, n in nodes.items() if s != side]
            prompt = token_prompt(next(seed), PROMPT_TOKENS)
            (p,) = other.generate([prompt], 1, [{"do_remote_decode": True}])
            time.sleep(SETTLE_S)
            d = decode_request(nodes[side], prompt, 1, p["kv_transfer_params"])
            if d.nixl_bytes <= 0 or d.computed_tokens >= PROMPT_TOKENS:
                raise RuntimeError(
                    f"{side}: the prompt's KV was not pulled over NIXL (bytes "
                    f"{d.nixl_bytes}, computed {d.computed_tokens}); see {nodes[side].log_path}"
                )
            work_done[side]["requests"] += 1
            work_done[side]["nixl_bytes"] += d.nixl_bytes
            work_done[side]["computed_tokens"] += d.computed_tokens
            return d.ttft_s

        for side in sides:  # NIXL handshakes both ways, and first-request warm-up
            request(side)
        work_done = {s: Counter() for s in sides}
        samples = interleave({side: (lambda _r, side=side: request(side)) for side in order}, reps)
    finally:
        for n in nodes.values():
            n.close()
    return samples, {s: dict(c) for s, c in work_done.items()}, started_s


def run(
    quick: bool = False,
    repeats: int | None = None,
    echo: Callable[[str], None] = print,
    work: Path | None = None,
    pairs: tuple[tuple[str, str], ...] = PAIRS,
    starts: int | None = None,
) -> Result:
    """Decode TTFT, one engine pair after the other (:data:`PAIRS`), each started ``starts``
    times (:data:`STARTS`; quick: once) with its samples pooled; each pair's ratio."""
    from kvcompose.e2e.model import make_model

    reps = repeats or repeats_for(quick, full=REPEATS)
    starts = starts or (1 if quick else STARTS)
    logs = Path(work or tempfile.mkdtemp(prefix="kvcompose-bench-ttft-"))
    model = str(make_model(0))
    seed = iter(range(10_000, 1_000_000))  # a new prompt for every request
    cases, ratios = [], []
    with engine_lock(echo=echo):
        for sides in pairs:
            label = f"{PROMPT_TOKENS}-token prompt: {sides[1]}"
            pooled: dict[str, Samples] = {s: Samples() for s in sides}
            work_done: dict[str, Counter[str]] = {s: Counter() for s in sides}
            per_start = []
            for start in range(starts):
                samples, work, started_s = measure_pair(sides, reps, model, logs, seed, start)
                for s in sides:
                    pooled[s].values.extend(samples[s].values)
                    work_done[s].update(work[s])
                one = ratio(label, samples, sides[1], sides[0])
                per_start.append({"ratio_by_median": round(one.by_median, 4), "engines_start_s": round(started_s, 1)})
                echo(
                    f"   {label}, start {start + 1} of {starts} (ratio {one.by_median:.3f}), TTFT ms: "
                    + "; ".join(f"{s} " + " ".join(f"{v * 1e3:.1f}" for v in samples[s].values) for s in sides)
                )
            cases.append(Case(label, pooled, {"work": {s: dict(c) for s, c in work_done.items()}, "starts": per_start}))
            ratios.append(ratio(label, pooled, sides[1], sides[0]))
    return Result(
        "pd_ttft",
        "Decode time to first token over NIXL: kvcompose vs a bare NixlConnector",
        "ms",
        1e3,
        cases,
        ratios,
        Target("<=", 1.02, "kvcompose", "NixlConnector"),
        reps * starts,
        quick,
        [
            f"per pair: two engines, both kv_both, each prefilling for the other, started {starts} time(s) (the "
            "sides launched in turn first), the samples of every start pooled; a sample is one request's TTFT "
            "inside the decode engine (arrival to first token: NIXL pull, scheduling, connector hooks); the sides "
            f"alternate request by request; each decode is sent {SETTLE_S:g} s after its prefill answered (the prefill "
            "engine idle again: the two engines share this host's cores)",
            "kvcompose: host-memory tier asked first, then NIXL (examples/pd-decode.yaml, NIXL in both roles); "
            "kvcompose-pd-only: the same composite with the NIXL child alone (the composite's own cost, without "
            "the host tier's lookups and stores); NixlConnector: the NIXL child with no composite (vLLM's "
            "NixlConnector via the nixl plugin, same options: its NIXL agent sleeps between polls; vLLM's own "
            "busy-spins a core here)",
            f"every prompt new ({PROMPT_TOKENS} tokens); one request each way before timing (NIXL handshakes); "
            "'work' in the JSON: NIXL bytes and computed tokens per side (equal)",
        ],
        {"prompt_tokens": PROMPT_TOKENS, "pairs": [list(p) for p in pairs], "starts": starts, "engine_logs": str(logs)},
    )
