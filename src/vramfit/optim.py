"""Optimizer (timm's factory: no weight decay on biases and norms) and a per-step LR schedule."""

from __future__ import annotations

from timm.optim import create_optimizer_v2
from timm.scheduler import CosineLRScheduler
from torch import nn

from .config import OptimConfig


def create_optimizer(model: nn.Module, cfg: OptimConfig):
    kwargs = dict(lr=cfg.lr, weight_decay=cfg.weight_decay)
    if cfg.name == "sgd":
        kwargs.update(momentum=cfg.momentum, nesterov=True)
    else:
        kwargs.update(betas=tuple(cfg.betas))
    return create_optimizer_v2(model, opt="sgd" if cfg.name == "sgd" else "adamw", **kwargs)


def create_scheduler(optimizer, cfg: OptimConfig, steps_per_epoch: int, epochs: int):
    """Warmup then cosine, stepped once per optimizer step (`step_update(global_step)`).

    The LR is a pure function of the global step, so resume and world-size changes cannot skew it.
    `constant` is the same scheduler with its floor at the base LR.
    """
    total = max(1, steps_per_epoch * epochs)
    warmup = min(total - 1, round(cfg.warmup_epochs * steps_per_epoch)) if cfg.warmup_epochs else 0
    floor = cfg.lr if cfg.schedule == "constant" else cfg.lr * cfg.min_lr_ratio
    return CosineLRScheduler(
        optimizer, t_initial=total, lr_min=floor, warmup_t=warmup,
        warmup_lr_init=cfg.lr * 0.01 if warmup else cfg.lr, warmup_prefix=False, t_in_epochs=False)
