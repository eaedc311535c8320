"""vramfit: image-classification training that predicts its memory and fits the GPU you have."""

from . import openmp  # noqa: F401  (before torch: libgomp reads its wait settings when it loads)

__version__ = "0.1.0"
