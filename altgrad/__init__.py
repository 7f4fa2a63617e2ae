"""AltGrad: which 8-bit float format trains a transformer best, per layer type?"""

__version__ = "0.1.0"
