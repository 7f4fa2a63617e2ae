"""The analysis report of a sweep: what each trial's record says (`records`), the findings over them
(`findings`, with the arithmetic of `stats`), figures (`plots`), report.md (`markdown`).

`write_report` is the one entry point; `python -m altgrad report` (`cli`) and the sweep call it.
"""

from __future__ import annotations

from pathlib import Path

from altgrad.experiment import REPORT_FILE, TrialRecord
from altgrad.report.findings import Findings, compute_findings
from altgrad.report.markdown import render
from altgrad.report.plots import plot_all

__all__ = ["Findings", "compute_findings", "write_report"]


def write_report(records: list[TrialRecord], out_dir: Path, missing: list[str] | None = None,
                 title: str = "AltGrad report") -> Path:
    """Write the plots and report.md into `out_dir`; `missing` names grid points never started."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    findings = compute_findings(records, missing)
    plots = plot_all(findings, out_dir)
    path = out_dir / REPORT_FILE
    path.write_text(render(records, findings, plots, out_dir, title))
    return path
