"""What the demo, the benchmarks and the engine tests start listens on 127.0.0.1 only, and
``kvcompose check`` says so, or warns when the environment would open a side channel wider."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcompose.cli import main
from kvcompose.compose import load
from kvcompose.examples import all_examples
from kvcompose_tools.e2e.spec import engine_env

EXAMPLES = [e.path for e in all_examples()]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_shipped_examples_bind_their_side_channel_to_loopback_whatever_the_environment(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_HOST", "0.0.0.0")
    monkeypatch.setenv("KVCOMPOSE_PD_KEY", "k" * 64)  # the key the examples name, where the engine runs
    plan = load(path)
    assert plan.warnings == ()
    (pd,) = [c for c in plan.children if c.type.name == "nixl"]
    assert "side channel: 127.0.0.1:" in pd.type.describe(pd) and "(loopback only)" in pd.type.describe(pd)


def test_engines_started_here_do_not_inherit_a_side_channel_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_HOST", "0.0.0.0")
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", "5600")
    env = engine_env()
    assert not any(k.startswith("VLLM_NIXL_SIDE_CHANNEL") for k in env)


def test_check_refuses_an_environment_that_opens_a_keyless_side_channel_and_accepts_a_keyed_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_HOST", "10.1.2.3")
    f = tmp_path / "decode.yaml"
    f.write_text("version: 1\nconnectors:\n  - name: pd\n    type: nixl\n    role: consumer\n")
    assert main(["check", str(f)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    assert err.startswith(
        f"{f}:3:5: connectors[0].options.side_channel_host: $VLLM_NIXL_SIDE_CHANNEL_HOST=10.1.2.3 "
        "(side_channel_host unset) binds the side channel to the interface with address 10.1.2.3"
    )
    # docs/deploy.md's setup: a key, side_channel_host unset, the host from the environment.
    monkeypatch.setenv("KVCOMPOSE_PD_KEY", "k" * 64)
    f.write_text(f.read_text() + "    options: {key_env: KVCOMPOSE_PD_KEY}\n")
    assert main(["check", str(f)]) == 0
    out, err = capsys.readouterr()
    assert err == "" and "side channel: 10.1.2.3:5600 + data-parallel rank (beyond loopback)" in out
