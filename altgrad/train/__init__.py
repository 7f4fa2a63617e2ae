"""The training loop (no Ray imports): `Trainer(cfg, run_dir).fit(report=..., resume=...)`."""

from altgrad.train.trainer import Trainer

__all__ = ["Trainer"]
