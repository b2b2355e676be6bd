"""The HTTP demo's pieces that need no engine: the server command line and the /metrics parser."""

from __future__ import annotations

import json
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvcompose.compose import load
from kvcompose.examples import EXAMPLES
from kvcompose.vllm.args import render
from kvcompose_tools.e2e.metrics import parse_metrics
from kvcompose_tools.e2e.server import SERVER_MODULE, server_argv
from kvcompose_tools.e2e.spec import EngineSpec, composed_kv_transfer_config


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_server_argv_parses_with_vllms_own_parser_into_the_offline_engine_settings() -> None:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    spec = EngineSpec("decode", "/models/tiny", str(EXAMPLES / "pd-decode.yaml"), 5601)
    argv = server_argv(spec, 8200)
    assert argv[1:3] == ["-m", SERVER_MODULE]
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv[3:])
    assert (args.host, args.port) == ("127.0.0.1", 8200)
    for key, value in spec.llm_kwargs().items():
        assert getattr(args, key) == value, key
    # The same value the offline node hands KVTransferConfig, as JSON.
    assert json.loads(_flag(argv, "--kv-transfer-config")) == spec.kv_transfer_config()


def test_kv_transfer_config_is_what_kvcompose_vllm_args_renders() -> None:
    path = EXAMPLES / "pd-prefill.yaml"
    spec = EngineSpec("prefill", "/m", str(path))  # no overrides: exactly the CLI's output
    assert _flag(server_argv(spec, 1), "--kv-transfer-config") == render(load(path))
    with_policy = EngineSpec("prefill", "/m", str(path), 7000, kv_load_failure_policy="recompute")
    value = json.loads(_flag(server_argv(with_policy, 1), "--kv-transfer-config"))
    assert value == composed_kv_transfer_config(path, 7000, None, "recompute")


def test_baseline_server_has_no_connector() -> None:
    assert "--kv-transfer-config" not in server_argv(EngineSpec("baseline", "/m"), 1)


def test_a_bare_connector_server_gets_its_kv_config_as_is() -> None:
    """A benchmark's baseline server (a connector without composite) is given its connector: a
    server without one answers P/D requests by computing the prompt ("Got kv_transfer_params, but
    no KVConnector found"), which once made a throughput baseline measure recompute."""
    bare = {"kv_connector": "NixlConnector", "kv_role": "kv_consumer", "kv_connector_extra_config": {"k": 1}}
    assert json.loads(_flag(server_argv(EngineSpec("decode", "/m", kv_config=bare), 1), "--kv-transfer-config")) == bare


def test_parse_metrics_gives_the_keys_flatten_metrics_gives() -> None:
    reg = CollectorRegistry()
    labels = ["model_name", "engine"]
    loads = Counter("vllm:kvcompose_loads", "loads", labels + ["child"], registry=reg)
    loads.labels("m", "0", "pd").inc(3)
    Counter("vllm:prompt_tokens_by_source", "t", labels + ["source"], registry=reg).labels(
        "m", "0", "external_kv_transfer"
    ).inc(600)
    hist = Histogram("vllm:nixl_bytes_transferred", "b", labels, registry=reg)
    hist.labels("m", "0").observe(622592)
    Gauge("vllm:num_requests_running", "g", labels, registry=reg).labels("m", "0").set(1)
    Counter("process_other", "not vllm", registry=reg).inc()
    got = parse_metrics(generate_latest(reg).decode())
    assert got == {
        "vllm:kvcompose_loads{child=pd}": 3.0,
        "vllm:prompt_tokens_by_source{source=external_kv_transfer}": 600.0,
        "vllm:nixl_bytes_transferred_sum": 622592.0,
        "vllm:nixl_bytes_transferred_count": 1.0,
        "vllm:num_requests_running": 1.0,
    }


def test_parse_metrics_reads_the_routers_summary_by_its_prefix() -> None:
    """vllm-router's exporter, as it wrote a P/D kv_aware placement's preparation (a summary)."""
    text = """# TYPE vllm_router_pd_kv_prepare_seconds summary
vllm_router_pd_kv_prepare_seconds{quantile="0.5"} 0.030248762130117984
vllm_router_pd_kv_prepare_seconds_sum 2.0994377430000006
vllm_router_pd_kv_prepare_seconds_count 59
# TYPE vllm_router_kv_placement_lookups_total counter
vllm_router_kv_placement_lookups_total{result="hit"} 114
"""
    assert parse_metrics(text, prefix="vllm_router_") == {
        "vllm_router_pd_kv_prepare_seconds_sum": 2.0994377430000006,
        "vllm_router_pd_kv_prepare_seconds_count": 59.0,
        "vllm_router_kv_placement_lookups{result=hit}": 114.0,
    }
    assert parse_metrics(text) == {}  # vLLM's own only, by default


def test_free_ports_are_distinct_bindable_and_never_ones_the_kernel_hands_out_itself() -> None:
    import socket

    from kvcompose_tools.e2e.ports import free_ports

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = free_ports(8)
    assert len(set(ports)) == 8 and all(1024 <= p < low for p in ports)
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
