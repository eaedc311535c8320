"""A micro-batch for every image size of a progressively resized run (data.progressive.Schedule).

The global batch, and so the maths of a step, is the same at every size; what changes is how
many images one forward can take. Where the micro-batch is vramfit's to pick on a card (`auto`),
each size gets the planner's pick at that size (never below the full size's: a smaller image
never needs more memory); a micro-batch that was written, the whole share or a resumed
out-of-memory reduction stays as it is at every size.

The planner traces the model at each size it plans (about a second each), so the sizes are
bisected (planner/sizes.py, which `vramfit plan` uses too).

The sizes of a phase that share the planner's micro-batch form one **fit segment**: where the
planner's micro-batch changes, the candidates `train.fit: fastest` measures change with it, so
each segment has its micro-batch chosen as it begins (fit.refit), and the choice holds at every
size of the segment (`hold`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from .. import batching
from ..data.progressive import segments
from ..planner.size_picks import Pick, planner_pick, planner_picks, size_picks
from ..train.phases import phase_named


def plan_sizes(run) -> dict[tuple[str, int], object]:
    """The plan (train.build.Plan) of every phase at every size below the full one, by (phase name,
    size); the full size keeps the phase's own plan. Made before the fit chooses (fit.choose)."""
    sizes = [s for s in run.sizes.sizes if s != run.cfg.data.image_size]
    if not sizes:
        return {}
    full, out = run.cfg.data.image_size, {}
    for phase, plan in zip(run.phases, run.plans):
        picks = size_picks(sizes + [full], plan.micro, plan.predicted_peak_bytes, full, size_pick(run, phase, plan))
        for size, (m, peak, at) in picks.items():
            if size == full:
                continue
            micro = batching.MicroBatch(m, plan.micro.per_process_batch, plan.micro.source)
            out[(phase.name, size)] = replace(plan, micro=micro, predicted_peak_bytes=peak, estimate=None,
                                              notes=[], image_size=size, predicted_at_size=at)
    return out


def size_pick(run, phase, plan) -> Callable[[int], Pick] | None:
    """The planner's pick on this run's card, where the micro-batch is its to pick (else None)."""
    if run.launch.device_type != "cuda" or not planner_picks(plan.micro):
        return None
    from .probe import card_budget_bytes

    return planner_pick(phase.config(run.cfg), len(run.class_names), plan.micro,
                        card_budget_bytes(run.cfg, run.launch.acc.device), run.launch.precision.accelerate,
                        run.launch.world)


# ---------------------------------------------------------------------------------- fit segments
def fit_segments(run, min_steps: float) -> dict[tuple[str, int], int]:
    """The first size of the fit segment of every (phase name, size) the run trains at. A segment
    begins with each phase and wherever the planner's micro-batch changes within one, unless the
    new one has fewer than `min_steps` steps (too short to pay for measuring; it joins the one
    before). Made from the plans as `plan_sizes` made them, before a fit's choice is held in them."""
    groups: list[list] = []  # [phase, planned micro-batch, sizes, steps]
    for phase, span in segments(run.phases, run.sizes, run.steps_per_epoch):
        micro = run.phase_plan(phase, _key(run, span.image_size)).micro.size
        if groups and groups[-1][0] is phase and groups[-1][1] == micro:
            groups[-1][2].append(span.image_size)
            groups[-1][3] += span.steps
        else:
            groups.append([phase, micro, [span.image_size], span.steps])
    out: dict[tuple[str, int], int] = {}
    start: dict[str, int] = {}
    for i, (phase, _, sizes, steps) in enumerate(groups):
        joins = i > 0 and groups[i - 1][0] is phase and steps < min_steps
        start[phase.name] = start[phase.name] if joins else sizes[0]
        out.update({(phase.name, size): start[phase.name] for size in sizes})
    return out


def segment_start(run, phase_name: str, size: int) -> int:
    """The first size of the fit segment (phase `phase_name`, `size`) lies in."""
    return run.fit_segments.get((phase_name, size), size)


def segment_sizes(run, phase_name: str, start: int) -> list[int]:
    """The sizes of the fit segment of `phase_name` beginning at `start`, ascending."""
    return sorted(s for (p, s), first in run.fit_segments.items() if p == phase_name and first == start) or [start]


def segment_steps(run, phase, start: int) -> int:
    """How many steps of the run train in the fit segment of `phase` beginning at `start`."""
    return sum(span.steps for p, span in segments(run.phases, run.sizes, run.steps_per_epoch)
               if p is phase and segment_start(run, p.name, span.image_size) == start)


def first_plan(run, phase, start: int):
    """The plan of the segment's first size, which a fit's candidates are planned and measured at."""
    return run.phase_plan(phase, _key(run, start))


def hold(run, phase, start: int, micro: int, peak: int | None) -> None:
    """A fit's choice `micro` holds at every size of the segment, never above the planner's
    micro-batch at a size (the plans record it). `peak`: the choice's predicted peak at the first
    size; at a larger one the planner's peak for its own (larger) micro-batch bounds it."""
    for size in segment_sizes(run, phase.name, start):
        plan = run.phase_plan(phase, _key(run, size))
        m = min(micro, plan.micro.size)
        if m != plan.micro.size:
            plan.micro = batching.MicroBatch(m, plan.micro.per_process_batch, "fit: fastest")
            if size == start and m == micro:
                plan.predicted_peak_bytes, plan.predicted_at_size = peak, None if size == run.cfg.data.image_size else size


def _key(run, size: int) -> int | None:
    return None if size == run.cfg.data.image_size else size


def size_note(run) -> str | None:
    """Said at start: the schedule and the micro-batch at each size (None: no resizing)."""
    if not run.sizes.on:
        return None
    full, plan = run.cfg.data.image_size, run.plan
    by_micro: dict[int, list[int]] = {}
    for size in run.sizes.sizes:
        by_micro.setdefault(run.phase_plan(phase_named(run.phases, plan.phase), None if size == full else size).micro.size,
                            []).append(size)
    if len(by_micro) == 1:
        micro = f"micro-batch {next(iter(by_micro))} at every size"
    else:
        micro = ", ".join(f"micro-batch {m} at {_sizes_text(s)}" for m, s in by_micro.items())
    starts = sorted({first for (p, _), first in run.fit_segments.items() if p == plan.phase})
    if run.fit is not None and run.fit.mode == "fastest" and len(starts) > 1:
        micro += f" (train.fit: fastest measures it again as {', '.join(f'{s} px' for s in starts[1:])} begin)"
    return f"{run.sizes.line()}; {micro}"




def _sizes_text(sizes: list[int]) -> str:
    return f"{sizes[0]} px" if len(sizes) == 1 else f"{sizes[0]}-{sizes[-1]} px"
