"""vramfit: image-classification training that predicts its memory and fits the GPU you have."""

__version__ = "0.1.0"
