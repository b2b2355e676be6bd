"""Bytecodes executed per scheduler step, kvcompose against MultiConnector (docs/performance.md, fifth round).

Not part of ``kvcompose bench``: a count, not a time, so it does not move with the machine's
load. Each side is the scheduler benchmark's driver (``tools/kvcompose_tools/bench/scheduler_step.py``: the
same request stream and worker reports), warmed up as the benchmark warms it; then only
``schedule()`` and ``update_from_output()`` run under ``sys.settrace`` with opcode events, and
every executed bytecode is counted against the function that ran it. The per-step totals of the
two sides, and the functions where they differ most, say where the composite's extra time goes.

Usage: ``python scripts/scheduler_opcodes.py [--requests 1 16 128] [--steps 100] [--top 25]``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from types import FrameType
from typing import Any

from kvcompose_tools.bench.scheduler_step import Driver, warmup_steps

SIDES = ("MultiConnector", "kvcompose")


def _where(frame: FrameType) -> str:
    code = frame.f_code
    path = code.co_filename.split("site-packages/")[-1]
    if os.path.isabs(path) and path.startswith(os.getcwd() + os.sep):
        path = os.path.relpath(path)
    return f"{path}:{code.co_qualname}"


def count(side: str, requests: int, steps: int) -> tuple[Counter[str], Counter[str]]:
    """Bytecodes and calls per function over ``steps`` timed steps of one side."""
    driver = Driver(side, requests)
    for _ in range(warmup_steps(quick=False)):
        driver.step()
    opcodes: Counter[str] = Counter()
    calls: Counter[str] = Counter()

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "call":
            frame.f_trace_opcodes = True
            calls[_where(frame)] += 1
        elif event == "opcode":
            opcodes[_where(frame)] += 1
        return tracer

    sched = driver.sched
    schedule, update = sched.schedule, sched.update_from_output

    def traced(fn: Any) -> Any:
        def run(*args: Any) -> Any:
            sys.settrace(tracer)
            try:
                return fn(*args)
            finally:
                sys.settrace(None)

        return run

    sched.schedule, sched.update_from_output = traced(schedule), traced(update)
    for _ in range(steps):
        driver.step()
    return opcodes, calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 16, 128])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    for n in args.requests:
        (base_ops, base_calls), (ops, calls) = (count(side, n, args.steps) for side in SIDES)
        per = args.steps
        total_base, total = sum(base_ops.values()) / per, sum(ops.values()) / per
        print(
            f"== {n} live requests, {per} steps: bytecodes/step MultiConnector {total_base:.0f}, "
            f"kvcompose {total:.0f} ({total - total_base:+.0f}, ratio {total / total_base:.4f}); "
            f"Python calls/step {sum(base_calls.values()) / per:.1f} and {sum(calls.values()) / per:.1f}"
        )
        diff = {k: (ops[k] - base_ops[k]) / per for k in set(ops) | set(base_ops)}
        for where, d in sorted(diff.items(), key=lambda kv: -abs(kv[1]))[: args.top]:
            print(f"  {d:+8.1f}  calls/step {base_calls[where] / per:6.2f} -> {calls[where] / per:6.2f}  {where}")


if __name__ == "__main__":
    main()
