"""deploy/kubernetes/, the 2P2D fleet behind vllm-router: valid against Kubernetes' own schemas, and
running what the project runs.

No cluster and no engine: what each pod would run is read out of its manifest (Kubernetes' ``$``
expansion, then the shell script) and compared with the flags the kit's servers and router are
started with (:mod:`kvcompose.serving`, ``server_argv``, ``router_argv``), with the shipped example
compositions, and with the ports and key those name. vLLM's and vllm-router's own parsers read the
flags.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvcompose import serving
from kvcompose.compose import load
from kvcompose.examples import EXAMPLES
from kvcompose.vllm.args import render
from kvcompose_tools.e2e.hosts import Host
from kvcompose_tools.e2e.router import ROUTER_MODULE, STARTUP, router_argv
from kvcompose_tools.e2e.server import server_argv
from kvcompose_tools.e2e.spec import PD_KEY_ENV, EngineSpec, engine_env

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "deploy" / "kubernetes"
#: The oldest Kubernetes release the manifests are checked against (besides the newest the
#: package ships): apps/v1 StatefulSets with ``publishNotReadyAddresses`` and startup probes.
OLDEST = "1.30.0"
#: The shell variable each server's script renders its composition into.
RENDERED = "$KV_TRANSFER_CONFIG"
#: The engine settings the manifests give every server before the P/D flags, per role's port.
BLOCK_SIZE = "16"  # vllm-router 0.1.17 indexes 16-token blocks only
ROLES = ("prefill", "decode")
#: Every instance's side channel on real hosts (docs/deploy.md, Ports; vLLM's default).
SIDE_CHANNEL_PORT = 5600


def _files() -> list[Path]:
    return sorted(DEPLOY.rglob("*.yaml"))


def _docs() -> dict[tuple[str, str], dict[str, Any]]:
    """Every resource in the folder by (kind, name)."""
    out = {}
    for path in _files():
        for doc in yaml.safe_load_all(path.read_text()):
            out[(doc["kind"], doc["metadata"]["name"])] = doc
    return out


DOCS = _docs()


def _container(kind: str, name: str) -> dict[str, Any]:
    (container,) = DOCS[(kind, name)]["spec"]["template"]["spec"]["containers"]
    return container


def _port(container: dict[str, Any], name: str) -> int:
    (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == name]
    return int(port)


def expand(text: str, env: dict[str, str] | None = None) -> str:
    """Kubernetes' expansion of ``command`` and ``args``: ``$$`` is ``$``, ``$(NAME)`` a defined
    variable's value; any other reference stays as written (``core/v1/types.go``, Container.Args)."""

    def one(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return (env or {}).get(m.group(1), m.group(0))

    return re.sub(r"\$\$|\$\(([^)]*)\)", one, text)


def server_script(role: str) -> tuple[str, list[str]]:
    """What a ``role`` server's shell runs: the composition file it renders, and the argv it
    ``exec``s (the rendered value as :data:`RENDERED`)."""
    c = _container("StatefulSet", f"kvcompose-{role}")
    assert c["command"] == ["/bin/sh", "-c"]
    (script,) = c["args"]
    lines = expand(script).replace("\\\n", " ").strip().splitlines()
    assert lines[0] == "set -e"  # a composition that fails to render stops the pod
    m = re.fullmatch(r'KV_TRANSFER_CONFIG="\$\(kvcompose vllm-args (\S+)\)"', lines[1])
    assert m, lines[1]
    assert len(lines) == 3
    return m.group(1), shlex.split(lines[2])


def _composition(role: str, tmp_path: Path) -> Path:
    """The ConfigMap's composition for ``role``, as a file."""
    path = tmp_path / f"pd-{role}.yaml"
    path.write_text(DOCS[("ConfigMap", "kvcompose-compositions")]["data"][path.name])
    return path


@pytest.fixture
def pod_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment a server's pod has: a key from the Secret, the side channel on its IP."""
    monkeypatch.setenv(PD_KEY_ENV, "0" * 64)
    monkeypatch.setenv(serving.SIDE_CHANNEL_HOST_ENV, "10.1.2.3")


@pytest.mark.parametrize("version", [OLDEST, "latest"])
def test_every_manifest_is_valid_against_kubernetes_own_schemas(version: str) -> None:
    import kubernetes_validate

    version = kubernetes_validate.latest_version() if version == "latest" else version
    assert len(_files()) == 5 and len(DOCS) == 8
    for path in _files():
        for doc in yaml.safe_load_all(path.read_text()):
            kubernetes_validate.validate(doc, version, strict=True)
    # The schemas are the package's own (no network) and strict: a misspelt field fails.
    wrong = yaml.safe_load((DEPLOY / "decode.yaml").read_text().split("---")[1])
    wrong["spec"]["template"]["spec"]["containers"][0]["ports"][0]["contanerPort"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wrong, version, strict=True)


@pytest.mark.parametrize("role", ROLES)
def test_the_compositions_are_the_shipped_examples_changed_only_as_deploy_md_says(
    role: str, tmp_path: Path, pod_env: None
) -> None:
    """docs/deploy.md, "What differs from the one-machine runs": no side_channel_host, no
    ucx_error_handling, side_channel_port 5600 on both, cpu_bytes sized for the node; every other
    field the example's."""
    ours = yaml.safe_load(_composition(role, tmp_path).read_text())
    want = yaml.safe_load((EXAMPLES / f"pd-{role}.yaml").read_text())
    for child in want["connectors"]:
        if child["type"] == "nixl":
            assert {"side_channel_host", "ucx_error_handling", "key_env"} <= set(child["options"])
            del child["options"]["side_channel_host"], child["options"]["ucx_error_handling"]
            child["options"]["side_channel_port"] = SIDE_CHANNEL_PORT
        else:
            (mine,) = [c for c in ours["connectors"] if c["name"] == child["name"]]
            child["options"]["cpu_bytes"] = mine["options"]["cpu_bytes"]
    assert ours == want
    plan = load(_composition(role, tmp_path))  # what `kvcompose vllm-args` in the pod loads
    assert plan.pd_transport is not None


@pytest.mark.parametrize("role", ROLES)
def test_each_server_runs_the_kits_pd_flags_which_vllm_parses(role: str, tmp_path: Path, pod_env: None) -> None:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    path, argv = server_script(role)
    c = _container("StatefulSet", f"kvcompose-{role}")
    assert path == f"/etc/kvcompose/pd-{role}.yaml"
    (mount,) = c["volumeMounts"]
    (volume,) = DOCS[("StatefulSet", f"kvcompose-{role}")]["spec"]["template"]["spec"]["volumes"]
    assert (mount["mountPath"], mount["name"], volume["name"]) == ("/etc/kvcompose", volume["name"], mount["name"])
    assert volume["configMap"]["name"] == "kvcompose-compositions"

    assert argv[:3] == ["exec", "vllm", "serve"]
    model, flags = argv[3], argv[4:]
    assert {server_script(r)[1][3] for r in ROLES} == {model}  # a P/D pair serves one model
    engine = ["--port", str(_port(c, "http")), "--block-size", BLOCK_SIZE]
    assert flags[: len(engine)] == engine
    events = serving.kv_events_config(f"tcp://*:{_port(c, 'kv-events')}") if role == "prefill" else None
    pd = serving.server_args(RENDERED, events)
    assert flags[len(engine) :] == pd

    # The kit's server of the same composition ends with the same flags, RENDERED being what
    # `kvcompose vllm-args` prints for it.
    composition = _composition(role, tmp_path)
    value = render(load(composition))
    ran = [value if a == RENDERED else a for a in pd]
    spec = EngineSpec(role, model, str(composition), kv_events=events, block_size=int(BLOCK_SIZE))
    kit = server_argv(spec, _port(c, "http"))
    assert kit[-len(ran) :] == ran
    assert kit[kit.index("--block-size") + 1] == BLOCK_SIZE

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", model, *flags[:-1], value])
    assert (args.port, args.block_size) == (8000, 16)
    assert args.kv_transfer_config.kv_connector == "MultiConnector"
    assert (args.kv_events_config is not None) is (role == "prefill")
    assert args.enable_scale_out is (role == "prefill")


@pytest.mark.parametrize("role", ROLES)
def test_each_server_has_the_kits_environment_the_key_from_the_secret_the_side_channel_on_its_ip(
    role: str, tmp_path: Path
) -> None:
    env = {e["name"]: e["valueFrom"] for e in _container("StatefulSet", f"kvcompose-{role}")["env"]}
    (nixl,) = [c for c in yaml.safe_load(_composition(role, tmp_path).read_text())["connectors"] if c["type"] == "nixl"]
    key_env = nixl["options"]["key_env"]
    assert key_env == PD_KEY_ENV  # the variable the kit's engines get their key in
    secret = DOCS[("Secret", "kvcompose-pd-key")]
    assert list(secret["stringData"]) == [key_env]
    assert secret["stringData"][key_env] == ""  # never a known key: empty stops every engine at start
    assert env == {
        serving.SIDE_CHANNEL_HOST_ENV: {"fieldRef": {"fieldPath": "status.podIP"}},
        key_env: {"secretKeyRef": {"name": "kvcompose-pd-key", "key": key_env}},
    }
    # The kit's servers in a host: the same two variables, the host's address for the pod IP.
    host = Host(role, "ns", "10.0.0.9")
    assert host.env()[serving.SIDE_CHANNEL_HOST_ENV] == "10.0.0.9"
    assert engine_env(host.env())[PD_KEY_ENV]


@pytest.mark.parametrize("role", ROLES)
def test_ports_agree_between_compositions_containers_services_and_scripts(role: str, tmp_path: Path) -> None:
    c = _container("StatefulSet", f"kvcompose-{role}")
    (nixl,) = [c for c in yaml.safe_load(_composition(role, tmp_path).read_text())["connectors"] if c["type"] == "nixl"]
    assert _port(c, "side-channel") == nixl["options"]["side_channel_port"] == SIDE_CHANNEL_PORT
    service = DOCS[("Service", f"kvcompose-{role}")]["spec"]
    assert {p["name"]: p["port"] for p in service["ports"]} == {p["name"]: p["containerPort"] for p in c["ports"]}
    assert service["selector"] == DOCS[("StatefulSet", f"kvcompose-{role}")]["spec"]["template"]["metadata"]["labels"]
    assert DOCS[("StatefulSet", f"kvcompose-{role}")]["spec"]["serviceName"] == f"kvcompose-{role}"
    _, argv = server_script(role)
    assert argv[argv.index("--port") + 1] == str(_port(c, "http"))


def _urls(role: str) -> list[str]:
    """Each pod's URL through the headless Service: ``http://NAME-i.SERVICE:PORT``."""
    sts = DOCS[("StatefulSet", f"kvcompose-{role}")]["spec"]
    port = _port(_container("StatefulSet", f"kvcompose-{role}"), "http")
    return [f"http://kvcompose-{role}-{i}.{sts['serviceName']}:{port}" for i in range(sts["replicas"])]


def test_the_router_runs_the_kits_fleet_flags_for_every_pod_which_vllm_router_parses() -> None:
    from vllm_router.launch_router import parse_router_args

    c = _container("Deployment", "kvcompose-router")
    assert c["command"] == ["python3", "-m", ROUTER_MODULE]
    prefills, decodes = _urls("prefill"), _urls("decode")
    assert (len(prefills), len(decodes)) == (2, 2)
    events_port = _port(_container("StatefulSet", "kvcompose-prefill"), "kv-events")
    events = {url: f"tcp://{url.split('//')[1].split(':')[0]}:{events_port}" for url in prefills}
    listen, metrics = ("0.0.0.0", _port(c, "http")), ("0.0.0.0", _port(c, "metrics"))
    want = serving.router_args(prefills, decodes, serving.FLEET_POLICY, events, listen, metrics, (1800, 10))
    assert c["args"] == [*want, *serving.HEALTH_ARGS]

    # The kit's router: the same builder, its own addresses and start-up wait.
    kit = router_argv(prefills, decodes, 8000, 29100, serving.FLEET_POLICY, "127.0.0.1", events)
    assert kit == [
        sys.executable,
        "-m",
        ROUTER_MODULE,
        *serving.router_args(
            prefills, decodes, serving.FLEET_POLICY, events, ("127.0.0.1", 8000), ("127.0.0.1", 29100), STARTUP
        ),
    ]

    args = parse_router_args(c["args"])
    assert (args.policy, args.decode_policy, args.kv_connector) == ("kv_aware", "consistent_hash", "nixl")
    assert [url for url, _ in args.prefill_urls] == prefills and args.decode_urls == decodes
    assert (args.health_check_interval_secs, args.health_failure_threshold) == (1, 2)
    service = DOCS[("Service", "kvcompose-router")]["spec"]
    assert {p["targetPort"] for p in service["ports"]} == {p["name"] for p in c["ports"]}


def test_deploy_md_quotes_the_manifests_and_names_every_router_flag() -> None:
    """docs/deploy.md, "Kubernetes: 2P2D behind vllm-router": its server block is prefill.yaml's
    text, and its router table names every flag router.yaml passes."""
    page = (ROOT / "docs" / "deploy.md").read_text()
    section = page.split("## Kubernetes: 2P2D behind vllm-router\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^```yaml\n(.*?)^```$", section, flags=re.M | re.S)
    (server,) = [b for b in blocks if "command:" in b]
    assert server in (DEPLOY / "prefill.yaml").read_text()
    flags = {a for a in _container("Deployment", "kvcompose-router")["args"] if a.startswith("--")}
    table = section.split("### vllm-router's flags for a fleet", 1)[1]
    assert sorted(f for f in flags if f"`{f}" not in table and f" {f} " not in table) == []


def test_the_router_subscribes_to_kv_events_at_a_host_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """router.yaml names each prefill's events endpoint by its pod's DNS name: vllm-router's
    subscriber resolves a name (``localhost`` here; regular mode's sources, the same indexer as
    P/D's) and takes in what is published there."""
    import kvcompose_tools.e2e.kv_replay as kv_replay

    built = kv_replay.router_argv

    def named(*args: Any, **kwargs: Any) -> list[str]:
        return [a.replace("=tcp://127.0.0.1:", "=tcp://localhost:") for a in built(*args, **kwargs)]

    monkeypatch.setattr(kv_replay, "router_argv", named)
    seen = kv_replay.replay([], [], tmp_path, block_size=32)
    assert "on tcp://localhost:" in seen.log
    assert kv_replay.SEQUENCE.search(seen.log), "the router took in no batch published at localhost"
