"""The network: timm creation, weights, BatchNorm policy, checkpointing and the export formats
(`create`), what trains and what keeps its BatchNorm statistics (`freezing`), and each backbone's
defaults (`backbones`).
"""
