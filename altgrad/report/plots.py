"""The report's figures (matplotlib, no pyplot: no global state, no display needed).

Every function returns a `Plot` holding the arrays read back from the figure's artists after
drawing, so tests check what was actually plotted rather than what was meant to be.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib import colormaps
from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.collections import PathCollection, PolyCollection
from matplotlib.colors import Normalize
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle

from altgrad.experiment import TrialRecord
from altgrad.metrics import (
    BACKWARD_OVERFLOW_RATE,
    BACKWARD_UNDERFLOW_RATE,
    BIT_STALL_RATE,
    FORWARD_OVERFLOW_RATE,
    FORWARD_UNDERFLOW_RATE,
    GRAD_DEAD_FRAC,
    OVERFLOW_RATE,
    SHADOW_COS_MEAN,
    UNDERFLOW_RATE,
    ZERO_UPDATE_FRAC,
)
from altgrad.precision import BASELINE
from altgrad.report.findings import Findings, twins_text
from altgrad.report.records import (
    AxesKey,
    axes_text,
    baseline_trials,
    broke,
    format_key,
    furthest_eval,
    metric_series,
    short_seeds,
    signals,
    stop_step,
)


@dataclass(frozen=True)
class StabilityRow:
    """One row of the stability figure. Every signal the failure table reads is drawn, with each
    run's threshold; overflow and underflow by pass, as the table names them ("backward
    underflow"), so a failure's evidence can be found on a plot."""

    title: str  # the panels' title after the layer precision
    label: str  # the y axis's
    metrics: dict[str, str]  # pass ("" for a single metric) -> the metric drawn with that pass's line style
    symlog: bool = False  # rare events matter: 0, 1e-4 and 0.5 alike readable


BOTH_PASSES = "both passes"  # the rate a run logged before the rates by pass
PASS_STYLES = {"": "-", "forward": "-", "backward": "--", BOTH_PASSES: "-."}

# Rates by pass replace the rate over both passes, which only runs recorded before the rates by pass
# have; such a run draws that rate instead (dash-dotted: dotted lines are the thresholds).
STABILITY_ROWS = (
    StabilityRow(BIT_STALL_RATE, "bit-stall rate", {"": BIT_STALL_RATE}),
    StabilityRow(f"{OVERFLOW_RATE} by pass", "overflow rate", {
        "forward": FORWARD_OVERFLOW_RATE, "backward": BACKWARD_OVERFLOW_RATE, BOTH_PASSES: OVERFLOW_RATE},
        symlog=True),
    StabilityRow(f"{UNDERFLOW_RATE} by pass", "underflow rate", {
        "forward": FORWARD_UNDERFLOW_RATE, "backward": BACKWARD_UNDERFLOW_RATE, BOTH_PASSES: UNDERFLOW_RATE},
        symlog=True),
    StabilityRow(f"{GRAD_DEAD_FRAC}, mean over layers", "dead-gradient fraction", {"": GRAD_DEAD_FRAC}),
    StabilityRow(ZERO_UPDATE_FRAC, "zero-update fraction", {"": ZERO_UPDATE_FRAC}),
    StabilityRow(SHADOW_COS_MEAN, "cosine to FP32 gradients", {"": SHADOW_COS_MEAN}),
)
ALONE = " alone"  # a seed's loss curve past the steps every seed of its group evaluated
COLLAPSE_MARKER = "x"  # where a trial collapsed (non-finite)
STOP_MARKER = "v"  # where a trial that broke without collapsing was stopped (ASHA, bit-stall)
BAND = " seeds"  # a format's band from its lowest to its highest seed
LEGEND_WIDTH = 1.0  # inches right of the panels for a figure's legend, so it covers no data
THRESHOLD_LABEL = "_threshold"  # "_": matplotlib keeps it out of the legend


