"""Sleep mode (vLLM 0.33's connector API): the composite supports it when every child does, as
vLLM's MultiConnector decides; ``unregister_kv_caches`` and ``restore_kv_caches`` reach every
child (``kvcompose check``'s line: tests/cli/test_check_sleep_mode.py).

On vLLM 0.32 the calls are forwarded too (vLLM never makes them), and the composite's
class-level answer is asked of the same classes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

from kvcompose.compose import loads
from kvcompose.testing import inspector
from kvcompose.testing.versions import HAS_SLEEP_MODE
from kvcompose.vllm.args import kv_transfer_config
from kvcompose.vllm.children import sleep_mode_support
from kvcompose.vllm.connector import KVComposeConnector

Factory = Callable[..., Any]

COMPOSITION = """
version: 1
connectors:
  - {{name: a, type: record, options: {{sleep_mode: {a}}}}}
  - {{name: b, type: record, options: {{sleep_mode: {b}}}}}
"""


def test_unregister_and_restore_reach_every_child_in_order(kvcompose_worker: Factory) -> None:
    conn = kvcompose_worker(COMPOSITION.format(a="true", b="true"), register=False).connector
    conn.unregister_kv_caches()
    conn.restore_kv_caches()
    for name in ("a", "b"):
        sleep_calls = [
            m for m, _ in inspector.child(conn, name).calls if m in ("unregister_kv_caches", "restore_kv_caches")
        ]
        assert sleep_calls == ["unregister_kv_caches", "restore_kv_caches"], name


def test_a_bypassed_child_still_unregisters(kvcompose_worker: Factory) -> None:
    """A child the faults rule bypassed still holds its registrations: sleep reaches it too."""
    text = COMPOSITION.format(a="true", b="true") + "rules: {faults: {use: isolate, children: [a]}}\n"
    conn = kvcompose_worker(text, register=False).connector
    inspector.bypass(conn, "a")
    conn.unregister_kv_caches()
    assert inspector.child(conn, "a").called("unregister_kv_caches") == [()]


def test_a_child_without_the_calls_is_passed_over(kvcompose_worker: Factory) -> None:
    """A child class written for vLLM 0.32 has no sleep-mode calls: the others still get them."""
    conn = kvcompose_worker(COMPOSITION.format(a="true", b="true"), register=False).connector
    inspector.child(conn, "a").unregister_kv_caches = None  # what a 0.32 class without the method looks like
    conn.unregister_kv_caches()
    assert inspector.child(conn, "b").called("unregister_kv_caches") == [()]


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [("true", "true", True), ("true", "false", False), ("false", "false", False)],
)
def test_sleep_mode_needs_every_child(a: str, b: str, expected: bool) -> None:
    ktc = KVTransferConfig(**kv_transfer_config(loads(COMPOSITION.format(a=a, b=b))))
    # What vLLM 0.33 asks at engine start (config/vllm.py): the class the factory loads.
    assert KVConnectorFactory.get_connector_class(ktc) is KVComposeConnector
    assert KVComposeConnector.supports_sleep_mode(ktc) is expected
    assert sleep_mode_support(ktc) == {"a": a == "true", "b": b == "true"}


@pytest.mark.skipif(not HAS_SLEEP_MODE, reason="this vLLM's connector API has no sleep mode (0.33 added it)")
@pytest.mark.parametrize(("b", "accepted"), [("true", True), ("false", False)])
def test_vllms_own_config_check_asks_the_composite(b: str, accepted: bool) -> None:
    """vLLM 0.33's VllmConfig refuses --enable-sleep-mode when the connector class says no."""
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, VllmConfig

    from kvcompose.testing.kv import TINY_MODEL

    ktc = KVTransferConfig(**kv_transfer_config(loads(COMPOSITION.format(a="true", b=b))))
    model = ModelConfig(model=str(TINY_MODEL), skip_tokenizer_init=True, dtype="float32", max_model_len=512)
    model.enable_sleep_mode = True  # set after validation: ModelConfig refuses it on the CPU platform
    cfg = {"model_config": model, "cache_config": CacheConfig(block_size=16), "device_config": DeviceConfig("cpu")}
    if accepted:
        VllmConfig(kv_transfer_config=ktc, **cfg)
        return
    with pytest.raises(ValueError, match="MultiConnector does not support sleep mode"):
        VllmConfig(kv_transfer_config=ktc, **cfg)
