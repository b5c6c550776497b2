"""Stacked bars of step time by operator and backend (matplotlib, optional)."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from pathlib import Path

from fly_lightning.callbacks.breakdown import (
    ATTENTION,
    COMM,
    GEMM,
    OPTIMIZER,
    OTHER,
    OVERHEAD,
    StepBreakdown,
    mean,
    part_order,
)

_FIXED = {GEMM: "#4c72b0", COMM: "#8c564b", OPTIMIZER: "#e377c2", OTHER: "#9e9e9e", OVERHEAD: "#dddddd"}
_GREENS = ("#1b7837", "#5aae61", "#a6dba0", "#00441b", "#7fbc41", "#4d9221")
_ORANGES = ("#e66101", "#fdb863", "#b35806", "#f1a340", "#fee0b6", "#d95f02")
_PURPLES = ("#762a83", "#9970ab", "#c2a5cf")


def save_step_bars(breakdowns: Sequence[StepBreakdown], path: str | Path, max_bars: int = 24) -> Path | None:
    """One stacked bar per profiled step (the last ``max_bars``), plus their mean; returns the path, or None when
    matplotlib is not installed (with a warning saying so)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        warnings.warn(
            "OperatorTime: matplotlib is not installed, so no PNG was written (pip install matplotlib, or "
            "OperatorTime(plot=False) to silence this)",
            stacklevel=2,
        )
        return None
    bars = list(breakdowns[-max_bars:])
    names = [f"step {b.step}" for b in bars]
    if len(bars) > 1:
        bars.append(mean(breakdowns))
        names.append("mean")
    labels = sorted({label for b in bars for label in b.parts_ms}, key=part_order)
    colors = _colors(labels, {s for b in bars for s in b.specialised})
    fig = Figure(figsize=(max(5.0, 1.0 + 0.7 * len(bars)) + 3.5, 5.0))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    bottoms = [0.0] * len(bars)
    xs = list(range(len(bars)))
    for label in labels:
        heights = [b.parts_ms.get(label, 0.0) for b in bars]
        ax.bar(xs, heights, bottom=bottoms, color=colors[label], label=label, edgecolor="white", linewidth=0.5)
        bottoms = [lo + h for lo, h in zip(bottoms, heights, strict=True)]
    ax.scatter(xs, [b.step_ms for b in bars], marker="_", s=400, color="black", zorder=3, label="measured step")
    ax.set_xticks(xs, names, rotation=45 if len(bars) > 6 else 0, ha="right" if len(bars) > 6 else "center")
    unit = "device" if bars[0].device == "cuda" else "CPU"
    ax.set_ylabel(f"ms per step ({unit} time)")
    last = bars[-1]
    title = f"step time by operator: coverage {100 * last.coverage:.1f}%"
    if last.device == "cuda":  # CPU times say nothing about what a GPU kernel would save
        bound = f"{last.amdahl_bound:.2f}x" if math.isfinite(last.amdahl_bound) else "unbounded"
        title += f", Amdahl bound {bound}"
    ax.set_title(title, fontsize=10)
    handles, legend_labels = ax.get_legend_handles_labels()
    ax.legend(handles[::-1], legend_labels[::-1], loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path


def _colors(labels: list[str], specialised: set[str]) -> dict[str, str]:
    """Green shades for specialised operator parts, orange for operators on ATen, fixed colours for the rest."""
    out, green, orange, purple = {}, 0, 0, 0
    for label in labels:
        if label in _FIXED:
            out[label] = _FIXED[label]
        elif label.startswith(ATTENTION + "/"):
            out[label], purple = _PURPLES[purple % len(_PURPLES)], purple + 1
        elif label in specialised:
            out[label], green = _GREENS[green % len(_GREENS)], green + 1
        else:
            out[label], orange = _ORANGES[orange % len(_ORANGES)], orange + 1
    return out
