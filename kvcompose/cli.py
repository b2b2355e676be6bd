"""``kvcompose``: check, explain, plugins, schema, vllm-args, bench.

Exit status: 0 on success, 2 for a bad composition or bad usage (the error is printed as
``FILE:LINE:COL: key: message (hint)``, never as a traceback), 1 for a broken plugin.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Sequence

from kvcompose.bench.runner import BENCHMARKS
from kvcompose.catalog import Plan
from kvcompose.compose import load
from kvcompose.errors import CompositionError
from kvcompose.plugins import PluginError, get_plugins


def _plan(path: str) -> Plan:
    plan = load(path)
    for warning in plan.warnings:
        print(warning.render(plan.source.filename), file=sys.stderr)
    return plan


def cmd_check(args: argparse.Namespace) -> int:
    plan = _plan(args.file)
    print(f"{args.file}: ok, {len(plan.children)} connectors")
    for line in plan.explain():
        print("  " + line)
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    plan = _plan(args.file)
    print("\n".join(plan.explain()))
    print("\nvLLM child configs, in order:")
    for c in plan.children:
        print(f"  {c.name}: {json.dumps(c.vllm_config(), sort_keys=True)}")
    return 0


def cmd_plugins(args: argparse.Namespace) -> int:
    rows = get_plugins().provided()
    if args.json:
        print(json.dumps([r.__dict__ for r in rows], indent=2))
        return 0
    width = max((len(f"{r.kind} {r.name}") for r in rows), default=0)
    for r in sorted(rows, key=lambda r: (r.kind != "type", r.kind, r.name)):
        print(f"{(r.kind + ' ' + r.name).ljust(width)}  {r.provider:<28}  {r.summary}")
    return 0


def cmd_schema(args: argparse.Namespace) -> int:
    from kvcompose.schema import json_schema

    print(json.dumps(json_schema(), indent=2))
    return 0


def cmd_vllm_args(args: argparse.Namespace) -> int:
    from kvcompose.vllm.args import render

    print(render(_plan(args.file), args.style))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    from kvcompose.bench.plot import PlotUnavailable
    from kvcompose.bench.runner import run

    try:
        run(quick=args.quick, only=args.only or (), png=args.png, out=Path(args.out))
    except (PlotUnavailable, ValueError) as exc:
        print(f"kvcompose bench: {exc}", file=sys.stderr)
        return 2
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from kvcompose.e2e.demo import run

    return run(http=args.http)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvcompose", description="Compose vLLM KV-cache connectors from YAML.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    s = sub.add_parser("check", help="validate a composition and say what it will do")
    s.add_argument("file")
    s.set_defaults(func=cmd_check)
    s = sub.add_parser("explain", help="the plan in plain words and each child's vLLM config")
    s.add_argument("file")
    s.set_defaults(func=cmd_explain)
    s = sub.add_parser("plugins", help="every connector type and rule, with the distribution providing it")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_plugins)
    s = sub.add_parser("schema", help="JSON Schema of the composition file (for editor completion)")
    s.set_defaults(func=cmd_schema)
    s = sub.add_parser("vllm-args", help="the --kv-transfer-config value that makes vLLM load the composition")
    s.add_argument("file")
    s.add_argument(
        "--style",
        choices=["json", "shell"],
        default="json",
        help="json: the value alone (default); shell: the whole flag, quoted",
    )
    s.set_defaults(func=cmd_vllm_args)
    s = sub.add_parser(
        "demo",
        help="P/D over NIXL plus the CPU tier between two real vLLM engines, "
        "checked against a single-engine baseline (the main job)",
    )
    s.add_argument(
        "--http",
        action="store_true",
        help="the serving stack: vLLM's router (P/D mode, nixl) in front of prefill and decode as "
        "vLLM's OpenAI-compatible HTTP servers, completions and a 3-turn chat through the router, "
        "counters from decode's /metrics (instead of offline engines)",
    )
    s.set_defaults(func=cmd_demo)
    s = sub.add_parser("bench", help="benchmarks: kvcompose vs vLLM's MultiConnector, copy paths, NIXL (ratios)")
    s.add_argument("--quick", action="store_true", help="fewer sizes and repeats, no engine run (under 2 minutes)")
    s.add_argument(
        "--only",
        action="append",
        metavar="NAME",
        help=f"run only this benchmark (repeatable): {', '.join(BENCHMARKS)}",
    )
    s.add_argument("--png", action="store_true", help="also draw each benchmark's ratios as a PNG (needs matplotlib)")
    s.add_argument("--out", default="bench/results", help="where the JSON (and PNG) files go (bench/results)")
    s.set_defaults(func=cmd_bench)
    return p


@functools.cache
def _parser() -> argparse.ArgumentParser:
    return parser()  # built once per process: argparse spends milliseconds on it


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.func(args)
    except CompositionError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    except PluginError as exc:
        print(f"kvcompose: plugin error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
