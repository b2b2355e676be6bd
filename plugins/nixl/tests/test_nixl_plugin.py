"""The ``nixl`` connector type: discovery, options, rendering to vLLM arguments, checks."""

from __future__ import annotations

import inspect
import re
from typing import Any

import msgspec
import pytest

from kvcompose.catalog import Child
from kvcompose.compose import loads
from kvcompose.errors import CompositionError
from kvcompose.plugins import Plugins
from kvcompose_nixl import backends as nixl_backends
from kvcompose_nixl.plugin import (
    INTERNAL_PARAM_KEYS,
    NOT_PROTECTED,
    PARAM_KEYS,
    NixlOptions,
    NixlType,
    reach_of,
)


@pytest.fixture(autouse=True)
def _deployment_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """The key the compositions here name (``key_env: PD_KEY``), set as on an engine's host."""
    monkeypatch.setenv("PD_KEY", "k" * 64)


@pytest.fixture(scope="module")
def plugins() -> Plugins:
    """The plugin manager with installed entry points, as ``kvcompose check`` builds it."""
    return Plugins()


def child(role: str = "consumer", **options: Any) -> Child:
    return Child(0, "pd", NixlType(), role, msgspec.convert(options, NixlOptions))  # type: ignore[arg-type]


def compose(plugins: Plugins, connectors: str) -> Any:
    return loads("version: 1\nconnectors:\n" + connectors, plugins, "compose.yaml")


# ----------------------------------------------------------------------------- discovery


def test_entry_point_provides_the_type(plugins: Plugins) -> None:
    assert isinstance(plugins.connector_types["nixl"], NixlType)
    (row,) = [p for p in plugins.provided() if p.kind == "type" and p.name == "nixl"]
    assert row.provider.startswith("kvcompose-nixl ")


def test_type_flags() -> None:
    t = NixlType()
    assert t.name == "nixl"
    assert t.owns_handshake and t.owns_host_buffer_ops
    assert t.options is NixlOptions
    assert {
        "do_remote_prefill",
        "do_remote_decode",
        "remote_block_ids",
        "remote_engine_id",
        "remote_request_id",
        "remote_host",
        "remote_port",
        "tp_size",
        "transfer_mode",
    } <= t.param_keys


