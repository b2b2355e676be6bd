"""Interleaved repeats and the ratios every benchmark reports.

Timings on a shared 2-core machine drift with the other processes' load, so a subject and its
baseline are never timed in separate blocks: each repeat runs every subject once, and the order
flips on every other repeat so that a slow phase hits both sides equally. Subjects whose turn
leaves the machine busy (real engines) go in an order where each follows every subject equally
often (:func:`interleave_balanced`).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import math
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

#: The fewest repeats a reported figure may rest on (the issue asks for min and median of >= 5).
MIN_REPEATS = 5


@dataclass
class Samples:
    """The per-repeat values of one subject in one case (seconds per unit, or bytes per second)."""

    values: list[float] = field(default_factory=list)

    @property
    def min(self) -> float:
        return min(self.values)

    @property
    def max(self) -> float:
        return max(self.values)

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    def to_json(self) -> dict[str, Any]:
        return {"min": self.min, "median": self.median, "max": self.max, "values": list(self.values)}


@contextlib.contextmanager
def _frozen_heap() -> Iterator[None]:
    """Move every object alive now out of the collector's reach for the duration.

    The collections that precede each sample then scan only what the benchmark itself made,
    not vLLM's whole heap (about 0.2 s a collection in a process that imported vLLM).
    """
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def interleave(subjects: Mapping[str, Callable[[int], float]], repeats: int) -> dict[str, Samples]:
    """Run ``subjects[name](repeat)`` for every name, ``repeats`` times, alternating the order.

    Each callable returns one sample (its own unit). The garbage collector is paused inside a
    sample so that a collection triggered by one subject's garbage is not billed to another.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    names = list(subjects)
    out = {n: Samples() for n in names}
    with _frozen_heap():
        for r in range(repeats):
            order = names if r % 2 == 0 else names[::-1]
            for name in order:
                out[name].values.append(_sample(subjects[name], r))
    return out


def _sample(subject: Callable[[int], float], repeat: int) -> float:
    """One sample, the collector run before it and paused inside it (:func:`interleave`)."""
    gc.collect()
    gc.disable()
    try:
        return subject(repeat)
    finally:
        gc.enable()


