"""A micro-batch for every image size of a progressively resized run (resize.Schedule).

The global batch, and so the maths of a step, is the same at every size; what changes is how
many images one forward can take. Where the micro-batch is vramfit's to pick on a card (`auto`),
each size gets the planner's pick at that size (never below the full size's: a smaller image
never needs more memory); a micro-batch that was written, the whole share, a fit's choice or a
resumed out-of-memory reduction stays as it is at every size.

The planner traces the model at each size it plans (about a second each), so the sizes are
bisected: the pick is monotone in the size, and where the two ends of a range pick the same
micro-batch every size between them does too. A size that was not traced carries the predicted
peak of the next larger one that was (an upper bound) and names it (`predicted_at_size`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from . import batching

# (micro-batch, predicted peak bytes or None) at a size
Pick = tuple[int, "int | None"]


def bisect_sizes(sizes: list[int], pick: Callable[[int], Pick]) -> dict[int, tuple[int, int | None, int]]:
    """(micro-batch, predicted peak, size it was predicted at) for each of `sizes` (ascending),
    calling `pick` only where the micro-batch may change."""
    known: dict[int, Pick] = {}

    def at(size: int) -> Pick:
        if size not in known:
            known[size] = pick(size)
        return known[size]

    out: dict[int, tuple[int, int | None, int]] = {}

    def fill(lo: int, hi: int) -> None:
        (small, _), (large, peak) = at(sizes[lo]), at(sizes[hi])
        if small == large or hi - lo <= 1:
            for s in sizes[lo:hi + 1]:
                out[s] = (*known[s], s) if s in known else (large, peak, sizes[hi])
            return
        mid = (lo + hi) // 2
        fill(lo, mid)
        fill(mid, hi)

    if sizes:
        fill(0, len(sizes) - 1)
    return out


def planner_pick(cfg, num_classes: int, micro: batching.MicroBatch, budget_bytes: int, precision: str,
                 num_processes: int) -> Callable[[int], Pick]:
    """The planner's pick at a size, for a run whose full-size micro-batch is `micro`."""
    from .planner import pick_micro_batch

    def pick(size: int) -> Pick:
        sized = cfg.model_copy(update={"data": cfg.data.model_copy(update={"image_size": size})})
        m, tried = pick_micro_batch(sized, num_classes, micro.per_process_batch, budget_bytes,
                                    precision=precision, num_processes=num_processes)
        m = max(m or 0, micro.size)
        peak = next((e.peak_bytes for e in tried if e.micro_batch == m), None)
        return m, peak

    return pick


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
