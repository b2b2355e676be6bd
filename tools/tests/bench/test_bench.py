"""The benchmarks' machinery: interleaving, ratios, results, equal work on both sides. No timing is asserted."""

from __future__ import annotations

import contextlib
import json
import math
import sys
from collections import Counter
from pathlib import Path

import pytest

from kvcompose_tools.bench.measure import (
    Samples,
    follow_balanced,
    interleave,
    interleave_balanced,
    interleave_units,
    paired,
    ratio,
)
from kvcompose_tools.bench.report import Case, Result, Target


def test_interleave_alternates_the_order_every_repeat() -> None:
    order: list[str] = []
    interleave({"a": lambda r: order.append("a") or 1.0, "b": lambda r: order.append("b") or 2.0}, 4)
    assert order == ["a", "b", "b", "a", "a", "b", "b", "a"]


@pytest.mark.parametrize("names", [["a", "b"], ["a", "b", "c"], ["a", "b", "c", "d"]])
def test_follow_balanced_has_every_name_follow_every_name_equally_often(names: list[str]) -> None:
    order = follow_balanced(names, 2 * len(names))
    assert Counter(order) == dict.fromkeys(names, 2 * len(names))
    pairs = Counter(zip(order, order[1:] + order[:1]))  # cyclically: the order repeats whole
    assert set(pairs) == {(a, b) for a in names for b in names} and set(pairs.values()) == {2}


def test_interleave_balanced_samples_whole_cycles_in_that_order() -> None:
    order: list[str] = []
    samples = interleave_balanced({n: (lambda r, n=n: order.append(n) or float(r)) for n in "abc"}, 2)
    assert order == follow_balanced(["a", "b", "c"], 3) and len(order) == 9
    assert samples["a"].values == [0.0, 1.0, 2.0]


def test_interleave_units_alternates_per_unit_and_averages() -> None:
    order: list[str] = []
    samples = interleave_units({"a": lambda: order.append("a") or 1.0, "b": lambda: order.append("b") or 3.0}, 2, 3)
    assert order[:6] == ["a", "b", "b", "a", "a", "b"]
    assert samples["a"].values == [1.0, 1.0] and samples["b"].values == [3.0, 3.0]


def test_ratio_uses_the_best_sample_in_the_right_direction() -> None:
    s = {"x": Samples([2.0, 4.0, 9.0]), "base": Samples([1.0, 2.0, 3.0])}
    lower = ratio("c", s, "x", "base")
    assert (lower.by_min, lower.by_median) == (2.0, 2.0)
    higher = ratio("c", s, "x", "base", higher_is_better=True)
    assert higher.by_min == 3.0  # max over max for throughputs


def test_result_json_and_table_name_the_target_and_its_verdict(tmp_path: Path) -> None:
    samples = {"MultiConnector": Samples([1.0] * 5), "kvcompose": Samples([1.1] * 5)}
    r = Result(
        "demo",
        "Demo",
        "us/step",
        1e6,
        [Case("16 reqs", samples)],
        [ratio("16 reqs", samples, "kvcompose", "MultiConnector")],
        Target("<=", 1.0, "kvcompose", "MultiConnector"),
        5,
    )
    data = json.loads(r.write(tmp_path).read_text())
    assert data["target"]["met"] is False and data["machine"]["cores"] >= 1
    assert data["cases"][0]["samples"]["kvcompose"]["median"] == pytest.approx(1.1)
    table = r.table()
    assert "16 reqs" in table and "MISS" in table and "cores" in table


