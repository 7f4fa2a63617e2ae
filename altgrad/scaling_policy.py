"""How a quantized tensor is scaled, as data: the modes, the amax estimators and one frozen policy.

Plain data, like `altgrad.precision`: the run config validates YAML into it (`ScalingConfig`
takes its allowed values and defaults from here) and the quantized layers build their scalers from
it (`TensorScaler(fmt, policy)`), so neither needs the other and reading a config needs no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

ScalingMode = Literal["none", "dynamic", "delayed"]  # none: the format's raw range (s = 1)
AmaxAlgo = Literal["max", "most_recent"]  # how the amax history becomes one amax


@dataclass(frozen=True)
class ScalingPolicy:
    """Per-tensor scaling (SPEC §2): `mode`, the amax history's length and estimator, a margin in
    powers of two below the format's max, and whether scales are powers of two."""

    mode: ScalingMode = "delayed"
    history_len: int = 16
    algo: AmaxAlgo = "max"
    margin: int = 0
    pow2: bool = True

    def __post_init__(self) -> None:
        if self.mode not in get_args(ScalingMode):
            raise ValueError(f"scaling mode must be one of {list(get_args(ScalingMode))}, got {self.mode!r}")
        check_history(self.history_len, self.algo)

    @property
    def pow2_scales(self) -> bool:
        """Every scale a scaler of this policy makes is a power of two (`pow2`'s floor, mode none's
        1), which the quantizer relies on (`kernels.unscale`). A scale it keeps from before is one
        too, unless it was loaded from a checkpoint of a run without `pow2` (docs/design.md)."""
        return self.pow2 or self.mode == "none"


def check_history(history_len: int, algo: str) -> None:
    """ValueError unless an amax history of `history_len` read by `algo` is valid (also used by
    the histories that belong to no policy)."""
    if algo not in get_args(AmaxAlgo):
        raise ValueError(f"amax algo must be one of {list(get_args(AmaxAlgo))}, got {algo!r}")
    if history_len < 1:
        raise ValueError(f"history_len must be >= 1, got {history_len}")
