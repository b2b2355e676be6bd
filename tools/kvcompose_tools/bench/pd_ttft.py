"""Benchmark 5b: decode time-to-first-token through kvcompose vs a bare NixlConnector, real engines.

One prefill engine and three decode engines, up together, started :data:`STARTS` times with the
samples pooled, each start in a rotated order (:func:`start_order`). The decode engines
(:data:`DECODES`) differ only in their connector:

* ``NixlConnector``: the composition's NIXL child alone as the engine's ``--kv-transfer-config``
  (vLLM's ``NixlConnector`` class through the nixl plugin's module path, the same options), no
  composite around it: the baseline;
* ``kvcompose``: :data:`COMPOSITION`, the shipped examples' decode composition (host-memory tier
  asked first, then NIXL);
* ``MultiConnector``: vLLM's own ``MultiConnector`` over the same two children
  (:func:`~kvcompose.vllm.args.vllm_multiconnector`), whose fixed rules are the composition's
  (the first child with a hit loads, every child saves): what the host tier costs a decode
  whatever composes it, and so ``kvcompose / MultiConnector`` the composite's own share.

The prefill engine is the baseline's connector (a bare NixlConnector), shared: every decode
pulls from the same engine. vLLM keeps a prefill engine stepping until the decode's read of
its blocks is notified (here a step every 2-3 ms for the 100-130 ms after each prefill,
``docs/performance.md`` 5b), so on this 2-core host the prefill engine's stepping lands in the
decode's time. With each engine prefilling for the other, as this benchmark did before, each
side's decodes met the *other* side's stepping, a confound the shared prefill engine removes.

A request goes the proxy way (:func:`kvcompose_tools.e2e.flow.decode_request`): prefill with
``do_remote_decode`` and one token, then decode with the prefill's ``kv_transfer_params``; the
decode engine pulls the prompt's KV over NIXL. A sample is the decode engine's own time from the
request's arrival to its first token (vLLM's ``first_token_latency``): the pull, the scheduling
and the connector hooks are in it, the client's IPC is not. The decodes alternate request by
request, so they share the machine's moments of load, in an order where every decode engine
follows every engine, itself included, equally often (:func:`~kvcompose_tools.bench.measure.follow_balanced`):
each engine's worker spins on its queue for a second after a step (vLLM's ``SpinCondition``), its
threads pinned to the same core as the other engines' workers, so the turn before a sample is in
that sample. Every prompt is new; one request per decode engine before timing does the NIXL
handshakes. Inside the decode engine each TTFT is also split (:data:`~kvcompose_tools.e2e.node.PHASES`;
the rest of it is the front end's hops).

Why the baseline goes through the nixl plugin's module path: vLLM's NIXL agent polls without
sleeping, so an idle engine's worker burns a whole core (measured here: ~100% CPU at idle) and on
this 2-core machine that, not the connector, would set the baseline's TTFT. The plugin's
``progress_delay_us`` (100 us, as in the examples) gives every engine the same NIXL agent; its
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

from kvcompose.vllm.args import vllm_multiconnector
from kvcompose_tools.bench.measure import Samples, follow_balanced, interleave_balanced, ratio, repeats_for
from kvcompose_tools.bench.report import Case, Result, Target
from kvcompose_tools.e2e.node import PHASES, EngineNode, wait_all_ready
from kvcompose_tools.e2e.ports import free_ports
from kvcompose_tools.e2e.spec import EngineSpec, composed_kv_transfer_config

LOCK_PATH = "/tmp/kvcompose-engines.lock"
#: The decode engines, the baseline first; :data:`SUBJECT` is held to the target, :data:`MULTI`
#: shown beside it.
DECODES = ("NixlConnector", "kvcompose", "MultiConnector")
BASELINE, SUBJECT, MULTI = DECODES
PROMPT_TOKENS = 600  # 18 full 32-token blocks and a partial one
#: Measured requests per decode engine and start (quick: the minimum, 5), rounded up to whole cycles
#: of :func:`~kvcompose_tools.bench.measure.follow_balanced` (3 turns each): single TTFTs swing widely.
REPEATS = 24
#: Engine starts (quick: one), their samples pooled; whole rounds of :func:`start_order`, so every
#: decode takes every place, which weighs more than its connector (docs/performance.md 5b, "Every
#: place for every engine").
STARTS = len(DECODES)
#: Pause between a prefill's answer and its decode, so that the prefill engine's own work after
#: answering (its scheduler's output, the request's free) is not in the decode's time. The decode's
#: TTFT is timed inside its engine, so the pause is not in it.
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
    """Hold the machine's engine lock (one benchmark's or test's engines at a time) while engines run.

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

