"""The planner's micro-batch at each image size of a progressively resized run.

The planner traces the model at each size it plans (about a second each), so the sizes are
bisected: the pick is monotone in the size, and where the two ends of a range pick the same
micro-batch every size between them does too. A size that was not traced carries the predicted
peak of the next larger one that was (an upper bound) and names it (`predicted_at_size`).
A run's plans per size (tuning/size_plans.py) and `vramfit plan` both use these.
"""

from __future__ import annotations

from typing import Callable

from .. import batching
from .estimate import pick_micro_batch

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


def planner_picks(micro: batching.MicroBatch) -> bool:
    """Whether the planner picks the micro-batch at each size (`auto`); otherwise the micro-batch
    was written, is the whole share or was resumed, and stays the same at every size."""
    return micro.source.startswith("auto")


def size_picks(sizes: list[int], micro: batching.MicroBatch, full_peak: int | None, full: int,
               pick: Callable[[int], Pick] | None) -> dict[int, tuple[int, int | None, int]]:
    """(micro-batch, predicted peak, size it was predicted at) at each of `sizes` (ascending):
    `pick`'s, bisected; `pick` None (not the planner's to pick): `micro` at every size, its
    full-size peak bounding each."""
    if pick is None:
        return {s: (micro.size, full_peak, full) for s in sizes}
    return bisect_sizes(sizes, pick)


def planner_pick(cfg, num_classes: int, micro: batching.MicroBatch, budget_bytes: int, precision: str,
                 num_processes: int) -> Callable[[int], Pick]:
    """The planner's pick at a size, for a run whose full-size micro-batch is `micro`."""

    def pick(size: int) -> Pick:
        sized = cfg.model_copy(update={"data": cfg.data.model_copy(update={"image_size": size})})
        m, tried = pick_micro_batch(sized, num_classes, micro.per_process_batch, budget_bytes,
                                    precision=precision, num_processes=num_processes)
        m = max(m or 0, micro.size)
        peak = next((e.peak_bytes for e in tried if e.micro_batch == m), None)
        return m, peak

    return pick