def follow_balanced(names: Sequence[str], repeats: int) -> list[str]:
    """An order of turns, at least ``repeats`` for each of ``names`` (rounded up to whole cycles of
    ``len(names)`` each), in which every name follows every name, itself included, equally often.

    For subjects that leave the machine busy after their turn (an engine's worker spins on its
    queue for a second after each step), the turn before a sample is part of the sample. Flipping
    the order every repeat does not balance that: with three subjects the middle one always
    follows another and the outer ones follow themselves half the time. A cycle here is a de
    Bruijn sequence of order 2 (the Lyndon words of length 1 and 2 in order: ``a a b a c b b c
    c`` for three), so every ordered pair, the wrap-around included, occurs once a cycle.
    """
    cycle: list[str] = []
    for i, a in enumerate(names):
        cycle.append(a)
        for b in names[i + 1 :]:
            cycle += (a, b)
    return cycle * -(-repeats // len(names)) if names else []


def interleave_balanced(subjects: Mapping[str, Callable[[int], float]], repeats: int) -> dict[str, Samples]:
    """Like :func:`interleave`, in :func:`follow_balanced`'s order: each subject is sampled at
    least ``repeats`` times (whole cycles), each as often after every subject."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    out: dict[str, Samples] = {n: Samples() for n in subjects}
    turns = dict.fromkeys(subjects, 0)
    with _frozen_heap():
        for name in follow_balanced(list(subjects), repeats):
            out[name].values.append(_sample(subjects[name], turns[name]))
            turns[name] += 1
    return out


def interleave_units(units: Mapping[str, Callable[[], float]], repeats: int, per_repeat: int) -> dict[str, Samples]:
    """Like :func:`interleave`, but alternating the subjects on every unit of work.

    ``units[name]()`` does one unit (a scheduler step) and returns the seconds it timed itself;
    a sample is the mean over ``per_repeat`` units. Alternating per unit, not per sample, lets
    subjects whose units last milliseconds share the same moments of machine load.
    """
    if repeats < 1 or per_repeat < 1:
        raise ValueError(f"repeats and per_repeat must be >= 1, got {repeats} and {per_repeat}")
    names = list(units)
    out = {n: Samples() for n in names}
    with _frozen_heap():
        for _r in range(repeats):
            total = dict.fromkeys(names, 0.0)
            gc.collect()
            gc.disable()
            try:
                for j in range(per_repeat):
                    for name in names if j % 2 == 0 else names[::-1]:
                        total[name] += units[name]()
            finally:
                gc.enable()
            for name in names:
                out[name].values.append(total[name] / per_repeat)
    return out


def balanced_rounds(names: Sequence[str]) -> list[list[str]]:
    """The orders of a cycle of rounds in which every name follows every name, itself included,
    equally often, each round running every name once (:func:`alternated_steps`).

    Flipping the order every other round balances two names, not three: with ``a b c`` then
    ``c b a`` the middle one never follows itself while the outer ones do half the time, and a
    step that follows another side's (its caches evicted by that side's objects) is slower. Here
    the cycle is every permutation once, each starting with the name the one before ended with
    (``a b c, c a b, b a c, c b a, a c b, b c a`` for three): within the rounds each ordered pair
    of different names is adjacent equally often by symmetry, and between them each name follows
    itself ``(n-1)!`` times. Up to five names (120 rounds a cycle).
    """
    names = list(names)
    if len(set(names)) != len(names) or not 1 <= len(names) <= 5:
        raise ValueError(f"one to five distinct names, got {names}")
    perms = [list(p) for p in itertools.permutations(names)]
    cycle, used = [perms[0]], {tuple(perms[0])}

    def extend() -> bool:
        if len(cycle) == len(perms):
            return cycle[-1][-1] == cycle[0][0]
        for p in perms:
            if p[0] == cycle[-1][-1] and tuple(p) not in used:
                cycle.append(p)
                used.add(tuple(p))
                if extend():
                    return True
                used.discard(tuple(cycle.pop()))
        return False

    if not extend():  # pragma: no cover - every n from 1 to 5 has such a cycle
        raise RuntimeError(f"no balanced cycle of rounds for {names}")
    return cycle


def alternated_steps(units: Mapping[str, Callable[[], float]], steps: int, chunk: int = 60) -> dict[str, list[float]]:
    """Each unit's own seconds for at least ``steps`` rounds, the units alternated one step at a time.

    A round runs every unit once (``units[name]()`` does one step and returns the seconds it
    timed itself), the rounds' orders those of :func:`balanced_rounds` (``a b`` then ``b a`` for
    two units), so that each pair of units shares the same moments of machine load and each unit
    follows each as often; ``steps`` is rounded up to whole cycles of those orders. As in
    :func:`interleave_units`, the collector runs before every ``chunk`` rounds and is paused
    inside them. Returns each unit's per-round seconds, in the rounds' order: the input of
    :func:`per_step_cost`.
    """
    if steps < 1 or chunk < 1:
        raise ValueError(f"steps and chunk must be >= 1, got {steps} and {chunk}")
    orders = balanced_rounds(list(units))
    rounds = -(-steps // len(orders)) * len(orders)
    out: dict[str, list[float]] = {n: [] for n in units}
    with _frozen_heap():
        for start in range(0, rounds, chunk):
            gc.collect()
            gc.disable()
            try:
                for r in range(start, min(start + chunk, rounds)):
                    for name in orders[r % len(orders)]:
                        out[name].append(units[name]())
            finally:
                gc.enable()
    return out


def per_step_cost(steps: Mapping[str, Sequence[float]], subject: str, baseline: str, per: float) -> Samples:
    """The paired per-step estimator's values: per round of :func:`alternated_steps`, the
    subject's step less the baseline's, over ``per`` (live requests), in microseconds.

    The figure is their median (``.median``): a round's two steps ran at the same moments of load,
    and the median of many such differences ignores the rounds a slow phase hit one side only.
    """
    return Samples([(s - b) / per * 1e6 for s, b in zip(steps[subject], steps[baseline], strict=True)])


def quartiles(values: Sequence[float]) -> tuple[float, float]:
    """The lower and upper quartiles of ``values`` (at least two)."""
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q3


def median_interval(values: Sequence[float], z: float = 1.96) -> tuple[float, float]:
    """A distribution-free confidence interval of the median of ``values`` (about 95 % with the
    default ``z``): the order statistics ``z*sqrt(n)/2`` ranks either side of the median's
    (rounded outwards), clamped to the sample."""
    ordered = sorted(values)
    n = len(ordered)
    middle, half = (n - 1) / 2, z * n**0.5 / 2
    return ordered[max(0, math.floor(middle - half))], ordered[min(n - 1, math.ceil(middle + half))]


def time_per_call(fn: Callable[[], Any], calls: int) -> float:
    """Seconds per call of ``fn``, over ``calls`` back-to-back calls."""
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


@dataclass(frozen=True)
class Ratio:
    """``subject / baseline`` for one case; ``higher_is_better`` says which way the target points."""

    case: str
    subject: str
    baseline: str
    by_min: float
    by_median: float
    higher_is_better: bool

    def to_json(self) -> dict[str, Any]:
        return {
            "case": self.case,
            "subject": self.subject,
            "baseline": self.baseline,
            "by_min": self.by_min,
            "by_median": self.by_median,
            "higher_is_better": self.higher_is_better,
        }


def ratio(
    case: str, samples: Mapping[str, Samples], subject: str, baseline: str, *, higher_is_better: bool = False
) -> Ratio:
    """The ratio of the best and of the median sample of ``subject`` to those of ``baseline``.

    For times (lower is better) the best sample is the minimum; for throughputs the maximum.
    """
    s, b = samples[subject], samples[baseline]
    best_s, best_b = (s.max, b.max) if higher_is_better else (s.min, b.min)
    return Ratio(case, subject, baseline, best_s / best_b, s.median / b.median, higher_is_better)


def paired(
    samples: Mapping[str, Samples], subject: str, baseline: str, figure: Callable[[float, float], float]
) -> Samples:
    """``figure(subject's sample, baseline's sample)`` for each repeat, in the repeats' order.

    The two samples of one repeat were taken at the same moments of machine load (interleaved),
    so a figure of the pair (a difference, a ratio) leaves out the load the sides shared.
    """
    return Samples([figure(s, b) for s, b in zip(samples[subject].values, samples[baseline].values, strict=True)])


def repeats_for(quick: bool, full: int, quick_repeats: int = MIN_REPEATS) -> int:
    """How many repeats a benchmark runs: never fewer than :data:`MIN_REPEATS`."""
    return max(MIN_REPEATS, quick_repeats if quick else full)


def pick(seq: Sequence[Any], quick: bool, quick_seq: Sequence[Any]) -> list[Any]:
    """The sizes a benchmark sweeps: all of ``seq``, or ``quick_seq`` in quick mode."""
    return list(quick_seq if quick else seq)