def test_a_derived_figure_pairs_each_repeats_samples_and_is_printed_and_written(tmp_path: Path) -> None:
    """The scheduler's own cost per request is of each repeat's two samples, not of their medians."""
    samples = {"MultiConnector": Samples([1.0, 3.0, 2.0]), "kvcompose": Samples([1.5, 3.0, 2.1])}
    own = paired(samples, "kvcompose", "MultiConnector", lambda s, b: (s - b) / 2)
    assert own.values == pytest.approx([0.25, 0.0, 0.05]) and own.median == pytest.approx(0.05)
    with pytest.raises(ValueError):  # the repeats must pair up
        paired({"a": Samples([1.0]), "b": Samples([1.0, 2.0])}, "a", "b", lambda s, b: s - b)
    case = Case("2 reqs", samples, derived={"own (us)": own})
    r = Result("demo", "Demo", "us/step", 1e6, [case], [ratio("2 reqs", samples, "kvcompose", "MultiConnector")])
    data = json.loads(r.write(tmp_path).read_text())
    assert data["cases"][0]["derived"]["own (us)"]["values"] == pytest.approx([0.25, 0.0, 0.05])
    assert data["ratios"]  # CI's check of every benchmark's JSON
    table = r.table()
    assert "own (us) med [min, max]" in table and "0.05 [0, 0.25]" in table


def test_png_without_matplotlib_fails_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvcompose_tools.bench.plot import PlotUnavailable, require_matplotlib

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an absent package looks like to import
    with pytest.raises(PlotUnavailable, match=r"kvcompose-tools\[bench\]"):
        require_matplotlib()


def test_cli_rejects_an_unknown_benchmark(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from kvcompose.cli import main

    assert main(["bench", "--only", "nope", "--out", str(tmp_path)]) == 2
    assert "unknown benchmark" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--hosts"], "choose it with --only"),
        (["--hosts", "--only", "scheduler"], "(not scheduler)"),
        (["--hosts", "--only", "cold-start", "--only", "pd-ttft"], "(not pd-ttft)"),
        (["--hosts", "--link", "fast", "--only", "cold-start"], "tc's units"),
        (["--link", "1gbit", "--only", "cold-start"], "add --hosts"),
    ],
)
def test_cli_runs_only_cold_start_across_hosts_and_checks_the_rate_first(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str], says: str
) -> None:
    from kvcompose.cli import main

    assert main(["bench", *argv, "--out", str(tmp_path)]) == 2
    assert says in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing ran


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--model", "medium"], "choose it with --only"),
        (["--model", "medium", "--only", "scheduler"], "(not scheduler)"),
        (["--model", "huge", "--only", "multi-turn"], "invalid choice: 'huge'"),
    ],
)
def test_cli_runs_another_model_only_in_pd_load_and_multi_turn(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str], says: str
) -> None:
    from kvcompose.cli import main

    with contextlib.suppress(SystemExit):  # argparse's own refusal of a name it does not know
        assert main(["bench", *argv, "--out", str(tmp_path)]) == 2
    assert says in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing ran


def test_the_runner_names_the_models_for_another_name() -> None:
    from kvcompose_tools.bench.runner import TAKE_MODEL, run

    assert TAKE_MODEL == ("pd-load", "multi-turn", "fleet", "fleet-kill", "fleet-join")
    with pytest.raises(ValueError, match="unknown model 'huge'; choose from tiny, medium"):
        run(only=["multi-turn"], model="huge")


def test_cold_start_across_hosts_puts_a_bare_nixl_connectors_side_channel_on_its_host() -> None:
    """The bare NixlConnector's config is rendered by the benchmark, so the kit cannot place its
    side channel: without the host's address there, decode asks 127.0.0.1 in its own host and
    every read waits vLLM's 5 s handshake timeout, then computes (no NIXL bytes)."""
    from kvcompose_tools.bench.cold_start import engine_spec
    from kvcompose_tools.e2e.hosts import Host

    host = Host("prefill", "kvc-0-0-prefill", "10.213.9.2")
    spec = engine_spec("NixlConnector", "prefill", "m", 5600, "none", host)
    assert spec.kv_config is not None
    assert spec.kv_config["kv_connector_extra_config"]["kvcompose_side_channel_host"] == "10.213.9.2"
    assert "10.213.9.2" not in str(engine_spec("NixlConnector", "prefill", "m", 5600, "none").kv_config)