@dataclass(frozen=True)
class Plot:
    path: Path
    title: str
    lines: dict[tuple[str, str], tuple[np.ndarray, np.ndarray]]  # (panel, label) -> x, y
    images: dict[str, np.ndarray]  # panel -> heatmap values (NaN where nothing finite)
    shades: dict[str, np.ndarray]  # panel -> the heatmap's colours as drawn, RGBA per cell
    collapses: dict[str, list[float]]  # panel -> steps of the collapse markers
    stops: dict[str, list[float]]  # panel -> steps of the marks where a broken trial was stopped
    bands: dict[tuple[str, str], tuple[np.ndarray, np.ndarray, np.ndarray]]  # (panel, label) -> x, lo, hi
    texts: dict[str, list[str]]  # panel -> the annotations written on it, in drawing order
    thresholds: dict[str, list[float]]  # panel -> the levels of its threshold guides
    limits: dict[str, tuple[tuple[float, float], tuple[float, float]]]  # panel -> (x range, y range) shown


# tab10's entries for e0 ... e7 exponent bits. Its brown (beside e3's red) and grey (beside bf16's
# black and the grey seed bands) are left out, so no two formats nor a format and bf16 look alike.
FORMAT_COLORS = (0, 1, 2, 3, 4, 9, 6, 8)


def color(fmt: str) -> str | tuple[float, ...]:
    """One colour per format across all figures (by exponent bits); bf16 black."""
    if fmt == BASELINE:
        return "black"
    return colormaps["tab10"](FORMAT_COLORS[format_key(fmt)[0] % len(FORMAT_COLORS)])


def _save(fig: Figure, path: Path) -> Plot:
    """Draw, save, and read every plotted array back from the figure's artists."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    lines, images, shades, collapses, stops, bands, texts, thresholds, limits = {}, {}, {}, {}, {}, {}, {}, {}, {}
    for ax in fig.axes:
        panel = ax.get_title()
        limits[panel] = (ax.get_xlim(), ax.get_ylim())
        for marks in ax.collections:
            if isinstance(marks, PathCollection):
                into = stops if marks.get_gid() == STOP_MARKER else collapses
                into.setdefault(panel, []).extend(marks.get_offsets()[:, 0].tolist())
            elif isinstance(marks, PolyCollection) and marks.get_paths() and not marks.get_label().startswith("_"):
                vertices = marks.get_paths()[0].vertices  # the outline: lo forwards, hi back
                x = np.unique(vertices[:, 0])
                lo = np.array([vertices[vertices[:, 0] == v, 1].min() for v in x])
                hi = np.array([vertices[vertices[:, 0] == v, 1].max() for v in x])
                bands[panel, marks.get_label()] = (x, lo, hi)
        for line in ax.get_lines():
            if line.get_label() == THRESHOLD_LABEL:
                thresholds.setdefault(panel, []).append(float(line.get_ydata()[0]))
            elif not line.get_label().startswith("_"):  # "_" = guides (thresholds), not data
                lines[panel, line.get_label()] = (np.asarray(line.get_xdata(), float),
                                                  np.asarray(line.get_ydata(), float))
        for image in ax.images:
            images[panel] = np.ma.filled(np.ma.asarray(image.get_array(), float), np.nan)
            shades[panel] = image.to_rgba(image.get_array())
        if ax.texts:
            texts[panel] = [t.get_text() for t in ax.texts]
    return Plot(path, fig.get_suptitle() or fig.axes[0].get_title(), lines, images, shades, collapses, stops,
                bands, texts, thresholds, limits)


def _stop_mark(ax: Axes, r: TrialRecord, since: float = -math.inf) -> None:
    """On the top edge (visible however far the curve went), a COLLAPSE_MARKER at the step where a
    trial collapsed, or a STOP_MARKER where one that broke otherwise was stopped (ASHA, bit-stall): its
    curve ends there, not where a healthy run's would. Left out before `since`: a panel showing
    only later steps (unclipped, the mark would land over the panel beside it)."""
    step, collapsed = stop_step(r)
    if step is not None and step >= since and (collapsed or broke(r)):
        marker = COLLAPSE_MARKER if collapsed else STOP_MARKER  # also its gid, which `_save` sorts by
        ax.scatter([step], [0.96], transform=ax.get_xaxis_transform(), marker=marker, s=60 if collapsed else 40,
                   color=color(r.format), zorder=3, clip_on=False, gid=marker)


def _curve(ax: Axes, r: TrialRecord, steps: list[int], values: list[float], what: str = "") -> None:
    """One trial's series (non-finite points are gaps), labelled `<format> s<seed>` and `what` (a
    pass: its line style)."""
    ax.plot(steps, _gaps(values), color=color(r.format), label=" ".join(x for x in (r.format, f"s{r.seed}", what) if x),
            ls=PASS_STYLES[what], lw=1.0)


def _gaps(values: Sequence[float]) -> np.ndarray:
    """`values` with every non-finite one NaN: matplotlib leaves a gap there (an inf it would draw)."""
    y = np.array(values, float)
    y[~np.isfinite(y)] = np.nan
    return y


def _drawn_passes(r: TrialRecord, row: StabilityRow) -> dict[str, tuple[list[int], list[float]]]:
    """pass -> the series a trial draws in a row: the passes it logged, else the rate over both."""
    logged = {what: series for what, metric in row.metrics.items() if (series := metric_series(r, metric))[0]}
    by_pass = {what: series for what, series in logged.items() if what not in ("", BOTH_PASSES)}
    return by_pass or logged


def seed_band(trials: list[TrialRecord]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(steps, mean, lowest, highest) of the val loss over seeds, at the steps every seed evaluated
    with a finite loss (a seed that collapsed ends the band where it collapsed)."""
    series = [dict(zip(*t.val_series(), strict=True)) for t in trials]
    steps = sorted(set.intersection(*(set(s) for s in series))) if series else []
    steps = [s for s in steps if all(math.isfinite(x[s]) for x in series)]
    values = np.array([[x[s] for s in steps] for x in series], float).reshape(len(series), len(steps))
    return np.array(steps, float), values.mean(0), values.min(0), values.max(0)


