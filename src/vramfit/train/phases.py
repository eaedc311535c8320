"""The phases of a run: spans of epochs in which the same parameters train. Without
`train.freeze_epochs` a run is one phase (`all`: everything but `model.freeze`); with it, `head`
(only the classifier trains, the rest frozen with fixed BatchNorm statistics) comes first, on
trained weights only (`Config.staged_epochs`): without them the run is one phase `all`, and its
`note` says why.

A phase is a pure function of the epoch, so a resumed run is in the phase the uninterrupted one
was; each phase has its own memory plan (`Phase.config` is what the planner sees).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..config import Config
from ..errors import VramfitError
from ..models.freezing import body_prefixes, classifier_names, freeze, unfreeze


@dataclass(frozen=True)
class Phase:
    name: str  # "head" | "all"
    first_epoch: int  # 0-based, inclusive
    end_epoch: int  # exclusive
    freeze: tuple[str, ...]  # the module / parameter names frozen in it
    note: str | None = None  # why the phases are not what the settings ask for (said at start)

    @property
    def epochs(self) -> int:
        return self.end_epoch - self.first_epoch

    def holds(self, epoch: int) -> bool:
        return self.first_epoch <= epoch < self.end_epoch

    def config(self, cfg: Config) -> Config:
        """`cfg` as the planner must see this phase: what it freezes in `model.freeze`."""
        return cfg.model_copy(update={"model": cfg.model.model_copy(update={"freeze": list(self.freeze)})})


def phases_of(cfg: Config, model: nn.Module) -> list[Phase]:
    """The run's phases, in order (`model`: the built model, to name its head and the rest)."""
    epochs, kept = cfg.train.epochs, tuple(cfg.model.freeze)
    n = cfg.staged_epochs
    if not n:
        return [Phase("all", 0, epochs, kept, unstaged_note(cfg))]
    heads = classifier_names(model, cfg.model.name)
    covered = [h for h in heads if any(h == p or h.startswith(p + ".") for p in kept)]
    if covered:
        raise VramfitError(f"model.freeze covers the classifier head ({', '.join(covered)}), which "
                           "train.freeze_epochs trains alone first.",
                           hint="take the head out of model.freeze, or set train.freeze_epochs=0")
    return [Phase("head", 0, n, tuple(body_prefixes(model, heads))), Phase("all", n, epochs, kept)]


def unstaged_note(cfg: Config) -> str | None:
    """What to say when train.freeze_epochs asks for staged fine-tuning that random weights rule out."""
    if not cfg.train.freeze_epochs or cfg.staged_epochs:
        return None
    return (f"train.freeze_epochs {cfg.train.freeze_epochs} is not applied: without pretrained weights "
            "(model.pretrained false, no model.pretrained_path) the backbone's features are random, so a "
            "head trained on them alone learns nothing the later epochs keep; the whole network trains "
            "from the first step")


def phase_named(phases: list[Phase], name: str) -> Phase:
    """The phase called `name` (a plan's or a fit's `phase`)."""
    return next(p for p in phases if p.name == name)


def phase_at(phases: list[Phase], epoch: int) -> Phase:
    """The phase `epoch` (0-based) trains in; past the last epoch, the last phase."""
    return next((p for p in phases if p.holds(epoch)), phases[-1])


def enter(model: nn.Module, phase: Phase, previous: Phase | None = None) -> None:
    """Make `model` train what `phase` trains (undoing `previous`'s freezing first)."""
    if previous is not None:
        unfreeze(model, previous.freeze)
    freeze(model, phase.freeze)


def unfreeze_step(phases: list[Phase], steps_per_epoch: int) -> int | None:
    """The global step at which parameters frozen in the first phase start training (None: never)."""
    return phases[1].first_epoch * steps_per_epoch if len(phases) > 1 else None
