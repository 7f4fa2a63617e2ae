"""Bit-position tracking (SPEC §6): how many codes each quantized weight moved in a step.

On diagnostic steps, per quantized layer: a histogram of |ordinal(code_new) - ordinal(code_old)|
(ordinal makes sign-magnitude codes monotone in value) over the bins 0, 1, 2, 3, 4-7, 8-15, 16+,
and the codes of a fixed seeded sample of weights (their trajectory across steps). Both codes use
the layer's current weight format and scale, so the count is in the grid the forward pass uses.
Everything is one device tensor, read in the trainer's one host sync, then written as one row per
diagnostic step to `bit_positions.jsonl`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from altgrad.quant.linear import QuantizedLinear
from altgrad.train.run_files import RunFiles

BIN_EDGES = (1, 2, 3, 4, 8, 16)
BIN_LABELS = ("0", "1", "2", "3", "4-7", "8-15", "16+")
FILE = "bit_positions.jsonl"


def ordinal(codes: torch.Tensor) -> torch.Tensor:
    """uint8 sign-magnitude codes -> integers monotone in the value they decode to."""
    c = codes.long()
    return torch.where(c >= 0x80, -(c & 0x7F), c)


class BitTracker:
    def __init__(self, layers: dict[str, QuantizedLinear], sample: int = 16, seed: int = 0):
        self.layers = layers
        g = torch.Generator().manual_seed(seed)
        self.samples = {
            n: torch.randperm(m.weight.numel(), generator=g)[:sample].to(m.weight.device)
            for n, m in layers.items()
        }

    def _codes(self, layer: QuantizedLinear, w: torch.Tensor) -> torch.Tensor:
        return layer.policy.weight.encode(w.detach().float() * layer.scalers["weight"].scale)

    @torch.no_grad()
    def observe(self, before: dict[str, torch.Tensor]) -> torch.Tensor:
        """[layers, bins + sample] float tensor: move histogram, then the sampled new codes."""
        rows = []
        for name, layer in self.layers.items():
            old, new = self._codes(layer, before[name]), self._codes(layer, layer.weight)
            moved = (ordinal(new) - ordinal(old)).abs().flatten()
            edges = torch.tensor(BIN_EDGES, device=moved.device)
            hist = torch.bincount(torch.bucketize(moved, edges, right=True), minlength=len(BIN_LABELS))
            rows.append(torch.cat([hist, new.flatten()[self.samples[name]].long()]))
        return torch.stack(rows).float()

    def rows(self, step: int, values: list[float]) -> dict:
        """The jsonl row of one step from `observe`'s values, as read in the host sync."""
        width = len(BIN_LABELS) + len(next(iter(self.samples.values())))
        out = {"step": step, "bins": list(BIN_LABELS), "layers": {}}
        for i, name in enumerate(self.layers):
            row = [int(v) for v in values[i * width:(i + 1) * width]]
            out["layers"][name] = {"moved": row[:len(BIN_LABELS)], "sample_codes": row[len(BIN_LABELS):]}
        return out


class BitPositionsFile:
    """`bit_positions.jsonl` in the run dir, truncated on resume like the metrics."""

    def __init__(self, files: RunFiles):
        self.files = files
        self.path = Path(files.dir) / FILE

    def start(self, resume_step: int | None) -> None:
        if resume_step is None:
            self.path.unlink(missing_ok=True)
        else:
            self.files.truncate(self.path, resume_step)

    def write(self, row: dict) -> None:
        self.files.append(self.path, row)
