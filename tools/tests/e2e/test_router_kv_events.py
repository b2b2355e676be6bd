"""KV events replayed into vllm-router's own indexer: its real binary, regular mode, ``kv_aware``,
in front of two stand-in workers (no engine; :mod:`kvcompose_tools.e2e.kv_replay`).

What kept the router from matching a composed engine's events, each checked here against the
router itself: a topic on the publisher (its static sources take in only batches without one),
and a host tier's stores without token ids or published before their parents (vLLM's lazy
SimpleCPUOffload; the composite now completes and orders them, kvcompose/vllm/events.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

from kvcompose.testing.harness import make_request
from kvcompose.testing.worker import WorkerHarness
from kvcompose_tools.e2e.events import TOPIC
from kvcompose_tools.e2e.kv_replay import encode, load_recording, replay, without_stores

DATA = Path(__file__).parent / "data"
#: Recorded from a real server of pd-decode.yaml, its host tier lazy
#: (tools/tests/engine/test_router_kv_events.py with KVCOMPOSE_RECORD_KV_EVENTS).
RECORDING = DATA / "pd_decode_lazy_events.json"
BS = 32


def chain(tokens: list[int], medium: str = "GPU") -> list[BlockStored]:
    """One store per full block of ``tokens``, each naming its parent, as vLLM publishes them."""
    n = len(tokens) // BS
    return [
        BlockStored(block_hashes=[9000 + i], parent_block_hash=9000 + i - 1 if i else None,
                    token_ids=tokens[i * BS : (i + 1) * BS], block_size=BS, lora_id=None, medium=medium,
                    lora_name=None)
        for i in range(n)
    ]  # fmt: skip


PROMPT = [100 + (i * 13) % 700 for i in range(6 * BS)]


def test_the_router_credits_a_prefix_its_worker_published_without_a_topic(tmp_path: Path) -> None:
    assert TOPIC == ""  # what the kit's servers publish on (kvcompose_tools.e2e.events)
    result = replay([encode(chain(PROMPT))], [PROMPT], tmp_path, block_size=BS, topic=TOPIC)
    (decision,) = result.decisions
    assert result.batches_seen == 1
    assert decision.worker == result.workers[0] and decision.credited_prefix_tokens >= 5 * BS


def test_the_router_takes_in_nothing_published_on_a_topic(tmp_path: Path) -> None:
    """vllm-router 0.1.17's static sources subscribe to no topic; it has no option to name one."""
    result = replay([encode(chain(PROMPT))], [PROMPT], tmp_path, block_size=BS, topic="kv-events")
    (decision,) = result.decisions
    assert result.batches_seen == 0 and decision.credited_prefix_tokens == 0


def test_stores_without_token_ids_are_never_credited(tmp_path: Path) -> None:
    """What vLLM's lazy SimpleCPUOffload publishes, as it publishes it: the router drops them."""
    bare = chain(PROMPT, "CPU")
    for e in bare:
        e.token_ids, e.parent_block_hash = [], None
    result = replay([encode(reversed(bare))], [PROMPT], tmp_path, block_size=BS)
    assert result.decisions[0].credited_prefix_tokens == 0


def test_a_device_removal_leaves_the_host_tiers_copy_credited(tmp_path: Path) -> None:
    """Removals are per medium: the device evicting a block the host tier stored leaves the
    host's entry, credited at the host weight."""
    device, host = chain(PROMPT), chain(PROMPT, "CPU")
    removed = BlockRemoved(block_hashes=[e.block_hashes[0] for e in device], medium="GPU")
    result = replay([encode(device), encode(host), encode([removed])], [PROMPT], tmp_path, block_size=BS)
    assert result.decisions[0].credited_prefix_tokens == int(0.8 * len(PROMPT))


def test_a_device_prefix_cache_reset_makes_the_router_forget_the_host_tier_too(tmp_path: Path) -> None:
    """vLLM's AllBlocksCleared carries no medium and vllm-router 0.1.17 drops every entry of the
    worker: after a device reset it no longer credits what the host tier still holds. A router
    release that keeps them shows up here. Told by the relay as the removal of the device's
    blocks (kvcompose.relay.DeviceBlocks), the host tier's copy stays credited."""
    from kvcompose.relay import DeviceBlocks

    events = [chain(PROMPT), chain(PROMPT, "CPU"), [AllBlocksCleared()]]
    result = replay([encode(e) for e in events], [PROMPT], tmp_path, block_size=BS)
    assert result.batches_seen == 3 and result.decisions[0].credited_prefix_tokens == 0
    device = DeviceBlocks()
    result = replay([encode(device.follow(list(e))) for e in events], [PROMPT], tmp_path, block_size=BS)
    assert result.decisions[0].credited_prefix_tokens == int(0.8 * len(PROMPT))