def _mean_curve(ax: Axes, fmt: str, trials: list[TrialRecord], label: str, since: float = -math.inf) -> None:
    """The seeds' mean and band where all of them evaluated, then each seed that went further on
    its own, thin and dotted from the band's last step: a seed that stopped early (NaN, bit-stall,
    ASHA) stays in its cell, and its end is not the others'."""
    steps, mean, lo, hi = seed_band(trials)
    baseline = fmt == BASELINE
    ax.plot(steps, mean, color=color(fmt), label=label, ls="--" if baseline else "-", lw=1.6 if baseline else 1.2)
    if len(trials) > 1 and len(steps):
        ax.fill_between(steps, lo, hi, color=color(fmt), alpha=0.15, lw=0, label=f"{label}{BAND}")
    end = steps[-1] if len(steps) else -math.inf
    for t in trials:
        beyond = [(s, v) for s, v in zip(*t.val_series(), strict=True) if s >= end]
        if len(trials) > 1 and any(s > end and math.isfinite(v) for s, v in beyond):
            x, y = zip(*beyond, strict=True)
            ax.plot(x, _gaps(y), color=color(fmt), label=f"{label} s{t.seed}{ALONE}", ls=":", lw=0.9)
        _stop_mark(ax, t, since)


def _facets(findings: Findings) -> list[tuple[str, AxesKey]]:
    return [(o, ax) for o in findings.optimizers for ax in findings.axes
            if any((c.optimizer, c.axes) == (o, ax) for c in findings.cells.values())]


def _suffix(axes: AxesKey) -> str:
    return "" if not axes else f" ({axes_text(axes)})"


