"""What trains: frozen modules get no gradient and keep their BatchNorm statistics, the classifier
head told from the rest of the network (staged fine-tuning), and the smallest micro-batch that
what still normalises by its batch allows.

A frozen BatchNorm stays in eval mode whatever calls `model.train()` (the loop, the evaluation,
the step's weightless forward, a library): its own `train` is replaced on the instance. timm's
freeze utilities swap the modules for FrozenBatchNorm2d instead, whose weight and bias are
buffers: the optimizer's parameters would be orphaned when staged fine-tuning unfreezes them,
and the checkpoint's layout would change between phases. Here nothing is swapped: the state dict,
the optimizer's parameters and the module tree are the same in every phase.
"""

from __future__ import annotations

import types
from typing import Iterable

from torch import nn

from ..errors import VramfitError

# BatchNorm that normalises with the statistics of its own batch in train mode (timm's BatchNormAct2d
# is a BatchNorm2d); `model.bn: freeze` turns them into FrozenBatchNorm2d, which is none of these.
BATCH_STATISTICS_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def _stay_in_eval(module: nn.Module, mode: bool = True) -> nn.Module:
    return nn.Module.train(module, False)


def holds_statistics(module: nn.Module) -> bool:
    """A BatchNorm frozen here: eval mode in every phase of training."""
    return "train" in vars(module)


def _hold(module: nn.Module) -> None:
    module.train = types.MethodType(_stay_in_eval, module)
    nn.Module.train(module, False)


def _release(module: nn.Module, training: bool) -> None:
    vars(module).pop("train", None)
    nn.Module.train(module, training)


def _under(name: str, prefixes: Iterable[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def check_prefixes(model: nn.Module, prefixes: Iterable[str]) -> None:
    """Every prefix names a module or a parameter of `model` (a typo freezes nothing otherwise)."""
    names = [n for n, _ in model.named_parameters()]
    modules = {n for n, _ in model.named_modules()}
    for prefix in prefixes:
        if prefix not in modules and not any(_under(n, [prefix]) for n in names):
            tops = sorted({n.split(".")[0] for n in modules if n})
            raise VramfitError(f"model.freeze names `{prefix}`, which matches no module or parameter.",
                               hint=f"top-level modules of this model: {', '.join(tops)}")


def freeze(model: nn.Module, prefixes: Iterable[str]) -> int:
    """Freeze what `prefixes` name: no gradient for their parameters, fixed statistics for their
    BatchNorm layers. Returns the number of parameter tensors frozen."""
    prefixes = list(prefixes)
    check_prefixes(model, prefixes)
    frozen = 0
    for name, p in model.named_parameters():
        if _under(name, prefixes):
            p.requires_grad_(False)
            frozen += 1
    for name, m in model.named_modules():
        if isinstance(m, BATCH_STATISTICS_NORMS) and _under(name, prefixes):
            _hold(m)
    return frozen


def unfreeze(model: nn.Module, prefixes: Iterable[str]) -> None:
    """Undo `freeze` for what `prefixes` name: they train again, their BatchNorm in the model's mode."""
    prefixes = list(prefixes)
    for name, p in model.named_parameters():
        if _under(name, prefixes):
            p.requires_grad_(True)
    for name, m in model.named_modules():
        if isinstance(m, BATCH_STATISTICS_NORMS) and _under(name, prefixes):
            _release(m, model.training)


def trainable_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def classifier_names(model: nn.Module, model_name: str = "") -> list[str]:
    """The module names of the classifier head (timm's `get_classifier()`; two for a distilled ViT)."""
    heads = model.get_classifier() if hasattr(model, "get_classifier") else None
    heads = [h for h in (heads if isinstance(heads, (tuple, list)) else [heads])
             if isinstance(h, nn.Module) and any(True for _ in h.parameters())]
    names = [n for n, m in model.named_modules() if any(m is h for h in heads)]
    if not names:
        raise VramfitError(
            f"`{model_name or type(model).__name__}` has no classifier head timm can name (get_classifier() "
            "returns no trainable module), so train.freeze_epochs cannot tell the head from the rest.",
            hint="run with --set train.freeze_epochs=0, and freeze stages by name with --set model.freeze=[...]")
    return names


def body_prefixes(model: nn.Module, heads: list[str]) -> list[str]:
    """The fewest module names that cover every parameter outside the head: what the head-only
    phase freezes (resnet: conv1, bn1, layer1..layer4; convnext: stem, stages, head.norm)."""
    out: list[str] = []

    def walk(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            full = f"{prefix}{name}"
            if full in heads:
                continue
            if any(h.startswith(full + ".") for h in heads):
                walk(child, full + ".")
            elif any(True for _ in child.parameters()) or any(
                    isinstance(m, BATCH_STATISTICS_NORMS) for m in child.modules()):
                out.append(full)
        out.extend(f"{prefix}{n}" for n, _ in module.named_parameters(recurse=False))

    walk(model, "")
    return out


def min_micro_batch(model: nn.Module) -> int:
    """The fewest samples one training forward of `model` can take: 2 while any BatchNorm still
    normalises by its batch (one sample has no batch statistics: torch refuses it where a feature
    map is 1x1, and its statistics are noise everywhere else), else 1."""
    return 2 if any(isinstance(m, BATCH_STATISTICS_NORMS) and not holds_statistics(m)
                    for m in model.modules()) else 1


def batch_statistics_norms(model: nn.Module) -> list[nn.Module]:
    """The BatchNorm layers that follow the batches they see (not frozen)."""
    return [m for m in model.modules() if isinstance(m, BATCH_STATISTICS_NORMS) and not holds_statistics(m)]


class StatisticsHorizon:
    """`model.bn_momentum_per: step`: BatchNorm's running statistics move as far per optimizer step
    as they would with the whole batch in one forward, however many micro-batches the step takes.

    Each forward updates the running statistics once (`r <- (1 - m) r + m x`); a step split into k
    micro-batches updates them k times, so with the same momentum they forget k times faster and
    follow the noisier means of k smaller batches. Momentum `1 - (1 - m) ** (1 / k)` per forward
    weighs the old statistics by `(1 - m)` per step, as one forward at the full batch does
    (measured in bench/small_batch.py). torch and timm have no such setting: BatchNorm only knows
    its own forward."""

    def __init__(self, model: nn.Module):
        self.norms = [(m, m.momentum) for m in model.modules()
                      if isinstance(m, BATCH_STATISTICS_NORMS) and m.momentum is not None]
        self.forwards = 1

    def per_step(self, forwards: int) -> None:
        """The step about to run takes `forwards` micro-batches on this process."""
        forwards = max(1, forwards)
        if forwards != self.forwards:
            self.forwards = forwards
            for m, base in self.norms:
                m.momentum = base if forwards == 1 else 1 - (1 - base) ** (1 / forwards)
