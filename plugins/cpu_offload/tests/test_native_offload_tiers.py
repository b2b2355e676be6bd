"""The native-offload child's secondary tiers (``tiers:``): rendered as vLLM's ``secondary_tiers``,
each struct pinned to its vLLM manager's parameters, every bad entry refused at its line."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import sys
import textwrap
from pathlib import Path
from typing import Any

import msgspec
import pytest
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.obj.config import ObjStoreConfig

from kvcompose.catalog import Plan
from kvcompose.compose import loads
from kvcompose.errors import CompositionError
from kvcompose_cpu_offload import tiers
from kvcompose_cpu_offload.offloading_type import TIERING_SPEC

ALL_FOUR = """\
version: 1
connectors:
  - name: host
    type: native-offload
    options:
      cpu_bytes: 64MiB
      tiers:
        - {type: fs, root_dir: /mnt/kv, n_read_threads: 4, enable_kv_events: true, locality: LOCAL}
        - type: obj
          store_config: {bucket: kv, endpoint_override: "http://10.0.0.5:9000", scheme: https}
          io_threads: 8
        - {type: p2p, host: 10.0.0.7, port: 5711, unbound_store_timeout_s: 30}
        - {type: kvcr, control_ports: [7000, 7001]}
"""


def _composition(tier_lines: str, extra: str = "") -> str:
    """A one-child composition whose ``tiers:`` list is ``tier_lines`` (YAML, indented 8)."""
    return (
        "version: 1\nconnectors:\n  - name: host\n    type: native-offload\n    options:\n"
        "      cpu_bytes: 64MiB\n" + extra + "      tiers:\n" + textwrap.indent(tier_lines, " " * 8)
    )


def _extra(plan: Plan, name: str = "host") -> dict[str, Any]:
    """The child's ``kv_connector_extra_config`` as vLLM gets it."""
    return plan.child(name).vllm_config()["kv_connector_extra_config"]


def _refused(text: str, **kw: Any) -> str:
    with pytest.raises(CompositionError) as info:
        loads(text, filename="c.yaml", **kw)
    return str(info.value)


def test_all_four_built_in_tiers_render_as_vllms_secondary_tiers_in_order() -> None:
    extra = _extra(loads(ALL_FOUR))
    assert extra["spec_name"] == TIERING_SPEC and "tiers" not in extra
    assert extra["secondary_tiers"] == [
        {"type": "fs", "root_dir": "/mnt/kv", "n_read_threads": 4, "enable_kv_events": True, "locality": "LOCAL"},
        {
            "type": "obj",
            "store_config": {"bucket": "kv", "endpoint_override": "http://10.0.0.5:9000", "scheme": "https"},
            "io_threads": 8,
        },
        {"type": "p2p", "host": "10.0.0.7", "port": 5711, "unbound_store_timeout_s": 30.0},
        {"type": "kvcr", "control_ports": [7000, 7001]},
    ]


def test_check_says_each_tier_in_order_one_line_each() -> None:
    lines = loads(ALL_FOUR).child("host").type.describe(loads(ALL_FOUR).child("host")).splitlines()
    tier_lines = [line for line in lines if line.startswith("then tier")]
    assert [line.split(",")[0] for line in tier_lines] == [f"then tier {n}" for n in range(1, 5)]
    assert "fs: block files in /mnt/kv" in tier_lines[0] and "stores published as KV events" in tier_lines[0]
    assert "p2p:" in tier_lines[2] and "10.0.0.7:5711" in tier_lines[2]


def test_disk_dir_stays_the_short_form_of_one_fs_tier() -> None:
    short = _composition("", extra="      disk_dir: /mnt/kv\n      disk_threads: 2\n").replace("      tiers:\n", "")
    long = _composition("- {type: fs, root_dir: /mnt/kv, n_read_threads: 2, n_write_threads: 2}\n")
    assert _extra(loads(short)) == _extra(loads(long))


