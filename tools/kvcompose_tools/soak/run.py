"""``kvcompose soak``: the serving stack under load while faults are injected, then checked.

1. Start the stack (:class:`~kvcompose_tools.soak.stack.Stack`): prefill ``pd-prefill.yaml``, decode
   ``pd-decode.yaml`` with the kit's ``faulty`` child in front under ``faults: breaker``, vLLM's
   router in P/D mode.
2. Send the plan's requests (:func:`~kvcompose_tools.soak.plan.plan`) through the router with
   ``concurrency`` clients; some clients hang up mid-request. Meanwhile the prefill server is
   SIGKILLed and restarted, later the decode server; each is also paused once (SIGSTOP on its
   process group for longer than the prefill's lease, then SIGCONT), and the flaky child raises
   at its planned calls. With ``hosts`` the prefill and the decode run on hosts of their own
   (:mod:`kvcompose_tools.e2e.hosts`), and between the two kills the link between them is cut, longer
   than the prefill's lease, and restored.
3. Wait until every engine is quiet: no request running or waiting, no KV block in use (the
   prefill frees the blocks it held for the killed decode when their lease expires), no host-tier
   block pinned or pending. Read the prefill logs: no decode read after a lease expired that the
   decode did not refuse, no lease expiry outside the lease after a planned cause (the decode's
   kill, a pause, the cut, a client hanging up at the router).
4. Stop the stack; answer a sample of the answered prompts on a single engine without a
   connector and compare.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path

from kvcompose.examples import pd_pair
from kvcompose.testing.types import registered
from kvcompose_tools.e2e.flow import same_output
from kvcompose_tools.e2e.hosts import DEFAULT_LINK, Hosts
from kvcompose_tools.e2e.load import LATE_READ, LEASE_EXPIRY, REFUSED_READ, RELEASED_UNREAD
from kvcompose_tools.e2e.model import make_model
from kvcompose_tools.e2e.node import EngineNode, EngineSpec, NodeError, wait_all_ready
from kvcompose_tools.e2e.stats import quantile
from kvcompose_tools.soak.drive import Injector, Load, Outcome
from kvcompose_tools.soak.plan import FLAKY, SoakOptions, decode_composition, plan, prefill_lease_s
from kvcompose_tools.soak.report import (
    LOGPROB_TOLERANCE,
    Comparison,
    SoakReport,
    by_request,
    count,
    cut_off_problems,
    during,
    first_tokens,
    hang_ups,
    last_counters,
    lease_problems,
    logged,
    planned_causes,
    process_logs,
    quiet_problems,
    unplanned_expiries,
    used_late_reads,
)
from kvcompose_tools.soak.stack import COUNTERS, GAUGES, ROLES, Sampler, Stack

#: Longest wait for the engines to be quiet after the load: vLLM's NIXL lease (30 s, the
#: examples keep vLLM's default) plus a margin for its heartbeats and the reaper's next step.
QUIET_TIMEOUT_S = 90.0


def run(
    options: SoakOptions,
    work: Path | None = None,
    echo: Callable[[str], None] = print,
    baseline: EngineNode | None = None,
) -> SoakReport:
    """One soak run; its report (``report.problems`` empty when every check passed).

    ``baseline``: a running engine without a connector on the demo model to compare the answers
    with (a test session's shared one); else the run starts its own once the stack is down.
    """
    from kvcompose_tools.bench.pd_ttft import engine_lock

    if options.hosts and options.link is None:
        options = dataclasses.replace(options, link=DEFAULT_LINK)
    work = Path(work or tempfile.mkdtemp(prefix="kvcompose-soak-"))
    logs = work / "logs"
    requests, faults = plan(options)
    model = str(make_model(0))
    prefill_yaml = pd_pair(options.host_tier)[0]
    lease_s = prefill_lease_s(prefill_yaml)
    t_start = time.monotonic()
    started = datetime.now()  # the year of the servers' log times (they have none)
    with engine_lock(echo=echo), registered(), _hosts(options, echo) as hosts:  # registered: the flaky child's type
        echo(f"starting prefill, decode and the router (logs: {logs}) ...")
        decode_yaml = decode_composition(faults, work, options.host_tier)
        stack = Stack(model, prefill_yaml, decode_yaml, logs, options.concurrency, hosts)
        try:
            echo(f"sending {options.requests} requests, {options.concurrency} at a time; faults:")
            for f in faults.describe():
                echo(f"  - {f}")
            load = Load(requests, stack, model, options.max_tokens)
            sampler = Sampler(stack, load.t0)
            kills = [(faults.kill_prefill_at, "prefill"), (faults.kill_decode_at, "decode")]
            cut = (faults.cut_link_at, faults.cut_s) if faults.cut_link_at is not None else None
            injector = Injector(load, stack, kills, cut, faults.pauses, faults.pause_s)
            injector.start()
            load.run(options.concurrency, _progress(load, echo))
            load_started = time.time() - (time.monotonic() - load.t0)  # the outcomes' times count from load.t0
            injector.join()
            echo("load done; waiting for the engines to be quiet ...")
            quiet, settle_s = _quiet(stack, time.monotonic())
            sampler.stop()
            processes, deaths = _processes(stack)
            breaker = _logged(logs, "decode", rf"connector {FLAKY}: breaker (open|half-open|closed):")
            # vLLM's NIXL worker on the prefill: a lease run out before every decode read, a read after one.
            expiries = logged(logs, "prefill", LEASE_EXPIRY, started)
            # ... and the reads the decode refused for it, or never made (nothing computed from them).
            refused = set(_logged(logs, "decode", REFUSED_READ.pattern))
            unread = set(_logged(logs, "decode", RELEASED_UNREAD.pattern))
            late_reads = used_late_reads(logged(logs, "prefill", LATE_READ, started), refused | unread)
        finally:
            stack.close()
        comparison = _compare(
            load.outcomes, {r.index: r.prompt for r in requests}, options, model, logs, echo, baseline
        )
    attempts = count(load.outcomes)
    requests_by = by_request(load.outcomes)
    answered = sorted(o.latency_s for o in load.outcomes if o.kind == "answered")
    ttft = first_tokens(load.outcomes, injector.outages)
    causes = planned_causes(injector, load.outcomes, load_started)
    unplanned = unplanned_expiries(expiries, causes, lease_s)
    problems = deaths + quiet_problems(quiet) + lease_problems(late_reads, unplanned, lease_s) + ttft.problems()
    if injector.error is not None:
        problems.append(f"fault injection failed: {injector.error}")
    if attempts["hung"]:
        problems.append(f"{attempts['hung']} attempt(s) got no answer in time")
    routed_drops = sum(1 for o in load.outcomes if o.kind == "dropped" and o.path == "router")
    if routed_drops:
        problems.append(f"the router closed {routed_drops} connection(s) without an HTTP answer")
    problems += cut_off_problems(load.outcomes, injector.outages)
    if requests_by["gave-up"]:
        problems.append(f"{requests_by['gave-up']} request(s) failed on every retry")
    if not requests_by["answered"]:
        problems.append("no request was answered")
    if comparison.differing:
        problems.append(f"answers differ from the baseline for requests {comparison.differing}")
    if comparison.max_logprob_gap > LOGPROB_TOLERANCE:
        problems.append(
            f"a logprob differs from the baseline's by {comparison.max_logprob_gap:.1e} (> {LOGPROB_TOLERANCE:g})"
        )
    if "open" not in breaker:
        problems.append(f"the {FLAKY} child never failed: its faults did not fire")
    return SoakReport(
        options=dataclasses.asdict(options),
        faults=faults.describe(),
        events=injector.events,
        wall_s=time.monotonic() - t_start,
        requests=requests_by,
        hang_ups=hang_ups(requests),
        attempts=attempts,
        first_errors=_first_errors(load.outcomes),
        failed_during_outages=during(load.outcomes, injector.outages),
        cut_off_during_outages=during(load.outcomes, injector.outages, kind="cut-off"),
        latency_p50_s=quantile(answered, 0.5),
        latency_p99_s=quantile(answered, 0.99),
        ttft_p50_s=ttft.p50_s,
        ttft_p99_s=ttft.p99_s,
        ttft_max_s=ttft.max_s,
        ttft_slow=len(ttft.slow),
        ttft_in_outages=ttft.in_outages,
        ttft_slow_in_outages=ttft.slow_in_outages,
        quiet=quiet,
        settle_s=settle_s,
        counters=last_counters(sampler.samples, tuple(COUNTERS)),
        prefill_held_after_decode_kill=_held(sampler, injector, lease_s),
        lease_releases=len(expiries),
        lease_releases_unplanned=len(unplanned),
        late_reads=len(late_reads),
        refused_reads=len(refused),
        breaker_changes=breaker,
        processes=processes,
        comparison=comparison,
        problems=problems,
        logs=str(logs),
    )


@contextlib.contextmanager
def _hosts(options: SoakOptions, echo: Callable[[str], None]) -> Iterator[Hosts | None]:
    """A ``prefill`` and a ``decode`` host joined at ``options.link`` when ``options.hosts``."""
    if not options.hosts:
        yield None
        return
    with Hosts(["prefill", "decode"], link=options.link) as hosts:
        echo(f"hosts: prefill {hosts['prefill'].address}, decode {hosts['decode'].address}, link {options.link}")
        yield hosts


def _progress(load: Load, echo: Callable[[str], None]) -> Callable[[], None]:
    last = [0.0]

    def show() -> None:
        now = time.monotonic()
        if now - last[0] >= 10:
            last[0] = now
            got = count(load.outcomes)
            echo(f"  {now - load.t0:5.0f} s  sent {load.sent}: " + ", ".join(f"{k} {n}" for k, n in got.items() if n))

    return show


def _quiet(stack: Stack, since: float) -> tuple[dict[str, dict[str, float]], float]:
    """Every server's :data:`GAUGES` once all are 0 after a probe (:meth:`Stack.probe`), or at the
    deadline; and the seconds it took."""
    while True:
        stack.probe()
        time.sleep(0.5)  # the probe's last step's stats reach the front end
        readings = {s.role: {k: s.values[k] for k in GAUGES} for s in stack.read(0.0)}
        waited = time.monotonic() - since
        if (len(readings) == len(ROLES) and not any(any(g.values()) for g in readings.values())) or (
            waited > QUIET_TIMEOUT_S
        ):
            return readings, waited
        time.sleep(2.0)


def _processes(stack: Stack) -> tuple[list[str], list[str]]:
    """A line per process started, and a problem per one that died without being killed."""
    lines, deaths = [], []
    for node, killed in stack.processes:
        rc = node.proc.poll()
        if killed:
            lines.append(f"{node.name}: killed by the soak (SIGKILL), as planned")
        elif rc is None:
            lines.append(f"{node.name}: running")
        else:
            lines.append(f"{node.name}: DIED (rc={rc})")
            deaths.append(f"{node.name} died on its own (rc={rc}); log: {node.log_path}")
    rc = stack.router.proc.poll()
    lines.append("router: running" if rc is None else f"router: DIED (rc={rc})")
    if rc is not None:
        deaths.append(f"the router died (rc={rc})")
    return lines, deaths


def _logged(logs: Path, role: str, pattern: str) -> list[str]:
    """``pattern``'s matches over the logs of every process of ``role``, in start order."""
    out: list[str] = []
    for path in process_logs(logs, role):
        out += re.findall(pattern, path.read_text(errors="replace"))
    return out


def _held(sampler: Sampler, injector: Injector, lease_s: float) -> float:
    killed = next((start for name, start, _ in injector.outages if name == "decode"), None)
    if killed is None:
        return 0.0
    return max(
        (s.values["kv_usage"] for s in sampler.samples if s.role == "prefill" and killed <= s.t <= killed + lease_s),
        default=0.0,
    )


def _first_errors(outcomes: list[Outcome]) -> list[str]:
    seen: dict[str, str] = {}
    for o in outcomes:
        if o.kind in ("http-error", "dropped", "cut-off", "hung") and o.kind not in seen:
            seen[o.kind] = f"{o.kind}: {o.detail}"
    return list(seen.values())


def _compare(
    outcomes: list[Outcome],
    prompts: dict[int, list[int]],
    options: SoakOptions,
    model: str,
    logs: Path,
    echo: Callable[[str], None],
    running: EngineNode | None = None,
) -> Comparison:
    """A sample of the answered requests, spread over the run, against one engine without a
    connector answering each prompt alone (``running``, else one started here)."""
    answered = sorted((o for o in outcomes if o.kind == "answered"), key=lambda o: o.index)
    step = max(1, len(answered) // options.sample)
    sample = answered[::step][: options.sample]
    result = Comparison()
    if not sample:
        return result
    echo(f"comparing {len(sample)} answered requests with a single-engine baseline ...")
    baseline = running or EngineNode(EngineSpec("baseline", model), logs)
    try:
        wait_all_ready([baseline])
        for o in sample:
            (want,) = baseline.generate([prompts[o.index]], options.max_tokens)
            result.compared += 1
            if o.token_ids != want["token_ids"]:
                result.differing.append(o.index)
                continue
            result.tokens_equal += 1
            result.bit_equal += same_output(o.token_ids, o.logprobs, want)
            gap = max((abs(a - b) for a, b in zip(o.logprobs, want["logprobs"], strict=True)), default=0.0)
            result.max_logprob_gap = max(result.max_logprob_gap, gap)
    except NodeError as exc:
        result.differing.append(-1)
        echo(f"baseline failed: {exc}")
    finally:
        if running is None:
            baseline.close()
    return result