#: The NIXL child every engine's connector is or holds (its side-channel port filled in per
#: engine), in both roles: the prefill engine and the baseline decode run it alone, so it is the
#: same child, with the same role, in each of them.
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
#: Decode ``kvcompose`` (:data:`SUBJECT`): ``examples/pd-decode.yaml``'s composition, host tier
#: first, with :data:`NIXL_CHILD`.
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
    :class:`~kvcompose_tools.e2e.spec.EngineSpec`), with the composite's role."""
    composed = composed_kv_transfer_config(composition, side_channel_port, nixl_options)
    (entry,) = [c for c in composed["kv_connector_extra_config"]["connectors"] if c["kv_connector"] == "NixlConnector"]
    return {**entry, "kv_role": composed["kv_role"]}


def engine_spec(side: str, model: str, directory: Path, port: int) -> EngineSpec:
    """The engine of ``side`` (a decode of :data:`DECODES`, or ``prefill``), its NIXL side channel
    on ``port`` (its composition under ``directory``)."""
    composition = composition_file(directory / side, port)
    if side == SUBJECT:
        return EngineSpec(side, model, str(composition))
    if side == MULTI:
        return EngineSpec(side, model, kv_config=vllm_multiconnector(composed_kv_transfer_config(composition)))
    if side in (BASELINE, "prefill"):
        return EngineSpec(side, model, kv_config=nixl_alone(composition))
    raise ValueError(f"unknown side {side!r}")


def start_order(start: int) -> tuple[str, ...]:
    """The order in which start number ``start`` launches the decode engines and cycles their turns
    (:func:`~kvcompose_tools.bench.measure.follow_balanced`): :data:`DECODES` rotated by ``start``, so
    that over ``len(DECODES)`` starts every engine takes every place once."""
    k = start % len(DECODES)
    return DECODES[k:] + DECODES[:k]


def measure_start(
    reps: int, model: str, logs: Path, seed: Iterator[int], start: int = 0
) -> tuple[dict[str, Samples], dict[str, dict[str, Samples]], dict[str, dict[str, int]], float]:
    """Start the prefill engine and the decode engines, then time ``reps`` decodes on each,
    alternating request by request.

    ``start`` counts the starts: each launches and cycles the decode engines in its
    :func:`start_order`. Returns the
    TTFT samples per decode engine, its TTFT phases inside the engine
    (:data:`~kvcompose_tools.e2e.node.PHASES`), its work (requests, NIXL bytes, computed tokens) and
    the engines' start time. The caller holds the engine lock.
    """
    from kvcompose_tools.e2e.flow import decode_request, token_prompt

    order = start_order(start)
    here = logs / f"start-{start}"
    ports = free_ports(len(order) + 1)
    prefill = EngineNode(engine_spec("prefill", model, here, ports[0]), here)
    nodes = {side: EngineNode(engine_spec(side, model, here, port), here) for side, port in zip(order, ports[1:])}
    work_done: dict[str, Counter[str]] = {s: Counter() for s in DECODES}
    phases: dict[str, dict[str, Samples]] = {s: {ph: Samples() for ph in PHASES} for s in DECODES}
    try:
        t0 = time.monotonic()
        wait_all_ready([prefill, *nodes.values()])
        started_s = time.monotonic() - t0

        def request(side: str) -> float:
            """Prefill on the prefill engine, decode on ``side``; the decode's TTFT."""
            prompt = token_prompt(next(seed), PROMPT_TOKENS)
            (p,) = prefill.generate([prompt], 1, [{"do_remote_decode": True}])
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
            for ph, seconds in (d.phases_s or {}).items():
                phases[side][ph].values.append(seconds)
            return d.ttft_s

        for side in order:  # NIXL handshakes, and first-request warm-up
            request(side)
        work_done = {s: Counter() for s in DECODES}
        phases = {s: {ph: Samples() for ph in PHASES} for s in DECODES}
        samples = interleave_balanced({side: (lambda _r, side=side: request(side)) for side in order}, reps)
    finally:
        for n in (*nodes.values(), prefill):
            n.close()
    return samples, phases, {s: dict(c) for s, c in work_done.items()}, started_s


