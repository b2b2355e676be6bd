"""The CLI as a user meets it: packaged examples, ``--version``, ``--help`` with an example of
each command, and a closed pipe ending the output quietly."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

import kvcompose
from kvcompose.cli import main, parser
from kvcompose.compose import load
from kvcompose.examples import EXAMPLES, all_examples

REPO = Path(__file__).parents[2]
#: The commands, as ``kvcompose --help`` lists them (each indented under COMMAND).
COMMANDS = re.findall(r"^    (\S+)\s", parser().format_help(), flags=re.M)


def test_the_readme_shows_a_packaged_example_verbatim() -> None:
    readme = (REPO / "README.md").read_text()
    first = re.search(r"^```yaml\n(.*?)^```$", readme, flags=re.M | re.S)
    assert first is not None
    assert first.group(1) in [e.text() for e in all_examples()]


def test_the_repository_examples_are_the_packaged_files() -> None:
    """``examples/*.yaml`` in the checkout are links to the package data: one copy of each."""
    linked = sorted(p for p in (REPO / "examples").glob("*.yaml"))
    assert [p.name for p in linked] == [e.path.name for e in all_examples()]
    for path in linked:
        assert path.is_symlink() and path.resolve() == EXAMPLES / path.name


def test_examples_lists_prints_and_writes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["examples"]) == 0
    listing = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in listing] == ["native-decode", "native-prefill", "pd-decode", "pd-prefill"]
    assert "The decode instance of P/D over NIXL, with a host-memory prefix tier" in listing[2]

    assert main(["examples", "pd-decode"]) == 0
    assert capsys.readouterr().out == (EXAMPLES / "pd-decode.yaml").read_text()

    assert main(["examples", "--write", str(tmp_path / "compose")]) == 0
    written = capsys.readouterr().out.split()
    assert written == [str(tmp_path / "compose" / f"{e.name}.yaml") for e in all_examples()]
    for e in all_examples():
        copy = tmp_path / "compose" / e.path.name
        assert copy.read_text() == e.text()
        assert main(["check", str(copy)]) == 0
        assert load(copy).names == load(e.path).names


def test_examples_refuses_unknown_names_and_overwrites(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["examples", "pd-decod"]) == 2
    assert capsys.readouterr().err == (
        "kvcompose examples: no example named 'pd-decod' (did you mean pd-decode?); there are: native-decode, "
        "native-prefill, pd-decode, pd-prefill\n"
    )
    edited = tmp_path / "pd-decode.yaml"
    edited.write_text("# mine\n")
    assert main(["examples", "pd-decode", "--write", str(tmp_path)]) == 2
    assert "already exists with other contents (--force replaces it)" in capsys.readouterr().err
    assert edited.read_text() == "# mine\n"
    assert main(["examples", "pd-decode", "--write", str(tmp_path), "--force"]) == 0
    assert edited.read_text() == (EXAMPLES / "pd-decode.yaml").read_text()


def test_version_names_every_distribution_and_the_runtimes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    # The tools' distribution is listed where it is installed (the wheels test has both cases).
    tools = [f"kvcompose-tools {metadata.version('kvcompose-tools')}"] if _installed("kvcompose-tools") else []
    distributions = [
        f"kvcompose {kvcompose.__version__}",
        f"kvcompose-nixl {metadata.version('kvcompose-nixl')}",
        f"kvcompose-cpu-offload {metadata.version('kvcompose-cpu-offload')}",
        *tools,
    ]
    assert lines[: len(distributions)] == distributions
    runtimes = lines[len(distributions) :]
    import vllm

    assert re.fullmatch(rf"vLLM {re.escape(vllm.__version__)} \(vllm(-cpu)?\)", runtimes[0])
    assert re.fullmatch(r"NIXL \d[^ ]* \(nixl[-\w]*\)(, \d[^ ]* \(nixl[-\w]*\))*", runtimes[1])


def _installed(distribution: str) -> bool:
    try:
        metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.parametrize("command", COMMANDS)
def test_every_commands_help_shows_an_example(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    help_text = capsys.readouterr().out
    example = help_text.partition("\nexample:\n")[2]
    assert f"kvcompose {command}" in example, help_text


@pytest.mark.parametrize("command", [["schema"], ["examples", "pd-decode"], ["plugins"]])
def test_a_closed_pipe_ends_quietly_with_sigpipes_status(command: list[str], tmp_path: Path) -> None:
    """``kvcompose schema | head -1``: the reader goes away before the output is written. Exit
    status 128 + SIGPIPE, as a shell reports for ``yes | head``, and nothing on stderr."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvcompose.cli", *command], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # no reader left: the first write fails with EPIPE
    err = proc.stderr.read().decode()
    assert proc.wait(60) == 128 + signal.SIGPIPE
    assert err == ""


def test_a_pipe_that_reads_everything_still_succeeds(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvcompose.cli", "examples", "pd-prefill"], capture_output=True, text=True, cwd=tmp_path
    )
    assert (out.returncode, out.stderr) == (0, "")
    assert out.stdout == (EXAMPLES / "pd-prefill.yaml").read_text()