@pytest.mark.parametrize("cls", [tiers.FsTier, tiers.ObjTier, tiers.P2pTier, tiers.KvcrTier])
def test_each_tier_struct_is_its_vllm_managers_parameters(cls: type[tiers.Tier]) -> None:
    """Every key the file takes is one the manager accepts, and every parameter of the manager is a
    key (those vLLM fills in itself, and kvcompose's own fields such as the p2p tier's ``pool``,
    aside); the manager is the class vLLM's factory picks for the type."""
    params = set(_manager_parameters(cls)) - {
        "self",
        "offloading_spec",
        "primary_kv_view",
        "tier_type",
        "backpressure_detector",  # vLLM builds it from the entry's `backpressure`
        "kwargs",
    }
    fields = set(cls.__struct_fields__) - {"backpressure"} - cls.own_fields
    assert fields == params


def _manager_parameters(cls: type[tiers.Tier]) -> list[str]:
    """The parameters of the manager vLLM's factory picks for the tier's type: imported, or read
    from its source where the module imports a package not installed here (kvcr's)."""
    module, _, name = cls.manager.rpartition(".")
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, module
    try:
        manager = SecondaryTierFactory.get_tier_class({"type": cls.__struct_config__.tag})
    except ModuleNotFoundError:
        tree = ast.parse(Path(spec.origin).read_text())
        (node,) = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name]
        (init,) = [f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"]
        return [a.arg for a in init.args.args + init.args.kwonlyargs]
    assert f"{manager.__module__}.{manager.__qualname__}" == cls.manager
    return list(inspect.signature(manager.__init__).parameters)


def test_the_object_stores_keys_are_vllms() -> None:
    assert set(tiers.ObjStore.__struct_fields__) == set(inspect.signature(ObjStoreConfig).parameters)


@pytest.mark.parametrize(
    ("entry", "at", "says"),
    [
        ("- {type: fs, root_dir: /kv, n_read_thread: 4}\n", "c.yaml:8:", "unknown key 'n_read_thread'"),
        ("- {type: fs}\n", "c.yaml:8:", "missing required key 'root_dir'"),
        ("- {type: p2p, port: 99999}\n", "c.yaml:8:", "port"),
        ("- {type: fs, root_dir: /kv, locality: local}\n", "c.yaml:8:", "locality"),
        ("- {type: ffs, root_dir: /kv}\n", "c.yaml:8:", "unknown tier type 'ffs'"),
        ("- {type: fs, root_dir: /kv, module_path: my.tiers}\n", "c.yaml:8:", "vLLM ignores module_path"),
        ("- {type: MyTier, module_path: .tiers}\n", "c.yaml:8:", "not a module's full dotted name"),
        ("- fs\n", "c.yaml:8:", "Expected `object`, got `str`"),
        (
            "- {type: p2p, backpressure: {backpressure_cls: EMABackpressureDetector}}\n",
            "c.yaml:8:",
            "refuses backpressure",
        ),
        ("- {type: fs, root_dir: /kv, backpressure: {high: 2}}\n", "c.yaml:8:", "backpressure needs backpressure_cls"),
    ],
)
def test_a_bad_tier_is_refused_at_its_line_saying_why(entry: str, at: str, says: str) -> None:
    message = _refused(_composition(entry))
    assert at in message and says in message, message
    assert "tiers[0]" in message, message


def test_an_unknown_type_suggests_the_close_one_and_names_vllms_tiers() -> None:
    message = _refused(_composition("- {type: ffs, root_dir: /kv}\n"))
    assert "did you mean fs?" in message and "fs, obj, p2p, kvcr" in message and "module_path" in message


def test_disk_dir_and_tiers_together_are_refused_one_way_to_say_it() -> None:
    message = _refused(_composition("- {type: p2p}\n", extra="      disk_dir: /mnt/kv\n"))
    assert "c.yaml:7:" in message and "short form of one fs tier" in message


def test_object_store_credentials_written_in_the_file_are_a_warning() -> None:
    plan = loads(_composition("- type: obj\n  store_config: {bucket: b, endpoint_override: e, secret_key: s3cr3t}\n"))
    (warning,) = plan.warnings
    assert "secret_key" in warning.message and "command line" in warning.message
    assert warning.path[-1] == "secret_key"


def test_two_p2p_tiers_on_one_port_clash() -> None:
    message = _refused(_composition("- {type: p2p, port: 5711}\n- {type: p2p, port: 5711}\n"))
    assert "p2p tier control socket port 5711 (its port option) is also the port of host's" in message
    assert "c.yaml:9:" in message


def test_p2p_tiers_of_two_children_on_their_default_port_clash(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(tiers.P2P_PORT_ENV, raising=False)
    monkeypatch.delenv(tiers.P2P_HOST_ENV, raising=False)
    text = (
        "version: 1\nconnectors:\n"
        "  - {name: a, type: native-offload, options: {cpu_bytes: 1MiB, tiers: [{type: p2p}]}}\n"
        "  - {name: b, type: native-offload, options: {cpu_bytes: 1MiB, tiers: [{type: p2p}]}}\n"
    )
    message = _refused(text)
    assert "port 5710 ($VLLM_P2P_SIDE_CHANNEL_PORT's default)" in message and "port of a's" in message


def test_p2p_tiers_on_different_hosts_or_ports_do_not_clash() -> None:
    plan = loads(_composition("- {type: p2p, port: 5711}\n- {type: p2p, host: 10.0.0.7, port: 5711}\n"))
    assert len(_extra(plan)["secondary_tiers"]) == 2
    loads(_composition("- {type: p2p, port: 5711}\n- {type: p2p, port: 5712}\n"))


def test_a_tier_class_of_your_own_renders_with_its_module_path_and_options() -> None:
    plan = loads(_composition("- {type: MyTier, module_path: my_pkg.tiers, size_gb: 4}\n"))
    (entry,) = _extra(plan)["secondary_tiers"]
    assert entry == {"type": "MyTier", "module_path": "my_pkg.tiers", "size_gb": 4}


@pytest.fixture
def tier_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A module holding a SecondaryTierManager subclass and a class that is not one."""
    (tmp_path / "kvc_test_tiers.py").write_text(
        "from vllm.v1.kv_offload.tiering.base import SecondaryTierManager\n"
        "class GoodTier(SecondaryTierManager):\n    pass\n"
        "class NotATier:\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "kvc_test_tiers"
    sys.modules.pop("kvc_test_tiers", None)


def test_import_modules_imports_a_tier_class_and_checks_it_is_a_tier(tier_module: str) -> None:
    good = _composition(f"- {{type: GoodTier, module_path: {tier_module}}}\n")
    loads(good, import_modules=True)
    bad = _composition(f"- {{type: NotATier, module_path: {tier_module}}}\n")
    assert "has a non-SecondaryTierManager NotATier" in _refused(bad, import_modules=True)
    missing = _composition(f"- {{type: Gone, module_path: {tier_module}}}\n")
    assert "has no Gone" in _refused(missing, import_modules=True)
    loads(missing)  # not imported without the flag: importing runs the module's code


def test_import_modules_says_a_tier_module_that_does_not_import() -> None:
    message = _refused(_composition("- {type: T, module_path: no_such_pkg_kvc.tiers}\n"), import_modules=True)
    assert "c.yaml:8:" in message and "does not import: ModuleNotFoundError" in message


def test_import_modules_says_the_kvcr_package_is_missing() -> None:
    pytest.importorskip("vllm")
    text = _composition("- {type: kvcr}\n")
    loads(text)
    message = _refused(text, import_modules=True)
    assert "the kvcr tier imports the 'kvcr' package, which is not installed here" in message


def test_tiers_pass_msgspec_round_trip_unchanged() -> None:
    """What is rendered converts back into the same struct (nothing dropped or renamed)."""
    for entry in _extra(loads(ALL_FOUR))["secondary_tiers"]:
        cls = tiers.BUILT_IN[entry["type"]]
        assert tiers.render(msgspec.convert(entry, cls)) == entry


def test_a_tiers_kv_events_are_published_through_the_composite_like_the_host_tiers(tmp_path: Path) -> None:
    """vLLM's real scheduler and worker around the composite over a native-offload child whose
    host memory (64 KiB, 8 chunks) spills into an fs tier with ``enable_kv_events`` and a
    ``locality``: the fs tier's stores reach the engine's publisher as ``BlockStored`` of medium
    ``STORAGE`` with that locality, each a 16-token block with its token ids, after its parent."""
    from vllm.distributed.kv_events import BlockStored

    from kvcompose.testing.harness import make_request
    from kvcompose.testing.worker import WorkerHarness

    block = 16
    text = _composition(f"- {{type: fs, root_dir: {tmp_path}, enable_kv_events: true, locality: REMOTE}}\n")
    h = WorkerHarness.from_yaml(
        text.replace("cpu_bytes: 64MiB", "cpu_bytes: 64KiB"),
        num_layers=2,
        num_blocks=24,
        block_size=block,
        kv_events_config={"enable_kv_cache_events": True, "publisher": "null"},
    )
    batches: list[Any] = []
    h.scheduler.kv_event_publisher = type("Pub", (), {"publish": batches.append, "shutdown": lambda self: None})()
    prompts = [[3 + (seed * 131 + i * 17) % 500 for i in range(4 * block + 8)] for seed in range(6)]
    try:
        for seed, p in enumerate(prompts):
            req = make_request(prompt=p, max_tokens=2, block_size=block, request_id=f"r{seed}")
            h.scheduler.add_request(req)
            h.step_until(lambda _, r=req: r.is_finished(), f"r{seed} did not finish", max_steps=20, write_blocks=True)
            h.drain(write_blocks=True)
    finally:
        h.shutdown()
    assert any(tmp_path.rglob("*.bin")), "nothing reached the fs tier"
    stored: set[object] = set()
    on_disk = []
    for batch in batches:
        for e in batch.events:
            if isinstance(e, BlockStored):
                if e.medium == "STORAGE":
                    assert e.locality == "REMOTE" and e.block_size == block and len(e.token_ids) == block, e
                    assert e.parent_block_hash is None or e.parent_block_hash in stored, e
                    on_disk.append(tuple(e.token_ids))
                stored.update(e.block_hashes)
    assert tuple(prompts[0][:block]) in on_disk


def test_a_p2p_tier_makes_the_class_vllms_mapped_for_vllms_proxy_and_router() -> None:
    """With a p2p tier the child's class is vLLM's ``OffloadingConnector`` from the plugin's p2p
    module (the name vLLM knows; it maps ``do_remote_decode`` onto the tier's role keys); without
    one, vLLM's own, no module path."""
    from kvcompose_cpu_offload import p2p

    with_p2p = loads(_composition("- {type: p2p, host: 10.0.0.7, port: 5711}\n")).child("host").vllm_config()
    assert with_p2p["kv_connector"] == "OffloadingConnector" and with_p2p["kv_connector_module_path"] == p2p.__name__
    assert issubclass(p2p.OffloadingConnector, p2p.offloading_connector.OffloadingConnector)
    fs_only = loads(_composition("- {type: fs, root_dir: /kv}\n")).child("host").vllm_config()
    assert "kv_connector_module_path" not in fs_only
    extra = with_p2p["kv_connector_extra_config"]
    assert p2p.p2p_address(extra, 0) == ("10.0.0.7", 5711) and p2p.p2p_address(extra, 2) == ("10.0.0.7", 5713)
    assert p2p.p2p_address({"secondary_tiers": [{"type": "fs", "root_dir": "/kv"}]}, 0) is None


def test_p2p_address_takes_vllms_environment_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvcompose_cpu_offload import p2p

    monkeypatch.setenv(tiers.P2P_HOST_ENV, "10.9.8.7")
    monkeypatch.setenv(tiers.P2P_PORT_ENV, "6000")
    assert p2p.p2p_address({"secondary_tiers": [{"type": "p2p"}]}, 1) == ("10.9.8.7", 6001)


def test_a_p2p_tier_on_the_nixl_side_channels_port_clashes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_NIXL_SIDE_CHANNEL_HOST", raising=False)
    pd = (
        "  - {name: pd, type: nixl, role: consumer, options: {side_channel_host: 127.0.0.1, side_channel_port: PORT}}\n"
    )
    text = _composition("- {type: p2p, host: 127.0.0.1, port: 5711}\n") + pd.replace("PORT", "5711")
    message = _refused(text)
    assert "NIXL side channel port 5711 (its side_channel_port) is also the port of host's p2p tier" in message
    assert "c.yaml:9:" in message
    loads(_composition("- {type: p2p, host: 127.0.0.1, port: 5711}\n") + pd.replace("PORT", "5712"))


def test_the_p2p_key_renders_for_the_p2p_class_and_is_refused_without_a_p2p_tier(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvcompose_cpu_offload.p2p import P2P_KEY_ENV_KEY

    monkeypatch.setenv("KVCOMPOSE_PD_KEY", "k" * 64)
    keyed = _composition("- {type: p2p}\n", extra="      key_env: KVCOMPOSE_PD_KEY\n")
    extra = _extra(loads(keyed))
    assert extra[P2P_KEY_ENV_KEY] == "KVCOMPOSE_PD_KEY" and "key_env" not in extra
    message = _refused(_composition("- {type: fs, root_dir: /kv}\n", extra="      key_env: KVCOMPOSE_PD_KEY\n"))
    assert "c.yaml:7:" in message and "this child has no p2p tier" in message
    monkeypatch.delenv("KVCOMPOSE_PD_KEY")
    (warning,) = loads(keyed).warnings
    assert "KVCOMPOSE_PD_KEY" in warning.message and "stops at start" in warning.message


# -- the fs tier as the fleet's shared directory (issue 62, item 3)


def test_check_says_what_instances_sharing_the_fs_directory_must_agree_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "4242")
    plan = loads(_composition("- {type: fs, root_dir: /mnt/kv}\n"))
    lines = [line.strip() for line in plan.child("host").type.brief(plan.child("host")).splitlines()]
    shared = [line for line in lines if line.startswith("fs:")]
    assert len(shared) == 3, lines
    assert tiers.FS_LAYOUT in shared[0] and "model's name" in shared[0]
    assert "PYTHONHASHSEED=4242" in shared[1] and "sha256" in shared[1]
    assert "whoever may write the directory" in shared[2]


@pytest.mark.parametrize("short", [False, True], ids=["tiers", "disk_dir"])
def test_a_shared_directory_any_user_may_write_is_refused_at_its_key(tmp_path: Path, short: bool) -> None:
    kv = tmp_path / "kv"
    kv.mkdir()
    kv.chmod(0o777)
    text = (
        _composition("", extra=f"      disk_dir: {kv}\n").replace("      tiers:\n", "")
        if short
        else _composition(f"- {{type: fs, root_dir: {kv}}}\n")
    )
    message = _refused(text)
    assert ("c.yaml:7:" if short else "c.yaml:8:") in message and "may be written by any user" in message, message
    assert f"chmod o-w {kv}" in message
    kv.chmod(0o770)  # the control: the fleet's group may write it
    assert loads(text).child("host").vllm_config()


def test_a_relative_or_non_directory_root_is_said(tmp_path: Path) -> None:
    plan = loads(_composition("- {type: fs, root_dir: kv-cache}\n"))
    (warning,) = plan.warnings
    assert "relative" in warning.message and warning.path[-1] == "root_dir"
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    assert "is not a directory" in _refused(_composition(f"- {{type: fs, root_dir: {not_a_dir}}}\n"))
