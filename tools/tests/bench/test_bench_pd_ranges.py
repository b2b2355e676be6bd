"""The range-loads engine benchmark without engines: its workload, compositions, figures and targets."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvcompose_tools.bench.pd_ranges import compositions, engines, figures, workload
from kvcompose_tools.bench.pd_ranges.figures import Served, build_result
from kvcompose_tools.bench.pd_ranges.workload import Workload, make_workload
from kvcompose_tools.e2e.spec import BLOCK_SIZE
from kvcompose_tools.e2e.stats import quantile


def test_workload_is_seeded_mixed_and_fits_the_engines() -> None:
    w = make_workload()
    assert w == make_workload() and w != make_workload(seed=workload.SEED + 1)
    assert (w.conversations, w.turns) == (workload.CONVERSATIONS, workload.TURNS)
    assert w.conversations >= 8 and w.turns >= 4
    lengths = [len(m) for conv in w.messages for m in conv]
    lo, hi = workload.MESSAGE_TOKENS
    assert all(lo <= n <= hi for n in lengths) and len(set(lengths)) > len(lengths) // 2  # mixed
    assert len({m[:8] for conv in w.messages for m in conv}) == len(lengths)  # every message new
    from kvcompose_tools.e2e.spec import MAX_MODEL_LEN

    assert w.longest_prompt() + w.answer_tokens <= MAX_MODEL_LEN
    # The host tier holds every conversation whole (tiny model: 1 KiB of KV per token).
    assert w.kv_blocks() * BLOCK_SIZE * 1024 <= compositions.CPU_BYTES
    with pytest.raises(ValueError, match="max_model_len"):
        make_workload(turns=6, lengths=(200, 200))


def test_turns_go_round_robin_and_each_prompt_extends_the_last_with_its_answer() -> None:
    w = Workload((((1, 2), (3,), (4, 5, 6)), ((7,), (8, 9), (10,))), answer_tokens=2)
    assert w.order() == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    answers = {(0, 0): [90, 91], (0, 1): [92], (1, 0): [93, 94], (1, 1): [95, 96]}
    assert w.prompt(0, 0, {}) == [1, 2]
    assert w.prompt(0, 1, answers) == [1, 2, 90, 91, 3]
    assert w.prompt(0, 2, answers) == [1, 2, 90, 91, 3, 92, 4, 5, 6]
    assert w.prompt(1, 2, answers) == [7, 93, 94, 8, 9, 95, 96, 10]
    assert w.longest_prompt() == 6 + 2 * 2
    with pytest.raises(KeyError):
        w.prompt(1, 1, {})  # an earlier answer is needed


def test_the_three_decode_compositions_resolve_as_described() -> None:
    from kvcompose.compose import loads

    got = {}
    for name in compositions.COMPOSITIONS:
        plan = loads(compositions.decode_composition(name))
        got[name] = (plan.names, plan.rules["load"].name, [c.type.name for c in plan.children])
    assert got == {
        "pd-first": (("pd", "host"), "first-wins", ["nixl", "cpu-offload"]),
        "host-first": (("host", "pd"), "first-wins", ["cpu-offload", "nixl"]),
        "ranges": (("host", "pd"), "ranges", ["cpu-offload", "nixl"]),
    }
    assert compositions.PREFILL_YAML.exists()
    # Engines start in order, then reversed: the same composition never first in every pass.


BLOCK = BLOCK_SIZE * 1024  # bytes of one block of the tiny model


def served(name: str, turn: int, prompt: int, host: int, computed: int, ttft_ms: float, answer: Any = None) -> Served:
    """One request as a composition would serve it: NIXL pulls every block host did not load
    unless the composition computes the rest itself (host-first with a host hit)."""
    pulled = 0 if computed > 1 else -(-prompt // BLOCK_SIZE) - host // BLOCK_SIZE
    return Served(
        name,
        1,
        0,
        turn,
        prompt,
        host,
        prompt - host if pulled else 0,
        pulled * BLOCK,
        computed,
        ttft_ms / 1e3,
        list(answer or [turn]),
    )


def three(ttft: dict[str, list[float]], answers: dict[str, list[Any]] | None = None) -> list[Served]:
    """Two turns (100 then 260 prompt tokens; host holds 96 tokens at turn 2) per composition."""
    answers = answers or {}
    out = []
    for name in compositions.COMPOSITIONS:
        a = answers.get(name, [None, None])
        t1, t2 = ttft[name]
        out.append(served(name, 0, 100, 0, 0, t1, a[0]))
        if name == "pd-first":
            out.append(served(name, 1, 260, 0, 0, t2, a[1]))
        elif name == "host-first":
            out.append(served(name, 1, 260, 96, 164, t2, a[1]))
        else:
            out.append(served(name, 1, 260, 96, 0, t2, a[1]))
    return out


REFERENCE = {(0, 0, False): [0], (0, 1, False): [1]}


def test_figures_ratios_and_targets_from_given_numbers(tmp_path: Path) -> None:
    r = build_result(three({"pd-first": [10, 20], "host-first": [10, 15], "ranges": [9, 12]}), REFERENCE, 1)
    t = r.totals
    # Prompt blocks: 4 + 9 = 13; pd-first pulls them all, ranges all but host's 3.
    assert (t["pd-first"].nixl_bytes, t["ranges"].nixl_bytes, t["host-first"].nixl_bytes) == (
        13 * BLOCK,
        10 * BLOCK,
        4 * BLOCK,
    )
    assert t["ranges"].host_fraction_blocks == pytest.approx(3 / 13)
    assert t["ranges"].host_fraction_tokens == pytest.approx(96 / 360)
    assert (t["host-first"].computed_tokens, t["host-first"].computed_max) == (164, 164)
    assert t["ranges"].ttft.median == pytest.approx(0.0105)
    by = {(x.case, x.baseline): x for x in r.ratios}
    assert by[("NIXL bytes", "pd-first")].by_median == pytest.approx(10 / 13)
    assert by[("NIXL bytes", "host-first")].by_median == pytest.approx(10 / 4)
    assert ("decode-computed tokens", "pd-first") not in by  # nothing to divide by
    assert by[("decode-computed tokens", "host-first")].by_median == 0
    assert by[("TTFT", "host-first")].by_median == pytest.approx(10.5 / 12.5)
    assert by[("TTFT", "host-first")].by_min == pytest.approx(9 / 10)
    # The exact split meets the NIXL target with equality: 1 - 3/13 in blocks.
    nixl, host, computed, ttft = r.target.items  # type: ignore[attr-defined]
    assert (host.op, host.baseline) == (">=", "host-first") and by[("host-loaded tokens", "host-first")].by_median == 1
    assert nixl.value == pytest.approx(10 / 13) and nixl.baseline == "pd-first"
    assert computed.baseline == figures.ONE_BLOCK
    assert ttft.baseline == "host-first"  # the lower median of the two others
    assert r.target_met is True
    table = r.table()
    for text in ("pd-first", "host-first", "ranges/pd-first", "0.769 ok", "answers: identical", "targets met"):
        assert text in table, text
    data = json.loads(r.write(tmp_path).read_text())
    assert data["target"]["met"] is True and len(data["target"]["targets"]) == 4
    assert data["totals"]["ranges"]["nixl_bytes"] == 10 * BLOCK
    assert data["totals"]["pd-first"]["ttft_s"]["p90"] == pytest.approx(0.019)
    assert data["answers"] == {"compared": 6, "identical": True, "mismatches": []}


def test_each_target_misses_on_its_own() -> None:
    slow = build_result(three({"pd-first": [10, 20], "host-first": [10, 15], "ranges": [19, 16]}), REFERENCE, 1)
    assert slow.target_met is False and "MISS" in slow.table()
    # ranges pulling the whole prompt (host loaded nothing the second time) misses the NIXL target.
    got = three({"pd-first": [10, 20], "host-first": [10, 15], "ranges": [9, 12]})
    got[-1] = served("ranges", 1, 260, 0, 0, 12)
    whole = build_result(got, REFERENCE, 1)
    assert whole.totals["ranges"].host_tokens == 0 and whole.target_met is False
    assert "host-loaded tokens: ranges/host-first >= 1" in whole.table() and "0.000 MISS" in whole.table()
    # More than one block computed on the decode instance under ranges.
    got = three({"pd-first": [10, 20], "host-first": [10, 15], "ranges": [9, 12]})
    got[-1].computed_tokens = BLOCK_SIZE + 1
    assert build_result(got, REFERENCE, 1).target_met is False


def test_a_different_answer_fails_the_result_whatever_the_ratios() -> None:
    got = three({"pd-first": [10, 20], "host-first": [10, 15], "ranges": [9, 12]}, {"host-first": [None, [7, 7]]})
    r = build_result(got, REFERENCE, 1)
    assert r.mismatches == ["host-first run 1 conversation 0 turn 2"]
    assert r.target_met is False
    assert "answers: FAILED, 1 of 6" in r.table() and "targets NOT MET" in r.table()


def test_p90_interpolates_and_takes_a_single_sample() -> None:
    assert quantile([1.0], 0.9) == 1.0
    assert quantile([float(i) for i in range(1, 11)], 0.9) == pytest.approx(9.1)


def test_the_engine_benchmark_is_left_out_of_quick_runs() -> None:
    from kvcompose_tools.bench.runner import BENCHMARKS, FULL_ONLY

    assert BENCHMARKS["ranges"] == "pd_ranges" and "ranges" in FULL_ONLY


class FakePrefill:
    def __init__(self) -> None:
        self.prompts: list[list[int]] = []

    def generate(self, prompts: list[list[int]], max_tokens: int, params: Any, timeout: float = 0) -> Any:
        assert max_tokens == 1 and params == [{"do_remote_decode": True}]
        self.prompts += prompts
        return [{"kv_transfer_params": {"remote_request_id": len(self.prompts)}}]


class FakeDecode:
    """Answers with the prompt's last tokens; counts what a ranges decode would (host: whole blocks
    of the longest prompt seen before that this one extends, NIXL: the rest)."""

    class spec:  # noqa: N801
        name = "decode"

    def __init__(self) -> None:
        self.seen: list[list[int]] = []
        self.counters: dict[str, float] = {}
        self.resets = 0

    def reset_prefix_cache(self) -> bool:
        self.resets += 1
        return True

    def metrics(self) -> dict[str, float]:
        return dict(self.counters)

    def generate(self, prompts: list[list[int]], max_tokens: int, params: Any, timeout: float = 0) -> Any:
        from kvcompose_tools.e2e.flow import NIXL_BYTES, loads_key, tokens_key

        (p,) = prompts
        assert params and params[0]["remote_request_id"] > 0
        answer = [x + 1 for x in p[-max_tokens:]]
        held = max((len(q) for q in self.seen if p[: len(q)] == q), default=0)
        host = (held - 1) // BLOCK_SIZE * BLOCK_SIZE if held else 0
        for key, n in (
            (tokens_key("host"), host),
            (loads_key("host"), int(host > 0)),
            (tokens_key("pd"), len(p) - host),
            (loads_key("pd"), 1),
            (NIXL_BYTES, (-(-len(p) // BLOCK_SIZE) - host // BLOCK_SIZE) * BLOCK),
        ):
            self.counters[key] = self.counters.get(key, 0) + n
        self.seen.append(p + answer)
        return [{"token_ids": answer, "logprobs": [0.0] * len(answer), "ttft_s": 0.01 * (1 + len(self.seen) % 3)}]


def test_a_run_sends_the_workload_round_robin_with_twins_in_flipping_order() -> None:
    w = make_workload(conversations=2, turns=3)
    prefill, decode = FakePrefill(), FakeDecode()
    answers: dict[tuple[int, int], list[int]] = {}
    got = engines.serve_lockstep({"ranges": decode}, 1, prefill, w, answers)
    assert len(got) == 2 * len(w.order()) and decode.resets == len(got)  # device cache dropped every time
    assert [(s.conversation, s.turn, s.twin) for s in got[:4]] == [
        (0, 0, False),
        (0, 0, True),
        (1, 0, True),
        (1, 0, False),
    ]
    main = [s for s in got if not s.twin]
    assert [(s.conversation, s.turn) for s in main] == w.order()
    # Each prompt: the previous one, its answer, the new message; the answers were this run's own.
    assert answers == {s.key[:2]: s.token_ids for s in main}
    for s in main:
        assert s.prompt_tokens == len(w.prompt(s.conversation, s.turn, answers))
    first = w.prompt(0, 0, {})
    assert prefill.prompts[:2] == [first, workload.twin_prompt(0, 0, len(first))]
    # Twins have their request's length and are never loaded from host; later turns are.
    for s in got:
        twin_of = next(m for m in main if (m.conversation, m.turn) == (s.conversation, s.turn))
        assert s.prompt_tokens == twin_of.prompt_tokens
    assert all(s.host_tokens == 0 for s in got if s.twin or s.turn == 0)
    assert all(s.host_tokens > 0 and s.host_tokens + s.pd_tokens == s.prompt_tokens for s in main if s.turn > 0)
    # A second run replays the same prompts (the reference answers) and is compared to the first.
    again = engines.serve_lockstep({"pd-first": FakeDecode()}, 1, FakePrefill(), w, answers)
    reference = {s.key: s.token_ids for s in got}
    assert [s.prompt_tokens for s in again] == [s.prompt_tokens for s in got]
    assert figures.compare_answers(again, reference) == []
    r = build_result(got + again, reference, 1)
    assert r.totals["ranges"].requests == len(w.order())  # twins are not in the workload's figures
    twin = r.totals["ranges"].twin_ttft
    assert twin is not None and len(twin.values) == len(w.order())
    cases = {(x.case, x.subject, x.baseline) for x in r.ratios}
    assert (figures.TWIN_CASE, "ranges", "twin") in cases and (figures.PAIRED_CASE, "ranges", "pd-first") in cases
    assert "TTFT/twin" in r.table()


def test_lockstep_sends_each_request_to_every_composition_first_one_rotating() -> None:
    w = make_workload(conversations=2, turns=2)
    decodes = {name: FakeDecode() for name in compositions.COMPOSITIONS}
    answers: dict[tuple[int, int], list[int]] = {}
    got = engines.serve_lockstep(decodes, 1, FakePrefill(), w, answers, twins=False)
    n = len(compositions.COMPOSITIONS)
    assert len(got) == n * len(w.order())
    names = list(compositions.COMPOSITIONS)
    for i, (c, t) in enumerate(w.order()):
        chunk = got[i * n : (i + 1) * n]
        assert {(s.conversation, s.turn) for s in chunk} == {(c, t)}
        assert [s.composition for s in chunk] == names[i % n :] + names[: i % n]
        assert len({s.prompt_tokens for s in chunk}) == 1  # the very same prompt for every composition
    assert all(d.resets == len(w.order()) for d in decodes.values())  # each device cache dropped per request
    reference = {s.key: s.token_ids for s in got[::n]}
    assert figures.compare_answers(got, reference) == []


def test_a_baseline_that_measured_nothing_leaves_its_target_without_a_figure() -> None:
    """pd_ranges drops a ratio whose baseline is 0 (no division by it): the target that ratio
    would judge is then "no figure", and the whole result is not "met"."""
    got = three({"pd-first": [10, 20], "host-first": [10, 15], "ranges": [9, 12]})
    for s in got:
        if s.composition == "host-first":
            s.host_tokens = 0
    r = build_result(got, REFERENCE, 1)
    assert r.target_met is not True
    host = [t for t in r.to_json()["target"]["targets"] if t["case"].startswith("host")]
    assert host and all(t["met"] is None for t in host)
