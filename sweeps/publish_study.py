"""Publish a finished study in the README: its heatmap, verdict and sweet spots, dated and
attributed to a commit, between the `<!-- study:begin -->` / `<!-- study:end -->` markers.

    python sweeps/publish_study.py experiments/cpu_study [--readme README.md]

`make study` runs the CPU study (sweeps/configs/cpu_study.yaml) and then this, so the README's
Results section is always what a run produced, never typed by hand.
"""

from __future__ import annotations

import argparse
import datetime
import shutil
import subprocess
import sys
from pathlib import Path

from altgrad.experiment import ExperimentError, load_experiment
from altgrad.report import compute_findings, write_report
from altgrad.report.findings import axes_text

BEGIN, END = "<!-- study:begin -->", "<!-- study:end -->"
IMAGES = Path("docs/img/study")


def commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown commit"
    return out.stdout.strip()


def section(exp_dir: Path, readme_dir: Path) -> str:
    records = load_experiment(exp_dir)
    report = write_report(records, exp_dir / "report", title=f"AltGrad report: {exp_dir.name}")
    f = compute_findings(records)
    (readme_dir / IMAGES).mkdir(parents=True, exist_ok=True)
    images = []
    for png in sorted(report.parent.glob("heatmap_*.png")):
        shutil.copyfile(png, readme_dir / IMAGES / png.name)
        images.append(f"![{png.stem}]({(IMAGES / png.name).as_posix()})")
    measured = [r for r in records if not r.same_as]
    seeds = sorted({r.seed for r in measured})
    stops = sorted({r.stop_reason for r in measured if r.stop_reason})
    lines = [
        f"*`make study` on {datetime.date.today().isoformat()}, commit {commit()}: "
        f"{len(measured)} trials, seeds {', '.join(map(str, seeds))}; stop reasons: "
        f"{', '.join(f'{s} {sum(r.stop_reason == s for r in measured)}' for s in stops)}. "
        f"Full report: `{exp_dir / 'report' / 'report.md'}` (not committed).*",
        "",
        f"**{f.verdict.line}**",
        "",
        *[f"- Sweet spot, {', '.join(x for x in (s.precision, s.optimizer, axes_text(s.axes)) if x)}: {s.text}"
          for s in f.sweet_spots],
        *[f"- {d.what} on {d.b.name} / {d.b.precision}: {d.diff.text('+.4f')}, {d.verdict}"
          for d in f.axis_effects],
        "",
        *images,
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("experiment", type=Path)
    p.add_argument("--readme", type=Path, default=Path("README.md"))
    args = p.parse_args(argv)
    text = args.readme.read_text()
    if BEGIN not in text or END not in text:
        print(f"error: {args.readme} has no {BEGIN} ... {END} section", file=sys.stderr)
        return 2
    try:
        body = section(args.experiment, args.readme.parent)
    except ExperimentError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    head, rest = text.split(BEGIN, 1)
    args.readme.write_text(f"{head}{BEGIN}\n{body}\n{END}{rest.split(END, 1)[1]}")
    print(f"published {args.experiment} in {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
