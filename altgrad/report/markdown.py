"""report.md: the verdict, then the plots, then the tables, then how every number was computed."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

from altgrad.experiment import TrialRecord
from altgrad.report.findings import DEFINITIONS, MANIFOLD, STANDARD, Findings, SweetSpot, name
from altgrad.report.plots import Plot

PLOT_SECTIONS = (
    ("heatmap", "Best val loss relative to bf16",
     "Lower is better; 1.000 = bf16. Grey hatched: no trial, no finite loss, or a trial that broke "
     "(× and its stop reason; in brackets the ratio it had reached before breaking)."),
    ("loss", "Validation loss vs step",
     "bf16 dashed black in every panel; an \"x\" on the top edge marks the step where a trial "
     "collapsed (its first non-finite loss); curves that diverge leave through the top."),
    ("stability", "Stability signals over steps",
     "Bit-stall rate (updates lost to rounding), forward overflow rate and cosine to the FP32 "
     "shadow gradients; dotted lines are the warning thresholds."),
)


def _num(x: float | None, spec: str = ".4f") -> str:
    return format(x, spec) if x is not None and math.isfinite(x) else "—"


def _table(headers: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _spot(s: SweetSpot) -> str:
    return f"{s.winner.format} at {s.winner.ratio:.3f}× bf16 ({s.optimizer})" if s.winner else "none"


def _overview(records: list[TrialRecord], f: Findings) -> str:
    status = ", ".join(f"{n} {s.lower()}" for s, n in sorted(Counter(r.status for r in records).items()))
    baselines = ", ".join(f"{o} {_num(f.baseline_best(o))}" for o in sorted(f.baselines))
    lines = [f"{len(records)} trials ({status}). Formats: {', '.join(f.formats) or 'none'}; "
             f"optimizers: {', '.join(f.optimizers)}; layer precisions: {', '.join(f.precisions)}. "
             f"bf16 best val loss: {baselines or 'none'}.", ""]
    for p in f.precisions:
        head = f.headline(p)
        lines.append(f"- Sweet spot for **{p}** quantization: {_spot(head) if head else 'none (every format broke)'}")
    lines += [f"- **Not independent:** {t.note()}" for t in f.twins]
    return "\n".join(lines)


def _plots(plots: dict[str, list[Plot]], out_dir: Path) -> str:
    parts = ["## Plots"]
    for kind, heading, caption in PLOT_SECTIONS:
        if plots.get(kind):
            parts += [f"### {heading}", caption]
            parts += [f"![{p.title}]({p.path.relative_to(out_dir).as_posix()})" for p in plots[kind]]
    return "\n\n".join(parts)


def _sweet_spots(f: Findings) -> str:
    rows = [[s.precision, s.optimizer, *([s.winner.format, _num(s.winner.ratio, ".3f"), _num(s.winner.best),
                                          s.winner.steps] if s.winner else ["none", "—", "—", "—"]),
             f"{s.runner_up.format} ({s.runner_up.ratio:.3f})" if s.runner_up else "—",
             ", ".join(s.excluded) or "—"] for s in f.sweet_spots]
    return _table(["precision", "optimizer", "sweet spot", "× bf16", "best val loss", "steps", "runner-up",
                   "not eligible (broke)"], rows)


def _failures(f: Findings) -> str:
    if not f.failures:
        return "Every trial completed without a collapse."
    rows = [[name(x.trial), x.trial.format, x.trial.optimizer, x.trial.precision, x.trial.seed,
             x.stop_reason, f"{x.step} ({'collapse' if x.collapsed else 'stop'})", x.where, x.evidence]
            for x in f.failures]
    return _table(["trial", "format", "optimizer", "precision", "seed", "stop reason", "step",
                   "where it failed", "evidence"], rows)


def _deltas(f: Findings) -> str:
    if not f.deltas:
        ran = ", ".join(f"`{o}`" for o in f.optimizers)
        return f"n/a: needs both `{STANDARD}` and `{MANIFOLD}` on the same format and precision (ran: {ran})."
    rows = [[d.standard.format, d.standard.precision, _num(d.standard.best), _num(d.manifold.best),
             _num(d.delta, "+.4f"), _num(100 * d.relative, "+.1f") + " %",
             "; ".join(f"{c.optimizer} stopped: {', '.join(c.stops)} (step {c.steps})"
                       for c in (d.standard, d.manifold) if c.stops) or "—"] for d in f.deltas]
    return ("Negative = the manifold optimizer reached a lower loss.\n\n"
            + _table(["format", "precision", STANDARD, MANIFOLD, "delta", "relative", "note"], rows))


def _cells(f: Findings) -> str:
    rows = [[c.format, c.optimizer, c.precision, ", ".join(name(t) for t in c.trials), _num(c.best),
             c.steps, _num(c.baseline), _num(c.ratio, ".3f"),
             ", ".join(c.stops) or ("running" if c.running else "completed")]
            for c in sorted(f.cells.values(), key=lambda c: (c.optimizer, c.precision))]
    return _table(["format", "optimizer", "precision", "trials", "best val loss", "steps",
                   "bf16 up to steps", "× bf16", "stops"], rows)


def render(records: list[TrialRecord], findings: Findings, plots: dict[str, list[Plot]],
           out_dir: Path, title: str = "AltGrad report") -> str:
    """The whole report.md text; image links are relative to `out_dir`."""
    f = findings
    sections = [
        f"# {title}", f"**{f.verdict.line}**", _overview(records, f), _plots(plots, out_dir),
        "## Sweet spot per layer precision", _sweet_spots(f),
        "## Failures and early stops", _failures(f),
        "## Manifold vs standard optimizer", _deltas(f),
        "## What is missing",
        "\n".join(f"- {m}" for m in f.missing) or "Nothing: every grid point has a finished trial.",
        "## All cells", _cells(f),
        "## How these numbers are computed", DEFINITIONS.strip(),
    ]
    if f.notes:
        sections += ["## Notes", "\n".join(f"- {n}" for n in f.notes)]
    return "\n\n".join(sections) + "\n"