def test_both_composites_do_the_same_scheduler_work() -> None:
    """The scheduler benchmark compares like with like: same loads per tier, same tokens."""
    from kvcompose_tools.bench.scheduler_step import Driver

    drivers = {s: Driver(s, 8) for s in ("MultiConnector", "kvcompose")}
    for d in drivers.values():
        for _ in range(120):
            d.step()
    multi, composed = (drivers[s].counts for s in ("MultiConnector", "kvcompose"))
    assert multi == composed
    # The mix is what it claims: NIXL loads remote prefills and the CPU tier serves repeats.
    assert composed["loaded:nixl"] > 0 and composed["loaded:cpu"] > 0 and composed["finished"] > 0


def test_the_trust_sides_do_the_same_work_and_the_keyed_decode_verifies_every_arrival() -> None:
    """trust-on's remote arrivals carry a keyed prefill's signed params and the decode takes every
    one (a refused set would be cheaper, and wrong); trust-off's prefill signs nothing."""
    from kvcompose_tools.bench.scheduler_step import TRUST_OFF, TRUST_ON, TRUST_SIDES, Driver

    drivers = {s: Driver(s, 8) for s in TRUST_SIDES}
    for d in drivers.values():
        for _ in range(120):
            d.step()
    on, off = (drivers[s].counts for s in (TRUST_ON, TRUST_OFF))
    assert on == off and not [k for k in on if k.startswith("refused:")]
    assert on["loaded:nixl"] == on["arrived:remote"] > 0
    assert len(drivers[TRUST_ON].pd_add_s) == on["arrived:remote"] and drivers[TRUST_ON].take_pd_adds() > 0
    assert drivers[TRUST_ON].pd_add_s == [] and math.isnan(drivers[TRUST_ON].take_pd_adds())
    signed = drivers[TRUST_ON].prefill.params("p-1", tuple(range(3, 131)))  # type: ignore[union-attr]
    unsigned = drivers[TRUST_OFF].prefill.params("p-1", tuple(range(3, 131)))  # type: ignore[union-attr]
    assert signed["kvcompose_sig"] and signed["remote_num_tokens"] == 128 and "kvcompose_sig" not in unsigned
    assert signed["kvcompose_prompt"] and unsigned["kvcompose_prompt"]  # the digest, with or without a key
    blocks = signed["remote_block_ids"]  # as JSON carries them: a list of the prompt's 8 blocks per group
    assert isinstance(blocks, list) and [len(g) for g in blocks] == [8]


def test_the_trust_case_stops_on_a_refused_arrival(monkeypatch: pytest.MonkeyPatch) -> None:
    """Params the keyed decode refuses are counted from its stats, and the case refuses to report."""
    from kvcompose_tools.bench import scheduler_step
    from kvcompose_tools.bench.scheduler_step import TRUST_ON, Driver, Prefill

    real = Prefill.params

    def forged(self: Prefill, rid: str, prompt: tuple[int, ...]) -> dict[str, object]:
        params = real(self, rid, prompt)
        if "kvcompose_sig" in params:
            params["kvcompose_sig"] = params["kvcompose_sig"][:-4] + "0000"
        return params

    monkeypatch.setattr(Prefill, "params", forged)
    d = Driver(TRUST_ON, 4)
    for _ in range(60):
        d.step()
    assert d.counts["refused:signature"] == d.counts["arrived:remote"] > 0
    monkeypatch.setattr(scheduler_step, "warmup_steps", lambda quick: 8)
    monkeypatch.setattr(scheduler_step, "steps_per_repeat", lambda n, quick: 16)
    with pytest.raises(RuntimeError, match="refused P/D params"):
        scheduler_step.trust_case(4, True, 5)