def plot_loss(findings: Findings, optimizer: str, axes: AxesKey, path: Path) -> Plot:
    """Validation loss vs step per format (mean over seeds, band = lowest to highest seed), one
    column per layer precision, bf16 dashed black in each: the whole run on top, and below it the
    second half, zoomed to the losses of the trials that did not break. On the whole run's scale,
    set by the initial loss, formats a percent apart draw one line (the CPU study's nine did)."""
    precisions = findings.precisions
    fig = Figure(figsize=(4.5 * len(precisions) + LEGEND_WIDTH + 0.6, 6.8), layout="constrained")
    grid = fig.subplots(2, len(precisions), squeeze=False)
    bf16 = baseline_trials(findings.baselines.get(optimizer, []), axes)
    # as the tables rule for a cell at bf16's furthest step: a bf16 seed short of it is no baseline.
    # One still running is left out; one that stopped (NaN) is drawn on its own: a broken reference
    # is news.
    short = short_seeds(bf16)
    stopped = [t for t in bf16 if t.seed in short and t.stop_reason]
    bf16 = [t for t in bf16 if t.seed not in short]
    starts, finite = [], []
    for (whole, zoom), precision in zip(grid.T, precisions, strict=True):
        groups = [(BASELINE, BASELINE, bf16)] if bf16 else []
        # a cell's seeds as its numbers take them: one cut short would end the band where it stopped
        cells = [c for c in sorted(findings.cells.values(), key=lambda c: format_key(c.format))
                 if (c.optimizer, c.precision, c.axes) == (optimizer, precision, axes)]
        groups += [(c.format, c.name, [t for t in c.trials if t.seed not in c.short]) for c in cells]
        # in the panel: the legend, figure-wide, names a format once for every precision
        said = []
        if broken := [f"{c.name} ({', '.join(c.stops)})" for c in cells if c.broke]:
            said.append(f"broke: {'; '.join(broken)}")
        if twins := twins_text((c.name, c.twin_of) for c in cells if c.twin_of):
            said.append(twins)
        if said:
            whole.text(0.01, 0.01, "\n".join(said), transform=whole.transAxes, fontsize=7,
                       ha="left", va="bottom", bbox={"facecolor": "white", "alpha": 0.7, "lw": 0})
        last = furthest_eval(t for _, _, trials in groups for t in trials)
        half, late = last // 2, []
        for fmt, label, trials in groups:
            _mean_curve(whole, fmt, trials, label)
            _mean_curve(zoom, fmt, trials, label, since=half)
            for t in trials:
                steps, values = t.val_series()
                starts += [v for v in values[:1] if math.isfinite(v)]
                finite += [v for v in values if math.isfinite(v)]
                if not broke(t):
                    late += [v for s, v in zip(steps, values, strict=True) if s >= half and math.isfinite(v)]
        for t in stopped:
            steps, values = t.val_series()
            for ax, since in ((whole, -math.inf), (zoom, half)):
                ax.plot(steps, _gaps(values), color=color(BASELINE), ls=":", lw=0.9,
                        label=f"{BASELINE} s{t.seed}: {t.stop_reason} at step {stop_step(t)[0]}, not the reference")
                _stop_mark(ax, t, since)
        whole.set(title=f"precision: {precision}", xlabel="step")
        zoom.set(title=f"precision: {precision}, steps {half}-{last}", xlabel="step")
        if last > half:
            zoom.set_xlim(half, last)
        if late:
            zoom.set_ylim(*_padded(min(late), max(late)))
        elif groups:  # every trial broke: the panel would zoom on the broken curves
            zoom.text(0.5, 0.5, "every trial broke", transform=zoom.transAxes, ha="center", va="center")
    for ax in grid.flat:
        ax.grid(alpha=0.3)
    grid[0, 0].set_ylabel("validation loss")
    grid[1, 0].set_ylabel("validation loss, second half")
    if starts:  # diverging trials leave through the top (the initial loss): the useful range stays readable
        for ax in grid[0]:
            ax.set_ylim(*_padded(min(finite), max(max(starts), min(finite) + 1e-6)))
    fig.legend(handles=_loss_legend(grid[0]), loc="outside right center", fontsize=7, frameon=False)
    fig.suptitle(f"Validation loss vs {BASELINE} — optimizer {optimizer}{_suffix(axes)}")
    return _save(fig, path)


def _padded(low: float, high: float) -> tuple[float, float]:
    """(low, high) widened by 3 % of their span each way (a flat span: of its value)."""
    pad = 0.03 * ((high - low) or abs(high) or 1.0)
    return low - pad, high + pad


