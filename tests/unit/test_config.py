"""The composition file: every bad file is refused with its line, column, key and a hint."""

from __future__ import annotations

import math
import re
import time
from decimal import Decimal
from pathlib import Path

import pytest

from kvcompose.cli import main
from kvcompose.compose import load, loads
from kvcompose.config import from_builtins
from kvcompose.errors import CompositionError
from kvcompose.examples import all_examples
from kvcompose.reader import MAX_BYTES, MAX_CONNECTORS, MAX_NODES
from kvcompose.units import MAX_SIZE, ByteSize, host_memory

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


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (  # the connector count has its own limit and message
            "version: 1\nconnectors:\n" + "".join(f"  - {{name: c{i}, type: cpu-offload}}\n" for i in range(5000)),
            f":3:3: connectors: 5000 connectors; a composition has at most {MAX_CONNECTORS}",
        ),
        (  # a big document without aliases: the limit and what was counted
            "version: 1\nconnectors: [{name: a, type: cpu-offload}]\nx: [" + ",".join(["1"] * 25_000) + "]\n",
            f"more than {MAX_NODES} nodes (values, lists and mappings counted)",
        ),
    ],
    ids=["connectors", "nodes"],
)
def test_size_limits_say_which_and_what_was_counted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, expected: str
) -> None:
    f = tmp_path / "big.yaml"
    f.write_text(text)
    assert main(["check", str(f)]) == 2
    err = capsys.readouterr().err
    assert expected in err
    assert "alias" not in err


def test_host_memory_beyond_this_machine_is_a_warning_naming_both_numbers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    total = host_memory()
    assert total is not None
    f = tmp_path / "big.yaml"
    f.write_text(
        f"version: 1\nconnectors:\n  - name: host\n    type: cpu-offload\n    options: {{cpu_bytes: {total * 2}}}\n"
    )
    assert main(["check", str(f)]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(f"{f}: ok")
    assert f"{f}:5:26: connectors[0].options.cpu_bytes: warning: " in err
    assert f"({total * 2} bytes) is more than this machine's memory" in err and f"({total} bytes)" in err


def test_sizes_are_exact_and_bounded() -> None:
    assert ByteSize.parse("1.1GiB") == int(Decimal("1.1") * 2**30)
    assert ByteSize.parse(MAX_SIZE) == MAX_SIZE
    with pytest.raises(ValueError, match="more than any size can be"):
        ByteSize.parse(MAX_SIZE + 1)
    with pytest.raises(ValueError, match="more than any size can be"):
        ByteSize.parse("9" * 40 + "TiB")


def test_anchors_and_merge_keys_are_plain_yaml() -> None:
    plan = loads(
        "version: 1\nconnectors:\n"
        "  - &tier {name: a, type: cpu-offload, options: {cpu_bytes: 1GiB}}\n"
        "  - <<: *tier\n    name: b\n"
    )
    assert plan.names == ("a", "b")
    assert plan.child("b").options == plan.child("a").options


@pytest.mark.parametrize(
    "construct",
    [
        "!!python/object/apply:os.system ['touch {marker}']",
        "!!python/object/new:subprocess.Popen [['touch', '{marker}']]",
        "!!python/name:os.system",
        "!include {secret}",
        "!!binary {secret}",
        "&a !!python/object/apply:os.system ['touch {marker}']",
    ],
)
def test_no_yaml_construct_runs_code_or_reads_a_file(tmp_path: Path, construct: str) -> None:
    marker, secret = tmp_path / "ran", tmp_path / "secret.yaml"
    secret.write_text("version: 1\nconnectors: [{name: leaked, type: cpu-offload}]\n")
    text = "version: 1\nconnectors: " + construct.format(marker=marker, secret=secret) + "\n"
    with pytest.raises(CompositionError, match="only plain YAML is accepted") as info:
        loads(text)
    assert not marker.exists()
    assert "leaked" not in str(info.value)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {"version": 1, "connectors": [{"name": "a", "type": "record", "options": {"matched_tokens": 2**64}}]},
            "64 bits",
        ),
        ({"version": 1, "connectors": [{"name": "a", "type": "record", "options": {"params": {1: 2}}}]}, "not text"),
        (
            {"version": 1, "connectors": [{"name": "a", "type": "cpu-offload", "options": {"cpu_bytes": math.inf}}]},
            "finite",
        ),
    ],
)
def test_plain_data_from_json_is_checked_as_from_yaml(data: object, message: str) -> None:
    with pytest.raises(CompositionError, match=message):
        from_builtins(data)