def test_the_trust_case_reports_add_request_per_pd_request_against_its_target(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvcompose_tools.bench import scheduler_step
    from kvcompose_tools.bench.measure import Ratio
    from kvcompose_tools.bench.scheduler_step import TRUST_BUDGET, TRUST_BUDGET_US, TRUST_COST, TRUST_ON, step_target

    assert TRUST_BUDGET_US == 10 + 128 * 10 / 1000  # 10 ns a prompt token + 10 us a request
    monkeypatch.setattr(scheduler_step, "warmup_steps", lambda quick: 8)
    monkeypatch.setattr(scheduler_step, "steps_per_repeat", lambda n, quick: 16)
    case, ratios = scheduler_step.trust_case(8, True, 5)
    assert case.label == "trust, 8 reqs" and len(case.derived[TRUST_COST].values) == 5
    assert [(r.subject, r.baseline) for r in ratios] == [(TRUST_ON, "trust-off"), (TRUST_ON, TRUST_BUDGET)]
    per = case.extra["add_request_per_pd_request_us"]
    assert ratios[1].by_median == pytest.approx(
        sorted(per[TRUST_ON])[2] / (sorted(per["trust-off"])[2] + TRUST_BUDGET_US)
    )

    def within(ratio: float) -> list[Ratio]:
        return [Ratio(f"{n} reqs", "kvcompose", "MultiConnector", 1.0, 1.0, False) for n in (1, 16)] + [
            Ratio(f"trust, {n} reqs", TRUST_ON, TRUST_BUDGET, ratio, ratio, False) for n in (1, 16)
        ]

    target = step_target((1, 16), trust=True)
    assert target.verdict(within(0.9)) is True and target.verdict(within(1.1)) is False
    assert "trust-on's add_request per P/D request <= trust-off's + 11.28 us" in str(target)
    assert step_target((1, 16)).verdict(within(1.1)) is True  # without the trust case, no trust target


def test_a_repeat_reuses_a_prompt_at_least_the_gap_old_at_the_largest_size() -> None:
    """At 1024 requests the gap is thousands of arrivals: the CPU tier must still get repeats to load."""
    from itertools import islice

    from kvcompose_tools.bench.scheduler_step import arrivals

    gap = 2568  # Driver's at 1024 requests
    stream = list(islice(arrivals(0, repeat_gap=gap), 2 * gap))
    first = {a.prompt: k for k, a in reversed(list(enumerate(stream))) if a.kind == "plain"}
    late = [(k, a) for k, a in enumerate(stream) if a.kind == "repeat" and k > gap + 200]
    assert late and all(a.prompt in first and first[a.prompt] <= k - gap for k, a in late)


def test_cpu_copy_benchmark_checks_what_it_copied() -> None:
    import os

    from kvcompose_tools.bench.cpu_copy import LOOP, MEMCPY, NUM_LAYERS, SUBJECT, run

    cores = os.sched_getaffinity(0)
    r = run(quick=True, sizes=(16 * 1024,), repeats=5, bytes_per_copy=NUM_LAYERS * 16 * 1024 * 8)
    # Both sides ran on one core, and the process has its cores back.
    assert any(n.startswith(f"host memory: every side on one core (core {min(cores)}") for n in r.notes)
    assert os.sched_getaffinity(0) == cores
    assert [c.label for c in r.cases] == [
        "store 16 KiB scattered",
        "load 16 KiB scattered",
        "store 16 KiB consecutive",
        "load 16 KiB consecutive",
    ]
    assert all(set(c.samples) == {MEMCPY, LOOP, SUBJECT} for c in r.cases)
    assert all(len(s.values) == 5 for c in r.cases for s in c.samples.values())
    assert {(x.subject, x.baseline) for x in r.ratios} == {(SUBJECT, MEMCPY), (SUBJECT, LOOP)}
    # Every case carries its own target against the memcpy, and the JSON says whether it was met.
    assert all(r.target is not None and r.target.applies(x) for x in r.ratios if x.baseline == MEMCPY)
    assert r.to_json()["target"]["met"] in (True, False)
    # Each case says which loop of the compiled copy moved its bytes (1 MiB a transfer: the helper's).
    assert {c.to_json()["copy_loop"] for c in r.cases} == {_expected_copy_loop()}


def _expected_copy_loop() -> str:
    from kvcompose_cpu_offload import block_copy

    return block_copy.copy_loop()


def test_cpu_copy_records_the_plain_loop_when_it_is_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvcompose_tools.bench.cpu_copy import NUM_LAYERS, run

    if _expected_copy_loop() == "numpy":
        pytest.skip("the cpu-offload plugin's compiled copy is not built here")
    monkeypatch.setenv("KVCOMPOSE_COPY_LOOP", "plain")
    r = run(quick=True, sizes=(16 * 1024,), repeats=1, bytes_per_copy=NUM_LAYERS * 16 * 1024 * 8)
    assert [c.to_json()["copy_loop"] for c in r.cases] == ["plain"] * 4


def test_cpu_copy_disk_cases_hold_the_worker_to_sequential_io_from_huge_pages(tmp_path: Path) -> None:
    from kvcompose_tools.bench.cpu_copy import FILE_IO, FILE_IO_SMALL_PAGES, NUM_LAYERS, SUBJECT, run

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVCOMPOSE_BENCH_DISK_DIR", str(tmp_path))
        size = 16 * 1024
        r = run(quick=True, sizes=(size,), repeats=3, bytes_per_copy=NUM_LAYERS * size * 8, disk_sizes=(size,))
    disk = [c for c in r.cases if c.label.startswith("disk ")]
    assert [c.label for c in disk] == [
        "disk store 16 KiB scattered",
        "disk load 16 KiB scattered",
        "disk store 16 KiB consecutive",
        "disk load 16 KiB consecutive",
    ]
    assert all(set(c.samples) == {FILE_IO, SUBJECT, FILE_IO_SMALL_PAGES} for c in disk)
    held = [x for x in r.ratios if x.baseline == FILE_IO]
    assert [x.case for x in held] == [c.label for c in disk]
    shown = [x for x in r.ratios if x.baseline == FILE_IO_SMALL_PAGES]
    assert [x.case for x in shown] == [c.label for c in disk] and not any(r.target.applies(x) for x in shown)
    # Only consecutive slots are held to the sequential rate; the files are gone afterwards.
    assert [r.target is not None and r.target.applies(x) for x in held] == [False, False, True, True]
    assert list(tmp_path.iterdir()) == []
    assert {c.to_json()["copy_loop"] for c in disk} == {_expected_copy_loop()}  # the staging copies' loop


def test_nixl_read_names_the_memory_it_cannot_use() -> None:
    import torch

    from kvcompose_tools.bench import nixl_read

    with pytest.raises(ValueError, match="memory must be one of \\('DRAM', 'VRAM'\\), not 'HBM'"):
        nixl_read.run(quick=True, memory="HBM")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="memory='VRAM' needs a CUDA device"):
            nixl_read.run(quick=True, memory="VRAM")


