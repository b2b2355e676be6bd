"""The composition file: every bad file is refused with its line, column, key and a hint."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from kvcompose.cli import main
from kvcompose.compose import load, loads
from kvcompose.config import MAX_BYTES
from kvcompose.errors import CompositionError
from kvcompose.examples import all_examples
from kvcompose.units import ByteSize

BAD = sorted((Path(__file__).parent / "bad").glob("*.yaml"))


def _expectation(path: Path) -> tuple[str, str]:
    m = re.match(r"# expect: (\d+:\d+) (.*)", path.read_text().splitlines()[0])
    assert m, f"{path.name} lacks an '# expect: LINE:COL text' first line"
    return m.group(1), m.group(2)


@pytest.mark.parametrize("path", BAD, ids=lambda p: p.stem)
def test_bad_file_is_refused_with_its_location(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    where, text = _expectation(path)
    started = time.perf_counter()
    assert main(["check", str(path)]) == 2
    elapsed = time.perf_counter() - started
    err = capsys.readouterr().err
    assert f"{path}:{where}: " in err, err
    assert text in err, err
    assert "Traceback" not in err
    assert elapsed < 30  # sanity bound only (alias bombs must not hang); not a performance assertion


@pytest.mark.parametrize("path", [e.path for e in all_examples()], ids=lambda p: p.stem)
def test_shipped_examples_are_valid(path: Path) -> None:
    plan = load(path)
    assert sorted(plan.names) == ["host", "pd"]  # the examples ask the host tier first


def test_oversized_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "big.yaml"
    f.write_text("version: 1\n# " + "x" * MAX_BYTES + "\n")
    assert main(["check", str(f)]) == 2
    assert "larger than" in capsys.readouterr().err


def test_missing_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "/nonexistent/compose.yaml"]) == 2
    assert "/nonexistent/compose.yaml: (top level): cannot read the file" in capsys.readouterr().err


def test_errors_are_collected_per_child() -> None:
    with pytest.raises(CompositionError) as info:
        loads("version: 1\nconnectors:\n  - {name: a, type: nope}\n  - {name: b, type: alsonope}\n")
    assert [p.line for p in info.value.problems] == [3, 4]


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("32GiB", 32 << 30),
        ("512MiB", 512 << 20),
        ("8GB", 8 * 10**9),
        ("1.5 KiB", 1536),
        (4096, 4096),
        ("64k", 64 << 10),
    ],
)
def test_sizes_accept_units(text: object, value: int) -> None:
    assert ByteSize.parse(text) == value


@pytest.mark.parametrize("text", ["-1", "12 parsecs", True, -5, "GiB"])
def test_bad_sizes(text: object) -> None:
    with pytest.raises(ValueError, match="size"):
        ByteSize.parse(text)


def test_rule_with_parameters() -> None:
    plan = loads(
        "version: 1\nconnectors:\n  - {name: pd, type: record}\n  - {name: host, type: record}\n"
        "rules:\n  store: {use: only, children: [host]}\n  faults: {use: isolate, children: [host]}\n"
    )
    assert plan.store.targets == (1,)
    assert plan.faults.contains(1) and not plan.faults.contains(0)


def test_small_sizes_render() -> None:
    assert repr(ByteSize(512)) == "ByteSize(512B)"
    assert repr(ByteSize(32 << 30)) == "ByteSize(32GiB)"
