"""``kvcompose bench``: run the benchmarks, print their tables, write JSON (and PNGs)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from kvcompose_tools.bench.report import RESULTS_DIR, Result, machine

#: Name -> module under kvcompose_tools.bench; each module has ``run(quick=...) -> Result``.
BENCHMARKS: dict[str, str] = {
    "scheduler": "scheduler_step",
    "worker": "worker_hooks",
    "dispatch": "dispatch",
    "cpu-copy": "cpu_copy",
    "nixl-read": "nixl_read",
    "pd-ttft": "pd_ttft",
    "ranges": "pd_ranges",
    "cold-start": "cold_start",
    "serve": "serve",
    "pd-load": "pd_load",
    "lease": "lease_cost",
    "multi-turn": "multi_turn",
    "fleet": "fleet",
    "fleet-kill": "fleet_kill",
    "fleet-join": "fleet_join",
    "overload": "overload",
    "load-failure": "load_failure",
}
#: Left out of ``--quick`` unless named with ``--only``: they start vLLM engines (minutes).
FULL_ONLY = (
    "pd-ttft",
    "ranges",
    "cold-start",
    "serve",
    "pd-load",
    "lease",
    "multi-turn",
    "fleet",
    "fleet-kill",
    "fleet-join",
    "overload",
    "load-failure",
)
#: Those that run across hosts with ``--hosts`` (``run(link=...)``: prefill and decode each in a
#: host of their own, :mod:`kvcompose_tools.e2e.hosts`).
ACROSS_HOSTS = ("cold-start", "overload")
#: Those that run another model than the tiny one with ``--model`` (``run(model=...)``).
TAKE_MODEL = ("pd-load", "multi-turn", "fleet", "fleet-kill", "fleet-join")


def _runner(name: str) -> Callable[..., Result]:
    import importlib

    return importlib.import_module(f"kvcompose_tools.bench.{BENCHMARKS[name]}").run  # type: ignore[no-any-return]


def run(
    quick: bool = False,
    only: Sequence[str] = (),
    png: bool = False,
    out: Path = RESULTS_DIR,
    echo: Callable[[str], None] = print,
    link: str | None = None,
    model: str | None = None,
) -> list[Result]:
    """Run the chosen benchmarks (all by default; by name or module name) one after another.

    Writes ``<out>/<benchmark>.json`` per benchmark and ``<out>/summary.json``; with ``png``
    also ``<out>/<benchmark>.png``. ``link``: the benchmarks of :data:`ACROSS_HOSTS` run with
    prefill and decode in two hosts joined by links at that rate (``--hosts``); only those may
    be chosen then. ``model``: the benchmarks of :data:`TAKE_MODEL` run that model of
    :data:`~kvcompose_tools.e2e.model.MODELS` (``--model``); only those may be chosen then.
    """
    # A benchmark answers to its module name too (``cpu_copy``, the name of its JSON file).
    by_module = {module: name for name, module in BENCHMARKS.items()}
    only = [by_module.get(n, n) for n in only]
    unknown = [n for n in only if n not in BENCHMARKS]
    if unknown:
        raise ValueError(f"unknown benchmark(s) {unknown}; choose from {list(BENCHMARKS)}")
    if link is not None:
        from kvcompose_tools.e2e.hosts import parse_rate

        parse_rate(link)  # a ValueError naming tc's units
        other = [n for n in only if n not in ACROSS_HOSTS]
        if not only or other:
            raise ValueError(
                f"--hosts runs {', '.join(ACROSS_HOSTS)} only; choose it with --only"
                + (f" (not {', '.join(other)})" if other else "")
            )
    if model is not None:
        from kvcompose_tools.e2e.model import model_config

        model_config(model)  # a ValueError naming the models
        other = [n for n in only if n not in TAKE_MODEL]
        if not only or other:
            raise ValueError(
                f"--model runs {', '.join(TAKE_MODEL)} only; choose it with --only"
                + (f" (not {', '.join(other)})" if other else "")
            )
    if png:
        from kvcompose_tools.bench.plot import require_matplotlib

        require_matplotlib()
    # vLLM logs every config it builds at INFO; the tables are what this command is for.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    # vLLM's CPU platform pins the process to one core when it builds a config; the copy and
    # NIXL benchmarks (and the NIXL target process, which inherits it) must see every core.
    cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    m = machine()
    echo(
        f"kvcompose bench{' --quick' if quick else ''}: {m['cores']} cores ({m['usable_cores']} usable), "
        f"{m['cpu']}, load {m['loadavg_1m']:.2f}"
    )
    if quick:
        echo("quick mode: fewer sizes and repeats")
    names = list(only) or [n for n in BENCHMARKS if not (quick and n in FULL_ONLY)]
    if quick and not only:
        echo(f"left out of --quick (they start vLLM engines): {', '.join(FULL_ONLY)}")
    echo(
        "every figure is a ratio against a baseline run in the same process, interleaved; "
        "the other processes on this machine add noise to both sides alike"
    )
    results = []
    started = time.perf_counter()
    for name in names:
        if cores is not None:
            os.sched_setaffinity(0, cores)
        t0 = time.perf_counter()
        given = {"link": link, "model": model}
        result = _runner(name)(quick=quick, **{k: v for k, v in given.items() if v is not None})
        result.config["wall_s"] = round(time.perf_counter() - t0, 1)
        path = result.write(out)
        echo("")
        echo(result.table())
        echo(f"   -> {path} ({result.config['wall_s']} s)")
        if png:
            from kvcompose_tools.bench.plot import draw

            echo(f"   -> {draw(result, out)}")
        results.append(result)
    summary = {
        "quick": quick,
        "machine": m,
        "wall_s": round(time.perf_counter() - started, 1),
        "benchmarks": {
            r.name: {
                "target": None if r.target is None else str(r.target),
                "target_met": r.target_met,
                "ratios": [x.to_json() for x in r.ratios],
            }
            for r in results
        },
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    echo(f"\nall benchmarks: {summary['wall_s']} s; summary -> {out / 'summary.json'}")
    return results