def test_every_benchmark_is_in_the_performance_docs_table() -> None:
    """docs/performance.md's first table lists every module ``kvcompose bench`` runs, each row with
    what it compares, its target, today's figure and the command that runs it."""
    from kvcompose_tools.bench.runner import BENCHMARKS

    text = (Path(__file__).parents[3] / "docs" / "performance.md").read_text()
    table = text[: text.index("## Machine and method")]
    bench = Path(__file__).parents[2] / "kvcompose_tools" / "bench"
    # A benchmark is a module or, split along its jobs, a package.
    listed = [
        f"| `tools/kvcompose_tools/bench/{m}.py`"
        if (bench / f"{m}.py").exists()
        else f"| `tools/kvcompose_tools/bench/{m}/`"
        for m in BENCHMARKS.values()
    ]
    missing = [m for m, row in zip(BENCHMARKS.values(), listed) if row not in table]
    assert not missing, f"benchmarks missing from docs/performance.md's table: {missing}"
    rows = {
        line.split("`")[1]: line for line in table.splitlines() if line.startswith("| `tools/kvcompose_tools/bench/")
    }
    for name, module in BENCHMARKS.items():
        path = (
            f"tools/kvcompose_tools/bench/{module}.py"
            if (bench / f"{module}.py").exists()
            else f"tools/kvcompose_tools/bench/{module}/"
        )
        cells = [c.strip() for c in rows[path].strip("|").split("|")]
        assert len(cells) == 5 and all(cells), f"{module}: benchmark, compares, target, today, command"
        assert f"`kvcompose bench --only {name}" in cells[4], f"{module}: its command is --only {name}"


