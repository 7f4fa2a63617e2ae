"""The report's figures (matplotlib, no pyplot: no global state, no display needed).

Every function returns a `Plot` holding the arrays read back from the figure's artists after
drawing, so tests check what was actually plotted rather than what was meant to be.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.collections import PathCollection
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from altgrad.config import BASELINE
from altgrad.experiment import TrialRecord
from altgrad.report.findings import SIGNALS, Findings, format_key, stop_step

STABILITY_METRICS = ("quant/bit_stall_rate", "quant/overflow_rate", "shadow/cos_mean")
THRESHOLDS = {key: threshold for key, threshold, _ in SIGNALS}


@dataclass(frozen=True)
class Plot:
    path: Path
    title: str
    lines: dict[tuple[str, str], tuple[np.ndarray, np.ndarray]]  # (panel, label) -> x, y
    images: dict[str, np.ndarray]  # panel -> heatmap values (NaN where nothing finite)
    collapses: dict[str, list[float]]  # panel -> steps of the collapse markers


def color(fmt: str) -> str | tuple[float, ...]:
    """One colour per format across all figures (by exponent bits); bf16 black."""
    return "black" if fmt == BASELINE else colormaps["tab10"](format_key(fmt)[0] % 10)


def _save(fig: Figure, path: Path) -> Plot:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    lines, images, collapses = {}, {}, {}
    for ax in fig.axes:
        for marks in ax.collections:
            if isinstance(marks, PathCollection):
                collapses.setdefault(ax.get_title(), []).extend(marks.get_offsets()[:, 0].tolist())
        for line in ax.get_lines():
            if not line.get_label().startswith("_"):  # "_" = guides (thresholds), not data
                lines[ax.get_title(), line.get_label()] = (np.asarray(line.get_xdata(), float),
                                                           np.asarray(line.get_ydata(), float))
        for image in ax.images:
            images[ax.get_title()] = np.ma.filled(np.ma.asarray(image.get_array(), float), np.nan)
    return Plot(path, fig.get_suptitle() or fig.axes[0].get_title(), lines, images, collapses)


def _line_label(r: TrialRecord, seeded: bool) -> str:
    return f"{r.format} s{r.seed}" if seeded else r.format


def _curve(ax: Axes, r: TrialRecord, steps: list[int], values: list[float], seeded: bool) -> None:
    """One trial's series (non-finite points are gaps); an "x" on the top edge marks its collapse."""
    y = np.array(values, float)
    y[~np.isfinite(y)] = np.nan
    baseline = r.format == BASELINE
    ax.plot(steps, y, color=color(r.format), label=_line_label(r, seeded),
            ls="--" if baseline else "-", lw=1.6 if baseline else 1.2)
    step, collapsed = stop_step(r)
    if collapsed:  # x in data, y in axes coordinates: visible however far the loss went
        ax.scatter([step], [0.96], transform=ax.get_xaxis_transform(), marker="x", s=60,
                   color=color(r.format), zorder=3, clip_on=False)


def _trials(records: list[TrialRecord], optimizer: str, precision: str) -> list[TrialRecord]:
    return sorted((r for r in records if r.format != BASELINE and r.optimizer == optimizer
                   and r.precision == precision and r.history), key=lambda r: (format_key(r.format), r.seed))


