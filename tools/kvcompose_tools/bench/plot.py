"""PNG drawing of a benchmark's ratios (needs matplotlib: ``pip install 'kvcompose-tools[bench]'``)."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

from kvcompose_tools.bench.report import Result


class PlotUnavailable(RuntimeError):
    """``--png`` was asked for but matplotlib is not installed."""


def require_matplotlib() -> None:
    """Fail before any benchmark runs, with the fix, when PNGs cannot be drawn."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise PlotUnavailable(
            "--png needs matplotlib, which is not installed; install it with "
            "`pip install 'kvcompose-tools[bench]'` (or `pip install matplotlib`)"
        ) from exc


def draw(result: Result, directory: Path) -> Path:
    """One horizontal bar per ratio (median, with the best sample marked) and the target line;
    a benchmark with TTFT by turn index (``config["ttft_by_turn"]``) draws that instead."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # no display here
    import matplotlib.pyplot as plt

    if "ttft_by_turn" in result.config:
        return _draw_turns(result, directory, plt)

    ratios = result.ratios
    labels = [
        f"{r.case}\n{r.subject} / {r.baseline}" if len({(q.subject, q.baseline) for q in ratios}) > 1 else r.case
        for r in ratios
    ]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(ratios) + 1.6))
    ys = range(len(ratios))
    ax.barh(list(ys), [r.by_median for r in ratios], color="#4c72b0", label="median ratio")
    ax.scatter(
        [r.by_min for r in ratios], list(ys), color="black", marker="|", s=200, zorder=3, label="best-sample ratio"
    )
    if result.target is not None:
        ax.axvline(result.target.value, color="#c44e52", linestyle="--", label=f"target {result.target}")
    ax.set_yticks(list(ys), labels, fontsize=8)
    ax.invert_yaxis()
    m = result.machine
    ax.set_xlabel(f"ratio ({'higher' if any(r.higher_is_better for r in ratios) else 'lower'} is better)")
    ax.set_title(
        f"{result.title}\n{m['cores']} cores, {result.repeats} interleaved repeats{' (quick)' if result.quick else ''}",
        fontsize=9,
    )
    ax.legend(fontsize=7, loc="best")
    return _save(fig, plt, directory, result.name)


def _draw_turns(result: Result, directory: Path, plt: Any) -> Path:
    """Per link, TTFT p50 by turn index (the median over the runs), one line per side; beside it,
    where a request's time goes per side (``config["breakdown_ms"]``), a stacked bar each."""
    by_link: dict[str, dict[str, list[float]]] = result.config["ttft_by_turn"]
    parts: dict[str, dict[str, dict[str, float]]] = result.config.get("breakdown_ms", {})
    cols = 2 if parts else 1
    fig, axes = plt.subplots(len(by_link), cols, figsize=(6.5 * cols, 3.8 * len(by_link)), squeeze=False)
    for row, (link, sides) in zip(axes, by_link.items(), strict=True):
        ax = row[0]
        for side, ttfts in sides.items():
            ax.plot(range(1, len(ttfts) + 1), [t * 1e3 for t in ttfts], marker="o", label=side)
        ax.set_xticks(range(1, max((len(t) for t in sides.values()), default=0) + 1))
        ax.set_title(f"{link} link: TTFT p50 by turn", fontsize=9)
        ax.set_xlabel("turn")
        ax.set_ylabel("TTFT p50 (ms)")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
        if parts:
            _draw_breakdown(row[1], parts.get(link, {}), f"{link} link: where a request's time goes")
    fig.suptitle("\n".join(textwrap.wrap(result.title, 90)), fontsize=9)
    return _save(fig, plt, directory, result.name)


def _draw_breakdown(ax: Any, by_side: dict[str, dict[str, float]], title: str) -> None:
    """One horizontal bar per side, its parts (ms per request, from vLLM's histograms) stacked."""
    sides = list(by_side)
    labels = list(next(iter(by_side.values()), {}))
    left = [0.0] * len(sides)
    for label in labels:
        widths = [max(0.0, by_side[s].get(label, 0.0)) for s in sides]
        ax.barh(sides, widths, left=left, label=label)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.invert_yaxis()
    ax.set_xlabel("ms per request (vLLM's histograms, mean over runs)")
    ax.set_title(title, fontsize=9)
    ax.tick_params(axis="y", labelsize=8)
    ax.legend(fontsize=6, loc="lower right")


def _save(fig: Any, plt: Any, directory: Path, name: str) -> Path:
    fig.tight_layout()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