def run(
    quick: bool = False,
    repeats: int | None = None,
    echo: Callable[[str], None] = print,
    work: Path | None = None,
    starts: int | None = None,
) -> Result:
    """Decode TTFT of every decode engine (:data:`DECODES`), the engines started ``starts`` times
    (:data:`STARTS`, rounded up to whole rounds of :func:`start_order`; quick: once, one place each)
    with the samples pooled; each decode's ratio to the baseline, and kvcompose's to MultiConnector."""
    from kvcompose_tools.e2e.model import make_model

    reps = repeats or repeats_for(quick, full=REPEATS)
    reps = len(follow_balanced(DECODES, reps)) // len(DECODES)  # whole cycles, as sampled
    starts = 1 if quick and not starts else -(-(starts or STARTS) // len(DECODES)) * len(DECODES)
    logs = Path(work or tempfile.mkdtemp(prefix="kvcompose-bench-ttft-"))
    model = str(make_model(0))
    seed = iter(range(10_000, 1_000_000))  # a new prompt for every request
    label = f"{PROMPT_TOKENS}-token prompt"
    pooled: dict[str, Samples] = {s: Samples() for s in DECODES}
    pooled_phases: dict[str, dict[str, Samples]] = {s: {ph: Samples() for ph in PHASES} for s in DECODES}
    work_done: dict[str, Counter[str]] = {s: Counter() for s in DECODES}
    per_start = []
    with engine_lock(echo=echo):
        for start in range(starts):
            samples, phases, work_of, started_s = measure_start(reps, model, logs, seed, start)
            for s in DECODES:
                pooled[s].values.extend(samples[s].values)
                work_done[s].update(work_of[s])
                for ph in PHASES:
                    pooled_phases[s][ph].values.extend(phases[s][ph].values)
            one = {s: round(ratio(label, samples, s, BASELINE).by_median, 4) for s in (SUBJECT, MULTI)}
            per_start.append({"ratio_by_median": one, "engines_start_s": round(started_s, 1)})
            echo(
                f"   start {start + 1} of {starts} (ratios {one}), TTFT ms: "
                + "; ".join(f"{s} " + " ".join(f"{v * 1e3:.1f}" for v in samples[s].values) for s in DECODES)
            )
    phase_ms = {s: {ph: round(v.median * 1e3, 2) for ph, v in pooled_phases[s].items() if v.values} for s in DECODES}
    echo(
        "   median ms inside the decode engine: "
        + "; ".join(f"{s} " + ", ".join(f"{ph} {ms}" for ph, ms in phase_ms[s].items()) for s in DECODES)
    )
    extra = {"work": {s: dict(c) for s, c in work_done.items()}, "starts": per_start, "phases_ms": phase_ms}
    return Result(
        "pd_ttft",
        "Decode time to first token over NIXL: kvcompose vs a bare NixlConnector",
        "ms",
        1e3,
        [Case(label, pooled, extra)],
        [
            ratio(label, pooled, SUBJECT, BASELINE),
            ratio(label, pooled, MULTI, BASELINE),
            ratio(label, pooled, SUBJECT, MULTI),
        ],
        Target("<=", 1.02, SUBJECT, BASELINE),
        reps * starts,
        quick,
        [
            f"one prefill engine (a bare NixlConnector) and three decode engines, up together, started {starts} "
            "time(s), the samples of every start pooled; every decode pulls from the same prefill engine; a sample "
            "is one request's TTFT inside the decode engine (arrival to first token: NIXL pull, scheduling, "
            "connector hooks); the decodes alternate request by request, each engine after every engine (itself "
            "included) equally often; each start launches and cycles the engines in a rotated order, every engine "
            f"in every place equally often; each decode is sent {SETTLE_S:g} s after its prefill answered",
            "kvcompose: host-memory tier asked first, then NIXL (examples/pd-decode.yaml, NIXL in both roles); "
            "MultiConnector: vLLM's own MultiConnector over kvcompose's two children (its fixed rules are the "
            "composition's: the host tier's cost whatever composes it, and kvcompose/MultiConnector the "
            "composite's own); "
            "NixlConnector: the NIXL child with no composite (vLLM's "
            "NixlConnector via the nixl plugin, same options: its NIXL agent sleeps between polls; vLLM's own "
            "busy-spins a core here)",
            f"every prompt new ({PROMPT_TOKENS} tokens); one request per decode engine before timing (NIXL "
            "handshakes); 'work' in the JSON: NIXL bytes and computed tokens per decode engine (equal); "
            "'phases_ms': the medians of each TTFT's waiting (arrival in the engine core to scheduling: the pull) "
            "and first_step (scheduling to the first token)",
        ],
        {"prompt_tokens": PROMPT_TOKENS, "decodes": list(DECODES), "starts": starts, "engine_logs": str(logs)},
    )
