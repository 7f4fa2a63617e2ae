"""Per 8-bit format, the largest learning rate that still trains stably (Optuna on Ray Tune).

    python sweeps/lr_search.py [--config sweeps/configs/lr_search.yaml] [--smoke] [--name N]
        [--storage-path P] [--resume | --fresh] [--dry-run] [--set key=value ...]
"""

import sys
from pathlib import Path

from altgrad.tune.cli import sweep_main
from altgrad.tune.lr_search import LrSearch

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "lr_search.yaml"

if __name__ == "__main__":
    sys.exit(sweep_main(LrSearch, DEFAULT_CONFIG, __doc__.splitlines()[0]))
