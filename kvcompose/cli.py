"""``kvcompose``: check, explain, plugins, schema, vllm-args, import, examples, demo, bench.

Exit status: 0 on success, 2 for a bad composition or bad usage (the error is printed as
``FILE:LINE:COL: key: message (hint)``, never as a traceback), 1 for a broken plugin; 141
(128 + SIGPIPE, what a shell reports for ``yes | head``) when the reader of the output goes away
first, quietly; 130 (128 + SIGINT) or 143 (SIGTERM) when ``demo`` or ``bench`` is interrupted,
after stopping every engine and router process it started.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import os
import shlex
import signal
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TextIO

from kvcompose.bench.runner import BENCHMARKS
from kvcompose.catalog import Child, Plan
from kvcompose.compose import build, load
from kvcompose.config import from_builtins
from kvcompose.errors import CompositionError
from kvcompose.examples import ExampleError
from kvcompose.generic import imported, module_class, unverified
from kvcompose.plugins import PluginError, get_plugins, trace_log, tracing_enabled


def _plan(args: argparse.Namespace) -> Plan:
    plan = load(args.file, import_modules=args.import_modules)
    for warning in plan.warnings:
        print(warning.render(plan.source.filename), file=sys.stderr)
    return plan


#: The flag that lets check, explain and vllm-args import the modules a composition names.
IMPORT_FLAG = "--import-modules"


def class_line(plan: Plan, command: str, file: str) -> str | None:
    """One line saying which children's classes were imported and checked, or were not and how to
    check them (None: the composition names no class a check could leave unresolved)."""
    left, why = unverified(plan)
    if left:
        how = f"; `kvcompose {command} {IMPORT_FLAG} {shlex.quote(file)}` imports and checks {_them(left)}"
        return f"not verified: {_classes(left)}, {why}" + ("" if plan.import_modules else how)
    done = imported(plan)
    if done:
        return f"imported and checked: {_classes(done)}"
    return None


def _classes(children: Sequence[Child]) -> str:
    """``the class of a (m.A)`` / ``the classes of a (m.A), b (B)``."""
    listed = ", ".join(f"{c.name} ({module_class(c)})" for c in children)
    return ("the class of " if len(children) == 1 else "the classes of ") + listed


def _them(children: Sequence[Child]) -> str:
    return "it" if len(children) == 1 else "them"


def cmd_check(args: argparse.Namespace) -> int:
    plan = _plan(args)
    print(f"{args.file}: ok, {len(plan.children)} connectors")
    line = class_line(plan, "check", args.file)
    if line:
        print(f"{args.file}: {line}")
    for line in plan.explain():
        print("  " + line)
    from kvcompose.vllm.sleep_mode import sleep_mode_line  # imports vLLM only where it has sleep mode

    print("  " + sleep_mode_line(plan))
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    plan = _plan(args)
    print("\n".join(plan.explain()))
    print("\nvLLM child configs, in order:")
    for c in plan.children:
        print(f"  {c.name}: {json.dumps(c.vllm_config(), sort_keys=True)}")
    line = class_line(plan, "explain", args.file)
    if line:
        print(f"\n{args.file}: {line}")
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

    plan = _plan(args)
    line = class_line(plan, "vllm-args", args.file)
    if line:  # stderr: stdout is the value alone, for "$(kvcompose vllm-args FILE)"
        print(f"{args.file}: {line}", file=sys.stderr)
    print(render(plan, args.style))
    return 0


class UsageError(Exception):
    """Bad input that is no composition (a file that is not there, an output it may not replace):
    ``kvcompose COMMAND: message``, exit status 2."""


#: What ``kvcompose import`` reads, for its errors.
IMPORT_SOURCES = "CONFIG is a --kv-transfer-config value, a file holding one, or - for stdin"


def _import_source(source: str | None) -> tuple[str, str]:
    """The text ``kvcompose import`` reads and where it came from (its header and errors say so)."""
    if source in (None, "-"):
        try:
            return sys.stdin.read(), "stdin"
        except UnicodeDecodeError as exc:
            raise UsageError(f"stdin: not UTF-8 text (byte {exc.start}); {IMPORT_SOURCES}") from None
    if source.strip() and not source.lstrip().startswith(("{", "-", "'", '"')):
        path = Path(source)
        try:
            there = path.exists()
        except (OSError, ValueError):  # a name no file can have (a whole command line, too long)
            there = False
        if there:
            try:
                return path.read_text(encoding="utf-8"), source
            except OSError as exc:
                raise UsageError(f"{source}: cannot read the file: {exc.strerror}") from None
            except UnicodeDecodeError as exc:
                raise UsageError(f"{source}: not UTF-8 text (byte {exc.start}); {IMPORT_SOURCES}") from None
        if len(source.split()) == 1 and "{" not in source and not _is_json(source):
            # One word, no JSON: a file's name, mistyped (not a value, nor a command line).
            raise UsageError(f"{source}: no such file ({IMPORT_SOURCES})")
    return source, "the command line"


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True


def _write_new(target: str, text: str, force: bool) -> None:
    """``text`` into the file ``target``; one already there with other contents only with ``force``."""
    path = Path(target)
    try:
        if path.is_dir():
            raise UsageError(f"{target}: is a directory (-o names the file to write)")
        if path.exists() and not force and path.read_bytes() != text.encode():
            raise UsageError(f"{target} already exists with other contents (--force replaces it)")
        if not path.parent.is_dir():
            raise UsageError(f"{target}: no such directory: {path.parent} (create it first)")
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"{target}: cannot write the file: {exc.strerror or exc}") from None


def cmd_import(args: argparse.Namespace) -> int:
    from kvcompose.vllm import dropin, migrate

    text, origin = _import_source(args.source)
    cfg = migrate.parse(text, origin)
    data = dropin.composition_data(cfg, get_plugins().connector_types, origin)
    build(from_builtins(data, origin))  # what is written must compose (vllm-args of it)
    out = migrate.to_yaml(data, origin, migrate.left_behind(cfg))
    if args.output:
        _write_new(args.output, out, args.force)
        print(f"{args.output}: {dropin.describe(data)}", file=sys.stderr)
    else:
        print(out, end="")
    return 0


def cmd_examples(args: argparse.Namespace) -> int:
    from kvcompose import examples

    chosen = [examples.example(args.name)] if args.name else examples.all_examples()
    if args.write:
        try:
            written = examples.write(chosen, Path(args.write), force=args.force)
        except OSError as exc:  # DIR is a file, a file there is a folder, no permission, ...
            where = f" ({exc.filename})" if exc.filename and exc.filename != args.write else ""
            raise UsageError(f"cannot write into {args.write}: {exc.strerror or exc}{where}") from None
        for path in written:
            print(path)
    elif args.name:
        print(chosen[0].text(), end="")
    else:
        width = max(len(e.name) for e in chosen)
        for e in chosen:
            print(f"{e.name.ljust(width)}  {e.summary()}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from kvcompose.bench.plot import PlotUnavailable
    from kvcompose.bench.runner import run
    from kvcompose.e2e.hosts import DEFAULT_LINK
    from kvcompose.e2e.processes import stopped_on_interrupt

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
            )
    except (PlotUnavailable, ValueError) as exc:
        print(f"kvcompose bench: {exc}", file=sys.stderr)
        return 2
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from kvcompose.e2e.demo import run
    from kvcompose.e2e.hosts import DEFAULT_LINK
    from kvcompose.e2e.processes import stopped_on_interrupt

    with stopped_on_interrupt():
        return run(http=args.http, decodes=args.decodes, link=(args.link or DEFAULT_LINK) if args.hosts else None)


def cmd_warmup(args: argparse.Namespace) -> int:
    from kvcompose.e2e.processes import NodeError
    from kvcompose.e2e.warmup import check_url, connect, warm

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

    from kvcompose.e2e.hosts import HostsError, parse_rate
    from kvcompose.e2e.processes import NodeError, stopped_on_interrupt
    from kvcompose.soak.plan import QUICK, SoakOptions
    from kvcompose.soak.run import run

    base = QUICK if args.quick else SoakOptions()
    given = {k: getattr(args, k) for k in ("requests", "concurrency", "seed", "link") if getattr(args, k) is not None}
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


class _Versions(argparse.Action):
    """``--version``: kvcompose's, its plugins' and the vLLM and NIXL found (read only when asked)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, help="the versions of kvcompose, its plugins, vLLM and NIXL")

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> None:
        from kvcompose.versions import version_lines, version_warnings

        print("\n".join(version_lines()))
        for warning in version_warnings():
            print(warning, file=sys.stderr)
        parser.exit()


