"""``kvcompose check`` says whether a composition supports vLLM's sleep mode, and which child does not.

On vLLM 0.33 ``check`` asks the children's classes (in a child process); on 0.32, whose
connector API has no sleep mode, it says so without importing vLLM, and the test asks the
classes anyway to show the line.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import kvcompose.vllm.sleep_mode
from kvcompose.cli import main
from kvcompose.testing.versions import HAS_SLEEP_MODE

COMPOSITION = """
version: 1
connectors:
  - {{name: a, type: record, options: {{sleep_mode: {a}}}}}
  - {{name: b, type: record, options: {{sleep_mode: {b}}}}}
"""


def test_check_names_the_child_without_sleep_mode(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    if not HAS_SLEEP_MODE:  # vLLM 0.32: check would say its API has none; ask the classes anyway
        monkeypatch.setattr(kvcompose.vllm.sleep_mode, "installed_sleep_api", lambda: True)
    path = tmp_path / "compose.yaml"
    path.write_text(COMPOSITION.format(a="true", b="false"))
    assert main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    with capsys.disabled():  # shown with -s: the closing note of issue 34 quotes it
        print(out)
    assert "  sleep mode: not supported: b (record) does not support it; vLLM refuses --enable-sleep-mode\n" in out
    path.write_text(COMPOSITION.format(a="true", b="true"))
    assert main(["check", str(path)]) == 0
    assert "  sleep mode: supported (every child supports it: a, b)\n" in capsys.readouterr().out


@pytest.mark.skipif(HAS_SLEEP_MODE, reason="this vLLM has sleep mode in its connector API")
def test_check_on_a_vllm_without_sleep_mode_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "examples/pd-decode.yaml"]) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  sleep mode:")]
    assert line.startswith("  sleep mode: not in the connector API of vLLM 0.32")
