"""report.md: the verdict, then the plots, then the tables, then how every number was computed."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

from altgrad.experiment import UNFINISHED, RunStatus, StopReason, TrialRecord, unfinished_text
from altgrad.report.findings import (
    DEFINITIONS,
    MANIFOLD,
    STANDARD,
    Cell,
    Difference,
    Findings,
    GradientFidelity,
)
from altgrad.report.plots import Plot
from altgrad.report.records import axes_text, format_key, name, where_text
from altgrad.report.stats import FamilyWise, seeds_text

PLOT_SECTIONS = (
    ("heatmap", "Best val loss relative to bf16",
     "Mean over seeds of the per-seed ratio to bf16, ± the half-width of its 95 % interval; lower is "
     "better, 1.000 = bf16. Grey hatched: no trial, not evaluated yet, no finite loss, no bf16 seed "
     "evaluated up to the cell's steps, or a trial that broke (× and its stop reason). \"format shift\": a seed moved layers to another format before "
     "an evaluation. A row marked ≡ repeats an equivalent format's measurement; a square marked "
     "\"≡ <precision>\", that precision's (its layers quantized the same way)."),
    ("loss", "Validation loss vs step",
     "Per format, the mean over seeds, with the band from the lowest to the highest seed, up to the last "
     "step every seed evaluated; past it, each seed that went further alone (dotted); "
     "bf16 dashed black in every panel, over its seeds that reached its furthest evaluation (the "
     "tables judge each cell's baseline against that cell's own steps; a bf16 seed that stopped short "
     "is drawn on its own, dotted black); a panel names its formats whose seeds broke, with why "
     "(\"broke: e4m3 (asha)\"), and on the top edge an \"x\" marks a step where a trial collapsed "
     "(non-finite), a \"▼\" where one that broke otherwise (ASHA, bit-stall) was stopped. "
     "Top: the whole run; below: its second half, on the scale of the losses of the trials that did not "
     "break."),
    ("stability", "Stability signals over steps",
     "Bit-stall rate (updates lost to rounding), overflow and underflow rates by pass (forward solid, "
     "backward dashed; dash-dotted: both passes, a run logged before the rates by pass), the fraction "
     "of gradient elements that are zero (mean over layers), the fraction of weights a step left "
     "unchanged, and cosine to the FP32 shadow gradients, one line per trial; dotted lines are the "
     "thresholds the failure table reads; on the top edge an \"x\" marks a collapse, a \"▼\" where a "
     "trial that broke otherwise was stopped."),
)


def _num(x: float | None, spec: str = ".4f") -> str:
    return format(x, spec) if x is not None and math.isfinite(x) else "—"


def _table(headers: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(_cell_text(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _cell_text(value: object) -> str:
    """A table cell on one line, its pipes escaped: a multi-line error (pydantic's) or a `|` in a
    message would otherwise end the row, and the table, there."""
    return " ".join(str(value).split()).replace("|", "\\|")


def _overview(records: list[TrialRecord], f: Findings) -> str:
    measured = [r for r in records if not r.same_as]
    status = ", ".join(f"{n} {s.lower()}" for s, n in sorted(Counter(r.status for r in measured).items()))
    seeds = sorted({r.seed for r in measured})
    baselines = ", ".join(f"{o} {f.baseline_best(o).text()}"
                          + "".join(f" (provisional: {state})" for state in dict.fromkeys(
                              unfinished_text(t.status) for t in f.baselines[o] if t.status in UNFINISHED))
                          for o in sorted(f.baselines))
    lines = [f"{len(measured)} trials ({status}), seeds {', '.join(map(str, seeds))}. Formats: "
             f"{', '.join(f.formats) or 'none'}; optimizers: {', '.join(f.optimizers)}; layer precisions: "
             f"{', '.join(f.precisions)}" + (f"; extra axes: {', '.join(sorted({p for ax in f.axes for p, _ in ax}))}"
                                             if any(f.axes) else "") +
             f". bf16 best val loss: {baselines or 'none'}.", ""]
    lines += [f"- Sweet spot for **{where_text(s.precision, s.optimizer, s.axes)}**: {s.text}" for s in f.sweet_spots]
    lines += [f"- **Gradients against the FP32 shadow**, {line}." for line in f.fidelity_summary()]
    lines += [f"- **Many comparisons at once:** {m}." for m in f.multiplicity()]
    lines += [f"- **One measurement, two names:** {alias} was not run: under this sweep's per-tensor amax "
              f"scaling it quantizes every tensor exactly like {measured_by} (one grid up to a power of "
              f"two), so {measured_by}'s trials are listed under both names and count once."
              for alias, measured_by in sorted(f.aliases.items())]
    return "\n".join(lines)


def _plots(plots: dict[str, list[Plot]], out_dir: Path) -> str:
    parts = ["## Plots"]
    for kind, heading, caption in PLOT_SECTIONS:
        if plots.get(kind):
            parts += [f"### {heading}", caption]
            parts += [f"![{p.title}]({p.path.relative_to(out_dir).as_posix()})" for p in plots[kind]]
    return "\n\n".join(parts)


def _sweet_spots(f: Findings) -> str:
    rows = [[s.precision, s.optimizer, axes_text(s.axes) or "—", s.text,
             ", ".join(s.excluded) or "—"] for s in f.sweet_spots]
    return _table(["precision", "optimizer", "extra axes", "sweet spot (95 % intervals)",
                   "not eligible (broke / partial budget / format shift / no bf16 at its steps)"], rows)


def _failures(f: Findings) -> str:
    if not f.failures and f.missing:  # trials still to run, or that cannot be read, may yet fail
        return f"No trial has failed so far; {len(f.missing)} not finished (see \"What is missing\")."
    if not f.failures:
        return "Every trial completed without a collapse."
    rows = [[name(x.trial), f.measured_name(x.trial.format), x.trial.optimizer, x.trial.precision,
             axes_text(tuple(sorted(x.trial.axes.items()))) or "—", x.trial.seed,
             x.stop_reason, "—" if x.step is None else f"{x.step} ({'collapse' if x.collapsed else 'stop'})",
             x.where, x.evidence]
            for x in f.failures]
    return _table(["trial", "format", "optimizer", "precision", "extra axes", "seed", "stop reason", "step",
                   "where it failed", "evidence"], rows)


def _warnings(f: Findings) -> str:
    if not f.warnings:
        return "None: no run skipped a non-finite step or crossed a warning threshold."
    rows = [[f.measured_name(w.format), w.optimizer,
             c.precision_label if (c := f.cells.get((w.format, w.optimizer, w.precision, w.axes))) else w.precision,
             axes_text(w.axes) or "—", w.what,
             f"{seeds_text(w.seeds)} of {w.of}", w.first, w.events] for w in f.warnings]
    return _table(["format", "optimizer", "precision", "extra axes", "warning", "seeds", "first at step",
                   "times raised"], rows)


def _family_wise(fw: FamilyWise | None) -> str:
    return fw.text if fw is not None else "—"


def _differences(diffs: list[Difference], empty: str) -> str:
    if not diffs:
        return empty
    # The axes both sides share: held fixed (an axis's effect differs in that axis alone, named by `what`).
    rows = [[d.what, d.a.name, d.a.precision_label, d.a.optimizer if d.a.optimizer == d.b.optimizer else "—",
             axes_text(tuple(i for i in d.a.axes if i in d.b.axes)) or "—",
             d.a.best.text(), d.b.best.text(), d.diff.text(), d.verdict, _family_wise(d.family_wise),
             "; ".join([*filter(None, [d.diff.note]), *_shift_notes(d)]) or "—"]
            for d in diffs]
    return _table(["difference", "format", "precision", "optimizer", "other axes", "first", "second",
                   "second − first (95 %)", "reading", "family-wise (Holm)", "notes"], rows)


def _shift_notes(d: Difference) -> list[str]:
    """Which side of a difference shifted a layer's format: its numbers are not its format's alone."""
    return [f"{side}: {c.shift_text}" for side, c in (("first", d.a), ("second", d.b)) if c.shifted]


def _stops(c: Cell) -> str:
    stops = ", ".join(c.stops) or (RunStatus.RUNNING if c.running else StopReason.COMPLETED)
    return "; ".join(filter(None, [stops, c.shift_text]))


def _seeds(c: Cell) -> str:
    """The cell's seeds; those evaluated short of its steps, left out of its numbers, marked."""
    used = ", ".join(str(s) for s in sorted({t.seed for t in c.trials} - set(c.short)))
    return f"{used} (short, left out: {', '.join(map(str, c.short))})" if c.short else used


def _cells(f: Findings) -> str:
    rows = [[c.name, c.optimizer, c.precision_label,
             axes_text(c.axes) or "—", _seeds(c),
             "not evaluated yet" if c.unevaluated else c.best.text(), c.steps,
             "—" if c.unevaluated or c.no_baseline else c.ratio.text(3), "—" if c.unevaluated else c.vs_bf16,
             _family_wise(c.family_wise), _stops(c)]
            for c in sorted(f.cells.values(), key=lambda c: (c.optimizer, c.precision, c.axes, format_key(c.format)))]
    return _table(["format", "optimizer", "precision", "extra axes", "seeds", "best val loss (95 %)", "steps",
                   "× bf16 (95 %)", "vs bf16", "family-wise (Holm)", "stops"], rows)


def _fidelity_table(fidelity: list[GradientFidelity]) -> str:
    rows = [[g.cell.name, g.cell.optimizer, g.cell.precision_label, axes_text(g.cell.axes) or "—", g.cell.steps,
             f"{g.nonfinite} of {g.shadow_steps}", g.cosine.text(4),
             *(("none", "—") if g.cell.no_baseline else (g.baseline.text(4), g.diff.text(4))),
             g.verdict, _family_wise(g.family_wise), g.cell.vs_bf16, _stops(g.cell)]
            for g in sorted(fidelity, key=lambda g: (g.cell.optimizer, g.cell.precision, g.cell.axes,
                                                      format_key(g.cell.format)))]
    return _table(["format", "optimizer", "precision", "extra axes", "steps", "non-finite shadow steps",
                   "gradient cosine (95 %)", "bf16's", "− bf16 (95 %)", "reading", "family-wise (Holm)",
                   "loss vs bf16", "stops"], rows)


def _pairing(f: Findings) -> str:
    # (a cell with nothing to compare, no evaluation or no finite loss, is no comparison)
    notes = [f"- {c.name} / {where_text(c.precision, c.optimizer, c.axes)}: {c.ratio.note}"
             for c in f.cells.values() if c.ratio.note and c.ratio.n]
    notes += [f"- {d.what}, {d.a.name} / {d.a.precision}: {d.diff.note}" for d in [*f.deltas, *f.axis_effects]
              if d.diff.note]
    notes += [f"- gradient cosine, {g.cell.name} / {where_text(g.cell.precision, g.cell.optimizer, g.cell.axes)}: "
              f"{g.diff.note}" for g in f.fidelity if g.diff.note and not g.cell.no_baseline]
    return "\n".join(notes) or "Every comparison was paired by seed."


def render(records: list[TrialRecord], findings: Findings, plots: dict[str, list[Plot]],
           out_dir: Path, title: str = "AltGrad report") -> str:
    """The whole report.md text; image links are relative to `out_dir`."""
    f = findings
    left_out = f.deltas_left_out()
    sections = [
        f"# {title}", f"**{f.verdict.line}**", _overview(records, f),
        *(["## Notes and anomalies", "\n".join(f"- {n}" for n in f.notes)] if f.notes else []),
        _plots(plots, out_dir),
        "## Sweet spot per layer precision", _sweet_spots(f),
        "## All cells", _cells(f),
        "## Failures and early stops", _failures(f),
        "## Warnings the runs raised", _warnings(f),
        "## Manifold vs standard optimizer",
        _differences(f.deltas, f"n/a: needs both `{STANDARD}` and `{MANIFOLD}` at full budget on the same "
                               f"format and precision (ran: {', '.join(f.optimizers)})."),
        *([f"Not compared, a side broke or ran short: {', '.join(left_out)}."] if left_out else []),
    ]
    axes_left_out = f.axis_effects_left_out()
    if f.axis_effects or axes_left_out:
        sections += ["## Extra grid axes", _differences(f.axis_effects, "No pair of cells ran the full budget on both sides."),
                     *([f"Not compared, a side broke or ran short: {'; '.join(axes_left_out)}."] if axes_left_out else [])]
    if f.fidelity:
        sections += ["## Gradients against the FP32 shadow", _fidelity_table(f.fidelity)]
    sections += [
        "## Comparisons not paired on every seed", _pairing(f),
        "## What is missing",
        "\n".join(f"- {m}" for m in f.missing) or "Nothing: every grid point has a finished trial.",
        "## How these numbers are computed", DEFINITIONS.strip(),
    ]
    return "\n\n".join(sections) + "\n"
