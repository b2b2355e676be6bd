"""NIXL agent settings vLLM has no option for: ``progress_delay_us`` and ``ucx_error_handling``
(kvcompose_nixl.patches)."""

from __future__ import annotations

from typing import Any

import pytest

from kvcompose_nixl.patches import UCX_ERROR_HANDLING_PARAM, calm_progress_thread, set_ucx_error_handling


@pytest.fixture
def api():  # type: ignore[no-untyped-def]
    api = pytest.importorskip("nixl._api")
    yield api
    calm_progress_thread(0)  # leave the process as NIXL made it
    set_ucx_error_handling(None)


def test_agent_config_takes_the_delay_nixl_would_overwrite_with_zero(api) -> None:  # type: ignore[no-untyped-def]
    assert calm_progress_thread(250)
    cfg = api.nixlBind.nixlAgentConfig()
    cfg.pthrDelay = 0  # what nixl._api.nixl_agent does
    assert cfg.pthrDelay == 250


def test_zero_restores_nixls_config_class(api) -> None:  # type: ignore[no-untyped-def]
    original = api.nixlBind.nixlAgentConfig
    calm_progress_thread(100)
    calm_progress_thread(100)  # applying twice wraps the original once
    assert api.nixlBind.nixlAgentConfig.__mro__[1] is original
    calm_progress_thread(0)
    assert api.nixlBind.nixlAgentConfig is original
    cfg = original()
    cfg.pthrDelay = 0
    assert cfg.pthrDelay == 0


def test_a_real_agent_gets_the_error_handling_mode_on_its_ucx_backend(api) -> None:  # type: ignore[no-untyped-def]
    """The agent vLLM builds (``nixl_agent(name, nixl_agent_config(...))``) creates its UCX
    backend with the mode; NIXL reports the backend's parameters back."""
    seen: list[dict[str, str]] = []
    original = api.nixl_agent.create_backend

    def spy(self: Any, backend: str, params: dict[str, str] | None = None) -> Any:
        seen.append(dict(params or {}))
        return original(self, backend, params or {})

    api.nixl_agent.create_backend = spy
    try:
        assert set_ucx_error_handling("none")
        agent = api.nixl_agent("kvcompose-test-errmode", api.nixl_agent_config(backends=["UCX"], num_threads=2))
    finally:
        set_ucx_error_handling(None)
        assert api.nixl_agent.create_backend is spy  # None restored what was there before
        api.nixl_agent.create_backend = original
    assert seen == [{"num_threads": "2", UCX_ERROR_HANDLING_PARAM: "none"}]
    assert agent.get_backend_params("UCX") == {"num_threads": "2", UCX_ERROR_HANDLING_PARAM: "none"}


def test_applying_twice_wraps_nixls_create_backend_once(api) -> None:  # type: ignore[no-untyped-def]
    original = api.nixl_agent.create_backend
    set_ucx_error_handling("none")
    set_ucx_error_handling("peer")
    assert api.nixl_agent.create_backend._kvcompose_base is original
    set_ucx_error_handling(None)
    assert api.nixl_agent.create_backend is original


@pytest.mark.parametrize(
    ("option", "value", "key"),
    [
        ("progress_delay_us", 100, "kvcompose_progress_delay_us"),
        ("ucx_error_handling", "none", "kvcompose_ucx_error_handling"),
    ],
)
def test_option_renders_to_the_key_the_connector_reads(option: str, value: object, key: str) -> None:
    from kvcompose.compose import loads

    plan = loads(
        f"version: 1\nconnectors:\n  - {{name: pd, type: nixl, role: consumer, options: {{{option}: {value}}}}}\n"
    )
    assert plan.children[0].vllm_config()["kv_connector_extra_config"][key] == value


def test_error_handling_without_ucx_is_refused_with_where_and_why() -> None:
    from kvcompose.compose import loads
    from kvcompose.errors import CompositionError

    with pytest.raises(CompositionError) as e:
        loads(
            "version: 1\nconnectors:\n  - {name: pd, type: nixl, role: consumer,"
            " options: {backends: [LIBFABRIC], ucx_error_handling: none}}\n"
        )
    assert "connectors[0].options.ucx_error_handling" in str(e.value) and "no UCX" in str(e.value)
    assert ":3:" in str(e.value)  # the line of the child's options


def test_every_setting_the_plugin_applies_exists_in_the_installed_nixl() -> None:
    """The settings above patch NIXL's Python wrapper and name a UCX plugin parameter: a NIXL
    that renamed one would make them silent no-ops (docs/versions.md, NIXL)."""
    from importlib import metadata

    from kvcompose.versions import NIXL, distribution_version, providers_of
    from kvcompose_nixl.patches import missing_settings

    pytest.importorskip("nixl._api")
    installed = [distribution_version(d) for d in providers_of("nixl", metadata.packages_distributions())]
    assert installed and all(NIXL.contains(v) for v in installed), installed
    assert missing_settings() == []


def test_a_nixl_without_a_setting_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    api = pytest.importorskip("nixl._api")
    from kvcompose_nixl import patches

    monkeypatch.setattr(patches, "_ucx_params", lambda api: {"num_workers": "1"})
    monkeypatch.setattr(api.nixlBind, "nixlAgentConfig", type("OldConfig", (), {}))
    assert patches.missing_settings() == [
        "progress_delay_us: nixl._api.nixlBind.nixlAgentConfig has no settable pthrDelay",
        "ucx_error_handling: NIXL's UCX plugin takes no 'ucx_error_handling_mode' parameter",
    ]


def test_a_setting_whose_nixl_name_is_missing_stops_the_connector_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """The connector applies the settings in its ``__init__``: a NIXL without the name they patch
    stops it there by name, instead of taking the option and changing nothing."""
    api = pytest.importorskip("nixl._api")
    from kvcompose_nixl.patches import MissingName

    monkeypatch.setattr(api.nixlBind, "nixlAgentConfig", type("OldConfig", (), {}))
    with pytest.raises(MissingName, match="progress_delay_us: .*no settable pthrDelay"):
        calm_progress_thread(100)
    assert calm_progress_thread(0)  # restoring NIXL's own needs no name

    def create_backend(self: object, name: str) -> None: ...

    monkeypatch.setattr(api.nixl_agent, "create_backend", create_backend)
    with pytest.raises(MissingName, match=r"ucx_error_handling: .*create_backend\(self, backend, initParams\)"):
        set_ucx_error_handling("none")
