"""Bit-position tracking (SPEC §6): how many codes each quantized weight moved in a step.

On diagnostic steps, per quantized layer: a histogram of code distances |ordinal(code_new) -
ordinal(code_old)| over the bins of `MOVE_BINS` (0, 1, 2, 3, 4-7, 8-15, 16+), and the codes of a
fixed seeded sample of weights (their trajectory across steps). The histogram comes from
`Diagnostics.update_metrics` (`code_moves` in the layer's current weight format and scale, the grid
the forward pass uses, like the bit-stall rate: the raw update rounded to nearest, or where weights
are stored in their format, the codes they store); the sample codes are those of the weights as
stored after the step. Everything is one device tensor, read in the trainer's one host sync, then
written as one row per diagnostic step to `bit_positions.jsonl`.
With `replay` (on CUDA), `observe` is recorded as a CUDA graph and replayed (`ReplayedCall`), as
the diagnostics' other calls are.
"""

from __future__ import annotations

from pathlib import Path

import torch

from altgrad.experiment import BIT_POSITIONS_FILE
from altgrad.metrics import STEP
from altgrad.quant.codes import MOVE_BINS, encode_samples
from altgrad.quant.linear import QuantizedLinear, by_weight_format
from altgrad.train.replay import ReplayedCall
from altgrad.train.run_files import RunFiles


class BitTracker:
    def __init__(self, layers: dict[str, QuantizedLinear], sample: int = 16, seed: int = 0, replay: bool = False):
        self.layers = layers
        g = torch.Generator().manual_seed(seed)
        self.samples = {
            n: torch.randperm(m.weight.numel(), generator=g)[:sample].to(m.weight.device)
            for n, m in layers.items()
        }
        if replay:
            self.observe = ReplayedCall(self.observe, self.reads)

    def reads(self, histograms: dict[str, torch.Tensor]) -> list[object]:
        """What `observe(histograms)` reads that can move or change between steps (`ReplayedCall`):
        the histograms and each layer's policy (its formats). The weights, their scales and the
        sample indices stay where they are."""
        return [*histograms, *histograms.values(), *(m.policy for m in self.layers.values())]

    @torch.no_grad()
    def observe(self, histograms: dict[str, torch.Tensor]) -> torch.Tensor:
        """[layers, bins + sample] int64 tensor: each layer's move histogram, then the sample's codes
        (integers kept as such: a count above 2^24 has no exact float32)."""
        codes = self._sample_codes()
        return torch.cat([torch.stack([histograms[n] for n in self.layers]),
                          torch.stack([codes[n] for n in self.layers])], dim=1).long()

    def _sample_codes(self) -> dict[str, torch.Tensor]:
        """Each layer's sample codes, in its weight format and scale: one call per weight format."""
        out: dict[str, torch.Tensor] = {}
        for fmt, names in by_weight_format(self.layers).items():
            layers = [self.layers[n] for n in names]
            codes = encode_samples([m.weight for m in layers], [self.samples[n] for n in names], fmt,
                                   [m.weight_scale for m in layers])
            out.update(zip(names, codes, strict=True))
        return out

    def rows(self, step: int, values: list[float]) -> dict:
        """The jsonl row of one step from `observe`'s values, as read in the host sync."""
        width = len(MOVE_BINS) + len(next(iter(self.samples.values())))
        out = {STEP: step, "bins": list(MOVE_BINS), "layers": {}}
        for i, name in enumerate(self.layers):
            row = [int(v) for v in values[i * width:(i + 1) * width]]
            out["layers"][name] = {"moved": row[:len(MOVE_BINS)], "sample_codes": row[len(MOVE_BINS):]}
        return out


class BitPositionsFile:
    """`bit_positions.jsonl` in the run dir: one of its logs, started and truncated on resume with
    the metrics (`RunFiles.start`)."""

    def __init__(self, files: RunFiles):
        self.files = files
        self.path = files.log(Path(files.dir) / BIT_POSITIONS_FILE)

    def write(self, row: dict) -> None:
        self.files.append(self.path, row)
