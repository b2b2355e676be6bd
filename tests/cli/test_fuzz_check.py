"""``kvcompose check`` on generated garbage: a clean refusal or a clean acceptance, never a traceback.

Seeded, so every run checks the same inputs: random bytes, every truncation and every
single-byte deletion of the smallest shipped example, and random edits that splice YAML's own
punctuation (and bytes no text file holds) into the examples. Each runs through the CLI's ``main`` in
this process (an exception escaping it fails the test with the input that caused it); a few run
as a real subprocess to prove that nothing reaches stderr as a traceback either.
"""

from __future__ import annotations

import random
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcompose.cli import main
from kvcompose.examples import all_examples

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
