"""The CLI on generated garbage: a clean refusal or a clean acceptance, never a traceback.

First ``kvcompose check`` on generated composition files, then every subcommand on generated
arguments (below, "every subcommand's arguments").

Seeded, so every run checks the same inputs: random bytes, every truncation and every
single-byte deletion of the smallest shipped example, and random edits that splice YAML's own
punctuation (and bytes no text file holds) into the examples. Each runs through the CLI's ``main`` in
this process (an exception escaping it fails the test with the input that caused it); a few run
as a real subprocess to prove that nothing reaches stderr as a traceback either.
"""

from __future__ import annotations

import io
import json
import random
import re
import socket
import string
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from kvcompose.cli import main
from kvcompose.examples import all_examples
from kvcompose_tools.bench.runner import BENCHMARKS
from kvcompose_tools.e2e.warmup import check_url

EXAMPLES = [e.path for e in all_examples()]
#: Every truncation and every single-byte deletion of this one (the suite stays fast).
SMALLEST = min(EXAMPLES, key=lambda p: p.stat().st_size)
SEED = 13
#: Bytes an edit splices in: YAML's punctuation, and what no text file holds.
SPLICE = [
    b":",
    b"-",
    b"[",
    b"]",
    b"{",
    b"}",
    b"&a",
    b"*a",
    b"<<: *a",
    b"!!python/object:os.system",
    b"!!binary",
    b"!include",
    b"\t",
    b"\x00",
    b"\xff",
    b"\xef\xbb\xbf",
    b"---\n",
    b"\n",
    b"'",
    b'"',
    b"#",
    b"|",
    b">",
    b"%YAML 1.1\n",
    b"99999999999TiB",
    b".nan",
    b"-.inf",
    b"1e999",
    b"9" * 30,
    b"yes",
    b"on",
    b"~",
    b"2024-01-01",
    b"? [a]\n: b",
]


def generated() -> Iterator[tuple[str, bytes]]:
    rng = random.Random(SEED)
    valid = [p.read_bytes() for p in EXAMPLES]
    for i in range(200):
        yield f"random-{i}", rng.randbytes(rng.randrange(0, 400))
    text = SMALLEST.read_bytes()
    for end in range(len(text)):
        yield f"{SMALLEST.name}-truncated-at-{end}", text[:end]
    for at in range(len(text)):
        yield f"{SMALLEST.name}-without-byte-{at}", text[:at] + text[at + 1 :]
    for i in range(400):
        text = bytearray(rng.choice(valid))
        for _ in range(rng.randrange(1, 4)):
            at = rng.randrange(len(text) + 1)
            cut = rng.choice((0, 0, 1, rng.randrange(1, 20)))
            text[at : at + cut] = rng.choice(SPLICE)
        yield f"edit-{i}", bytes(text)


def test_check_refuses_or_accepts_generated_input_cleanly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], record_property: object
) -> None:
    outcomes: Counter[str] = Counter()
    path = tmp_path / "compose.yaml"
    located = re.compile(rf"^{re.escape(str(path))}(:\d+:\d+)?: \S")
    for name, data in generated():
        path.write_bytes(data)
        try:
            rc = main(["check", str(path)])
        except BaseException as exc:  # what the user would see as a traceback
            pytest.fail(f"{name}: {type(exc).__name__}: {exc}\ninput: {data!r}")
        out, err = capsys.readouterr()
        if rc == 0:
            assert out.startswith(f"{path}: ok"), (name, data, out)
            # warnings are allowed on acceptance, each located like an error
            assert all(located.match(line) for line in err.splitlines()), (name, data, err)
            outcomes["accepted"] += 1
        else:
            assert rc == 2, (name, data, rc, err)
            lines = err.splitlines()
            assert lines and all(located.match(line) for line in lines), (name, data, err)
            outcomes["refused"] += 1
    total = sum(outcomes.values())
    print(f"\nfuzz: {total} generated inputs, {outcomes['refused']} refused cleanly, {outcomes['accepted']} accepted")
    # the generator must reach both outcomes, or it tests nothing
    assert outcomes["accepted"] > 0 and outcomes["refused"] > 0
    assert total > 2000


