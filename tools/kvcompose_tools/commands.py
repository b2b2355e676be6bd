"""The ``kvcompose`` CLI's tool commands: ``demo``, ``bench``, ``warmup``, ``soak``.

Each ``add_*`` is an entry point of the ``kvcompose.commands`` group (kvcompose.cli.COMMANDS_GROUP):
the CLI calls it with its subparsers to add the command. Building the parser imports nothing
heavy: each ``cmd_*`` imports what it runs when it runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvcompose.cli import command
from kvcompose.examples import HOST_TIERS

#: The models ``--model`` takes (kvcompose_tools.e2e.model.MODELS, named here so that building the
#: parser imports nothing heavy; a test pins the two).
MODEL_NAMES = ("tiny", "medium")
MODEL_HELP = (
    "tiny: 2 layers, 1 KiB of KV a token, what the tests run; medium: 8 layers, 16 KiB of KV a token, "
    "a 4,096-token context, where a token's compute outweighs a request's fixed costs"
)


def cmd_bench(args: argparse.Namespace) -> int:
    from kvcompose_tools.bench.plot import PlotUnavailable
    from kvcompose_tools.bench.runner import run
    from kvcompose_tools.e2e.hosts import DEFAULT_LINK
    from kvcompose_tools.e2e.processes import stopped_on_interrupt

    if args.link and not args.hosts:
        print("kvcompose bench: --link sets the rate of --hosts' links; add --hosts", file=sys.stderr)
        return 2
    try:
        with stopped_on_interrupt():
            run(
                quick=args.quick,
                only=args.only or (),
                png=args.png,
                out=Path(args.out),
                link=(args.link or DEFAULT_LINK) if args.hosts else None,
                model=args.model,
            )
    except (PlotUnavailable, ValueError) as exc:
        print(f"kvcompose bench: {exc}", file=sys.stderr)
        return 2
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from kvcompose_tools.e2e.demo import run
    from kvcompose_tools.e2e.hosts import DEFAULT_LINK
    from kvcompose_tools.e2e.processes import stopped_on_interrupt

    if args.prefills == 2:
        if not args.http or args.hosts or args.decodes != 2:
            print("kvcompose demo: --prefills 2 runs 2P2D on this host: add --http --decodes 2, without --hosts",
                  file=sys.stderr)  # fmt: skip
            return 2
        from kvcompose_tools.e2e.fleet_demo import run as run_fleet

        with stopped_on_interrupt():
            return run_fleet(model_name=args.model, host_tier=args.host_tier)
    with stopped_on_interrupt():
        return run(
            http=args.http,
            decodes=args.decodes,
            link=(args.link or DEFAULT_LINK) if args.hosts else None,
            model=args.model,
            host_tier=args.host_tier,
        )


def cmd_warmup(args: argparse.Namespace) -> int:
    from kvcompose_tools.e2e.processes import NodeError
    from kvcompose_tools.e2e.warmup import check_url, connect, warm

    try:
        for url in args.prefill + args.decode:
            check_url(url)
    except ValueError as exc:
        print(f"kvcompose warmup: {exc}", file=sys.stderr)
        return 2
    try:
        prefills = [connect(u) for u in args.prefill]
        decodes = [connect(u) for u in args.decode]
        warmed = warm(prefills, decodes, echo=print)
    except NodeError as exc:
        print(f"kvcompose warmup: {exc}", file=sys.stderr)
        return 1
    cold = [w for w in warmed if w.nixl_bytes <= 0]
    for w in cold:
        print(
            f"kvcompose warmup: {w.prefill} -> {w.decode} moved nothing over NIXL: is the decode a kv_consumer "
            "composition with a nixl child, and the prefill a kv_producer?",
            file=sys.stderr,
        )
    return 1 if cold else 0


def cmd_soak(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    from kvcompose_tools.e2e.hosts import HostsError, parse_rate
    from kvcompose_tools.e2e.processes import NodeError, stopped_on_interrupt
    from kvcompose_tools.soak.plan import QUICK, SoakOptions
    from kvcompose_tools.soak.run import run

    base = QUICK if args.quick else SoakOptions()
    names = ("requests", "concurrency", "seed", "link", "host_tier")
    given = {k: getattr(args, k) for k in names if getattr(args, k) is not None}
    if args.link and not args.hosts:
        print("kvcompose soak: --link sets the rate of --hosts' link; add --hosts", file=sys.stderr)
        return 2
    try:
        options = dataclasses.replace(base, hosts=args.hosts, **given)
        if options.link is not None:
            parse_rate(options.link)  # a ValueError naming tc's units
    except ValueError as exc:
        print(f"kvcompose soak: {exc}", file=sys.stderr)
        return 2
    try:
        with stopped_on_interrupt():
            report = run(options, Path(args.work) if args.work else None, echo=lambda line: print(line, flush=True))
    except HostsError as exc:  # not root, or no namespace could be made: nothing was measured
        print(f"kvcompose soak: {exc}", file=sys.stderr)
        return 2
    except NodeError as exc:  # the stack did not start: nothing was measured
        print(f"kvcompose soak: {exc}", file=sys.stderr)
        return 1
    print()
    print(report.render())
    if args.json:
        Path(args.json).write_text(json.dumps(report.as_dict(), indent=1))
    return 1 if report.problems else 0


def add_demo(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """``kvcompose demo``."""
    s = command(
        sub,
        "demo",
        "P/D over NIXL plus the CPU tier between two real vLLM engines, "
        "checked against a single-engine baseline (the main job)",
        "kvcompose demo                      # offline engines\n"
        "kvcompose demo --http               # vLLM's router and HTTP servers\n"
        "kvcompose demo --http --decodes 2  # 1P2D: one conversation per decode\n"
        "kvcompose demo --http --decodes 2 --prefills 2  # 2P2D: prefills routed by their KV events\n"
        "kvcompose demo --hosts              # the --http stack, prefill and decode on two hosts\n"
        "kvcompose demo --host-tier native   # vLLM's OffloadingConnector as the host tier",
    )
    s.add_argument(
        "--http",
        action="store_true",
        help="the serving stack: vLLM's router (P/D mode, nixl) in front of prefill and decode as "
        "vLLM's OpenAI-compatible HTTP servers, completions and a 3-turn chat through the router, "
        "counters from decode's /metrics (instead of offline engines)",
    )
    s.add_argument(
        "--decodes",
        type=int,
        choices=[1, 2],
        default=1,
        help="with --http: decode servers behind the router (2: 1P2D, the router's consistent_hash keeps each "
        "conversation on one decode, whose host tier serves its later turns)",
    )
    s.add_argument(
        "--prefills",
        type=int,
        choices=[1, 2],
        default=1,
        help="with --http --decodes 2: prefill servers behind the router (2: 2P2D, the router's kv_aware picks the "
        "prefill holding a conversation by the prefills' KV events; then one prefill is killed)",
    )
    s.add_argument(
        "--hosts",
        action="store_true",
        help="the --http stack across hosts: prefill and each decode in a host of its own (network namespaces, "
        "needs root), the router in this one",
    )
    s.add_argument(
        "--link",
        metavar="RATE",
        help="with --hosts: the links' rate in tc's units (default 800mbit: the tiny model's KV scaled to "
        "Llama-3-8B's on 100 Gbit/s)",
    )
    s.add_argument("--model", choices=MODEL_NAMES, default="tiny", help=MODEL_HELP)
    s.add_argument(
        "--host-tier",
        choices=list(HOST_TIERS),
        default="simple",
        help="the host-memory tier beside NIXL: simple (cpu-offload, vLLM's SimpleCPUOffloadConnector: "
        "pd-*.yaml) or native (native-offload, vLLM's OffloadingConnector: native-*.yaml)",
    )
    s.set_defaults(func=cmd_demo)
    return s


def add_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """``kvcompose bench``."""
    from kvcompose_tools.bench.runner import BENCHMARKS  # the names alone (the module imports no benchmark)

    s = command(
        sub,
        "bench",
        "benchmarks: kvcompose vs vLLM's MultiConnector, copy paths, NIXL (ratios)",
        "kvcompose bench --quick --only dispatch --png",
    )
    s.add_argument("--quick", action="store_true", help="fewer sizes and repeats, no engine run (under 2 minutes)")
    s.add_argument(
        "--only",
        action="append",
        metavar="NAME",
        help=f"run only this benchmark (repeatable): {', '.join(BENCHMARKS)}",
    )
    s.add_argument("--png", action="store_true", help="also draw each benchmark's ratios as a PNG (needs matplotlib)")
    s.add_argument("--out", default="bench/results", help="where the JSON (and PNG) files go (bench/results)")
    s.add_argument(
        "--hosts",
        action="store_true",
        help="prefill and decode each in a host of their own (network namespaces, needs root): cold-start only",
    )
    s.add_argument("--link", metavar="RATE", help="with --hosts: the links' rate in tc's units (default 800mbit)")
    s.add_argument(
        "--model",
        choices=MODEL_NAMES,
        help="pd-load and multi-turn only: the model their engines run (default tiny; " + MODEL_HELP + ")",
    )
    s.set_defaults(func=cmd_bench)
    return s


def add_warmup(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """``kvcompose warmup``."""
    s = command(
        sub,
        "warmup",
        "one small P/D request through every prefill/decode pair, so that no user request pays a "
        "pair's first NIXL handshake and transfer (run after a deploy or a scale-out, before traffic)",
        "kvcompose warmup --prefill http://10.0.0.1:8100 --decode http://10.0.0.2:8200\n"
        "kvcompose warmup --prefill $P1 --prefill $P2 --decode $D1 --decode $D2   # all 4 pairs",
    )
    s.add_argument("--prefill", action="append", required=True, metavar="URL", help="a prefill server (repeatable)")
    s.add_argument("--decode", action="append", required=True, metavar="URL", help="a decode server (repeatable)")
    s.set_defaults(func=cmd_warmup)
    return s


def add_soak(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """``kvcompose soak``."""
    s = command(
        sub,
        "soak",
        "the serving stack under load with faults: servers killed and restarted, clients hanging up, "
        "a child raising; then every engine must be quiet and answers equal a baseline",
        "kvcompose soak                       # 1,000 requests, 32 at a time (about 10 minutes)\n"
        "kvcompose soak --quick               # CI's short variant\n"
        "kvcompose soak --seed 7 --json soak.json\n"
        "kvcompose soak --quick --hosts       # prefill and decode on two hosts; the link between them cut once",
    )
    s.add_argument("--requests", type=int, help="requests to send (default 1000; --quick: 160)")
    s.add_argument("--concurrency", type=int, help="clients sending at once (default 32; --quick: 8)")
    s.add_argument("--seed", type=int, help="draws the prompts, hang-ups and fault moments (default 0)")
    s.add_argument("--quick", action="store_true", help="the short variant CI runs")
    s.add_argument("--work", metavar="DIR", help="where the logs and the decode composition go (default: a temp dir)")
    s.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    s.add_argument(
        "--hosts",
        action="store_true",
        help="prefill and decode each in a host of their own (network namespaces, needs root), the router in this "
        "one; the link between the two is cut once, longer than the prefill's lease, and restored",
    )
    s.add_argument("--link", metavar="RATE", help="with --hosts: the link's rate in tc's units (default 800mbit)")
    s.add_argument(
        "--host-tier",
        choices=list(HOST_TIERS),
        help="the shipped pair the stack runs: simple (pd-*.yaml, the default) or native (native-*.yaml, vLLM's "
        "OffloadingConnector as the host tier)",
    )
    s.set_defaults(func=cmd_soak)
    return s