def test_lease_cost_orphans_leave_less_than_one_request_free() -> None:
    """The lease benchmark's sizing: the orphans leave too few blocks for one more request, so the
    requests behind them wait for the lease (what it measures)."""
    from kvcompose_tools.bench import lease_cost
    from kvcompose_tools.bench.runner import BENCHMARKS, FULL_ONLY

    per = lease_cost.blocks_of(lease_cost.PROMPT_TOKENS)
    assert per == 17  # 512 prompt tokens and the one generated, 32-token blocks
    free = lease_cost.NUM_BLOCKS - 1 - lease_cost.ORPHANS * per
    assert 0 <= free < per
    assert BENCHMARKS["lease"] == "lease_cost" and "lease" in FULL_ONLY


def test_nixl_read_gathers_its_baseline_on_one_thread_and_gives_the_threads_back() -> None:
    """The docs call the memcpy gather one-thread: the run sets it, records it, and restores torch's count."""
    pytest.importorskip("nixl")
    import torch

    from kvcompose_tools.bench import nixl_read

    before = torch.get_num_threads()
    result = nixl_read.run(quick=True, sizes=(256 * 1024,), repeats=2)
    assert result.config["baseline_threads"] == 1 and torch.get_num_threads() == before
    assert any("one thread" in note for note in result.notes)


def test_a_target_without_a_figure_is_no_figure_never_met(tmp_path: Path) -> None:
    """``all([])`` is true: a target no ratio applies to (its baseline measured nothing, its case
    not run) must read "no figure", in the JSON and the table, not "met"."""
    from kvcompose_tools.bench.report import AllTargets, CaseTarget

    samples = {"MultiConnector": Samples([1.0] * 5), "kvcompose": Samples([0.9] * 5)}
    ratios = [ratio("16 reqs", samples, "kvcompose", "MultiConnector")]
    other = Target("<=", 1.0, "kvcompose", "NixlConnector")
    r = Result("demo", "Demo", "us/step", 1e6, [Case("16 reqs", samples)], ratios, other, 5)
    assert r.target_met is None
    assert json.loads(r.write(tmp_path).read_text())["target"]["met"] is None
    assert "no figure for the target" in r.table()
    met = CaseTarget("<=", 1.0, "kvcompose", "MultiConnector", "16 reqs")
    missing = CaseTarget("<=", 1.0, "kvcompose", "MultiConnector", "1024 reqs")
    assert AllTargets("<=", 1.0, "kvcompose", "MultiConnector", (met,)).verdict(ratios) is True
    assert AllTargets("<=", 1.0, "kvcompose", "MultiConnector", (met, missing)).verdict(ratios) is None
    missed = CaseTarget("<=", 0.5, "kvcompose", "MultiConnector", "16 reqs")
    assert AllTargets("<=", 1.0, "kvcompose", "MultiConnector", (missed, missing)).verdict(ratios) is False


def test_the_scheduler_step_target_is_1_03_up_to_16_requests_and_1_01_from_128() -> None:
    from kvcompose_tools.bench.measure import Ratio
    from kvcompose_tools.bench.scheduler_step import step_target

    def ratios(**by_size: float) -> list[Ratio]:
        return [Ratio(f"{n} reqs", "kvcompose", "MultiConnector", v, v, False) for n, v in by_size.items()]

    target = step_target((1, 16, 128, 1024))
    assert target.verdict(ratios(**{"1": 1.029, "16": 1.02, "128": 1.01, "1024": 0.99})) is True
    assert target.verdict(ratios(**{"1": 1.031, "16": 1.0, "128": 1.0, "1024": 1.0})) is False
    assert target.verdict(ratios(**{"1": 1.0, "16": 1.0, "128": 1.02, "1024": 1.0})) is False
    assert target.verdict(ratios(**{"1": 1.0, "16": 1.0, "128": 1.0})) is None  # 1024 not measured: no figure
