"""Benchmark 5i: the decode's ``load_failure`` policy (vLLM's ``kv_load_failure_policy``) under a
paused decode (issue 43 item 4).

One prefill server (``examples/pd-prefill.yaml``) and one decode server (``examples/pd-decode.yaml``),
both with ``lease_seconds`` :data:`LEASE_S` (shorter than vLLM's 30 s to keep a run short), the
decode started once per policy: ``fail`` (vLLM's default, what the example ships without the key)
and ``recompute``. Per policy, a steady P/D load (:mod:`.client`: :data:`CLIENTS` clients, the
proxy flow, streamed decode) runs :data:`WINDOW_S` s, then the decode's process group is stopped
(SIGSTOP) for the lease + 10 s and continued (SIGCONT), and the load runs :data:`AFTER_S` s more.
While the decode is stopped it sends no heartbeats, the prefill releases the blocks of the
requests waiting for it at the lease's end (in its next step: a short plain request every
:data:`~.client.TICK_S` stands for its other decodes' traffic, without which an idle prefill
releases nothing and nothing is refused), and after the resume the decode's nixl child refuses
those reads: the policy decides what becomes of them. Per policy (:mod:`.findings`): answered
and failed, the refused requests (matched to the client's by ``X-Request-Id``), how long after
the resume they got a first token (recomputed, or a failed one's single retry), and the
others' TTFT/TPOT in the window after the resume against the window before the pause. A sample of
the recomputed answers (and of the others) is checked against one engine without a connector.
The policies take turns, their order flipping every run.
"""

from __future__ import annotations

import json
import signal
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvcompose_tools.bench.load_failure.client import Clients, pd_once, request_body
from kvcompose_tools.bench.load_failure.findings import Phase, counts_table
from kvcompose_tools.bench.measure import Samples, ratio
from kvcompose_tools.bench.pd_ttft import engine_lock
from kvcompose_tools.bench.report import Case, Result
from kvcompose_tools.e2e.spec import EngineSpec

POLICIES = ("fail", "recompute")
#: Both sides' ``lease_seconds``: a third of vLLM's 30 s, so a pause past it is short.
LEASE_S = 10
#: The decode is stopped this much longer than the lease (no heartbeat in it: the prefill releases).
PAUSE_MARGIN_S = 10
CLIENTS = 8
#: Long prompts and short answers: most clients are in their prefill or waiting for their read
#: (their blocks leased), not streaming, when the pause comes.
PROMPT_TOKENS = 512
MAX_TOKENS = 8
#: The load runs this long before the pause (the "before" window) ...
WINDOW_S = 20.0
#: ... and this long after the resume (the "after" window: what the decode's recompute costs the others).
AFTER_S = 45.0  # quick: 30
RUNS = 2  # quick: 1
#: Answers checked against the single engine: every recomputed one, and this many others per phase.
OTHERS_CHECKED = 2


def _server(name: str, model: str, yaml: str, port: int, logs: Path, policy: str | None = None) -> Any:
    from kvcompose.examples import EXAMPLES
    from kvcompose_tools.e2e.server import ServerNode

    spec = EngineSpec(
        name, model, str(EXAMPLES / yaml), port, {"lease_seconds": LEASE_S}, kv_load_failure_policy=policy
    )
    # `kvcompose bench` sets VLLM_LOGGING_LEVEL=ERROR for itself; the servers' warnings (lease
    # expiries, refused reads) are what this benchmark reads, so they log at INFO.
    return ServerNode(spec, logs, extra_env={"VLLM_LOGGING_LEVEL": "INFO"})


def phase(prefill: Any, decode: Any, policy: str, run: int, after_s: float, echo: Callable[[str], None]) -> Phase:
    """The load through ``prefill`` and ``decode`` with one pause of the decode (module docstring)."""
    from kvcompose_tools.e2e.processes import signal_group
    from kvcompose_tools.e2e.server import HOST

    p, d = (HOST, prefill.port), (HOST, decode.port)
    # The handshake and the engines' first pass, not measured.
    body = request_body(decode.model, 7, PROMPT_TOKENS, MAX_TOKENS)
    _, _, err = pd_once(p, d, body, f"warmup-{policy}-{run}", time.monotonic())
    if err:
        raise RuntimeError(f"warm-up request through {decode.name} failed: {err}")
    clients = Clients(p, d, decode.model, f"lf{run}{policy[0]}", CLIENTS, PROMPT_TOKENS, MAX_TOKENS, seed=run)
    time.sleep(WINDOW_S)
    paused = clients.now()
    signal_group(decode.proc, signal.SIGSTOP)
    try:
        time.sleep(LEASE_S + PAUSE_MARGIN_S)
    finally:
        signal_group(decode.proc, signal.SIGCONT)  # never leave a server stopped
    resumed = clients.now()
    echo(f"   {policy} run {run + 1}: decode paused at {paused:.1f} s for {resumed - paused:.1f} s")
    time.sleep(after_s)
    clients.stop()
    time.sleep(1.0)  # the last lines of the decode's log
    return Phase(
        policy, run, clients.sent, Path(decode.log_path).read_text(errors="replace"), paused, resumed, WINDOW_S
    )