def _loss_legend(panels: Iterable[Axes]) -> list[Artist]:
    """One entry per curve label over the panels, then one for every seed band and one for every
    seed drawn alone (per format they would double the legend)."""
    handles: dict[str, Artist] = {}
    for ax in panels:
        for h in ax.get_legend_handles_labels()[0]:
            handles.setdefault(h.get_label(), h)
    curves = [h for label, h in handles.items() if not label.endswith((BAND, ALONE))]
    if any(label.endswith(BAND) for label in handles):
        curves.append(Patch(color="black", alpha=0.15, lw=0, label="lowest to highest seed"))
    if any(label.endswith(ALONE) for label in handles):
        curves.append(Line2D([], [], color="black", ls=":", lw=0.9, label=f"a seed{ALONE}"))
    marks = {m.get_gid() for ax in panels for m in ax.collections if isinstance(m, PathCollection)}
    if COLLAPSE_MARKER in marks:
        curves.append(Line2D([], [], color="black", marker=COLLAPSE_MARKER, ls="", label="collapsed (non-finite)"))
    if STOP_MARKER in marks:
        curves.append(Line2D([], [], color="black", marker=STOP_MARKER, ls="", label="stopped: broke"))
    return curves


def plot_stability(findings: Findings, optimizer: str, axes: AxesKey, path: Path) -> Plot:
    """Bit-stall, overflow and underflow by pass, dead-gradient and zero-update fractions, and
    FP32-shadow cosine over steps: rows = signal, columns = precision."""
    precisions = findings.precisions
    # fixed margins (inches): a layout engine doubles the time
    width, height = max(4.5 * len(precisions), 5.0) + LEGEND_WIDTH, 2.0 + 2.0 * len(STABILITY_ROWS)
    fig = Figure(figsize=(width, height))
    grid = fig.subplots(len(STABILITY_ROWS), len(precisions), squeeze=False, sharex=True, gridspec_kw=dict(
        left=0.75 / width, right=1 - (0.2 + LEGEND_WIDTH) / width, bottom=0.6 / height, top=1 - 0.65 / height,
        hspace=0.3, wspace=0.25))
    plotted: set[str] = set()
    passes: set[str] = set()
    for panels, row in zip(grid, STABILITY_ROWS, strict=True):
        for ax, precision in zip(panels, precisions, strict=True):
            cells = sorted((c for c in findings.cells.values()
                            if (c.optimizer, c.precision, c.axes) == (optimizer, precision, axes)),
                           key=lambda c: format_key(c.format))
            trials = [t for c in cells for t in sorted(c.trials, key=lambda t: t.seed)]
            for r in trials:
                drawn = _drawn_passes(r, row)
                for what, (steps, values) in drawn.items():
                    _curve(ax, r, steps, values, what)
                    passes.add(what)
                if drawn:
                    _stop_mark(ax, r)
                    plotted.add(r.format)
            if row.symlog:
                ax.set_yscale("symlog", linthresh=1e-4)
            metrics = set(row.metrics.values())
            for threshold in sorted({t for r in trials for key, t, _ in signals(r.stability) if key in metrics}):
                ax.axhline(threshold, color="grey", ls=":", lw=1, label=THRESHOLD_LABEL)  # each run's own
            ax.set_title(f"{precision}: {row.title}", fontsize=9)
            ax.grid(alpha=0.3)
        panels[0].set_ylabel(row.label, fontsize=8)
    if plotted:  # one entry per format (its seeds share its colour) and per pass style, beside the panels
        handles = [Line2D([], [], color=color(f), lw=1.0, label=findings.measured_name(f))
                   for f in sorted(plotted, key=format_key)]
        handles += [Line2D([], [], color="black", lw=1.0, ls=PASS_STYLES[what], label=what)
                    for what in PASS_STYLES if what in passes and what]
        fig.legend(handles=handles, loc="center right", fontsize=7,
                   title="format, pass" if passes - {""} else "format", title_fontsize=7, frameon=False)
    for ax in grid[-1]:
        ax.set_xlabel("step")
    fig.suptitle(f"Stability signals — optimizer {optimizer}{_suffix(axes)}")
    return _save(fig, path)


