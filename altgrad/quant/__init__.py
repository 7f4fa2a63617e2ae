"""Exact simulation of 8-bit float formats: format specs, the quantizer, scaling and bit-stall."""

from altgrad.quant.codes import code_moves, decode, encode
from altgrad.quant.formats import FORMATS, FormatSpec, get_format
from altgrad.quant.kernels import compile_status
from altgrad.quant.quantize import fake_quantize, quantize
from altgrad.quant.scaling import AmaxHistory, TensorScaler, compute_scale
from altgrad.quant.stall import bit_stall_mask, stall_stats, stiffness

__all__ = [
    "FORMATS", "AmaxHistory", "FormatSpec", "TensorScaler", "bit_stall_mask", "code_moves",
    "compile_status", "compute_scale", "decode", "encode", "fake_quantize", "get_format", "quantize", "stall_stats", "stiffness",
]
