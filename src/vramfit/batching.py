"""Batch arithmetic, in one place: how an optimizer batch is shared over processes, how a share is
split into micro-batches, how many steps an epoch has, and which micro-batch a run uses.

`vramfit train`, `vramfit plan` and `micro_batch: auto` all call `resolve_micro_batch` and
`grad_accum_steps`; nothing else derives them. The micro-batch a run executes with at any moment is
one `InEffect` object: the step splits by it, the fit measures from it, the out-of-memory retry
lowers it and the checkpoint saves it; nothing holds a copy to reconcile.

The rules (docs/distributed.md):
- The recipe fixes the global batch. Each process takes a near-equal share of it; the order of the
  samples and the number of steps per epoch do not depend on the process count.
- A share is split into `ceil(share / micro_batch)` near-equal chunks, the same count on every
  process (FSDP needs every process to run the same number of forwards). The micro-batch need not
  divide the share: 30 samples at micro-batch 8 run as 8 + 8 + 7 + 7.
- No chunk ever holds exactly one sample while the share has two or more: train-mode BatchNorm
  cannot normalise one sample (timm heads with a 1x1 feature map raise on it). Where that would
  happen (micro-batch 2 and an odd share), one chunk fewer is used and a chunk takes one sample more.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from .errors import VramfitError


def per_process_batch(global_batch: int, num_processes: int) -> int:
    """The share of one full optimizer batch each process takes (checked to divide, as llm.c does)."""
    if global_batch % num_processes:
        valid = [g for g in (global_batch - global_batch % num_processes,
                             global_batch + num_processes - global_batch % num_processes) if g > 0]
        raise VramfitError(
            f"global_batch {global_batch} does not divide over {num_processes} processes.",
            hint=f"use global_batch {' or '.join(map(str, valid))} (a multiple of the process count), "
                 f"e.g. --global-batch {valid[-1]}")
    return global_batch // num_processes


def steps_per_epoch(num_samples: int, global_batch: int) -> int:
    """Full batches, plus a short final batch when it holds at least two samples (whatever the
    process count, so the schedule of a recipe is the same on 1 or 8 processes)."""
    full, rest = divmod(num_samples, global_batch)
    return full + (1 if rest >= 2 else 0)


def rank_shares(step_samples: int, num_processes: int, partitions: int | None = None) -> list[int]:
    """Samples each process takes from one optimizer batch of `step_samples`: near-equal, and never
    exactly one while the batch has two or more (a short final batch with fewer than two samples a
    process goes to fewer processes; the others take none and add nothing to the gradient sums).
    With `partitions` (tar shards: data.shards), each process takes what its contiguous block of
    the fixed partitions gives the step (`partition_shares`), so the step's samples are the same
    at every process count that divides them."""
    if partitions is not None:
        per = check_partitions(partitions, num_processes)
        shares = partition_shares(step_samples, partitions)
        return [sum(shares[r * per:(r + 1) * per]) for r in range(num_processes)]
    takers = max(1, min(num_processes, step_samples // 2))
    per, extra = divmod(step_samples, takers)
    return [(per + (1 if r < extra else 0)) if r < takers else 0 for r in range(num_processes)]


def check_partitions(partitions: int, num_processes: int) -> int:
    """The partitions each process holds (tar shards' `data.shard_partitions`), checked to divide."""
    if partitions % num_processes:
        more = partitions * num_processes // math.gcd(partitions, num_processes)
        raise VramfitError(
            f"data.shard_partitions {partitions} does not divide over {num_processes} processes: the order "
            "of tar shards is cut into that many fixed partitions, a whole number of them per process.",
            hint=f"--set data.shard_partitions={more} (a multiple of the process count; it changes the "
                 "sample order, so it is a new run), or launch a number of processes that divides "
                 f"{partitions}")
    return partitions // num_processes


def spread_order(n: int) -> list[int]:
    """0..n-1 in bit-reversed order (the numbers past n skipped): its first k entries fall evenly,
    within one, into the aligned halves, quarters, ... of 0..n-1 (exactly so where n is a power of
    two), so what goes to the first k goes to every process's block alike."""
    bits = max(1, (n - 1).bit_length())
    return [r for r in (int(format(i, f"0{bits}b")[::-1], 2) for i in range(2 ** bits)) if r < n]


def partition_shares(step_samples: int, partitions: int) -> list[int]:
    """Samples each fixed partition gives one optimizer batch of `step_samples`: the rule of
    `rank_shares` (near-equal, never exactly one, so a process's block never sums to one either),
    with the takers and the extra samples placed in `spread_order`. Where every partition takes two
    or more (a full batch of at least twice as many samples as partitions) each process's block
    then sums to the count `rank_shares` gives it, within one; a smaller batch (an epoch's short
    last one) is shared in pairs, a little less evenly. The step reads the counts from here too
    (train.step), so it splits every process's real share."""
    takers = max(1, min(partitions, step_samples // 2))
    per, extra = divmod(step_samples, takers)
    shares = [0] * partitions
    for k, c in enumerate(spread_order(partitions)[:takers]):
        shares[c] = per + (1 if k < extra else 0)
    return shares


def rank_slice(batch: list, rank: int, num_processes: int) -> list:
    """This process's contiguous part of one optimizer batch (see `rank_shares`)."""
    shares = rank_shares(len(batch), num_processes)
    start = sum(shares[:rank])
    return batch[start:start + shares[rank]]


def num_chunks(shares: list[int], micro_batch: int) -> int:
    """Forwards each process runs for one step: the same count on every process."""
    taken = [s for s in shares if s > 0]
    if not taken:
        return 0
    count = math.ceil(max(taken) / micro_batch)
    if micro_batch >= 2 and min(taken) >= 2:
        count = min(count, min(taken) // 2)  # no 1-sample chunk (see the module docstring)
    return max(1, count)


def chunk_bounds(n: int, count: int) -> list[tuple[int, int]]:
    """`n` samples in `count` near-equal consecutive chunks, as (start, end); empty ones left out."""
    if count <= 0 or n <= 0:
        return []
    per, extra = divmod(n, count)
    out, start = [], 0
    for i in range(count):
        end = start + per + (1 if i < extra else 0)
        if end > start:
            out.append((start, end))
        start = end
    return out


def grad_accum_steps(per_process: int, micro_batch: int) -> int:
    """Micro-batches (forward/backward passes) per optimizer step for a full batch."""
    return num_chunks([per_process], micro_batch)


def largest_chunk(per_process: int, micro_batch: int) -> int:
    """The largest forward a process runs for a full batch at this micro-batch."""
    return max(e - s for s, e in chunk_bounds(per_process, grad_accum_steps(per_process, micro_batch)))


def smaller_micro_batch(micro_batch: int) -> int:
    """The next micro-batch to try after running out of memory (halving; 1 is the floor)."""
    return max(1, micro_batch // 2)


@dataclass
class InEffect:
    """The micro-batch a run executes with now: the one object the step splits by (train.step.TrainStep),
    the fit measures from and sets (fit.apply), the loop moves from plan to plan (`enter`) and the
    checkpoint saves (trainer_state.json `micro_batch`, `oom_retries`: state.TrainerState)."""

    micro_batch: int  # the largest forward of one process
    oom_retries: int = 0  # over the whole run (a resume continues the count)
    # What an out-of-memory retry lowered it to since the plan last changed what trains (a resumed
    # run starts with its checkpoint's), None where none did: `capped` keeps every later pick under it.
    lowered: int | None = None
    history: list = field(default_factory=list)  # each change: {"from", "to", "why"}

    def capped(self, micro_batch: int) -> int:
        """The rule that a micro-batch never runs above one an out-of-memory retry lowered, written
        here only: the loop's next size, a resumed fit's choice and a resumed plan all go through it."""
        return micro_batch if self.lowered is None else min(micro_batch, self.lowered)

    def lower(self, why: str, smallest: int) -> bool:
        """After running out of memory: the next smaller micro-batch, never below `smallest`
        (models.min_micro_batch). False where it already is the smallest (nothing left to try)."""
        if self.micro_batch <= smallest:
            return False
        new = max(smallest, smaller_micro_batch(self.micro_batch))
        self.history.append({"from": self.micro_batch, "to": new, "why": why})
        self.micro_batch = self.lowered = new
        self.oom_retries += 1
        return True

    def enter(self, planned: int, fresh: bool) -> int:
        """Another plan takes over (a phase, a fit segment or an image size begins): its micro-batch
        `planned`, as it is where the plan changed what trains or how it is chosen (`fresh`: a new
        phase, a new fit's choice, the launch's first step), else under what a retry lowered."""
        if fresh:
            self.lowered = None
        self.micro_batch = planned if fresh else self.capped(planned)
        return self.micro_batch


@dataclass(frozen=True)
class MicroBatch:
    """The micro-batch a run (or a plan) uses, and why."""

    size: int  # the largest number of samples one forward of one process takes
    per_process_batch: int
    source: str  # configured | whole share | auto ... | resumed
    note: str | None = None  # said at start when the request was changed

    @property
    def lowered_by_oom(self) -> bool:
        """Whether it is where an interrupted run had come down to after out-of-memory errors."""
        return self.source == "resumed"

    def in_effect(self, oom_retries: int = 0) -> InEffect:
        """The run's micro-batch in effect, starting at this one (under it, if a retry had lowered it)."""
        return InEffect(self.size, oom_retries, lowered=self.size if self.lowered_by_oom else None)

    @property
    def grad_accum_steps(self) -> int:
        return grad_accum_steps(self.per_process_batch, self.size)

    def as_dict(self) -> dict:
        return {"micro_batch": self.size, "per_process_batch": self.per_process_batch,
                "grad_accum_steps": self.grad_accum_steps, "micro_batch_source": self.source,
                "micro_batch_note": self.note}


def _check_min_size(requested, per_process: int, min_size: int) -> None:
    if per_process < min_size:
        raise VramfitError(
            f"Each process takes {per_process} sample(s) of the global batch per step, and this model's "
            f"train-mode BatchNorm cannot train on fewer than {min_size} at once.",
            hint=f"raise --global-batch to at least {min_size} per process, or fix the BatchNorm statistics "
                 "with --set model.bn=freeze")
    if isinstance(requested, int) and requested < min_size:
        raise VramfitError(
            f"--micro-batch {requested}: this model's train-mode BatchNorm cannot train on fewer than "
            f"{min_size} samples at once.",
            hint=f"use --micro-batch {min_size} (or auto), or fix the BatchNorm statistics with --set model.bn=freeze")


def eval_batch(configured: int | None, micro: MicroBatch) -> int:
    """Samples per evaluation forward (`train.eval_batch`, or): evaluation keeps no activations for
    backward, no gradients and no optimizer state, so the training micro-batch always fits, and up
    to the whole share (at most 256) usually does."""
    return configured or max(micro.size, min(micro.per_process_batch, 256))


def resolve_micro_batch(requested: int | str | None, per_process: int, *,
                        pick: Callable[[int], int] | None = None,
                        resumed: int | None = None, min_size: int = 1) -> MicroBatch:
    """The one rule for the micro-batch, for training, `plan` and `auto` alike.

    `requested`: the config's `train.micro_batch` (a number, `auto`, or None for the whole share).
    `pick(per_process)`: how `auto` sizes against a device (planner, then probe); without it `auto`
    runs the whole share at once (nothing to size against, e.g. on a CPU).
    `resumed`: the micro-batch an interrupted run had come down to after running out of memory;
    a resumed run continues there rather than run out of memory again.
    `min_size`: the fewest samples the model can train on at once (models.min_micro_batch: 2 with
    train-mode BatchNorm); a share or a micro-batch below it is refused with the fix.
    """
    _check_min_size(requested, per_process, min_size)
    if requested is None:
        mb = MicroBatch(per_process, per_process, "whole share")
    elif requested == "auto":
        if pick is None:
            mb = MicroBatch(per_process, per_process, "auto without a device to size against: whole share")
        else:
            mb = MicroBatch(min(max(min_size, int(pick(per_process))), per_process), per_process, "auto")
    elif int(requested) > per_process:
        # A recipe's micro-batch is what fits its card; with more processes each holds fewer
        # samples, so the same recipe runs unchanged on 8 GPUs with the whole share at once.
        mb = MicroBatch(per_process, per_process, "configured, capped at the share",
                        note=f"micro-batch {requested} is larger than this process's share of the global "
                             f"batch ({per_process}): each step runs its {per_process} samples at once")
    else:
        mb = MicroBatch(int(requested), per_process, "configured")
    if resumed is not None and min_size <= resumed < mb.size:
        return MicroBatch(resumed, per_process, "resumed",
                          note=f"continuing at micro-batch {resumed}, where the interrupted run had come "
                               f"down to after out-of-memory errors (instead of {mb.size}; "
                               f"--set allow_resume_change=true starts from {mb.size} again)")
    return mb
