"""Progressive resizing (`data.progressive_resize`): the image size each training step crops at.

Composer's schedule, by its names: for the first `delay_fraction` of the steps the size is
`initial_scale` x `data.image_size`; it then grows linearly, in multiples of `size_increment`
px, to the full size, reached when `finetune_fraction` of the steps is left. Unlike Composer, which
shrinks each batch on the device after it is loaded, the loader crops at the step's size (the key
a sampler yields carries it), so decoding, augmenting and moving the batch all get cheaper too;
evaluation stays at the full size.

The size is a pure function of the global step, so a resumed run crops every step at the size
the uninterrupted run did; and the size never shrinks, so a micro-batch that fits one size fits
every smaller one (memory grows with the pixels).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ProgressiveResize
from ..errors import VramfitError

SMALLEST_SIZE = 8  # data.image_size's own floor


@dataclass(frozen=True)
class Span:
    """Consecutive global steps (0-based, end exclusive) cropped at one size."""

    image_size: int
    first_step: int
    end_step: int

    @property
    def steps(self) -> int:
        return self.end_step - self.first_step


class Schedule:
    """The size of every global step of a run of `total_steps` at full size `full`."""

    def __init__(self, full: int, total_steps: int, settings: ProgressiveResize | None = None):
        self.full, self.total_steps, self.settings = full, max(1, total_steps), settings
        self.spans = self._spans()

    @property
    def on(self) -> bool:
        return self.settings is not None

    def size_at(self, step: int) -> int:
        """The size global step `step` (0-based) trains at: Composer's, from the share of the
        steps done before it."""
        s = self.settings
        if s is None:
            return self.full
        done = step / self.total_steps
        ramp = 1.0 - s.finetune_fraction - s.delay_fraction
        if done < s.delay_fraction:
            grown = 0.0
        else:
            grown = 1.0 if ramp <= 0 else min(1.0, (done - s.delay_fraction) / ramp)
        if grown >= 1.0:
            return self.full
        scale = s.initial_scale + (1.0 - s.initial_scale) * grown
        side = round(self.full * scale / s.size_increment) * s.size_increment
        return min(self.full, max(side, s.size_increment))

    def _spans(self) -> list[Span]:
        spans: list[Span] = []
        for step in range(self.total_steps):
            size = self.size_at(step)
            if spans and spans[-1].image_size == size:
                spans[-1] = Span(size, spans[-1].first_step, step + 1)
            else:
                spans.append(Span(size, step, step + 1))
        return spans

    @property
    def sizes(self) -> list[int]:
        """Every size the run trains at, smallest first."""
        return sorted({sp.image_size for sp in self.spans})

    def line(self) -> str:
        """The schedule in a line, for the start of the run."""
        if not self.on:
            return f"{self.full} px throughout"
        first, last = self.spans[0], self.spans[-1]
        ramp = self.spans[1:-1]
        text = f"{first.image_size} px for steps 1-{first.end_step}"
        if ramp:
            text += (f", then {ramp[0].image_size}..{ramp[-1].image_size} px in {len(ramp)} sizes over steps "
                     f"{ramp[0].first_step + 1}-{ramp[-1].end_step}")
        if len(self.spans) > 1:
            text += f", then {last.image_size} px from step {last.first_step + 1}"
        return f"progressive resizing: {text} (evaluation at {self.full} px)"


def schedule_of(cfg, steps_per_epoch: int) -> Schedule:
    """The run's schedule (`cfg`: a config.Config)."""
    return Schedule(cfg.data.image_size, cfg.train.epochs * steps_per_epoch, cfg.data.progressive_resize)


def possible_sizes(cfg) -> list[int]:
    """Every size a run of `cfg` may train at, whatever its step count: the multiples of
    size_increment from the initial size up, and the full size."""
    s, full = cfg.data.progressive_resize, cfg.data.image_size
    first = Schedule(full, 1, s).size_at(0)
    return sorted({*range(first, full, s.size_increment), full})


def check_backbone(cfg) -> None:
    """Before anything loads: the schedule's sizes are ones the model takes (a forward of one image
    at each, on a weightless copy on the meta device: nothing is computed or allocated)."""
    import torch

    from ..models.create import create_model

    sizes = possible_sizes(cfg)
    s = cfg.data.progressive_resize
    if sizes[0] < SMALLEST_SIZE:
        raise VramfitError(
            f"data.progressive_resize would train at {sizes[0]} px (initial_scale {s.initial_scale:g} x "
            f"data.image_size {cfg.data.image_size}, in steps of {s.size_increment} px), below the "
            f"smallest size of {SMALLEST_SIZE} px.",
            hint="raise data.progressive_resize.initial_scale, or lower its size_increment")
    if cfg.model.name.startswith("hf-hub:"):  # its architecture is on the Hub: checked when it is built
        return
    with torch.device("meta"):
        model = create_model(cfg.model, 2, load_weights=False, image_size=cfg.data.image_size, any_size=True)
    model.eval()
    # What a backbone refuses is a size below its smallest or one its strides / patches do not
    # divide (none of which is over 32 px): the smallest size of each remainder by 32, and the full.
    firsts = {}
    for size in sizes:
        firsts.setdefault(size % 32, size)
    with torch.no_grad(), torch.device("meta"):
        for size in sorted({*firsts.values(), sizes[-1]}):
            try:
                model(torch.empty(1, 3, size, size))
            except Exception as e:  # noqa: BLE001 - whatever the model raises, the answer is the same
                raise VramfitError(
                    f"{cfg.model.name} cannot take {size} px inputs, which data.progressive_resize trains at "
                    f"({type(e).__name__}: {str(e)[:200]}).",
                    hint="progressive resizing needs a backbone that takes any input size (a CNN such as "
                         "resnet50 or efficientnet_b0, or a ViT, which timm resizes); pick one, or turn it off "
                         "with --set data.progressive_resize=null") from None


def segments(phases: list, sched: Schedule, steps_per_epoch: int) -> list[tuple]:
    """What trained when, at which size: (phases.Phase, Span) for every run of steps in which
    neither what trains nor the size changes, in order."""
    out = []
    for phase in phases:
        first, end = phase.first_epoch * steps_per_epoch, phase.end_epoch * steps_per_epoch
        for span in sched.spans:
            lo, hi = max(first, span.first_step), min(end, span.end_step)
            if lo < hi:
                out.append((phase, Span(span.image_size, lo, hi)))
    return out
