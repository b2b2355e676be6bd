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


@pytest.mark.parametrize(
    ("config", "got"),
    [
        ('{"kv_connector":"MultiConnector","kv_connector_extra_config":["connectors"]}', "an array"),
        ('{"kv_connector":"MultiConnector","kv_connector_extra_config":"connectors"}', "a string"),
        ('{"kv_connector":"NixlConnector","kv_connector_extra_config":[{"backends":["UCX"]}]}', "an array"),
        ('{"kv_connector":"ExampleConnector","kv_connector_extra_config":"local_storage"}', "a string"),
    ],
    ids=["multi-list", "multi-string", "single-list", "single-string"],
)
def test_an_extra_config_that_is_not_an_object_is_located(
    config: str, got: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["import", config]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"the command line: kv_connector_extra_config: expected a JSON object, got {got} ("), err


def test_a_mistyped_file_is_no_such_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "kv-transfer-confg.json"
    assert main(["import", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvcompose import: {missing}: no such file (CONFIG is a --kv-transfer-config value"), err
    assert "JSON" not in err.partition("(")[0]


def test_output_into_a_missing_directory_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "nowhere" / "compose.yaml"
    assert main(["import", DOCUMENTED, "-o", str(out)]) == 2
    assert capsys.readouterr().err == f"kvcompose import: {out}: no such directory: {out.parent} (create it first)\n"
    assert not out.parent.exists()


def test_output_replaces_a_file_only_with_force(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "compose.yaml"
    out.write_text("# mine\n")
    assert main(["import", DOCUMENTED, "-o", str(out)]) == 2
    assert (
        capsys.readouterr().err == f"kvcompose import: {out} already exists with other contents (--force replaces it)\n"
    )
    assert out.read_text() == "# mine\n"
    assert main(["import", DOCUMENTED, "-o", str(out), "--force"]) == 0
    written = out.read_text()
    assert written.startswith("# Imported by `kvcompose import` from the command line.\n")
    # The same import again changes nothing, so it needs no --force.
    assert main(["import", DOCUMENTED, "-o", str(out)]) == 0
    assert out.read_text() == written
    assert main(["import", DOCUMENTED, "-o", str(tmp_path)]) == 2
    assert "is a directory (-o names the file to write)" in capsys.readouterr().err