def _command(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str, help: str, example: str
) -> argparse.ArgumentParser:
    """A subcommand whose ``--help`` ends with an example of its use."""
    return sub.add_parser(
        name,
        help=help,
        description=help[0].upper() + help[1:] + ".",
        epilog="example:\n" + "\n".join("  " + line for line in example.splitlines()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def _import_modules_flag(s: argparse.ArgumentParser) -> None:
    """``--import-modules``, for the commands that check a composition."""
    s.add_argument(
        IMPORT_FLAG,
        action="store_true",
        help="import the modules the file names (a vllm child's kv_connector_module_path) and check their "
        "classes; this runs their code, so use it on files you trust (default: not imported, and the "
        "output says which classes were left unchecked)",
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvcompose",
        description="Compose vLLM KV-cache connectors from YAML.",
        epilog="example:\n  kvcompose examples --write .\n  kvcompose check pd-decode.yaml",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action=_Versions)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    s = _command(sub, "check", "validate a composition and say what it will do", "kvcompose check pd-decode.yaml")
    s.add_argument("file")
    _import_modules_flag(s)
    s.set_defaults(func=cmd_check)
    s = _command(
        sub,
        "explain",
        "the plan in plain words and each child's vLLM config",
        "kvcompose explain pd-decode.yaml",
    )
    s.add_argument("file")
    _import_modules_flag(s)
    s.set_defaults(func=cmd_explain)
    s = _command(
        sub,
        "plugins",
        "every connector type and rule, with the distribution providing it",
        "kvcompose plugins --json",
    )
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_plugins)
    s = _command(
        sub,
        "schema",
        "JSON Schema of the composition file (for editor completion)",
        "kvcompose schema > kvcompose.schema.json",
    )
    s.set_defaults(func=cmd_schema)
    s = _command(
        sub,
        "vllm-args",
        "the --kv-transfer-config value that makes vLLM load the composition",
        'vllm serve MODEL --kv-transfer-config "$(kvcompose vllm-args pd-decode.yaml)"',
    )
    s.add_argument("file")
    s.add_argument(
        "--style",
        choices=["json", "shell"],
        default="json",
        help="json: the value alone (default); shell: the whole flag, quoted",
    )
    _import_modules_flag(s)
    s.set_defaults(func=cmd_vllm_args)
    s = _command(
        sub,
        "import",
        "a composition file from a vLLM --kv-transfer-config (MultiConnector JSON or one connector)",
        'kvcompose import \'{"kv_connector":"MultiConnector","kv_role":"kv_both",...}\' > compose.yaml\n'
        "kvcompose import kv-transfer-config.json -o compose.yaml\n"
        "grep -o -e \"--kv-transfer-config '.*'\" serve.sh | kvcompose import",
    )
    s.add_argument(
        "source",
        nargs="?",
        metavar="CONFIG",
        help="the JSON (with or without the flag name and shell quotes), a file holding it, or - / nothing: stdin",
    )
    s.add_argument(
        "-o",
        "--output",
        metavar="FILE",
        help="write the YAML here (default: stdout); a file already there with other contents is refused",
    )
    s.add_argument("--force", action="store_true", help="with -o: replace a file that differs")
    s.set_defaults(func=cmd_import)
    s = _command(
        sub,
        "examples",
        "the example compositions shipped with kvcompose: list them, print one, or copy them",
        "kvcompose examples                     # list them\n"
        "kvcompose examples pd-decode           # print one\n"
        "kvcompose examples --write compose/    # copy them all into compose/",
    )
    s.add_argument("name", nargs="?", metavar="NAME", help="one example (default: all)")
    s.add_argument("--write", metavar="DIR", help="copy the example(s) into DIR (created if missing)")
    s.add_argument("--force", action="store_true", help="with --write: replace files that differ")
    s.set_defaults(func=cmd_examples)
    s = _command(
        sub,
        "demo",
        "P/D over NIXL plus the CPU tier between two real vLLM engines, "
        "checked against a single-engine baseline (the main job)",
        "kvcompose demo                      # offline engines\n"
        "kvcompose demo --http               # vLLM's router and HTTP servers\n"
        "kvcompose demo --http --decodes 2  # 1P2D: one conversation per decode\n"
        "kvcompose demo --hosts              # the --http stack, prefill and decode on two hosts",
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
    s.set_defaults(func=cmd_demo)
    s = _command(
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
    s.set_defaults(func=cmd_bench)
    s = _command(
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
    s = _command(
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
    s.set_defaults(func=cmd_soak)
    return p


#: 128 + the signal's number: the status a shell reports for a command a signal ended.
SIGNALLED = 128


@functools.cache
def _parser() -> argparse.ArgumentParser:
    return parser()  # built once per process: argparse spends milliseconds on it


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to ``sys.stderr`` as it is when a record comes (a test may have replaced it)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:
        pass


@contextlib.contextmanager
def _trace_to_stderr() -> Iterator[None]:
    """With ``KVCOMPOSE_TRACE`` set: the ``kvcompose.trace`` logger's lines (every hook call, every
    child call) on stderr, each line prefixed ``kvcompose.trace:``. Nothing configures logging in
    the CLI otherwise, and a logger without a handler shows INFO nowhere."""
    if not tracing_enabled():
        yield
        return
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    level = trace_log.level
    trace_log.addHandler(handler)
    if not trace_log.isEnabledFor(logging.INFO):
        trace_log.setLevel(logging.INFO)
    try:
        yield
    finally:
        trace_log.removeHandler(handler)
        trace_log.setLevel(level)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    with _trace_to_stderr():
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    try:
        status = args.func(args)
        # Inside the try: a reader that went away shows here, not at interpreter exit.
        sys.stdout.flush()
        return status
    except CompositionError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    except ExampleError as exc:
        print(f"kvcompose examples: {exc}", file=sys.stderr)
        return 2
    except UsageError as exc:
        print(f"kvcompose {args.command}: {exc}", file=sys.stderr)
        return 2
    except PluginError as exc:
        print(f"kvcompose: plugin error: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # Python's recipe (the signal module's "Note on SIGPIPE"): point stdout at devnull so the
        # flush at exit cannot fail again. Not SIGPIPE's default action, which would also end
        # the process on a socket closed under it (the demo's HTTP clients).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return SIGNALLED + signal.SIGPIPE
    except KeyboardInterrupt as exc:
        from kvcompose.e2e.processes import Interrupted

        if isinstance(exc, Interrupted):
            print("\n" + exc.message(args.command), file=sys.stderr)
            return SIGNALLED + exc.signum
        print(f"\nkvcompose {args.command}: interrupted", file=sys.stderr)
        return SIGNALLED + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main())
