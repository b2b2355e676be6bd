"""Benchmark 5i: a burst into a decode that must queue requests past the prefill's lease, against
vLLM's own NixlConnector (issue 43).

One prefill and one decode server per side (fresh for each side and run), both servers of a pair
running the same side:

* ``vllm-NixlConnector``: vLLM's NixlConnector as shipped, the class vLLM registers (no
  ``kv_connector_module_path``, so not the nixl plugin's subclass), its side channel through
  vLLM's ``VLLM_NIXL_SIDE_CHANNEL_HOST``/``_PORT``, the same lease as the other sides;
* ``MultiConnector``: vLLM's MultiConnector over the examples' children;
* ``kvcompose``: the shipped examples, ``examples/pd-prefill.yaml`` and ``examples/pd-decode.yaml``;
* ``kvcompose-native``: the native examples, ``native-prefill.yaml`` and ``native-decode.yaml`` (vLLM's
  OffloadingConnector as the host tier, issue 52).

After one warm-up request, :class:`Size`'s burst goes in at once the way vLLM's disaggregated
proxy sends it (:func:`kvcompose_tools.e2e.burst.send_burst`). At the issue's size (:data:`FULL`: 96
requests of 64 prompt tokens, 950 tokens out each, 256 device blocks) the decode holds about 8
requests at a time, and the later ones wait for free blocks 50-70 s after their prefill
finished, past vLLM's 30 s lease: only the decode's heartbeats keep their blocks on the prefill.
Per side: requests answered and failed, the longest decode call, and from the logs the prefill's
lease expiries and late-read lines and the decode's refusals (:mod:`kvcompose_tools.e2e.burst`). The
figure is answered requests, each side's over vLLM's NixlConnector's. :data:`SHORT` (``--quick``
and ``tools/tests/engine/test_overload.py``) is the same situation in about two minutes: a 6 s lease on
both servers, a smaller decode, fewer and shorter requests.

``link`` (``kvcompose bench --only overload --hosts``) puts the prefill and the decode in two
hosts of their own (:mod:`kvcompose_tools.e2e.hosts`), their links at that rate.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcompose_tools.bench.measure import Samples, ratio
from kvcompose_tools.bench.pd_ttft import engine_lock
from kvcompose_tools.bench.report import Case, Result, Target
from kvcompose_tools.e2e.burst import Burst, LeaseLines, errors, lease_lines, send_burst
from kvcompose_tools.e2e.spec import EngineSpec

if TYPE_CHECKING:
    from kvcompose_tools.e2e.hosts import Host, Hosts

BASELINE, MULTI, SUBJECT, NATIVE = SIDES = ("vllm-NixlConnector", "MultiConnector", "kvcompose", "kvcompose-native")
RUNS = 1
#: vLLM's ``kv_lease_duration`` when none is set.
VLLM_LEASE_S = 30
#: How long after a burst the prefill may take to free its last blocks beyond the lease (its reaper
#: runs on the next step).
SETTLE_S = 10.0
USAGE = "vllm:kv_cache_usage_perc"


@dataclass(frozen=True)
class Size:
    """A burst and the servers it meets. ``lease_s``: the lease on both servers (None: vLLM's)."""

    requests: int
    prompt_tokens: int
    max_tokens: int
    decode_blocks: int = 256
    lease_s: int | None = None

    def describe(self) -> str:
        lease = f"{self.lease_s} s lease" if self.lease_s else f"vLLM's {VLLM_LEASE_S} s lease"
        return (
            f"{self.requests} requests at once, {self.prompt_tokens}-token prompts, {self.max_tokens} tokens out "
            f"(ignore_eos), {self.decode_blocks} device blocks on the decode, {lease} on both servers"
        )


#: The issue's reproduction.
FULL = Size(96, 64, 950)
#: The same situation in about two minutes (``--quick``, the engine test).
SHORT = Size(24, 64, 300, decode_blocks=48, lease_s=6)


def specs(
    side: str, model: str, ports: tuple[int, int], size: Size, addresses: tuple[str, str] = ("127.0.0.1", "127.0.0.1")
) -> list[tuple[EngineSpec, dict[str, str]]]:
    """The prefill's and the decode's spec and extra environment for ``side``, their NIXL side
    channels on ``addresses`` and ``ports``."""
    from kvcompose.examples import pd_pair
    from kvcompose.vllm.args import vllm_multiconnector
    from kvcompose_tools.e2e.spec import composed_kv_transfer_config

    out = []
    for role, yaml, kv_role, port, address, blocks in zip(
        ("prefill", "decode"),
        pd_pair("native" if side == NATIVE else "simple"),
        ("kv_producer", "kv_consumer"),
        ports,
        addresses,
        (256, size.decode_blocks),
        strict=True,
    ):
        name = f"{side}-{role}"
        options: dict[str, Any] = {"side_channel_host": address}
        if size.lease_s is not None:
            options["lease_seconds"] = size.lease_s
        if side in (SUBJECT, NATIVE):
            spec = EngineSpec(name, model, str(yaml), port, options, num_gpu_blocks=blocks)
            out.append((spec, {}))
        elif side == MULTI:
            multi = vllm_multiconnector(composed_kv_transfer_config(yaml, port, options))
            out.append((EngineSpec(name, model, kv_config=multi, num_gpu_blocks=blocks), {}))
        elif side == BASELINE:
            out.append(
                (
                    EngineSpec(name, model, kv_config=vllm_nixl(kv_role, size.lease_s), num_gpu_blocks=blocks),
                    side_channel_env(address, port),
                )
            )
        else:
            raise ValueError(f"unknown side {side!r}; choose from {SIDES}")
    return out


def vllm_nixl(kv_role: str, lease_s: int | None) -> dict[str, Any]:
    """vLLM's NixlConnector as shipped (the name vLLM registers, no module path), in ``kv_role``,
    with ``lease_s`` as its ``kv_lease_duration`` when set."""
    config: dict[str, Any] = {"kv_connector": "NixlConnector", "kv_role": kv_role}
    if lease_s is not None:
        config["kv_connector_extra_config"] = {"kv_lease_duration": lease_s}
    return config


def side_channel_env(host: str, port: int) -> dict[str, str]:
    """vLLM's own way to place a NixlConnector's side channel."""
    return {"VLLM_NIXL_SIDE_CHANNEL_HOST": host, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port)}


