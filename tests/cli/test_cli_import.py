"""``kvcompose import``: a --kv-transfer-config in, a composition file out, and back through vllm-args."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from kvcompose.cli import main

#: vLLM, docs/features/disagg_prefill.md: MultiConnector over NIXL and ExampleConnector.
DOCUMENTED = (
    '{"kv_connector":"MultiConnector","kv_role":"kv_both","kv_connector_extra_config":{"connectors":['
    '{"kv_connector":"NixlConnector","kv_role":"kv_both"},{"kv_connector":"ExampleConnector","kv_role":"kv_both",'
    '"kv_connector_extra_config":{"shared_storage_path":"local_storage"}}]}}'
)


def test_import_then_vllm_args_composes_the_same_children(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["import", f"--kv-transfer-config '{DOCUMENTED}'"]) == 0
    out = capsys.readouterr().out
    assert "- name: example\n  type: vllm\n" in out
    path = tmp_path / "compose.yaml"
    path.write_text(out)
    assert main(["vllm-args", str(path)]) == 0
    children = json.loads(capsys.readouterr().out)["kv_connector_extra_config"]["connectors"]
    original = json.loads(DOCUMENTED)["kv_connector_extra_config"]["connectors"]
    assert children[1] == original[1]
    assert (children[0]["kv_connector"], children[0]["kv_role"]) == ("NixlConnector", "kv_both")


def test_import_reads_a_file_or_stdin_and_writes_a_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    source = tmp_path / "kv.json"
    source.write_text(DOCUMENTED)
    out = tmp_path / "compose.yaml"
    assert main(["import", str(source), "-o", str(out)]) == 0
    assert f"{out}: nixl (nixl, both), example (vllm ExampleConnector, both)" in capsys.readouterr().err
    assert out.read_text().startswith(f"# Imported by `kvcompose import` from {source}.\n")
    monkeypatch.setattr("sys.stdin", io.StringIO(DOCUMENTED))
    assert main(["import"]) == 0
    assert capsys.readouterr().out.startswith("# Imported by `kvcompose import` from stdin.\n")


def test_import_of_bad_json_exits_2_with_the_place(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["import", '{"kv_connector": "MultiConnector",}']) == 2
    assert "the command line:1:35: (top level): not valid JSON" in capsys.readouterr().err
