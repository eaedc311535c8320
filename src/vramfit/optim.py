"""Optimizer (timm's factory: no weight decay on biases and norms), the LR for the run's global
batch, and a per-step LR schedule."""

from __future__ import annotations

import math

from timm.optim import create_optimizer_v2
from timm.scheduler import CosineLRScheduler
from torch import nn

from .config import OptimConfig


def scaled_lr(cfg: OptimConfig, global_batch: int | None) -> tuple[float, str | None]:
    """The LR for a run at `global_batch`, and a line saying how it was derived (None: as stated).

    A recipe states `lr` at `lr_base_batch` samples per step. At another global batch the LR
    follows it, as the noise of the gradient does: by the square root of the ratio for AdamW
    (Malladi et al. 2022, "On the SDEs and scaling rules for adaptive gradient algorithms"),
    linearly for SGD (Goyal et al. 2017). At the stated batch, or without one, `lr` as given.
    """
    base = cfg.lr_base_batch
    if not base or not global_batch or base == global_batch:
        return cfg.lr, None
    ratio = global_batch / base
    rule, factor = ("linear", ratio) if cfg.name == "sgd" else ("sqrt", math.sqrt(ratio))
    lr = cfg.lr * factor
    return lr, (f"lr {lr:.3g} = {cfg.lr:g} (stated at global batch {base}) x {factor:.3g} "
                f"({rule} scaling of {cfg.name} to global batch {global_batch})")


def create_optimizer(model: nn.Module, cfg: OptimConfig, global_batch: int | None = None):
    """`global_batch`: the run's, to scale `lr` from `lr_base_batch` (see `scaled_lr`)."""
    kwargs = dict(lr=scaled_lr(cfg, global_batch)[0], weight_decay=cfg.weight_decay)
    if cfg.name == "sgd":
        kwargs.update(momentum=cfg.momentum, nesterov=True)
    else:
        kwargs.update(betas=tuple(cfg.betas))
    return create_optimizer_v2(model, opt="sgd" if cfg.name == "sgd" else "adamw", **kwargs)


def create_scheduler(optimizer, cfg: OptimConfig, steps_per_epoch: int, epochs: int,
                     global_batch: int | None = None):
    """Warmup then cosine, stepped once per optimizer step (`step_update(global_step)`).

    The LR is a pure function of the global step, so resume and world-size changes cannot skew it.
    `constant` is the same scheduler with its floor at the base LR (`scaled_lr` at `global_batch`).
    """
    lr = scaled_lr(cfg, global_batch)[0]
    total = max(1, steps_per_epoch * epochs)
    warmup = min(total - 1, round(cfg.warmup_epochs * steps_per_epoch)) if cfg.warmup_epochs else 0
    floor = lr if cfg.schedule == "constant" else lr * cfg.min_lr_ratio
    return CosineLRScheduler(
        optimizer, t_initial=total, lr_min=floor, warmup_t=warmup,
        warmup_lr_init=lr * 0.01 if warmup else lr, warmup_prefix=False, t_in_epochs=False)