def plot_loss(records: list[TrialRecord], findings: Findings, optimizer: str, path: Path) -> Plot:
    """Validation loss vs step, one panel per layer precision, bf16 dashed black in each."""
    seeded = len({r.seed for r in records}) > 1
    fig = Figure(figsize=(4.5 * len(findings.precisions), 3.6), layout="constrained")
    axes = fig.subplots(1, len(findings.precisions), squeeze=False, sharey=True)[0]
    starts, finite = [], []
    for ax, precision in zip(axes, findings.precisions, strict=True):
        for r in findings.baselines.get(optimizer, []) + _trials(records, optimizer, precision):
            steps, values = r.val_series()
            _curve(ax, r, steps, values, seeded)
            starts += [v for v in values[:1] if math.isfinite(v)]
            finite += [v for v in values if math.isfinite(v)]
        ax.set(title=f"precision: {precision}", xlabel="step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("validation loss")
    if starts:  # diverging trials leave through the top (the initial loss): the useful range stays readable
        low, high = min(finite), max(max(starts), min(finite) + 1e-6)
        axes[0].set_ylim(low - 0.03 * (high - low), high + 0.03 * (high - low))
    fig.suptitle(f"Validation loss vs bf16 — optimizer {optimizer}")
    return _save(fig, path)


def plot_stability(records: list[TrialRecord], findings: Findings, optimizer: str, path: Path) -> Plot:
    """Bit-stall, overflow and FP32-shadow cosine over steps: rows = metric, columns = precision."""
    seeded = len({r.seed for r in records}) > 1
    precisions = findings.precisions
    width, height = max(4.5 * len(precisions), 5.0), 8.0  # fixed margins (inches): a layout engine doubles the time
    fig = Figure(figsize=(width, height))
    grid = fig.subplots(len(STABILITY_METRICS), len(precisions), squeeze=False, sharex=True, gridspec_kw=dict(
        left=0.75 / width, right=1 - 0.2 / width, bottom=0.6 / height, top=1 - 0.65 / height,
        hspace=0.3, wspace=0.25))
    for row, metric in zip(grid, STABILITY_METRICS, strict=True):
        for ax, precision in zip(row, precisions, strict=True):
            for r in _trials(records, optimizer, precision):
                steps, values = r.series(metric)
                if steps:
                    _curve(ax, r, steps, values, seeded)
            if metric == "quant/overflow_rate":  # rare events matter: show 0, 1e-4 and 0.5 alike
                ax.set_yscale("symlog", linthresh=1e-4)
            if metric in THRESHOLDS:
                ax.axhline(THRESHOLDS[metric], color="grey", ls=":", lw=1, label="_threshold")
            ax.set_title(f"{precision}: {metric}", fontsize=9)
            ax.grid(alpha=0.3)
    for ax in grid[0]:  # one legend per column is enough
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6)
    for ax in grid[-1]:
        ax.set_xlabel("step")
    fig.suptitle(f"Stability signals — optimizer {optimizer}")
    return _save(fig, path)


def plot_heatmap(findings: Findings, optimizer: str, path: Path) -> Plot:
    """Best val loss / bf16 over format × precision. Only usable cells are coloured: grey hatched
    = no trial, no finite loss (×), or a trial that broke (its stop reason, and the ratio it had
    reached before breaking in brackets)."""
    formats, precisions = findings.formats, findings.precisions
    cells = [[findings.cells.get((f, optimizer, p)) for p in precisions] for f in formats]
    ratio = np.array([[c.ratio if c and not c.broke else np.nan for c in row] for row in cells], float)
    fig = Figure(figsize=(max(1.8 + 1.3 * len(precisions), 4.8), 1.2 + 0.55 * len(formats)), layout="constrained")
    ax = fig.subplots()
    finite = ratio[np.isfinite(ratio)]  # colour range: at least 1 ± 0.1 around bf16, at most 2×
    image = ax.imshow(np.ma.masked_invalid(ratio), cmap=colormaps["RdYlGn_r"].with_extremes(bad="lightgrey"),
                      aspect="auto", vmin=finite.min(initial=1.0),
                      vmax=float(np.clip(finite.max(initial=1.1), 1.1, 2.0)))
    for i, row in enumerate(cells):
        for j, cell in enumerate(row):
            if math.isfinite(ratio[i, j]):  # a cut trial (asha) was compared at fewer steps: say so
                text = f"{ratio[i, j]:.3f}" + "".join(f"\n({s})" for s in cell.stops)
            else:
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, hatch="//", edgecolor="grey", lw=0))
                text = "no trial" if cell is None else "× " + (",".join(cell.stops) or "no finite loss")
                if cell is not None and math.isfinite(cell.ratio):
                    text += f"\n({cell.ratio:.3f})"
            ax.text(j, i, text, ha="center", va="center", fontsize=8)
    ax.set(xticks=range(len(precisions)), xticklabels=precisions, yticks=range(len(formats)),
           yticklabels=formats, xlabel="layer precision", title=f"Best val loss / bf16 — optimizer {optimizer}")
    fig.colorbar(image, ax=ax, label="× bf16 (lower is better)")
    return _save(fig, path)


def plot_all(records: list[TrialRecord], findings: Findings, out_dir: Path) -> dict[str, list[Plot]]:
    """Every figure of the report, per optimizer; keys: "loss", "heatmap", "stability"."""
    plots: dict[str, list[Plot]] = {"loss": [], "heatmap": [], "stability": []}
    for opt in findings.optimizers:
        plots["loss"].append(plot_loss(records, findings, opt, out_dir / f"loss_{opt}.png"))
        if findings.formats:
            plots["heatmap"].append(plot_heatmap(findings, opt, out_dir / f"heatmap_{opt}.png"))
            plots["stability"].append(plot_stability(records, findings, opt, out_dir / f"stability_{opt}.png"))
    return plots
