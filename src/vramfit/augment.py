"""Batch-level augmentation on the device: random erasing, then mixup / cutmix (timm's own classes).

Batches leave the loader workers as uint8; `data.normalizer` turns them into normalised floats on the
device, and `DeviceAugment` then applies, to the whole per-process share of one optimizer batch
(before it is split into micro-batches, so an OOM retry sees the very same mixed batch):

- timm `RandomErasing` (`data.reprob`), per sample, noise patches (timm's `mode="pixel"`);
- timm `Mixup` (`data.mixup`, `data.cutmix` alphas, `data.mixup_prob`, `data.mixup_switch_prob`),
  one lambda per batch, partners paired within the process's share; the targets become soft
  (label smoothing folded in), which `engine._loss` handles.

Every draw is seeded from (seed, epoch, step, rank), so the augmentation of a step is a pure
function of where it is in the run: a resumed run repeats it exactly, and retries do not shift it.
The erasing noise is drawn on the CPU generator (small patches, copied to the device) for the same
reason: seeding CUDA's generator per step would also reset the stream dropout draws from.
"""

from __future__ import annotations

import torch

from .config import DataConfig
from .data import SeededRNG, mix_seed


class DeviceAugment:
    def __init__(self, cfg: DataConfig, num_classes: int, label_smoothing: float, seed: int, rank: int):
        from timm.data import Mixup
        from timm.data.random_erasing import RandomErasing

        self.seed, self.rank = seed, rank
        self.erase = (RandomErasing(probability=cfg.reprob, mode="pixel", device="cpu")
                      if cfg.reprob > 0 else None)
        self.mix = None
        if cfg.mixup > 0 or cfg.cutmix > 0:
            self.mix = Mixup(mixup_alpha=cfg.mixup, cutmix_alpha=cfg.cutmix, prob=cfg.mixup_prob,
                             switch_prob=cfg.mixup_switch_prob, mode="batch",
                             label_smoothing=label_smoothing, num_classes=num_classes)

    @property
    def soft_targets(self) -> bool:
        """True when targets become class distributions (label smoothing is then inside them)."""
        return self.mix is not None

    def __call__(self, images: torch.Tensor, labels: torch.Tensor, epoch: int, step: int):
        """Augment `images` (normalised float NCHW, modified in place) for optimizer step `step`;
        return (images, targets): hard labels, or soft targets with mixup/cutmix."""
        if self.erase is None and self.mix is None:
            return images, labels
        with SeededRNG(mix_seed(self.seed, epoch, step, self.rank, "device-aug")):
            if self.erase is not None:
                self.erase(images)
            if self.mix is not None:
                labels = self._mixup(images, labels)
        return images, labels

    def _mixup(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        from timm.data.mixup import mixup_target

        # timm pairs sample i with sample n-1-i and needs an even count; a short last batch may be
        # odd: its last sample stays unmixed (smoothed one-hot target).
        n = images.shape[0] - images.shape[0] % 2
        parts = []
        if n:
            _, soft = self.mix(images[:n], labels[:n])  # mixes the view, i.e. `images`, in place
            parts.append(soft)
        if n < images.shape[0]:
            parts.append(mixup_target(labels[n:], self.mix.num_classes, 1.0, self.mix.label_smoothing))
        return torch.cat(parts)
