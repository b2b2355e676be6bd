"""The ``progress_delay_us`` option: NIXL agents stop busy-spinning their progress thread."""

from __future__ import annotations

import pytest

from kvcompose_nixl.progress import calm_progress_thread


@pytest.fixture
def api():  # type: ignore[no-untyped-def]
    api = pytest.importorskip("nixl._api")
    yield api
    calm_progress_thread(0)  # leave the process as NIXL made it


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


def test_option_renders_to_the_key_the_connector_reads() -> None:
    from kvcompose.compose import loads

    plan = loads(
        "version: 1\nconnectors:\n  - {name: pd, type: nixl, role: consumer, options: {progress_delay_us: 100}}\n"
    )
    assert plan.children[0].vllm_config()["kv_connector_extra_config"]["kvcompose_progress_delay_us"] == 100
