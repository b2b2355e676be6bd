"""``kvcompose check`` reads in one screen: one fact a line, each under 100 characters, none
contradicting another; ``kvcompose explain`` keeps the long explanations (issue 63)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcompose.cli import main
from kvcompose.examples import all_examples

EXAMPLES = [e.path for e in all_examples()]
#: The widest line ``check`` prints for a shipped example, and the most lines.
WIDTH = 100
LINES = 30


@pytest.fixture(autouse=True)
def deployment_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """The key the examples name, set as on a deployment's engines (unset, check warns of it)."""
    monkeypatch.setenv("KVCOMPOSE_PD_KEY", "k" * 64)
    monkeypatch.delenv("VLLM_NIXL_SIDE_CHANNEL_HOST", raising=False)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_every_line_check_prints_for_a_shipped_example_fits_the_screen(
    path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["check", str(path)]) == 0
    out, err = capsys.readouterr()
    lines = (out + err).splitlines()
    too_long = [line for line in lines if len(line) > WIDTH]
    assert not too_long, too_long
    assert len(lines) <= LINES
    assert lines[-1] == f"  the details: kvcompose explain {path}"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_explain_keeps_what_check_leaves_out(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", str(path)]) == 0
    out = capsys.readouterr().out
    assert "handshake: pd exchanges its own handshake metadata" in out
    assert "host-buffer copies: pd" in out and "behind vllm-router: " in out
    assert "not protected: NIXL's own traffic (the reads and notifications) is neither authenticated" in out


def test_a_keyed_decode_says_nothing_of_reads_taken_unchecked(capsys: pytest.CaptureFixture[str]) -> None:
    """With a key, params no prefill signed are refused, so nothing is read without the lease
    check; neither command may say otherwise (it did: "reads are taken unchecked, as vLLM does")."""
    for command in ("check", "explain"):
        assert main([command, "examples/pd-decode.yaml"]) == 0
        out = capsys.readouterr().out
        assert "unchecked" not in out and "no lease stamped" not in out
        assert "lease: a read that ends after the prefill's lease on its blocks is refused" in out


def test_one_child_is_said_in_the_singular(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "examples/pd-decode.yaml"]) == 0
    out = capsys.readouterr().out
    assert "params: by owner; pd owns the P/D params (19 keys); host declares none" in out
    assert main(["explain", "examples/pd-decode.yaml"]) == 0
    out = capsys.readouterr().out
    assert "host declares no keys: a key no child declares goes to the first child" in out
    assert "pd exchanges its own handshake metadata" in out and "pd exchange " not in out
