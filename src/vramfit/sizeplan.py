"""A micro-batch for every image size of a progressively resized run (resize.Schedule).

The global batch, and so the maths of a step, is the same at every size; what changes is how
many images one forward can take. Where the micro-batch is vramfit's to pick on a card (`auto`),
each size gets the planner's pick at that size (never below the full size's: a smaller image
never needs more memory); a micro-batch that was written, the whole share, a fit's choice or a
resumed out-of-memory reduction stays as it is at every size.

The planner traces the model at each size it plans (about a second each), so the sizes are
bisected (planner/sizes.py, which `vramfit plan` uses too).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from . import batching
from .planner.sizes import Pick, bisect_sizes, planner_pick


def plan_sizes(run) -> dict[tuple[str, int], object]:
    """The plan (setup.Plan) of every phase at every size below the full one, by (phase name,
    size); the full size keeps the phase's own plan."""
    sizes = [s for s in run.sizes.sizes if s != run.cfg.data.image_size]
    if not sizes:
        return {}
    full, out = run.cfg.data.image_size, {}
    for phase, plan in zip(run.phases, run.plans):
        pick = _pick_for(run, phase, plan)
        # Not the planner's to pick: the same micro-batch; its full-size peak bounds every size.
        picks = ({s: (plan.micro.size, plan.predicted_peak_bytes, full) for s in sizes} if pick is None
                 else bisect_sizes(sizes + [full], pick))
        for size, (m, peak, at) in picks.items():
            if size == full:
                continue
            micro = batching.MicroBatch(m, plan.micro.per_process_batch, plan.micro.source)
            out[(phase.name, size)] = replace(plan, micro=micro, predicted_peak_bytes=peak, estimate=None,
                                              notes=[], image_size=size, predicted_at_size=at)
    return out


def _pick_for(run, phase, plan) -> Callable[[int], Pick] | None:
    """The planner's pick on this run's card, where the micro-batch is its to pick (else None)."""
    if run.launch.device_type != "cuda" or not plan.micro.source.startswith("auto"):
        return None
    import torch

    from .planner import budget_bytes_for

    total = torch.cuda.get_device_properties(run.launch.acc.device).total_memory
    return planner_pick(phase.config(run.cfg), len(run.class_names), plan.micro,
                        budget_bytes_for(run.cfg, total_bytes=total), run.launch.precision.accelerate,
                        run.launch.world)


def size_note(run) -> str | None:
    """Said at start: the schedule and the micro-batch at each size (None: no resizing)."""
    if not run.sizes.on:
        return None
    full, plan = run.cfg.data.image_size, run.plan
    by_micro: dict[int, list[int]] = {}
    for size in run.sizes.sizes:
        by_micro.setdefault(run.phase_plan(_phase_of(run, plan), None if size == full else size).micro.size,
                            []).append(size)
    if len(by_micro) == 1:
        micro = f"micro-batch {next(iter(by_micro))} at every size"
    else:
        micro = ", ".join(f"micro-batch {m} at {_sizes_text(s)}" for m, s in by_micro.items())
    return f"{run.sizes.line()}; {micro}"


def _phase_of(run, plan):
    return next(p for p in run.phases if p.name == plan.phase)


def _sizes_text(sizes: list[int]) -> str:
    return f"{sizes[0]} px" if len(sizes) == 1 else f"{sizes[0]}-{sizes[-1]} px"