@pytest.mark.parametrize(
    "data",
    [
        b"version: 1\nconnectors:\n  - name: pd\x00\n    type: nixl\n",
        bytes(range(256)),
        b"version: 1\nconnectors: !!python/object/apply:os.system ['echo pwned']\n",
        b"\xff\xfeversion: 1\n",
        b"version: 1\nx: " + b"[" * 5000 + b"]" * 5000 + b"\n",
    ],
    ids=["nul", "every-byte", "python-tag", "utf16", "deep"],
)
def test_no_traceback_reaches_stderr(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "compose.yaml"
    path.write_bytes(data)
    proc = subprocess.run(
        [sys.executable, "-m", "kvcompose.cli", "check", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith(f"{path}"), proc.stderr


# ------------------------------------------------------------------ every subcommand's arguments
#
# Seeded random and malformed arguments for every subcommand, each run through ``main`` in this
# process: the exit status is one the CLI documents (0, 1 for a broken plugin or a server that
# does not answer as vLLM does, 2 for bad input), a failure says why on stderr, and nothing
# escapes as an exception (a traceback). ``demo``, ``soak`` and ``bench`` start engines: they
# only get arguments refused before anything starts (argparse's checks, ``soak``'s option
# bounds, ``bench``'s unknown names), and their runners are replaced by a guard that fails the
# test should one be reached anyway. ``warmup`` only reaches 127.0.0.1: a port held closed here,
# and a local server giving seeded garbage for ``/v1/models``, ``/metrics`` and completions.

ARGS_SEED = 33
#: Cases per subcommand (warmup's are cheap and draw from many server answers).
CASES = {"warmup": 200, "nosuch": 10}
#: A Python exception as the last line a traceback prints: never what a user is told.
EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)(: |$)")
#: Words a user might mistype or paste anywhere.
WORDS = [
    "",
    " ",
    "-",
    "--",
    "-x",
    "--no-such-option",
    "--json",
    "--force",
    "--style",
    "shell",
    "yaml",
    "-o",
    "--write",
    "pd-decode",
    "pd-prefill",
    "{",
    "}",
    "[]",
    "{}",
    "null",
    "'",
    '"',
    "\\",
    "\n",
    "\t",
    "../",
    "/",
    "~",
    "$HOME",
    "%s%n",
    "é",
    "名前",
    "\u202e",
    "x" * 300,
    "y" * 5000,
    "a=b",
    "--kv-transfer-config",
    "-1",
    "0",
    "1e999",
    "http://",
]
#: MultiConnector configs ``import`` fuzz starts from (no generic ``vllm`` child: each would
#: import vLLM, seconds).
CONFIGS: list[Any] = [
    {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "connectors": [
                {"kv_connector": "SimpleCPUOffloadConnector", "kv_role": "kv_both"},
                {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"},
            ]
        },
    },
    {"kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_connector_extra_config": {"backends": ["UCX"]}},
]
JSON_VALUES: list[Any] = [None, True, 0, -1, 2**70, 1.5, "", "x", "kv_both", [], [1], {}, {"a": 1}, [[[]]]]


def token(rng: random.Random) -> str:
    """A word a user might type. Never a path out of the working folder (the test's own, where
    ``examples --write`` and ``import -o`` may write what they are given): nothing absolute, no ``..``."""
    kind = rng.randrange(4)
    if kind == 0:
        word = rng.choice(WORDS)
    elif kind == 1:
        word = "".join(rng.choice(string.printable) for _ in range(rng.randrange(0, 24)))
    elif kind == 2:  # any code point but the surrogates (argv never holds one; capture cannot write one)
        word = "".join(chr(rng.choice([rng.randrange(1, 0xD800), rng.randrange(0xE000, 0x110000)])) for _ in range(4))
    else:
        word = str(rng.randrange(-(10**6), 10**6))
    word = word.replace("..", "._")
    return "./" + word.lstrip("/") if word.startswith("/") else word


def mutated(rng: random.Random, value: Any, depth: int = 0) -> Any:
    """``value`` with one random node replaced, removed or added to."""
    if isinstance(value, dict) and value and rng.random() < 0.7:
        key = rng.choice(list(value))
        out = dict(value)
        roll = rng.random()
        if roll < 0.15:
            del out[key]
        elif roll < 0.25:
            out[token(rng)] = rng.choice(JSON_VALUES)
        else:
            out[key] = mutated(rng, value[key], depth + 1)
        return out
    if isinstance(value, list) and value and rng.random() < 0.7:
        at = rng.randrange(len(value))
        return value[:at] + [mutated(rng, value[at], depth + 1)] + value[at + 1 :]
    return rng.choice(JSON_VALUES + [token(rng)])


class Garbage(BaseHTTPRequestHandler):
    """A server that is not vLLM's: ``/<case>/...`` answers what that case's seed draws."""

    def answer(self) -> tuple[int, bytes]:
        case, _, route = self.path.lstrip("/").partition("/")
        rng = random.Random(f"{ARGS_SEED}-{case}-{route}")
        if route == "v1/models":
            bodies = [b'{"object": "list", "data": [{"id": "m"}]}', b'{"data": []}', b'{"data": {"id": "m"}}']
        elif route == "metrics":
            bodies = [b"", b"vllm:request_success_total 1\n", b"vllm:x{a=} 1\n", b"# TYPE vllm:x counter\nvllm:x nan\n"]
        else:  # completions: never one whose answer counts, which would wait for the counters
            bodies = [b"", b"[]", b'{"choices": []}', b'{"choices": [{}]}', b'{"choices": "x"}', b"<html>"]
        if route != "v1/completions" and rng.random() < 0.5:
            return 200, bodies[0]  # what vLLM answers: the request goes on to the next route
        bodies += [rng.randbytes(rng.randrange(0, 64)), json.dumps(mutated(rng, {"data": [{"id": "m"}]})).encode()]
        return rng.choice([200, 200, 200, 404, 500]), rng.choice(bodies)

    def reply(self) -> None:
        if self.command == "POST":
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
        status, body = self.answer()
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = reply  # noqa: N815 (http.server's names)

    def log_message(self, *args: Any) -> None:
        pass


@dataclass
class Places:
    """What the arguments may name: files, folders, URLs, all in this test's own corner."""

    tmp: Path
    files: list[str]
    closed_url: str
    garbage_url: str

    def path(self, rng: random.Random) -> str:
        return rng.choice(self.files + [str(self.tmp / token(rng).replace("/", "_").replace("\0", "")[:100])])

    def url(self, rng: random.Random, case: int) -> str:
        good = [self.closed_url, f"{self.closed_url}/"] + [f"{self.garbage_url}/{case}"] * 4
        bad = ["127.0.0.1:8100", "localhost", "ftp://127.0.0.1", "http://", "http://127.0.0.1:x", "http://[::1"]
        bad += ["http://127.0.0.1:99999", "https://127.0.0.1:0", " http://127.0.0.1", "http://127.0.0.1:1 x", ""]
        url = rng.choice(good * 3 + bad + [token(rng)])
        try:
            check_url(url)
        except ValueError:
            return url  # refused before any connection
        # Only the two servers here are ever asked, never one a drawn word might name.
        return url if url.startswith((self.closed_url, self.garbage_url)) else self.closed_url


def extra(rng: random.Random, n: int = 2) -> list[str]:
    return [token(rng) for _ in range(rng.choice([0, 0, 0, rng.randrange(1, n + 1)]))]


def shuffled(rng: random.Random, parts: list[list[str]]) -> list[str]:
    rng.shuffle(parts)
    return [word for part in parts for word in part]


def arguments(command: str, rng: random.Random, at: Places, case: int) -> list[str]:
    """One seeded argument list for ``command``, of the kind a user might give."""
    if command in COMMANDS and rng.random() < 0.03:
        return [command, rng.choice(["-h", "--help"])]
    if command in ("check", "explain", "vllm-args"):
        parts = [[at.path(rng)] if rng.random() < 0.9 else []]
        if command == "vllm-args" and rng.random() < 0.5:
            parts.append(["--style", rng.choice(["json", "shell", token(rng)])])
        return [command] + shuffled(rng, parts + [extra(rng)])
    if command in ("plugins", "schema"):
        return [command] + (["--json"] if command == "plugins" and rng.random() < 0.5 else []) + extra(rng, 1)
    if command == "examples":
        parts = [[rng.choice(["pd-decode", "pd-prefill", token(rng)])] if rng.random() < 0.6 else []]
        if rng.random() < 0.6:
            parts.append(["--write", at.path(rng)])
        parts.append(["--force"] if rng.random() < 0.3 else [])
        return [command] + shuffled(rng, parts + [extra(rng, 1)])
    if command == "import":
        roll = rng.random()
        if roll < 0.5:
            source = [json.dumps(mutated(rng, rng.choice(CONFIGS)))]
        elif roll < 0.6:
            source = [f"--kv-transfer-config '{json.dumps(mutated(rng, rng.choice(CONFIGS)))}'"]
        elif roll < 0.8:
            source = [at.path(rng)]
        else:
            source = [rng.choice(["-", token(rng)])] if rng.random() < 0.7 else []
        parts = [source, ["-o", at.path(rng)] if rng.random() < 0.4 else [], ["--force"] if rng.random() < 0.2 else []]
        return [command] + shuffled(rng, parts + [extra(rng, 1)])
    if command == "warmup":
        times = [0] + [1] * 6 + [2] * 3
        parts = [[flag, at.url(rng, case)] for flag in ("--prefill", "--decode") for _ in range(rng.choice(times))]
        # No drawn option: one argparse would take for an abbreviation of --prefill or --decode.
        words = [w for w in extra(rng, 1) if not w.startswith("-")] if rng.random() < 0.3 else []
        return [command] + shuffled(rng, parts + [words])
    # demo, soak, bench start engines: each list holds one argument refused before anything starts.
    if command == "demo":
        refused = rng.choice([["--decodes", rng.choice(["0", "3", "-1", "two", ""])], ["--no-such-option"], ["x"]])
        return [command] + shuffled(rng, [refused, ["--http"] if rng.random() < 0.5 else []])
    if command == "soak":
        refused = rng.choice(
            [
                ["--requests", str(rng.randrange(-5, 20))],
                ["--concurrency", str(rng.randrange(-5, 1))],
                ["--requests", rng.choice(["many", "1e3", ""])],
                ["--no-such-option"],
            ]
        )
        safe = [["--quick"], ["--seed", str(rng.randrange(100))], ["--json", str(at.tmp / "soak.json")]]
        return [command] + shuffled(rng, [refused] + rng.sample(safe, rng.randrange(len(safe) + 1)))
    if command == "bench":
        name = token(rng)
        if name in BENCHMARKS or name in BENCHMARKS.values():
            name = "no-such-benchmark"
        safe = [["--quick"], ["--png"], ["--out", str(at.tmp / "bench")], ["--only", "no-such-benchmark"]]
        return [command] + shuffled(rng, [["--only", name]] + rng.sample(safe, rng.randrange(len(safe) + 1)))
    # The top level: an unknown command (never one of those above), --version, --help.
    first = rng.choice([token(rng)] * 8 + ["--version", "-h"])
    return [first if first not in COMMANDS else "nosuch"] + extra(rng)


COMMANDS = ["check", "explain", "vllm-args", "plugins", "schema", "examples", "import", "warmup", "demo", "soak"]
COMMANDS += ["bench"]


@pytest.fixture
def places(tmp_path: Path) -> Iterator[Places]:
    corner = tmp_path / "args"
    corner.mkdir()
    files = {
        "example.yaml": SMALLEST.read_bytes(),
        "garbage.yaml": random.Random(ARGS_SEED).randbytes(300),
        "empty.yaml": b"",
        "nul.yaml": b"version: 1\x00\n",
        "kv.json": json.dumps(CONFIGS[0]).encode(),
        "not-utf8.json": b'{"kv_connector": "\xff"}',
    }
    for name, data in files.items():
        (corner / name).write_bytes(data)
    (corner / "folder").mkdir()
    (corner / "folder" / "pd-decode.yaml").mkdir()  # a folder where examples --write puts a file
    names = [str(corner / n) for n in files] + [str(corner / "folder"), str(corner / "missing" / "x.yaml")]
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, never listening: refused, and nobody else can take it
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Garbage)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield Places(
            corner,
            names,
            f"http://127.0.0.1:{closed.getsockname()[1]}",
            f"http://127.0.0.1:{httpd.server_address[1]}",
        )
    finally:
        httpd.shutdown()
        httpd.server_close()
        closed.close()


def refuse_to_start(what: str) -> Callable[..., Any]:
    def guard(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"the fuzz reached {what}, which starts engines")

    return guard


def test_every_subcommand_refuses_or_accepts_generated_arguments_cleanly(
    places: Places, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import kvcompose_tools.bench.runner
    import kvcompose_tools.e2e.demo
    import kvcompose_tools.soak.run

    bench = kvcompose_tools.bench.runner.run

    def bench_refusing(*args: Any, only: Sequence[str] = (), **kwargs: Any) -> Any:
        known = set(BENCHMARKS) | set(BENCHMARKS.values())
        assert only and not set(only) <= known, f"the fuzz would run benchmarks {only}"
        return bench(*args, only=only, **kwargs)

    monkeypatch.setattr(kvcompose_tools.e2e.demo, "run", refuse_to_start("kvcompose demo"))
    monkeypatch.setattr(kvcompose_tools.soak.run, "run", refuse_to_start("kvcompose soak"))
    monkeypatch.setattr(kvcompose_tools.bench.runner, "run", bench_refusing)
    monkeypatch.chdir(places.tmp)  # anything written to a relative path lands here
    rng = random.Random(ARGS_SEED)
    outcomes: Counter[tuple[str, int]] = Counter()
    spent: Counter[str] = Counter()
    for command in COMMANDS + ["nosuch"]:
        for case in range(CASES.get(command, 60)):
            argv = arguments(command, rng, places, case)
            monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps(mutated(rng, rng.choice(CONFIGS)))))
            t0 = time.perf_counter()
            try:
                rc = main(argv)
            except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
                rc = exc.code if isinstance(exc.code, int) else 1
            except BaseException as exc:  # what the user would see as a traceback
                pytest.fail(f"kvcompose {argv!r}: {type(exc).__name__}: {exc}")
            out, err = capsys.readouterr()
            said = f"kvcompose {argv!r} -> {rc}\nstdout: {out[-2000:]}\nstderr: {err[-2000:]}"
            assert rc in (0, 1, 2), said
            assert "Traceback (most recent call last)" not in out + err, said
            assert not any(EXCEPTION_LINE.match(line) for line in err.splitlines()), said
            if rc != 0:
                assert err.strip(), said  # a failure says why
            if command in ("demo", "soak", "bench"):
                assert rc in (0, 2), said  # refused, or --help
            outcomes[(command, rc)] += 1
            spent[command] += time.perf_counter() - t0
    print("\nfuzz, arguments: " + ", ".join(f"{c} -> {rc}: {n}" for (c, rc), n in sorted(outcomes.items())))
    print("seconds per command: " + ", ".join(f"{c} {t:.2f}" for c, t in spent.items()))
    # The generator must reach acceptance and refusal where both are possible, or it tests little.
    for command in ("check", "vllm-args", "examples", "import"):
        assert outcomes[(command, 0)] and outcomes[(command, 2)], (command, outcomes)
    assert outcomes[("warmup", 1)] and outcomes[("warmup", 2)], outcomes


@pytest.mark.parametrize(
    "argv",
    [
        ["import", "/nonexistent/\udcff.json"],
        ["import", '{"kv_connector":"MultiConnector","kv_connector_extra_config":["x"]}', "-o", "/nonexistent/x"],
        ["check", "/nonexistent/\udcfe.yaml"],
        ["warmup", "--prefill", "127.0.0.1:8100", "--decode", "127.0.0.1:8200"],
        ["examples", "--write", "/dev/null"],
        ["bench", "--only", "no-such-benchmark"],
        ["soak", "--requests", "3"],
        ["demo", "--decodes", "3"],
        ["demo", "--prefills", "2"],
        ["relay-events", "--from", "ipc:///nonexistent.events", "--to", "tcp://x:0", "--engine-block-size", "32"],
        ["register", "--router", "127.0.0.1", "--decode", "http://127.0.0.1:1"],
    ],
    ids=lambda argv: " ".join(argv[:2]),
)
def test_no_traceback_reaches_stderr_from_any_command(argv: list[str], tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvcompose.cli", *argv], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert proc.returncode in (1, 2), proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.strip(), proc.stderr