@dataclass
class SideRun:
    """One side's burst and what its servers logged meanwhile."""

    side: str
    burst: Burst
    lines: LeaseLines
    warmup_error: str | None = None
    logs: dict[str, str] = field(default_factory=dict)

    def figures(self) -> dict[str, Any]:
        """The row of the table, and what the JSON keeps of this run."""
        return {
            "answered": self.burst.answered,
            "failed": len(self.burst.failed),
            "longest_decode_s": round(self.burst.longest_decode_s, 1),
            "lease_expiries": self.lines.expiries,
            "late_read_lines": self.lines.late_reads,
            "refused": self.lines.refusals,
            "released_unread": sum(self.lines.released.values()),
            "late_reads_unaccounted": sum(self.lines.unmatched().values()),
            "burst_s": round(self.burst.wall_s, 1),
            "errors": errors(self.burst.failed),
            "warmup_error": self.warmup_error,
            "logs": self.logs,
        }


def side_run(side: str, model: str, size: Size, logs: Path, hosts: Hosts | None = None, seed: int = 0) -> SideRun:
    """Start ``side``'s pair (in ``hosts`` when given), warm it with one request, send the burst,
    wait for the prefill to free its blocks, read the logs; stop the pair."""
    from kvcompose_tools.e2e.burst import SEED, Outcome, proxy_request
    from kvcompose_tools.e2e.flow import token_prompt
    from kvcompose_tools.e2e.node import wait_all_ready
    from kvcompose_tools.e2e.ports import free_ports
    from kvcompose_tools.e2e.server import ServerNode

    placed: list[Host | None] = [hosts["prefill"], hosts["decode"]] if hosts else [None, None]
    addresses = tuple(h.address if h else "127.0.0.1" for h in placed)
    pair = specs(side, model, tuple(free_ports(2)), size, addresses)  # type: ignore[arg-type]
    # `kvcompose bench` sets VLLM_LOGGING_LEVEL=ERROR for itself: the prefill's lease expiries are
    # warnings, and this benchmark counts them.
    nodes = [
        ServerNode(spec, logs, extra_env={**env, "VLLM_LOGGING_LEVEL": "INFO"}, host=h)
        for (spec, env), h in zip(pair, placed, strict=True)
    ]
    try:
        wait_all_ready(nodes)  # type: ignore[arg-type]
        prefill, decode = nodes
        warm = Outcome(-1)
        proxy_request(prefill.url, decode.url, model, token_prompt(SEED - 1 - seed, size.prompt_tokens), 4, warm)
        marks = [len(n.log_path.read_text(errors="replace")) for n in nodes]
        burst = send_burst(
            prefill.url, decode.url, model, size.requests, size.prompt_tokens, size.max_tokens, SEED + 1_000 * seed
        )
        settle(prefill, (size.lease_s or VLLM_LEASE_S) + SETTLE_S)
        p_log, d_log = (n.log_path.read_text(errors="replace")[m:] for n, m in zip(nodes, marks, strict=True))
        return SideRun(
            side, burst, lease_lines(p_log, d_log), warm.error, {n.spec.name: str(n.log_path) for n in nodes}
        )
    finally:
        for n in reversed(nodes):
            n.close()


def settle(prefill: Any, bound_s: float) -> None:
    """Wait until the prefill holds no blocks (its leases reaped or read), ``bound_s`` at most,
    then a second more: a reaped lease is logged on the step after."""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        try:
            if float(prefill._scrape(10.0).get(USAGE, -1.0)) == 0.0:
                break
        except Exception:  # a server too busy to answer its metrics now: ask again
            pass
        time.sleep(0.5)
    time.sleep(1.0)