def test_param_keys_cover_what_vllm_reads() -> None:
    """Every literal key vLLM's NIXL scheduler and metadata code reads from or writes to
    ``kv_transfer_params`` is declared (push-mode registration fields are not params: they
    travel worker to worker in a NIXL notification)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (
        base_scheduler,
        metadata,
        pull_scheduler,
        push_scheduler,
    )

    pattern = re.compile(r"""(?:params|kv_transfer_params)(?:\.get\(|\[)\s*["']([A-Za-z_]+)["']""")
    found: set[str] = set()
    for module in (base_scheduler, pull_scheduler, push_scheduler, metadata):
        found |= set(pattern.findall(inspect.getsource(module)))
    # Keys of the dicts request_finished returns: dict(do_remote_prefill=..., ...).
    for module in (pull_scheduler, push_scheduler):
        src = inspect.getsource(module)
        for body in re.findall(r"return delay_free_blocks, dict\((.*?)\n        \)", src, re.S):
            found |= set(re.findall(r"^\s*([a-z_]+)=", body, re.M))
    assert found, "the vLLM source no longer matches this test's patterns"
    declared = PARAM_KEYS | INTERNAL_PARAM_KEYS
    assert found <= declared, f"undeclared: {sorted(found - declared)}"
    assert not {k for k in PARAM_KEYS if k.startswith("_")}, "private markers are not P/D params"


# ------------------------------------------------------------------------------- options


def test_defaults_render_minimal_vllm_config() -> None:
    cfg = child().vllm_config()
    assert cfg == {
        "kv_connector": "NixlConnector",
        "kv_connector_module_path": "kvcompose_nixl.connector",
        "kv_connector_extra_config": {},
        "kv_role": "kv_consumer",
    }


@pytest.mark.parametrize(
    ("option", "value", "key", "rendered"),
    [
        ("backends", ["UCX", "GDS"], "backends", ["UCX", "GDS"]),
        ("lease_seconds", 45, "kv_lease_duration", 45),
        ("recompute_threshold", 0, "kv_recompute_threshold", 0),
        ("num_threads", 8, "num_threads", 8),
        ("enforce_handshake_compat", False, "enforce_handshake_compat", False),
        ("bidirectional", True, "bidirectional_kv_xfer", True),
        ("decoder_blocks_ttl", 120, "decoder_kv_blocks_ttl", 120.0),
        ("engine_ttl", 0, "engine_ttl", 0.0),
        ("side_channel_host", "10.0.0.7", "kvcompose_side_channel_host", "10.0.0.7"),
        ("side_channel_port", 5700, "kvcompose_side_channel_port", 5700),
        ("handshake_tries", 3, "kvcompose_handshake_tries", 3),
    ],
)
def test_each_option_maps_to_its_extra_config_key(option: str, value: Any, key: str, rendered: Any) -> None:
    assert NixlType.extra_config_keys[option] == key
    extra = child(**{option: value}).vllm_config()["kv_connector_extra_config"]
    assert extra == {key: rendered}


def test_backends_equal_to_vllms_default_are_not_rendered() -> None:
    """The field's default is vLLM's ["UCX"]: saying it again changes nothing, so nothing is passed."""
    assert child(backends=["UCX"]).vllm_config()["kv_connector_extra_config"] == {}
    assert child(backends=["GDS", "UCX"]).vllm_config()["kv_connector_extra_config"] == {"backends": ["GDS", "UCX"]}


def test_every_option_is_rendered_or_picks_the_class() -> None:
    rendered = set(NixlType.extra_config_keys) | set(NixlType.top_level_keys)
    assert set(NixlOptions.__struct_fields__) - rendered == {"mode"}
    assert not set(NixlType.extra_config_keys) & set(NixlType.top_level_keys)


def test_push_registration_timeout_maps_in_push_mode() -> None:
    cfg = child(mode="push", push_registration_timeout=30).vllm_config()
    assert cfg["kv_connector"] == "NixlPushConnector"
    assert cfg["kv_connector_extra_config"] == {"push_registration_timeout": 30.0}


def test_top_level_options() -> None:
    cfg = child("producer", buffer_device="cpu", engine_id="prefill-0").vllm_config()
    assert cfg["kv_buffer_device"] == "cpu"
    assert cfg["engine_id"] == "prefill-0"
    assert cfg["kv_role"] == "kv_producer"
    assert "engine_id" not in cfg["kv_connector_extra_config"]


def test_extra_config_keys_are_the_ones_vllm_and_the_connector_read() -> None:
    """The vLLM names are pinned to the installed vLLM source, not to a copy of them."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (
        base_scheduler,
        base_worker,
        push_scheduler,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (
        connector as vllm_connector,
    )

    import kvcompose_nixl.connector as ours
    import kvcompose_nixl.patches as patches

    src = "".join(inspect.getsource(m) for m in (base_scheduler, base_worker, vllm_connector, push_scheduler))
    read = set(re.findall(r"""get_from_extra_config\(\s*["']([a-z_]+)["']""", src))
    # The connector reads most keys; patches.patch_scheduler, which it calls, the side channel's.
    ours_read = {
        getattr(module, name)
        for module in (ours, patches)
        for name in re.findall(r"get_from_extra_config\(\s*([A-Z_]+_KEY)\b", inspect.getsource(module))
    }
    for option, key in NixlType.extra_config_keys.items():
        if key.startswith("kvcompose_"):
            assert key in ours_read, f"{option} -> {key}: neither kvcompose_nixl.connector nor .patches reads it"
        else:
            assert key in read, f"{option} -> {key}: vLLM does not read it"


def test_rendered_config_loads_our_classes_through_vllm() -> None:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    import kvcompose_nixl.connector as ours

    for mode, cls in (("pull", ours.NixlConnector), ("push", ours.NixlPushConnector)):
        ktc = KVTransferConfig(**child(mode=mode, backends=["UCX"], lease_seconds=10).vllm_config())
        assert KVConnectorFactory.get_connector_class(ktc) is cls
        assert ktc.get_from_extra_config("kv_lease_duration", None) == 10


@pytest.mark.parametrize(
    "options",
    [
        {"backends": ["UCXX"]},
        {"backends": ["MOONCAKE"]},  # NIXL names are case-sensitive: the plugin is "Mooncake"
        {"backends": []},
        {"side_channel_port": 0},
        {"side_channel_port": 65536},
        {"side_channel_port": "5600"},
        {"mode": "pipe"},
        {"buffer_device": "gpu"},
        {"lease_seconds": 0},
        {"recompute_threshold": -1},
        {"decoder_blocks_ttl": 0},
        {"side_channel_host": ""},
        {"kv_lease_duration": 30},  # vLLM's name is not an option name
    ],
)
def test_bad_options_are_msgspec_errors(options: dict[str, Any]) -> None:
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert(options, NixlOptions)


def test_known_backend_names_are_accepted() -> None:
    for name in ("UCX", "LIBFABRIC", "GDS", "GDS_MT", "POSIX", "OBJ", "Mooncake", "UCCL"):
        assert msgspec.convert({"backends": ["UCX", name]}, NixlOptions).backends[1] == name


def test_installed_nixl_plugins_are_found() -> None:
    """The backends this machine's NIXL wheel ships are accepted (nixl-cu12 ships UCX)."""
    pytest.importorskip("nixl_cu12")
    assert "UCX" in nixl_backends.installed_backends()
    assert set(nixl_backends.installed_backends()) <= set(nixl_backends.backend_names())


def test_bad_backend_error_points_at_the_line(plugins: Plugins) -> None:
    with pytest.raises(CompositionError) as excinfo:
        compose(plugins, "  - name: pd\n    type: nixl\n    options:\n      backends: [UCX, UCXX]\n")
    (problem,) = excinfo.value.problems
    assert problem.path == ("connectors", 0, "options", "backends", 1)
    assert problem.line == 6  # the `backends:` line (after `version:` and `connectors:`)
    assert "UCXX" in problem.message and "UCX" in (problem.hint or "")


def test_port_out_of_range_error(plugins: Plugins) -> None:
    with pytest.raises(CompositionError) as excinfo:
        compose(plugins, "  - name: pd\n    type: nixl\n    options: {side_channel_port: 70000}\n")
    (problem,) = excinfo.value.problems
    assert problem.path == ("connectors", 0, "options", "side_channel_port")
    assert "65535" in problem.message


# -------------------------------------------------------------------------------- checks


def messages(plugins: Plugins, connectors: str) -> dict[tuple[Any, ...], str]:
    with pytest.raises(CompositionError) as excinfo:
        compose(plugins, connectors)
    return {p.path: p.message for p in excinfo.value.problems}


def test_check_push_with_bidirectional(plugins: Plugins) -> None:
    found = messages(plugins, "  - {name: pd, type: nixl, options: {mode: push, bidirectional: true}}\n")
    assert "bidirectional" in found[("connectors", 0, "options", "bidirectional")]


def test_check_option_vllm_would_ignore(plugins: Plugins) -> None:
    found = messages(
        plugins,
        "  - {name: pd, type: nixl, options: {backends: [UCX, GDS], num_threads: 2, push_registration_timeout: 5}}\n",
    )
    assert ("connectors", 0, "options", "num_threads") in found
    assert ("connectors", 0, "options", "push_registration_timeout") in found


def test_check_storage_only_and_duplicate_backends(plugins: Plugins) -> None:
    found = messages(plugins, "  - {name: pd, type: nixl, options: {backends: [POSIX, POSIX]}}\n")
    assert ("connectors", 0, "options", "backends") in found
    assert "twice" in found[("connectors", 0, "options", "backends", 1)]


@pytest.mark.parametrize(
    ("a", "b", "clash"),
    [
        ("{side_channel_port: 5600}", "{side_channel_port: 5600}", True),
        ("{}", "{}", True),  # both take $VLLM_NIXL_SIDE_CHANNEL_PORT
        ("{side_channel_port: 5600}", "{side_channel_port: 5601}", False),
        (
            "{side_channel_host: 10.0.0.1, side_channel_port: 5600}",
            "{side_channel_host: 10.0.0.2, side_channel_port: 5600}",
            False,
        ),
    ],
)
def test_check_side_channel_port_clash(plugins: Plugins, a: str, b: str, clash: bool) -> None:
    connectors = (
        f"  - {{name: a, type: nixl, role: consumer, options: {a}}}\n"
        f"  - {{name: b, type: nixl, role: producer, options: {b}}}\n"
    )
    # Two NIXL children also trip kvcompose's own one-host-buffer-owner check; only the
    # port problem is this type's.
    found = messages(plugins, connectors)
    port = found.get(("connectors", 1, "options", "side_channel_port"))
    assert (port is not None) == clash
    if clash:
        assert "is also the port of a's NIXL side channel" in port


def test_valid_child_has_no_problem(plugins: Plugins, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_NIXL_SIDE_CHANNEL_HOST", raising=False)  # else a warning of it
    plan = compose(
        plugins, "  - {name: pd, type: nixl, role: producer, options: {backends: [UCX], side_channel_port: 5600}}\n"
    )
    (pd,) = plan.children
    assert list(pd.type.check(pd, plan)) == []


# ------------------------------------------------------------------------------ describe


def test_describe_each_role() -> None:
    consumer = NixlType().describe(child("consumer", backends=["UCX"], buffer_device="cuda"))
    assert consumer.startswith("pulls prompt KV from the prefill instance over NIXL (UCX), GPUDirect into VRAM")
    producer = NixlType().describe(child("producer"))
    assert "serves its prompt KV to decode instances" in producer
    assert "returns the P/D kv_transfer_params" in producer
    assert "30 s lease" in producer
    assert "45 s lease" in NixlType().describe(child("producer", lease_seconds=45))
    both = NixlType().describe(child("both"))
    assert "serves" in both and "pulls" in both and "deprecates kv_both" in both
    push = NixlType().describe(child("consumer", mode="push"))
    assert "writes the prompt KV into them" in push


def test_describe_says_a_consumer_checks_reads_only_behind_this_type() -> None:
    consumer = NixlType().describe(child("consumer"))
    assert "lease: a read that ends after the prefill's lease on its blocks is refused" in consumer
    unstamped = "params with no lease stamped (a prefill running vLLM's own NixlConnector, taken unsigned)"
    assert unstamped in consumer  # no key: vLLM's prefill's params are taken, without a lease
    assert unstamped in NixlType().describe(child("consumer", key_env="PD_KEY", accept_unsigned=True))
    # With a key, unsigned params are refused: nothing is read unchecked, and it does not say so.
    keyed = NixlType().describe(child("consumer", key_env="PD_KEY"))
    assert "lease: a read that ends after" in keyed and "no lease stamped" not in keyed
    assert "no lease stamped" not in NixlType().describe(child("producer"))


@pytest.mark.parametrize(
    "options",
    [{}, {"key_env": "PD_KEY"}, {"key_env": "PD_KEY", "accept_unsigned": True, "peers": ["10.0.0.0/8"]}],
)
@pytest.mark.parametrize("role", ["consumer", "producer", "both"])
def test_brief_is_short_lines_that_describe_says_in_full(role: str, options: dict[str, Any]) -> None:
    brief = NixlType().brief(child(role, **options)).split("\n")
    assert max(len(line) for line in brief) <= 90  # check's screen of 100, less its indent
    assert any(line.startswith("side channel: localhost:5600") for line in brief)
    assert ("agent metadata: sealed with $PD_KEY" in brief[-2]) is ("key_env" in options)


def test_describe_says_one_fact_a_line_what_is_and_is_not_protected() -> None:
    bare = NixlType().describe(child("consumer")).split("\n")
    assert "params: not authenticated (no key)" in "\n".join(bare)
    assert "peers: connects only to side channels on loopback (no key, no peers)" in bare
    assert max(len(line) for line in bare[1:]) <= 170  # short lines, one fact each
    keyed = NixlType().describe(child("consumer", key_env="PD_KEY", peers=["10.0.0.0/8"]))
    assert "params: only those a prefill signed with the key in $PD_KEY" in keyed
    assert "peers: connects only to side channels in 10.0.0.0/8" in keyed
    assert "agent metadata: sealed with the key in $PD_KEY" in keyed
    assert keyed.endswith(NOT_PROTECTED)
    producer = NixlType().describe(child("producer", key_file="/etc/pd.key"))
    assert "signs: the P/D params it returns, with the key in /etc/pd.key" in producer
    assert "params:" not in producer


def test_a_side_channel_beyond_loopback_needs_a_key(plugins: Plugins) -> None:
    exposed = "  - {name: pd, type: nixl, role: producer, options: {side_channel_host: 10.1.2.3}}\n"
    with pytest.raises(CompositionError) as refused:
        compose(plugins, exposed)
    assert "without a key it hands this engine's NIXL agent metadata" in str(refused.value)
    keyed = "  - {name: pd, type: nixl, role: producer, options: {side_channel_host: 10.1.2.3, key_env: PD_KEY}}\n"
    assert compose(plugins, keyed).warnings == ()
    both = "  - {name: pd, type: nixl, role: consumer, options: {key_env: A, key_file: /k, peers: ['10.0.0.0/8:x']}}\n"
    with pytest.raises(CompositionError) as refused:
        compose(plugins, both)
    assert "key_env and key_file both name the key" in str(refused.value)
    assert "the port is not a number" in str(refused.value)
    unsigned = "  - {name: pd, type: nixl, role: consumer, options: {key_env: PD_KEY, accept_unsigned: true}}\n"
    (warning,) = compose(plugins, unsigned).warnings
    assert "also takes params no prefill signed" in warning.message


def test_describe_says_what_a_shorter_lease_trades_away() -> None:
    short = NixlType().describe(child("producer", lease_seconds=10))
    assert "the 10 s lease, shorter than vLLM's 30 s, frees a dead decode instance's blocks sooner" in short
    assert "finds them freed and recomputes the prompt" in short and "the same lease_seconds" in short
    longer = NixlType().describe(child("producer", lease_seconds=60))
    assert "a decode instance that dies holds this instance's blocks for its requests up to 60 s" in longer
    assert "shorter" not in NixlType().describe(child("consumer", lease_seconds=10))  # a decode holds no blocks


def test_describe_host_buffer_and_side_channel() -> None:
    text = NixlType().describe(child("producer", buffer_device="cpu", side_channel_port=5700))
    assert "device-to-host copies" in text
    assert ":5700" in text
    text = NixlType().describe(child("consumer", buffer_device="cpu"))
    assert "host-to-device copies" in text
    assert "$VLLM_NIXL_SIDE_CHANNEL_PORT (5600)" in text


def test_handshake_tries_are_described_and_warned_of_when_they_outlast_the_lease(
    plugins: Plugins, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VLLM_NIXL_SIDE_CHANNEL_HOST", raising=False)
    assert "asked up to 3 times, 5 s each" in NixlType().describe(child("consumer", handshake_tries=3))
    assert "asked up to" not in NixlType().describe(child("consumer"))
    ok = compose(plugins, "  - {name: pd, type: nixl, role: consumer, options: {handshake_tries: 5}}\n")
    assert ok.warnings == ()
    plan = compose(plugins, "  - {name: pd, type: nixl, role: consumer, options: {handshake_tries: 6}}\n")
    (warning,) = plan.warnings
    assert warning.path == ("connectors", 0, "options", "handshake_tries")
    assert "6 handshake tries of 5 s outlast the 30 s" in warning.message
    assert "at most 5 tries" in (warning.hint or "")
    with pytest.raises(CompositionError, match="handshake_tries"):
        compose(plugins, "  - {name: pd, type: nixl, role: consumer, options: {handshake_tries: 0}}\n")


def test_kv_layout_is_left_to_vllm() -> None:
    """Unknown without the model: vLLM's NixlConnector needs LBHNC except for MLA models."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector

    from kvcompose.testing.harness import make_vllm_config

    assert NixlType().kv_layout(child()) is None
    cfg = make_vllm_config({"kv_connector": "NixlConnector", "kv_role": "kv_consumer"})
    assert NixlConnector.get_required_kvcache_layout(cfg) == "LBHNC"  # tiny llama: not MLA


# ------------------------------------------------------------------------ side channel exposure


@pytest.mark.parametrize(
    ("host", "reach"),
    [
        ("localhost", "loopback only"),
        ("127.0.0.1", "loopback only"),
        ("127.8.9.1", "loopback only"),
        ("::1", "loopback only"),
        ("[::1]", "loopback only"),
        ("0.0.0.0", "all interfaces"),
        ("::", "all interfaces"),
        ("*", "all interfaces"),
        ("10.0.0.7", "the interface with address 10.0.0.7"),
        ("prefill-0.internal", "the interface the name prefill-0.internal resolves to at engine start"),
    ],
)
def test_reach_of_a_bind_address(host: str, reach: str) -> None:
    assert reach_of(host) == reach


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3"])
def test_an_unset_host_that_the_environment_opens_is_refused_without_a_key(
    plugins: Plugins, monkeypatch: pytest.MonkeyPatch, host: str
) -> None:
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_HOST", host)
    with pytest.raises(CompositionError) as refused:
        compose(plugins, "  - name: pd\n    type: nixl\n    role: producer\n")
    (problem,) = refused.value.problems
    assert not problem.warning and problem.path == ("connectors", 0, "options", "side_channel_host")
    assert (problem.line, problem.column) == (3, 5)
    assert f"$VLLM_NIXL_SIDE_CHANNEL_HOST={host} (side_channel_host unset)" in problem.message
    assert "without a key it hands this engine's NIXL agent metadata" in problem.message
    # docs/deploy.md's advice: a key, the host from the environment; loopback on one host.
    assert "leave side_channel_host unset and set $VLLM_NIXL_SIDE_CHANNEL_HOST" in (problem.hint or "")
    assert "on one host: side_channel_host: 127.0.0.1" in (problem.hint or "")
    # With a key it is docs/deploy.md's setup: accepted, nothing to warn of.
    keyed = compose(plugins, "  - {name: pd, type: nixl, role: producer, options: {key_env: PD_KEY}}\n")
    assert [w for w in keyed.warnings if "side_channel" in w.render()] == []
    brief = NixlType().brief(keyed.children[0])
    assert f"side channel: {host}:5600 + data-parallel rank (beyond loopback)" in brief
    assert "side channel set by $VLLM_NIXL_SIDE_CHANNEL_HOST and _PORT" in brief
    # Without a key, only when the file says it is meant.
    meant = compose(plugins, "  - {name: pd, type: nixl, role: producer, options: {insecure_side_channel: true}}\n")
    (warning,) = meant.warnings
    assert warning.path[-1] == "insecure_side_channel" and "beyond loopback without a key" in warning.message


def test_the_default_side_channel_is_loopback_and_not_warned_of(
    plugins: Plugins, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VLLM_NIXL_SIDE_CHANNEL_HOST", raising=False)
    plan = compose(plugins, "  - name: pd\n    type: nixl\n    role: producer\n")
    assert plan.warnings == ()
    assert "$VLLM_NIXL_SIDE_CHANNEL_HOST (localhost)" in NixlType().describe(plan.children[0])
    assert "(loopback only)" in NixlType().describe(plan.children[0])


def test_an_explicit_all_interfaces_host_is_explained_not_warned_of(
    plugins: Plugins, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_HOST", "0.0.0.0")
    options = "{side_channel_host: 0.0.0.0, key_env: PD_KEY}"
    plan = compose(plugins, f"  - {{name: pd, type: nixl, role: producer, options: {options}}}\n")
    assert plan.warnings == ()
    text = NixlType().describe(plan.children[0])
    assert "side channel: 0.0.0.0:" in text
    assert "(all interfaces, as side_channel_host asks)" in text
    assert "agent metadata: sealed with the key in $PD_KEY" in text


@pytest.mark.parametrize(
    ("role", "buffer", "refused"),
    [("producer", "cpu", True), ("both", "cpu", True), ("consumer", "cpu", False), ("producer", None, False)],
)
def test_a_host_buffer_producer_left_out_of_the_save_hooks_is_refused(
    plugins: Plugins, role: str, buffer: str | None, refused: bool
) -> None:
    options = f"{{buffer_device: {buffer}}}" if buffer else "{}"
    text = (
        "version: 1\nconnectors:\n"
        f"  - {{name: pd, type: nixl, role: {role}, options: {options}}}\n"
        "  - {name: other, type: vllm, options: {kv_connector: ExampleConnector}}\n"
        "rules: {store: {use: only, children: [other]}}\n"
    )
    if not refused:
        assert loads(text, plugins, "compose.yaml").store.targets == (1,)
        return
    with pytest.raises(CompositionError) as excinfo:
        loads(text, plugins, "compose.yaml")
    [problem] = [p for p in excinfo.value.problems if p.path == ("rules", "store")]
    assert "leaves pd out of the save hooks" in problem.message and "save_kv_to_host" in problem.message
    assert problem.hint == "list pd in store.children, or use `store: all`"
