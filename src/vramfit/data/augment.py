"""Batch-level augmentation on the device: colour jitter, random erasing, then mixup / cutmix.

Batches leave the loader workers as uint8; `data.normalizer` turns them into normalised floats on the
device, and `DeviceAugment` then applies, to the whole per-process share of one optimizer batch
(before it is split into micro-batches, so an OOM retry sees the very same mixed batch):

- colour jitter (`data.color_jitter`) when `data.loader.color_jitter_on` puts it here (on an
  accelerator): torchvision's ColorJitter(b, c, s) as timm's train transform sets it, per sample
  (factors in [1 - j, 1 + j], the operations in a random order, each result clipped to the pixel
  range). Each sample's parameters are drawn in the loader worker from its own seeded RNG
  (`data.jitter_params`, torchvision's get_params) and travel with the batch, so a sample's jitter
  is the same on any number of processes. In a worker the jitter itself is a fifth of the work on
  a 500x375 JPEG (~0.55 ms a 224 px image, whatever the PIL route); here it is a few passes over
  the batch. torchvision's tensor kernels take one image and one order at a time, so the batched
  form is written here (tested against them);
- timm `RandomErasing` (`data.reprob`), per sample, noise patches (timm's `mode="pixel"`);
- timm `Mixup` (`data.mixup`, `data.cutmix` alphas, `data.mixup_prob`, `data.mixup_switch_prob`),
  one lambda per batch, partners paired within the process's share; the targets become soft
  (label smoothing folded in), which `engine._loss` handles.

Every other draw is seeded from (seed, epoch, step, rank), so the augmentation of a step is a pure
function of where it is in the run: a resumed run repeats it exactly, and retries do not shift it.
The erasing noise is drawn on the batch's device, from its default generator seeded for the step
and put back after (`seeded_device_rng`: dropout's stream is untouched, and on CUDA the state is
host-side, so nothing waits for the device).
"""

from __future__ import annotations

import contextlib

import torch

from ..config import DataConfig
from . import SeededRNG, device_jitter, mix_seed

# ITU-R 601 luma, the weights of torchvision's rgb_to_grayscale (and PIL's "L" conversion).
LUMA = (0.2989, 0.587, 0.114)
BRIGHTNESS, CONTRAST, SATURATION = range(3)


class ColorJitter:
    """Per-sample brightness, contrast and saturation jitter of a normalised float NCHW batch."""

    def __init__(self, mean, std):
        self.mean_std = (tuple(mean), tuple(std))
        self._constants: dict = {}  # per device: made once (a tensor from a list is a copy to the device)

    def apply(self, images: torch.Tensor, params: torch.Tensor) -> None:
        """Jitter `images` in place with each sample's `data.jitter_params` (its factors
        indexed by BRIGHTNESS/CONTRAST/SATURATION, then the order of the operations): in pixel
        values (0..1) each sample gets its three operations in its own order, each
        `clip(f * x + (1 - f) * target)` as torchvision's `_blend`, with target 0 (brightness), the
        image's mean luma (contrast) or its luma (saturation)."""
        if images.device not in self._constants:
            self._constants[images.device] = tuple(torch.tensor(v, device=images.device).view(1, 3, 1, 1)
                                                   for v in self.mean_std)
        mean, std = self._constants[images.device]
        params = params.to(images.device, non_blocking=True)  # pinned on a GPU run: no wait
        factors, order = params[:, :3].to(images.dtype), params[:, 3:].long()
        images.mul_(std).add_(mean)
        for position in range(3):
            op = order[:, position:position + 1]
            f = factors.gather(1, op).view(-1, 1, 1, 1)
            op = op.view(-1, 1, 1, 1)
            gray = (images[:, 0:1] * LUMA[0]).add_(images[:, 1:2], alpha=LUMA[1]).add_(images[:, 2:3], alpha=LUMA[2])
            target = torch.where(op == SATURATION, gray,
                                 torch.where(op == CONTRAST, gray.mean(dim=(2, 3), keepdim=True), 0.0))
            images.mul_(f).add_(target.mul_(1 - f)).clamp_(0.0, 1.0)
        images.sub_(mean).div_(std)


@contextlib.contextmanager
def seeded_device_rng(device: torch.device, seed: int):
    """The default generator of an accelerator `device` seeded with `seed` for the block, its state
    put back after. A CUDA generator's state is a seed and an offset held on the host: neither
    reading, seeding nor restoring it waits for the device. On the CPU, SeededRNG does this."""
    if device.type != "cuda":
        yield
        return
    with torch.random.fork_rng(devices=[device], device_type="cuda"):
        torch.cuda.default_generators[device.index if device.index is not None
                                      else torch.cuda.current_device()].manual_seed(seed)
        yield


class DeviceAugment:
    def __init__(self, cfg: DataConfig, num_classes: int, label_smoothing: float, seed: int, rank: int,
                 *, mean, std, device_type: str):
        from timm.data import Mixup
        from timm.data.random_erasing import RandomErasing

        self.seed, self.rank = seed, rank
        self.jitter = ColorJitter(mean, std) if device_jitter(cfg, device_type) is not None else None
        self.erase = (RandomErasing(probability=cfg.reprob, mode="pixel")
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

    def __call__(self, images: torch.Tensor, labels: torch.Tensor, epoch: int, step: int,
                 jitter: torch.Tensor | None = None):
        """Augment `images` (normalised float NCHW, modified in place) for optimizer step `step`;
        `jitter`: the batch's per-sample colour jitter parameters (`Batch.jitter`). Returns
        (images, targets): hard labels, or soft targets with mixup/cutmix."""
        if self.jitter is not None and len(images):
            if jitter is None or len(jitter) != len(images):
                raise ValueError("colour jitter is on the device, but the batch carries no jitter parameters "
                                 "for its samples (the dataset must be built with device_jitter)")
            self.jitter.apply(images, jitter)
        if self.erase is None and self.mix is None:
            return images, labels
        seed = mix_seed(self.seed, epoch, step, self.rank, "device-aug")
        with SeededRNG(seed):
            if self.erase is not None:
                # Noise drawn where the batch is: a patch made on the CPU would be one copy to the
                # device, and one wait for it, per erased sample.
                self.erase.device = images.device
                with seeded_device_rng(images.device, seed):
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
