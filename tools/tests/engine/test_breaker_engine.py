"""``faults: {use: breaker}`` in a real vLLM engine (marker ``engine``): the kit's ``faulty`` type,
composed with the real cpu-offload tier, fails for a while on the scheduler and on the worker,
then is healthy; the breaker bypasses it, probes it, re-enables it, and every answer equals a
baseline engine's without a connector.

The engine process gets the ``faulty`` type the way a user gets a plugin: an installed
distribution's ``kvcompose`` entry point (:func:`kvcompose.testing.types.install_entry_point`).
Run under ``flock /tmp/kvcompose-engines.lock`` on a shared machine.
"""

from __future__ import annotations

import re
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcompose.testing.types import install_entry_point
from kvcompose_tools.e2e.flow import token_prompt
from kvcompose_tools.e2e.model import make_model
from kvcompose_tools.e2e.node import EngineNode, wait_all_ready
from kvcompose_tools.e2e.spec import EngineSpec

pytestmark = pytest.mark.engine

MAX_TOKENS = 16
GAUGE = "vllm:kvcompose_breaker_state{child=flaky}"
#: flaky answers two lookups, then raises in three (scheduler half); its worker half raises
#: once in wait_for_save after 40 calls. One failure opens the breaker (failures: 1).
COMPOSITION = """
version: 1
connectors:
  - name: flaky
    type: faulty
    options:
      matched_tokens: 0
      faults:
        - {call: get_num_new_matched_tokens, action: raise, after: 2, times: 3}
        - {call: wait_for_save, action: raise, after: 40, times: 1}
  - name: host
    type: cpu-offload
    options: {cpu_bytes: 64MiB}
rules:
  faults: {use: breaker, children: [flaky], failures: 1, cooldown_s: 2, successes: 2}
"""
#: Every fault fired: three on the scheduler, one on the worker, each opening the breaker once.
OPENS = 4


@pytest.fixture(scope="module")
def engines(baseline: EngineNode) -> Iterator[tuple[EngineNode, EngineNode]]:
    with tempfile.TemporaryDirectory(prefix="kvcompose-e2e-breaker-") as tmp:
        root = Path(tmp)
        composition = root / "breaker.yaml"
        composition.write_text(COMPOSITION)
        kit_types = install_entry_point(root / "site")
        model = str(make_model(0))
        composed = EngineNode(EngineSpec("breaker", model, str(composition)), root / "logs", kit_types)
        try:
            wait_all_ready([composed])
            yield baseline, composed
        finally:
            composed.close()


def changes(node: EngineNode) -> list[str]:
    """The breaker's state changes of ``flaky``, in the order the engine logged them."""
    return re.findall(r"connector flaky: breaker (open|half-open|closed):", node.log_path.read_text(errors="replace"))


def test_a_child_failing_for_a_while_is_bypassed_probed_and_re_enabled_with_correct_outputs(
    engines: tuple[EngineNode, EngineNode],
) -> None:
    baseline, composed = engines
    gauge: list[float | None] = []
    compared = 0

    def ask(prompt: list[int]) -> None:
        nonlocal compared
        (got,) = composed.generate([prompt], MAX_TOKENS)
        (want,) = baseline.generate([prompt], MAX_TOKENS)
        assert got["token_ids"] == want["token_ids"] and got["logprobs"] == want["logprobs"], compared
        compared += 1
        gauge.append(composed.metrics().get(GAUGE))

    deadline = time.monotonic() + 400  # a hang guard, not a timing assertion
    seed = 100
    while changes(composed).count("open") < OPENS or gauge[-1] != 0:
        assert time.monotonic() < deadline, (changes(composed), gauge)
        ask(token_prompt(seed, 200))
        seed += 1
    # The host tier keeps serving throughout: a prompt pushed out of the device cache is loaded
    # from it, and the answer is still the baseline's.
    assert composed.reset_prefix_cache()
    ask(token_prompt(100, 200))
    metrics = composed.metrics()
    assert metrics.get("vllm:kvcompose_loads{child=host}", 0) >= 1, metrics

    log = changes(composed)
    print(f"\nrequests compared with the baseline: {compared}, all equal")
    print(f"breaker state changes of flaky, in log order: {log}")
    print(f"{GAUGE} after each request: {gauge}")
    assert log.count("open") == OPENS  # one per fault: each is logged once
    assert log.count("half-open") == OPENS  # every open child was probed again
    assert 1 <= log.count("closed") <= OPENS
    assert 2 in gauge  # open was exported
    assert gauge[-1] == 0  # closed everywhere: re-enabled