def harness_events(lazy: bool) -> tuple[list[bytes], list[int]]:
    """A composed cpu-offload tier's events from vLLM's real scheduler (the kit's harness): a
    prompt, then three that push it out of the 12-block device cache; the batches as vLLM's
    publisher encodes them, and the first prompt."""
    yaml = f"""
version: 1
connectors:
  - name: host
    type: cpu-offload
    options: {{cpu_bytes: 1MiB, lazy: {str(lazy).lower()}}}
rules: {{load: first-wins, store: all, metadata: merge}}
"""
    events = {"enable_kv_cache_events": True, "publisher": "null"}
    h = WorkerHarness.from_yaml(yaml, num_layers=2, num_blocks=12, block_size=16, kv_events_config=events)
    payloads: list[bytes] = []

    class Recorder:
        def publish(self, batch: object) -> None:
            payloads.append(encode(batch.events, batch.ts))  # type: ignore[attr-defined]

        def shutdown(self) -> None:
            pass

    prompts = [[3 + (seed * 131 + i * 17) % 500 for i in range(4 * 16 + 8)] for seed in range(4)]
    try:
        h.scheduler.kv_event_publisher = Recorder()  # type: ignore[assignment]
        for i, p in enumerate(prompts):
            req = make_request(prompt=p, max_tokens=2, block_size=16, request_id=f"r{i}")
            h.scheduler.add_request(req)
            h.step_until(lambda _, r=req: r.is_finished(), "not finished", max_steps=20, write_blocks=True)
            h.drain(write_blocks=True)
    finally:
        h.shutdown()
    return payloads, prompts[0]


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_a_composed_host_tiers_prefix_is_credited_at_the_host_weight(tmp_path: Path, lazy: bool) -> None:
    """The first prompt's device blocks were evicted: only the host tier holds its 4 blocks (64
    tokens), which the router credits at ``--kv-penalty-host`` (0.8)."""
    payloads, first = harness_events(lazy)
    result = replay(payloads, [first], tmp_path, block_size=16)
    (decision,) = result.decisions
    assert decision.worker == result.workers[0], result.log[-3000:]
    assert decision.credited_prefix_tokens == int(0.8 * 64), decision


@pytest.mark.skipif(not RECORDING.exists(), reason="no recording of a real engine's events")
def test_a_real_composed_engines_recorded_events_are_credited(tmp_path: Path) -> None:
    payloads, prompts, about = load_recording(RECORDING)
    result = replay(payloads, prompts, tmp_path, block_size=about["block_size"])
    assert result.batches_seen >= 1
    (decision,) = result.decisions
    assert decision.worker == result.workers[0], result.log[-3000:]
    # The device kept the first prompt's blocks 0-5 (192 tokens; 4 removals), the host tier all 10.
    # Without the composite's completion the host stores had no token ids and the router credited
    # the device's 192 alone (measured on a server run without it); with it, the host's blocks
    # 6-9 too, at 0.8.
    assert decision.credited_prefix_tokens > 192, decision
    # the control: the same batches less the host tier's stores credit the device's 192 alone
    control = replay(without_stores(payloads, "CPU"), prompts, tmp_path, block_size=about["block_size"])
    assert control.decisions[0].credited_prefix_tokens == 192, control.decisions
    # the same batches on a topic: nothing taken in, nothing credited (the docs' first finding)
    result = replay(payloads, prompts, tmp_path, block_size=about["block_size"], topic="kv-events")
    assert result.batches_seen == 0 and all(d.credited_prefix_tokens == 0 for d in result.decisions)


@pytest.mark.skipif(not RECORDING.exists(), reason="no recording of a real engine's events")
def test_a_cpu_engines_32_token_blocks_are_credited_in_16_token_blocks_through_the_relay(tmp_path: Path) -> None:
    """vllm-router 0.1.17's P/D ``kv_aware`` indexes 16-token blocks only (a batch of other
    stores is rejected whole) and vLLM's CPU attention takes multiples of 32: the recording as
    :func:`kvcompose.relay.split_events` tells it is credited at 16 tokens a block; as published,
    nothing."""
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch

    from kvcompose.relay import split_events

    payloads, prompts, about = load_recording(RECORDING)
    assert about["block_size"] == 32
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    split = [encode(split_events(decoder.decode(p).events, 16, 32)) for p in payloads]
    (decision,) = replay(split, prompts, tmp_path, block_size=16).decisions
    assert decision.credited_prefix_tokens > 192, decision  # as many as at 32 (the test above)
    (decision,) = replay(payloads, prompts, tmp_path, block_size=16).decisions
    assert decision.credited_prefix_tokens == 0, decision
