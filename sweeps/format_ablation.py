"""Which 8-bit format trains best, per layer type and optimizer: one Ray Tune sweep.

The format × optimizer × layer-precision grid, with ASHA and a stability stopper.

    python sweeps/format_ablation.py [--config sweeps/configs/format_ablation.yaml] [--smoke]
        [--name N] [--storage-path P] [--resume | --fresh] [--dry-run] [--set key=value ...]
"""

import sys
from pathlib import Path

from altgrad.report.cli import report_after_sweep
from altgrad.tune.ablation import FormatAblation
from altgrad.tune.cli import sweep_main

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "format_ablation.yaml"

if __name__ == "__main__":
    sys.exit(sweep_main(FormatAblation, DEFAULT_CONFIG, __doc__.splitlines()[0], after=report_after_sweep))