def check_answers(phases: list[Phase], model: str, logs: Path) -> dict[str, int]:
    """Every recomputed answer and :data:`OTHERS_CHECKED` others per phase, against one engine
    without a connector (greedy, ``ignore_eos``: the same token ids): ``checked`` and ``equal``."""
    from kvcompose_tools.e2e.flow import token_prompt
    from kvcompose_tools.e2e.node import EngineNode, wait_all_ready

    picked = []
    for ph in phases:
        groups = ph.groups()
        picked += [s for s in groups["refused"] if s.answered]
        picked += [s for s in groups["after"] if s.answered][:OTHERS_CHECKED]
    if not picked:
        return {"checked": 0, "equal": 0}
    node = EngineNode(EngineSpec("baseline", model), logs)
    try:
        wait_all_ready([node])
        # One at a time, as the kit's baselines are asked.
        outs = [node.generate([token_prompt(s.seed, PROMPT_TOKENS)], MAX_TOKENS, ignore_eos=True)[0] for s in picked]
    finally:
        node.close()
    equal = sum(o["token_ids"] == s.token_ids for o, s in zip(outs, picked, strict=True))
    return {"checked": len(picked), "equal": equal}


def run(quick: bool = False, echo: Callable[[str], None] = print, work: Path | None = None) -> Result:
    """Each policy once per run, :data:`RUNS` runs (one quick), the order flipping every run."""
    from kvcompose_tools.e2e.model import make_model
    from kvcompose_tools.e2e.node import wait_all_ready
    from kvcompose_tools.e2e.ports import free_ports

    runs, after_s = (1, 30.0) if quick else (RUNS, AFTER_S)
    logs = Path(work or tempfile.mkdtemp(prefix="kvcompose-bench-load-failure-"))
    model = str(make_model(0))
    phases: list[Phase] = []
    errors: list[str] = []
    with engine_lock(echo=echo):
        p_side, d_side = free_ports(2)
        prefill = _server("prefill", model, "pd-prefill.yaml", p_side, logs)
        try:
            for r in range(runs):
                for policy in POLICIES if r % 2 == 0 else POLICIES[::-1]:
                    decode = _server(f"decode-{policy}-{r + 1}", model, "pd-decode.yaml", d_side, logs, policy)
                    try:
                        wait_all_ready([prefill, decode])
                        phases.append(phase(prefill, decode, policy, r, after_s, echo))
                    except Exception as exc:  # the other phases still run; the error is in the notes
                        errors.append(f"{policy} run {r + 1}: {type(exc).__name__}: {exc}"[:500])
                        echo(f"   {errors[-1]}; log {decode.log_path}")
                        continue
                    finally:
                        decode.close()
                    f = phases[-1].figures()
                    (logs / f"phase-{policy}-{r + 1}.json").write_text(json.dumps(f, indent=2) + "\n")
                    echo(
                        f"   {policy} run {r + 1}: {f['sent']} sent, {f['answered']} answered, {f['failed']} failed; "
                        f"{f['refused']} reads refused ({f['refused_answered']} answered); TTFT p50 before "
                        f"{f['before']['ttft_p50_s']} s, after {f['after']['ttft_p50_s']} s"
                    )
        finally:
            prefill.close()
        answers = check_answers(phases, model, logs)
    return summarize(phases, answers, runs, quick, logs, errors)


#: The table's cases: (label, the per-run figure of a phase).
CASES: tuple[tuple[str, Callable[[dict[str, Any]], float | None]], ...] = (
    ("TTFT p50, window before the pause", lambda f: f["before"]["ttft_p50_s"]),
    ("TTFT p50, window after the resume", lambda f: f["after"]["ttft_p50_s"]),
    ("TTFT p90, window after the resume", lambda f: f["after"]["ttft_p90_s"]),
    ("TPOT p50, window after the resume", lambda f: f["after"]["tpot_p50_s"]),
    (
        "refused reads: first token after the resume",
        lambda f: (
            max(f["refused_first_token_after_resume_s"] or f["refused_retry_first_token_after_resume_s"] or [0]) or None
        ),
    ),
)


def summarize(
    phases: list[Phase], answers: dict[str, int], runs: int, quick: bool, logs: Path, errors: Sequence[str] = ()
) -> Result:
    """The result: per case, each policy's per-run figure; recompute / fail per case; the counts
    table and the answers' check in the notes."""
    figures = [ph.figures() for ph in phases]
    cases, ratios = [], []
    for label, get in CASES:
        samples = {
            policy: Samples([v for f in figures if f["policy"] == policy and (v := get(f)) is not None])
            for policy in POLICIES
        }
        samples = {p: s for p, s in samples.items() if s.values}
        cases.append(Case(label, samples))
        if len(samples) == 2:
            ratios.append(ratio(label, samples, "recompute", "fail"))
    return Result(
        "load_failure",
        "The decode's load_failure policy under a paused decode: recompute against fail (vLLM's default)",
        "s",
        1.0,
        cases,
        ratios,
        None,
        runs,
        quick,
        [
            f"one prefill and one decode server (examples/pd-prefill.yaml, pd-decode.yaml), lease_seconds {LEASE_S} "
            f"on both; the decode started per policy; {CLIENTS} clients, the proxy flow (prefill max_tokens 1 and "
            f"do_remote_decode, then the decode streamed), {PROMPT_TOKENS}-token prompts, {MAX_TOKENS} tokens out",
            f"{WINDOW_S:g} s of load, the decode SIGSTOPped for {LEASE_S + PAUSE_MARGIN_S} s, then the load's window "
            "after the resume; a failed request is retried once by its client",
            "refused reads: the decode's 'NIXL read refused' lines matched by X-Request-Id; the last case is the "
            "latest first token of a refused request after the resume (recomputed, or a failed one's retry)",
            f"answers against one engine without a connector: {answers['equal']} of {answers['checked']} equal "
            "(every recomputed answer, and others)",
            "per run and policy:\n" + counts_table(figures),
            *(f"phase failed: {e}" for e in errors),
        ],
        {"phases": figures, "answers": answers, "engine_logs": str(logs), "lease_s": LEASE_S},
    )