def run(
    quick: bool = False,
    repeats: int | None = None,
    echo: Callable[[str], None] = print,
    work: Path | None = None,
    sides: tuple[str, ...] = SIDES,
    link: str | None = None,
    size: Size | None = None,
) -> Result:
    """Every side's burst, ``repeats`` times, the sides' order flipping every run; on this host or,
    with ``link``, across two hosts whose links run at that rate."""
    from kvcompose_tools.e2e.model import make_model

    unknown = [s for s in sides if s not in SIDES]
    if unknown:
        raise ValueError(f"unknown side(s) {unknown}; choose from {list(SIDES)}")
    size = size or (SHORT if quick else FULL)
    runs = repeats or RUNS
    logs = Path(work or tempfile.mkdtemp(prefix="kvcompose-bench-overload-"))
    model = str(make_model(0))
    done: dict[str, list[SideRun]] = {s: [] for s in sides}
    echo(f"   {size.describe()}; logs in {logs}")
    with engine_lock(echo=echo), _hosts(link) as hosts:
        for r in range(runs):
            for side in sides if r % 2 == 0 else sides[::-1]:
                one = side_run(side, model, size, logs, hosts, seed=r)
                done[side].append(one)
                echo(f"   run {r + 1}/{runs} {side}: " + row_text(one.figures()))
    return summarize(done, size, runs, quick, link, logs)


def _hosts(link: str | None) -> Any:
    """Two hosts joined at ``link``'s rate, or nothing (a context manager either way)."""
    import contextlib

    if link is None:
        return contextlib.nullcontext(None)
    from kvcompose_tools.e2e.hosts import Hosts

    return Hosts(["prefill", "decode"], link=link)


def row_text(f: dict[str, Any]) -> str:
    """One run's figures in words."""
    return (
        f"{f['answered']} answered, {f['failed']} failed, longest decode call {f['longest_decode_s']} s, "
        f"prefill: {f['lease_expiries']} lease expiries, {f['late_read_lines']} late-read lines; "
        f"decode: {f['refused']} refused, {f['late_reads_unaccounted']} late reads unaccounted"
        + (f"; e.g. {f['errors'][0]}" if f["errors"] else "")
    )


#: The detail table's columns: (heading, key of :meth:`SideRun.figures`).
COLUMNS = (
    ("side (both servers)", "side"),
    ("answered", "answered"),
    ("failed", "failed"),
    ("decode call, max (s)", "longest_decode_s"),
    ("prefill: leases expired", "lease_expiries"),
    ("prefill: late-read lines", "late_read_lines"),
    ("decode: reads refused", "refused"),
    ("late reads unaccounted", "late_reads_unaccounted"),
)


def detail(rows: list[dict[str, Any]]) -> list[str]:
    """The issue's table: a row per side and run (``rows``: :meth:`SideRun.figures` with ``side``)."""
    cells = [[h for h, _ in COLUMNS]] + [[str(r[k]) for _, k in COLUMNS] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    fmt = lambda cs: "  ".join(c.ljust(w) for c, w in zip(cs, widths))  # noqa: E731
    return [fmt(cells[0]), fmt(["-" * w for w in widths])] + [fmt(c) for c in cells[1:]]


def summarize(
    done: dict[str, list[SideRun]], size: Size, runs: int, quick: bool, link: str | None, logs: Path
) -> Result:
    """One case (this host, or across the link); samples: each run's answered requests; ratios:
    every side's over vLLM's NixlConnector's (higher is better), target ``kvcompose >= 1``."""
    label = f"across hosts ({link})" if link else "one host"
    samples = {side: Samples([float(r.burst.answered) for r in rs]) for side, rs in done.items() if rs}
    rows = [{"side": side, **r.figures()} for side, rs in done.items() for r in rs]
    ratios = [
        ratio(label, samples, side, BASELINE, higher_is_better=True)
        for side in samples
        if side != BASELINE and BASELINE in samples and samples[BASELINE].max > 0
    ]
    return Result(
        "overload",
        "A burst into a busy decode, requests queued past the prefill's lease: answered, against vLLM's "
        "own NixlConnector",
        "answered",
        1.0,
        [Case(label, samples, {"runs": rows, "size": asdict(size)})],
        ratios,
        Target(">=", 1.0, SUBJECT, BASELINE),
        runs,
        quick,
        [
            size.describe() + "; one warm-up request first; a fresh pair per side and run",
            'vllm-NixlConnector: {"kv_connector": "NixlConnector"} on both servers (vLLM\'s class); '
            "MultiConnector: vLLM's over the examples' children; kvcompose: examples/pd-prefill.yaml, pd-decode.yaml; "
            "kvcompose-native: examples/native-prefill.yaml, native-decode.yaml",
            "late reads unaccounted: the prefill's 'Potentially invalid KV blocks' lines no refusal (2 lines) or "
            "release without a read (1) on the decode accounts for: reads of released blocks used",
            *detail(rows),
        ],
        {"size": asdict(size), "link": link, "engine_logs": str(logs)},
    )