def ratio_norm(ratio: np.ndarray) -> Normalize:
    """The heatmap's colour scale: × bf16 = 1 at the colour map's middle whatever the range, so
    that green is better and red worse, and one distance from 1 the same depth of colour on either
    side: 1 ± the data's furthest distance from 1, at least 0.1, at most 1."""
    finite = ratio[np.isfinite(ratio)]
    half = float(np.clip(np.abs(finite - 1.0).max(initial=0.0), 0.1, 1.0))
    return Normalize(vmin=1.0 - half, vmax=1.0 + half)


def plot_heatmap(findings: Findings, optimizer: str, axes: AxesKey, path: Path) -> Plot:
    """× bf16 over format × precision, annotated `ratio ± half-width` ("format shift" where a seed
    shifted layers to another format before an evaluation). Only usable cells are coloured: grey hatched = no trial, no
    evaluation yet, no finite loss (×), a trial that broke (its stop reason), or no bf16 seed that
    evaluated up to the cell's steps."""
    formats, precisions = findings.formats, findings.precisions
    cells = [[findings.cell(f, optimizer, p, axes) for p in precisions] for f in formats]
    ratio = np.array([[c.ratio.mean if c and not c.broke else np.nan for c in row] for row in cells], float)
    # tall enough for the colour bar's two-line label, which constrained layout does not shrink
    fig = Figure(figsize=(max(1.8 + 1.5 * len(precisions), 6.4), max(1.2 + 0.6 * len(formats), 2.4)),
                 layout="constrained")
    ax = fig.subplots()
    image = ax.imshow(np.ma.masked_invalid(ratio), cmap=colormaps["RdYlGn_r"].with_extremes(bad="lightgrey"),
                      aspect="auto", norm=ratio_norm(ratio))
    for i, row in enumerate(cells):
        for j, cell in enumerate(row):
            if math.isfinite(ratio[i, j]):
                hw, d = cell.ratio.half_width, cell.ratio.places(3)
                text = f"{ratio[i, j]:.{d}f}\n" + (f"± {hw:.{d}f}" if hw is not None else f"n = {cell.ratio.n}")
            else:
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, hatch="//", edgecolor="grey", lw=0))
                if cell is None:
                    text = "no trial"
                elif cell.unevaluated:
                    text = "not evaluated yet"
                elif cell.no_baseline and not cell.broke:
                    text = f"no {BASELINE} up to\nstep {cell.steps}"
                else:
                    text = "× " + (",".join(cell.stops) or "no finite loss")
            if formats[i] in findings.aliases and cell is not None:
                text += f"\n≡ {findings.aliases[formats[i]]}"
            if cell is not None and cell.twin_of:  # measured by another precision's cell
                text += f"\n≡ {cell.twin_of}"
            if cell is not None and cell.shifted:  # its numbers are not its format's alone
                text += "\nformat shift"
            ax.text(j, i, text, ha="center", va="center", fontsize=7)
    ax.set(xticks=range(len(precisions)), xticklabels=precisions, yticks=range(len(formats)),
           yticklabels=formats, xlabel="layer precision",
           title=f"Best val loss / {BASELINE} — optimizer {optimizer}{_suffix(axes)}")
    fig.colorbar(image, ax=ax, label=f"× {BASELINE}, mean over seeds\n(lower is better)")
    return _save(fig, path)


def plot_all(findings: Findings, out_dir: Path) -> dict[str, list[Plot]]:
    """Every figure of the report, per optimizer and extra-axis values; keys: "loss", "heatmap",
    "stability"."""
    plots: dict[str, list[Plot]] = {"loss": [], "heatmap": [], "stability": []}
    facets = _facets(findings) or [(o, ()) for o in findings.optimizers]
    for opt, axes in facets:
        stem = "_".join([opt, *(a.replace("=", "-").replace(".", "-") for a in axes_text(axes).split(", ") if a)])
        plots["loss"].append(plot_loss(findings, opt, axes, out_dir / f"loss_{stem}.png"))
        if findings.formats:
            plots["heatmap"].append(plot_heatmap(findings, opt, axes, out_dir / f"heatmap_{stem}.png"))
            plots["stability"].append(plot_stability(findings, opt, axes, out_dir / f"stability_{stem}.png"))
    return plots
