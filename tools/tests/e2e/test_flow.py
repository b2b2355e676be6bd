"""What the demo and engine tests read off one request's counters (no engine)."""

from __future__ import annotations

from kvcompose_tools.e2e.flow import Served, next_turn


def served(loaded: dict[str, int], counters: dict[str, float]) -> Served:
    return Served("t", 705, [1], [0.0], "length", loaded, 0, 0, 0, 0, 0.1, None, counters)


def test_a_request_served_by_two_children_names_both_in_composition_order() -> None:
    s = served({"host": 288, "pd": 417}, {})
    assert s.children == ("host", "pd")
    assert s.loaded_tokens == 705
    assert s.served_by() == "host 288 + pd 417"
    assert served({}, {}).served_by() == "none" and served({}, {}).children == ()


def test_cached_by_source_is_vllms_split_without_device_hits() -> None:
    counters = {
        "vllm:prompt_tokens_cached_by_source{source=host}": 288.0,
        "vllm:prompt_tokens_cached_by_source{source=p2p}": 417.0,
        "vllm:prompt_tokens_cached_by_source{source=device}": 32.0,
        "vllm:prompt_tokens_by_source{source=local_compute}": 1.0,
    }
    assert served({}, counters).cached_by_source() == {"host": 288, "p2p": 417}


def test_next_turn_is_prompt_then_answer_then_message() -> None:
    assert next_turn([1, 2], [3], [4, 5]) == [1, 2, 3, 4, 5]
