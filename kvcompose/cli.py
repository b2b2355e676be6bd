"""``kvcompose``: check, explain, plugins, schema, vllm-args, import, examples, relay-events,
register; and the commands other distributions add through the ``kvcompose.commands``
entry-point group (``kvcompose-tools``: demo, bench, soak, warmup).

Exit status: 0 on success, 2 for a bad composition or bad usage (the error is printed as
``FILE:LINE:COL: key: message (hint)``, never as a traceback) or for a command whose distribution
is not installed (the line says which to install), 1 for a broken plugin; 141 (128 + SIGPIPE,
what a shell reports for ``yes | head``) when the reader of the output goes away first, quietly;
130 (128 + SIGINT) or 143 (SIGTERM) when ``demo`` or ``bench`` is interrupted, after stopping
every engine and router process it started.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.metadata
import json
import logging
import os
import shlex
import signal
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TextIO

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
    for line in plan.summary():
        print("  " + line)
    from kvcompose.vllm.sleep_mode import sleep_mode_line  # imports vLLM only where it has sleep mode

    print("  " + sleep_mode_line(plan))
    from kvcompose.router import router_brief

    for line in router_brief(plan):
        print("  " + line)
    print(f"  the details: kvcompose explain {shlex.quote(args.file)}")
    return 0


def cmd_relay_events(args: argparse.Namespace) -> int:
    import signal
    import threading

    from kvcompose.relay import Relay

    try:
        relay = Relay(args.source, args.target, args.engine_block_size, args.block_size)
    except (ValueError, OSError) as exc:  # zmq.ZMQError is an OSError: a bad or taken endpoint
        print(f"kvcompose relay-events: {exc}", file=sys.stderr)
        return 2
    print(
        f"kvcompose relay-events: {args.source} -> {args.target}, "
        f"{args.engine_block_size}-token blocks told in {args.block_size}-token blocks",
        file=sys.stderr,
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    relay.close()
    print(f"kvcompose relay-events: {relay.relayed} batches relayed, {relay.dropped} dropped", file=sys.stderr)
    return 0


def cmd_register(args: argparse.Namespace) -> int:
    import signal
    import threading

    from kvcompose.discovery import HEALTH_TIMEOUT_S, Registrar, healthy, host_port

    servers = [("prefill", url) for url in args.prefill] + [("decode", url) for url in args.decode]
    why = f"GET /health did not answer 200 within {HEALTH_TIMEOUT_S} s; the router drops it within about 5 s"

    def said(kind: str, address: str, registered: bool) -> None:
        state = "registered" if registered else f"not registered ({why})"
        print(f"kvcompose register: {kind} {address}: {state}", file=sys.stderr, flush=True)

    try:
        if not servers:
            raise ValueError("name the servers to register: --prefill URL or --decode URL, one or more")
        router = host_port(args.router, "--router")
        for kind, url in servers:
            host_port(url, f"--{kind}")
        registrar = Registrar(router, health=None if args.no_health else healthy, on_change=said)
    except (ValueError, OSError) as exc:  # zmq.ZMQError is an OSError
        print(f"kvcompose register: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    for kind, url in servers:
        registrar.add(kind, url)
    print(f"kvcompose register: {len(servers)} servers with the router's discovery socket at {router}", file=sys.stderr)
    stop.wait()
    registrar.close()
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    from kvcompose.router import router_lines

    plan = _plan(args)
    print("\n".join(plan.explain()))
    print("\n".join(router_lines(plan)))
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


def command(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str, help: str, example: str
) -> argparse.ArgumentParser:
    """A subcommand whose ``--help`` ends with an example of its use (what a ``kvcompose.commands``
    entry point calls to add its command)."""
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
    s = command(sub, "check", "validate a composition and say what it will do", "kvcompose check pd-decode.yaml")
    s.add_argument("file")
    _import_modules_flag(s)
    s.set_defaults(func=cmd_check)
    s = command(
        sub,
        "explain",
        "the plan in plain words and each child's vLLM config",
        "kvcompose explain pd-decode.yaml",
    )
    s.add_argument("file")
    _import_modules_flag(s)
    s.set_defaults(func=cmd_explain)
    s = command(
        sub,
        "plugins",
        "every connector type and rule, with the distribution providing it",
        "kvcompose plugins --json",
    )
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_plugins)
    s = command(
        sub,
        "schema",
        "JSON Schema of the composition file (for editor completion)",
        "kvcompose schema > kvcompose.schema.json",
    )
    s.set_defaults(func=cmd_schema)
    s = command(
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
    s = command(
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
    s = command(
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
    s = command(
        sub,
        "relay-events",
        "re-publish an engine's KV events in the block size vllm-router indexes (16 tokens)",
        "kvcompose relay-events --from ipc:///run/prefill.events --to tcp://10.0.0.5:5557 --engine-block-size 32",
    )
    s.add_argument(
        "--from",
        dest="source",
        required=True,
        metavar="ENDPOINT",
        help="the engine's --kv-events-config endpoint (ipc://PATH, or tcp://HOST:PORT it binds)",
    )
    s.add_argument(
        "--to",
        dest="target",
        required=True,
        metavar="ENDPOINT",
        help="where the router subscribes (tcp://HOST:PORT, bound here)",
    )
    s.add_argument("--engine-block-size", type=int, required=True, metavar="N", help="the engine's --block-size")
    s.add_argument("--block-size", type=int, default=16, metavar="N", help="the router's (default: 16)")
    s.set_defaults(func=cmd_relay_events)
    s = command(
        sub,
        "register",
        "keep servers registered with vllm-router's discovery socket while their /health answers",
        "kvcompose register --router 10.0.0.2:30001 --decode http://10.0.0.7:8000",
    )
    s.add_argument(
        "--router",
        required=True,
        metavar="HOST:PORT",
        help="the router's --vllm-discovery-address (with it, the router routes to registered servers only)",
    )
    s.add_argument("--prefill", action="append", default=[], metavar="URL", help="a prefill server (repeatable)")
    s.add_argument("--decode", action="append", default=[], metavar="URL", help="a decode server (repeatable)")
    s.add_argument(
        "--no-health",
        action="store_true",
        help="register without asking each server's /health first (default: asked every heartbeat)",
    )
    s.set_defaults(func=cmd_register)
    _added_commands(sub)
    return p


#: The entry-point group through which other distributions add commands to the CLI: each entry
#: point is named after its command and is a function ``add(sub)`` that adds the subcommand to the
#: parser's subparsers (with :func:`command`) and sets its ``func``.
COMMANDS_GROUP = "kvcompose.commands"
#: The commands that come with another distribution, and which: ``kvcompose demo`` without it
#: says what to install.
TOOL_COMMANDS = {
    "demo": "kvcompose-tools",
    "bench": "kvcompose-tools",
    "warmup": "kvcompose-tools",
    "soak": "kvcompose-tools",
}


class NotInstalled(Exception):
    """A command of a distribution that is not installed: ``kvcompose COMMAND: ...``, exit status 2."""


def _added_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The commands of the installed distributions' ``kvcompose.commands`` entry points, then a
    stand-in for each tool command none provides (it says which distribution to install). An
    entry point that fails to load fails only its own command, as a plugin error."""
    found = {ep.name: ep for ep in importlib.metadata.entry_points(group=COMMANDS_GROUP)}
    order = [*TOOL_COMMANDS, *sorted(found)]  # the tools' in the order --help has always listed them
    for name, ep in sorted(found.items(), key=lambda item: order.index(item[0])):
        try:
            ep.load()(sub)
        except Exception as exc:  # a broken install: the other commands still work
            _stand_in(sub, name, f"added by {ep.value}, which failed to load", PluginError(f"{ep.value}: {exc}"))
    for name, distribution in TOOL_COMMANDS.items():
        if name not in found:
            why = f"a command of {distribution}, which is not installed (pip install {distribution})"
            _stand_in(sub, name, why, NotInstalled(why))


def _stand_in(sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str, help: str, error: Exception) -> None:
    """A command that is listed, takes any arguments and, run, raises ``error``."""

    def fail(args: argparse.Namespace) -> int:
        raise error

    s = sub.add_parser(name, help=help, description=help[0].upper() + help[1:] + ".")
    s.set_defaults(func=fail, any_arguments=True)


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
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "any_arguments", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")  # what parse_args says
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
    except (UsageError, NotInstalled) as exc:
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
        # A tool's interrupt (kvcompose_tools.e2e.processes.Interrupted) names its signal and what
        # it stopped; kvcompose does not import the tools, so it is recognised by its message().
        message = getattr(exc, "message", None)
        if callable(message):
            print("\n" + message(args.command), file=sys.stderr)
            return SIGNALLED + int(getattr(exc, "signum", signal.SIGINT))
        print(f"\nkvcompose {args.command}: interrupted", file=sys.stderr)
        return SIGNALLED + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main())
