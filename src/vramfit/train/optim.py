"""Optimizer (timm's factory: no weight decay on biases and norms), the LR for the run's global
batch, and a per-step LR schedule."""

from __future__ import annotations

import math

from timm.optim import create_optimizer_v2
from timm.scheduler import CosineLRScheduler
from torch import nn

from ..config import OptimConfig


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
    """timm's optimizer over timm's parameter groups (weight decay off for biases and norms; with
    `layer_decay`, timm's per-layer LR scales), each group split into the classifier head and the
    rest (`"part"`: the unfreeze warmup and the logged LR tell them apart; the update of every
    parameter is the same either way). `global_batch`: the run's, to scale `lr` (see `scaled_lr`)."""
    kwargs = dict(lr=scaled_lr(cfg, global_batch)[0], weight_decay=cfg.weight_decay)
    if cfg.name == "sgd":
        kwargs.update(momentum=cfg.momentum, nesterov=True)
    else:
        kwargs.update(betas=tuple(cfg.betas))
    return create_optimizer_v2(model, opt="sgd" if cfg.name == "sgd" else "adamw",
                               param_group_fn=lambda m: param_groups(m, cfg), **kwargs)


def param_groups(model: nn.Module, cfg: OptimConfig) -> list[dict]:
    """timm's groups for `cfg` (what create_optimizer_v2 would build), split by head and rest."""
    from timm.optim import param_groups_layer_decay, param_groups_weight_decay

    no_decay = getattr(model, "no_weight_decay", lambda: set())()
    if cfg.layer_decay is not None:
        groups = param_groups_layer_decay(model, weight_decay=cfg.weight_decay, layer_decay=cfg.layer_decay,
                                          no_weight_decay_list=no_decay)
    else:
        groups = param_groups_weight_decay(model, weight_decay=cfg.weight_decay, no_weight_decay_list=no_decay)
    head = _head_parameters(model)
    out = []
    for group in groups:
        for part in ("body", "head"):
            params = [p for p in group["params"] if (id(p) in head) == (part == "head")]
            if params:
                out.append({**group, "params": params, "part": part})
    return out


def _head_parameters(model: nn.Module) -> set[int]:
    from ..errors import VramfitError
    from ..models.freezing import classifier_names

    try:
        names = classifier_names(model)
    except VramfitError:  # no head timm can name: one part (staged fine-tuning refuses such a model)
        return set()
    modules = dict(model.named_modules())
    return {id(p) for n in names for p in modules[n].parameters()}


def head_lr(optimizer) -> float:
    """The LR of the classifier head (the full LR under layer decay): what the metrics log."""
    groups = optimizer.param_groups
    return next((g["lr"] for g in groups if g.get("part") == "head"), groups[-1]["lr"])


def lr_range_note(optimizer, cfg: OptimConfig) -> str | None:
    """Said at start under layer decay: the LR of the first and of the last layer group."""
    if cfg.layer_decay is None:
        return None
    scales = sorted({g.get("lr_scale", 1.0) for g in optimizer.param_groups})
    top = max(g["initial_lr"] for g in optimizer.param_groups)  # the base LR, before each group's scale
    return (f"layer decay {cfg.layer_decay:g}: {len(scales)} layer groups, LR {top * scales[0]:.3g} (first) "
            f"to {top * scales[-1]:.3g} (last, the head)")


class Schedule:
    """timm's per-step schedule (`step_update(global_step)`), and on top of it the unfreeze warmup
    of staged fine-tuning: from `unfreeze_step` the parameters that start training there (groups
    of part `body`) ramp linearly up to the schedule's LR over `warmup_steps`; the head continues
    its schedule unchanged. A pure function of the global step, like the schedule itself."""

    def __init__(self, scheduler, optimizer, unfreeze_step: int | None = None, warmup_steps: int = 0):
        self.scheduler, self.optimizer = scheduler, optimizer
        self.unfreeze_step, self.warmup_steps = unfreeze_step, warmup_steps

    def step_update(self, num_updates: int) -> None:
        self.scheduler.step_update(num_updates=num_updates)
        factor = self.unfreeze_factor(num_updates)
        if factor < 1.0:
            for group in self.optimizer.param_groups:
                if group.get("part") == "body":
                    group["lr"] *= factor

    def unfreeze_factor(self, num_updates: int) -> float:
        """The body's LR factor for the step after `num_updates` (1: no ramp)."""
        if self.unfreeze_step is None or not self.warmup_steps or num_updates < self.unfreeze_step:
            return 1.0
        return min(1.0, (num_updates - self.unfreeze_step + 1) / (self.warmup_steps + 1))


def create_scheduler(optimizer, cfg: OptimConfig, steps_per_epoch: int, epochs: int,
                     global_batch: int | None = None, unfreeze_step: int | None = None) -> Schedule:
    """Warmup then cosine, stepped once per optimizer step (`step_update(global_step)`), with the
    unfreeze warmup from `unfreeze_step` (staged fine-tuning; None: none).

    The LR is a pure function of the global step, so resume and world-size changes cannot skew it.
    `constant` is the same scheduler with its floor at the base LR (`scaled_lr` at `global_batch`).
    """
    lr = scaled_lr(cfg, global_batch)[0]
    total = max(1, steps_per_epoch * epochs)
    warmup = min(total - 1, round(cfg.warmup_epochs * steps_per_epoch)) if cfg.warmup_epochs else 0
    floor = lr if cfg.schedule == "constant" else lr * cfg.min_lr_ratio
    # A one-step run (t_initial 1) makes timm warn that cosine "will have no effect"; at 2 the LR
    # of its only step (t = 0) is the same, and no second step exists.
    scheduler = CosineLRScheduler(
        optimizer, t_initial=max(2, total), lr_min=floor, warmup_t=warmup,
        warmup_lr_init=lr * 0.01 if warmup else lr, warmup_prefix=False, t_in_epochs=False)
    return Schedule(scheduler, optimizer, unfreeze_step, round(cfg.unfreeze_warmup_epochs * steps_per_epoch))
