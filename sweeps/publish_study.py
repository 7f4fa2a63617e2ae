"""Publish a finished study in the README: its heatmap, verdict and sweet spots.

Dated and attributed to a commit, between the `<!-- study:begin -->` / `<!-- study:end -->`
markers.

    python sweeps/publish_study.py experiments/cpu_study [--readme README.md]

`make study` runs the CPU study (sweeps/configs/cpu_study.yaml) and then this, so the README's
Results section is always what a run produced, never typed by hand.
"""

from __future__ import annotations

import argparse
import datetime
import math
import shutil
import sys
from collections import Counter
from pathlib import Path
from statistics import fmean, stdev

from altgrad.config import ConfigError, utf8_text
from altgrad.experiment import (
    REPORT_DIR,
    REPORT_FILE,
    WORKER_FILE,
    ExperimentError,
    ExperimentSnapshot,
    read_experiment,
    read_json,
)
from altgrad.report import Findings, compute_findings, write_report
from altgrad.report.records import seed_values, where_text

BEGIN, END = "<!-- study:begin -->", "<!-- study:end -->"
IMAGES = Path("docs/img/study")


def section(exp_dir: Path, experiment: ExperimentSnapshot, readme_dir: Path) -> str:
    """The README section of the experiment read from `exp_dir`; writes its report and images."""
    records = experiment.records
    report = write_report(records, exp_dir / REPORT_DIR, title=f"AltGrad report: {exp_dir.name}")
    f = compute_findings(records)
    (readme_dir / IMAGES).mkdir(parents=True, exist_ok=True)
    for stale in (readme_dir / IMAGES).glob("heatmap_*.png"):  # an earlier study's, whose facets may differ
        stale.unlink()
    images = []
    for png in sorted(report.parent.glob("heatmap_*.png")):
        shutil.copyfile(png, readme_dir / IMAGES / png.name)
        images.append(f"![{png.stem}]({(IMAGES / png.name).as_posix()})")
    measured = [r for r in records if not r.same_as]
    seeds = sorted({r.seed for r in measured})
    stops = sorted({r.stop_reason for r in measured if r.stop_reason})
    sweep = experiment.sweep or {}
    workers = [w for r in measured if (w := read_json(r.trial_dir / WORKER_FILE))]
    lines = [
        f"*`make study` published {datetime.date.today().isoformat()}; {code_text(workers, sweep)}: "
        f"{len(measured)} trials, seeds {', '.join(map(str, seeds))}; stop reasons: "
        f"{', '.join(f'{s} {sum(r.stop_reason == s for r in measured)}' for s in stops)}; "
        f"{wall_time(workers, sweep.get('updated'))}. "
        f"Full report: `{exp_dir / REPORT_DIR / REPORT_FILE}` (not committed).*",
        "",
        f"**{f.verdict.line}**",
        "",
        *[f"- Sweet spot, {where_text(s.precision, s.optimizer, s.axes)}: {s.text}"
          for s in f.sweet_spots],
        *[f"- {d.what} on {d.b.name} / {d.b.precision}: {d.diff.text()}, {d.verdict}"
          + (f" ({d.family_wise.text})" if d.family_wise else "") for d in f.axis_effects],
        *[f"- Gradients against the FP32 shadow, {line}" for line in f.fidelity_summary()],
        *[f"- Many comparisons at once: {m}" for m in f.multiplicity()],
        f"- {spread(f)}",
        "",
        *images,
    ]
    return "\n".join(lines)


def code_text(workers: list[dict], sweep: dict) -> str:
    """Which code trained the trials: each trial's worker.json names the commit it ran; a sweep
    from before trials named theirs gives the one its sweep.json holds."""
    ran = Counter(w["commit"] for w in workers if w.get("commit"))
    if not ran:
        return f"the sweep ran commit {sweep.get('commit') or 'not recorded'}"
    if len(ran) == 1:
        return f"its trials ran commit {next(iter(ran))}"
    return "its trials ran commits " + ", ".join(f"{c} ({n} trial{'s' * (n != 1)})" for c, n in ran.items())


def wall_time(workers: list[dict], finished: float | None) -> str:
    """First trial's start (its worker.json) to the sweep's last state update (its end, once it
    finished): the study's wall time, including any time it spent interrupted."""
    starts = [w["started"] for w in workers if "started" in w]
    if not starts or finished is None:
        return "wall time not recorded"
    return f"{(finished - min(starts)) / 60:.1f} min of wall time"


def spread(f: Findings) -> str:
    """Seed noise against format effects: the seed-to-seed standard deviation of bf16's best val
    loss, the standard deviation across healthy full-budget cells of their seed-mean, and the
    median half-width of × bf16."""
    bf16 = [v for trials in f.baselines.values() for v in seed_values(trials).values() if math.isfinite(v)]
    cells = [c for c in f.cells.values() if c.full_budget and not c.broke and math.isfinite(c.best.mean)]
    widths = sorted(c.ratio.half_width for c in cells if c.ratio.half_width is not None)
    parts = [f"bf16 between seeds: sd {stdev(bf16):.4f}" if len(bf16) > 1 else "bf16: one seed",
             f"between healthy cells (seed means): sd {stdev([c.best.mean for c in cells]):.4f}, range "
             f"{min(c.best.mean for c in cells):.4f}-{max(c.best.mean for c in cells):.4f}"
             if len(cells) > 1 else "fewer than two healthy cells",
             f"median 95 % half-width of × bf16: {widths[len(widths) // 2]:.4f}" if widths else
             "no × bf16 interval"]
    mean_loss = fmean(bf16) if bf16 else math.nan
    return f"Spread of best val loss (bf16 ≈ {mean_loss:.3f}): " + "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("experiment", type=Path)
    p.add_argument("--readme", type=Path, default=Path("README.md"))
    args = p.parse_args(argv)
    if not args.readme.is_file():
        print(f"error: --readme {args.readme}: no such file", file=sys.stderr)
        return 2
    # Both checked before the report and the images are written: a failure leaves nothing half-published.
    try:
        text = utf8_text(args.readme)
    except ConfigError as e:  # not UTF-8: rewritten, the rest of it would be mangled
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # no permission
        print(f"error: --readme {args.readme}: {e.strerror}", file=sys.stderr)
        return 2
    if BEGIN not in text or END not in text.split(BEGIN, 1)[1]:
        print(f"error: {args.readme} has no {BEGIN} ... {END} section (in that order)", file=sys.stderr)
        return 2
    try:
        experiment = read_experiment(args.experiment)  # a corrupt sweep file is an ExperimentError too
    except ExperimentError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    body = section(args.experiment, experiment, args.readme.parent)
    head, rest = text.split(BEGIN, 1)
    args.readme.write_text(f"{head}{BEGIN}\n{body}\n{END}{rest.split(END, 1)[1]}", encoding="utf-8")
    print(f"published {args.experiment} in {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
