"""One optimizer step: the process's share split into micro-batches, safe against running out of
memory, with one agreement between processes.

The loader hands each process its share of one optimizer batch; only the split into micro-batches
changes when memory runs out, so the maths of the run never does.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.nn.functional as F

from .. import batching
from ..errors import VramfitError
from ..models.freezing import StatisticsHorizon
from ..runtime.collectives import GradReducer, ProcessFailed, Status, StepVote, world_size


@dataclass
class StepResult:
    loss: float  # mean loss over the global batch
    correct: int
    samples: int
    grad_norm: float | None
    skipped: bool  # fp16 GradScaler skipped the update
    bad_files: int = 0  # unreadable files in this step's batch, all processes
    signum: int = 0  # a stop signal arrived during the step (which completed): save and exit


class StepInterrupted(Exception):
    """A stop was requested between micro-batches; the step was undone on every process."""

    def __init__(self, signum: int = 0):
        super().__init__(f"stopped by signal {signum}")
        self.signum = signum


class NonFiniteLoss(Exception):
    def __init__(self, value: float, what: str = "loss"):
        super().__init__(f"non-finite {what} {value}")
        self.value, self.what = value, what


class MicroBatchExhausted(Exception):
    """Even micro-batch 1 does not fit."""


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def cross_entropy_sum(logits, y, label_smoothing: float):
    # A SUM over the micro-batch; the caller divides by the samples of the whole optimizer batch.
    # `y` is class indices, or class distributions (mixup/cutmix: smoothing is already inside them).
    return F.cross_entropy(logits.float(), y, reduction="sum",
                           label_smoothing=label_smoothing if y.dim() == 1 else 0.0)


def hits(logits, y) -> torch.Tensor:
    """Correct top-1 predictions, left on the device (no host synchronisation per micro-batch)."""
    target = y if y.dim() == 1 else y.argmax(1)
    return (logits.detach().argmax(1) == target).sum()


@dataclass(frozen=True)
class StepMaths:
    """The maths of one optimizer step: the one definition that the trainer runs (`TrainStep`) and
    the planner traces (`planner.tracing`), so a change here moves the memory plan with it.

    Per micro-batch: forward, the loss summed over its samples, backward of that sum divided by the
    samples of the whole optimizer batch. Then the total gradient norm (clipped when asked) and the
    optimizer's update. How gradients are reduced, retried and voted on is TrainStep's."""

    label_smoothing: float = 0.0
    clip_grad_norm: float | None = None
    loss_fn: Callable = cross_entropy_sum

    def loss(self, logits, labels):
        """The loss of a batch, summed over its samples: the one definition the step trains on,
        the planner traces, lr-find sweeps with (`mean_loss`) and, unsmoothed, evaluation reports
        (`evaluated`)."""
        return self.loss_fn(logits, labels, self.label_smoothing)

    def mean_loss(self, logits, labels):
        """The loss of a batch averaged over its samples (a criterion as torch-lr-finder takes one)."""
        return self.loss(logits, labels) / labels.shape[0]

    def evaluated(self) -> "StepMaths":
        """The same loss as validation reports it: without label smoothing (what is measured is how
        well the model predicts the labels, not the training target)."""
        return replace(self, label_smoothing=0.0)

    def micro_batch(self, forward: Callable, backward: Callable, images, labels, step_samples: int,
                    fsdp_world: int = 0):
        """One micro-batch; returns (its loss sum, its correct predictions), left on the device."""
        logits = forward(images)
        loss = self.loss(logits, labels)
        # FSDP averages gradients over processes; scaling by the process count turns that average
        # back into the sum over the global batch that the reducer path computes.
        backward(loss * (fsdp_world / step_samples) if fsdp_world else loss / step_samples)
        return loss.detach(), hits(logits, labels)

    def grad_norm(self, clip: Callable, params):
        """The total gradient norm as `clip(params, max_norm)` returns it, clipped when
        clip_grad_norm is set. Computed even without clipping: it is logged, and a non-finite one
        (bf16/fp32; fp16's GradScaler handles its own) must stop the run before the update."""
        return clip(params, self.clip_grad_norm or float("inf"))

    @staticmethod
    def update(optimizer) -> None:
        optimizer.step()


def step_maths(train_cfg) -> StepMaths:
    """The step a config trains with (`cfg.train`)."""
    return StepMaths(label_smoothing=train_cfg.label_smoothing, clip_grad_norm=train_cfg.clip_grad_norm,
                     loss_fn=cross_entropy_sum)


def is_fsdp(model) -> bool:
    from torch.distributed.fsdp import FullyShardedDataParallel

    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # older torch: FSDP2 lives elsewhere or not at all
        FSDPModule = ()
    return isinstance(model, (FullyShardedDataParallel, *((FSDPModule,) if FSDPModule else ())))


@contextlib.contextmanager
def gradient_sync(model, enabled: bool):
    """FSDP: skip the gradient reduce-scatter on all but the last micro-batch. FSDP2 has its own
    switch (Accelerate's no_sync is a no-op on it); FSDP1 has a no_sync context."""
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(enabled)
        yield
    elif not enabled and hasattr(model, "no_sync"):
        with model.no_sync():
            yield
    else:
        yield


class TrainStep:
    """Call it once per optimizer step with this process's share of the batch.

    Each micro-batch loss is a SUM over its samples divided by the samples of the whole optimizer
    batch (all processes), and gradients are SUMMED over processes: the update is the exact mean
    over the global batch for any split, including a short last micro-batch or a short last batch.

    Processes agree once per step (collectives.StepVote): the worst status, a stop signal, the
    unreadable-file count and the loss and hit sums, in one collective. A signal seen between
    micro-batches abandons the step on every process: gradients, BatchNorm statistics and RNG state
    are put back and StepInterrupted is raised, so the caller saves the last completed step and a
    resumed run redoes this one exactly. An out-of-memory error frees the failed graph first, then
    takes part in the same collectives (which allocate nothing), and the step is retried on every
    process with a smaller micro-batch from the same starting point.
    """

    def __init__(self, accelerator, model, optimizer, micro_batch: int | batching.InEffect, *, label_smoothing: float = 0.0,
                 clip_grad_norm: float | None = None, check_grad_norm: bool = True, oom_retries: int = 0,
                 recomputes: bool = False, maths: StepMaths | None = None, min_micro_batch: int = 1,
                 bn_momentum_per_step: bool = False, partitions: int | None = None):
        self.acc, self.model, self.optimizer = accelerator, model, optimizer
        # Tar shards' fixed partitions (data.shard_partitions): each process's share of a step is
        # what its partitions give it (batching.rank_shares), as the sampler dealt it.
        self.partitions = partitions
        self.device = accelerator.device
        self.fsdp = is_fsdp(model)
        self._collect_params()
        # SyncBatchNorm gathers statistics inside every forward: a process may neither leave the
        # micro-batches early (a stop request waits for the step's end) nor retry them alone.
        self.collective_forward = any(isinstance(m, torch.nn.SyncBatchNorm) for m in model.modules())
        self.vote = StepVote(self.device)
        # The run's micro-batch in effect (build shares it with the trainer state), or one of its own.
        self.state = micro_batch if isinstance(micro_batch, batching.InEffect) else \
            batching.InEffect(micro_batch, oom_retries)
        self.thrash_warned = False
        self.maths = maths or StepMaths(label_smoothing=label_smoothing, clip_grad_norm=clip_grad_norm)
        self.check_grad_norm = check_grad_norm
        self.min_micro_batch = min_micro_batch  # models.min_micro_batch: the OOM retry stops there
        self.recomputes = recomputes and any(True for _ in model.buffers())  # gradient checkpointing
        self.horizon = StatisticsHorizon(model) if bn_momentum_per_step else None
        self.zero_loss = torch.zeros((), device=self.device)
        self.zero_hits = torch.zeros((), device=self.device, dtype=torch.int64)

    def _collect_params(self) -> None:
        """The parameters that train now, and the reducer that sums their gradients."""
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.reducer = GradReducer(self.params) if not self.fsdp else None

    def retarget(self, min_micro_batch: int) -> None:
        """Another phase of the run (phases.enter changed what trains): its parameters and the
        floor of its out-of-memory retry (its micro-batch: `self.state.enter`)."""
        self._collect_params()
        self.min_micro_batch = min_micro_batch

    def __call__(self, images, labels, step_samples: int, *, stop_requested: Callable[[], int] | None = None,
                 bad_files: int = 0, loss_fn: Callable | None = None) -> StepResult:
        maths = self.maths if loss_fn is None else replace(self.maths, loss_fn=loss_fn)
        shares = batching.rank_shares(step_samples, world_size(), self.partitions)
        if self.fsdp:
            return self._fsdp_step(images, labels, step_samples, shares, stop_requested, bad_files, maths)
        undo = _Undo(self.model, self.device)
        while True:
            bounds = self._bounds(labels, shares)
            retries_before = _alloc_retries(self.device)
            status, sums = self._attempt(images, labels, bounds, step_samples, stop_requested, maths)
            if status == Status.OK and _alloc_retries(self.device) > retries_before:
                status = Status.THRASH
            self.reducer.launch_rest()
            verdict = self.vote.vote(status, _signal(stop_requested), bad_files, *sums)
            self.reducer.finish(apply=verdict.status in (Status.OK, Status.THRASH))
            if verdict.status == Status.OOM:
                self._retry_smaller(undo)
                continue
            self._check(verdict, undo)
            break
        result = self._update(verdict, step_samples, maths)
        if verdict.status == Status.THRASH:
            self._after_thrash()
        return result

    def rehearse(self, images, labels, step_samples: int) -> bool:
        """The forwards, backwards and gradient sums of a step at the current micro-batch, with no
        update: gradients, BatchNorm statistics and RNG are put back as an abandoned step's are
        (tuning/fit.py times candidates with it). False when it ran out of memory (on any process)."""
        undo = _Undo(self.model, self.device)
        bounds = self._bounds(labels, batching.rank_shares(step_samples, world_size(), self.partitions))
        try:
            status, sums = self._attempt(images, labels, bounds, step_samples, None, self.maths)
            self.reducer.launch_rest()
            verdict = self.vote.vote(status, 0, 0, *sums)
            self.reducer.finish(apply=False)
        finally:
            self.optimizer.zero_grad(set_to_none=True)
            undo.restore()
        return verdict.status != Status.OOM

    def _bounds(self, labels, shares: list[int]) -> list[tuple[int, int]]:
        """This process's micro-batches at the current micro-batch (every process runs as many
        as the largest share needs), with BatchNorm's momentum set for their count."""
        count = batching.num_chunks(shares, self.state.micro_batch)
        if self.horizon:
            self.horizon.per_step(count)
        return batching.chunk_bounds(labels.shape[0], count)

    def _attempt(self, images, labels, bounds, step_samples, stop_requested, maths: StepMaths):
        """The micro-batches; returns (status, (loss sum, hits)). An OOM leaves this frame and its
        graph behind before anything else runs."""
        loss_sum, correct = self.zero_loss.clone(), self.zero_hits.clone()
        try:
            for k, (s, e) in enumerate(bounds):
                if stop_requested is not None and not self.collective_forward and stop_requested():
                    return Status.STOP, (loss_sum, correct)
                if k == len(bounds) - 1:
                    self.reducer.arm()
                loss, right = maths.micro_batch(self.model, self._backward, images[s:e], labels[s:e], step_samples)
                loss_sum += loss
                correct += right
                del loss, right
        except Exception as e:  # noqa: BLE001 - OOM is handled; anything else is voted, then raised
            if not is_oom(e):
                self.fail_together(e)
            if self.collective_forward:
                raise MicroBatchExhausted("out of memory with bn: sync (its statistics are gathered inside "
                                          "every forward, so one process cannot retry alone)") from e
            self.optimizer.zero_grad(set_to_none=True)  # the partial gradients go with the graph
            return Status.OOM, (self.zero_loss, self.zero_hits)
        return Status.OK, (loss_sum, correct)

    def _backward(self, loss) -> None:
        """With gradient checkpointing, backward runs the checkpointed forwards again, and train-mode
        BatchNorm would update its running statistics a second time (52 of resnet50's 53 layers):
        the statistics the forward left are put back after it, so they count each batch once."""
        kept = Buffers(self.model) if self.recomputes else None
        self.acc.backward(loss)
        if kept is not None:
            kept.restore()

    def fail_together(self, error: Exception) -> None:
        """A real error on this process: the others still finish the step's collectives and stop."""
        self.reducer.launch_rest()
        with contextlib.suppress(Exception):
            self.vote.vote(Status.ERROR, 0, 0, self.zero_loss, self.zero_hits)
            self.reducer.finish(apply=False)
        if world_size() > 1:  # its own error: the command line prints it here, on any rank (cli._prints_here)
            error.failed_ranks = [torch.distributed.get_rank()]
        raise error

    def _retry_smaller(self, undo: "_Undo") -> None:
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        undo.restore()
        self._shrink("out of memory")

    def _check(self, verdict, undo: "_Undo") -> None:
        if verdict.status == Status.ERROR:
            undo.restore()
            raise ProcessFailed([], "running a training step")
        if verdict.status == Status.STOP:
            self.optimizer.zero_grad(set_to_none=True)
            undo.restore()
            raise StepInterrupted(verdict.signum)
        if verdict.status == Status.NONFINITE or not math.isfinite(verdict.loss_sum):
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteLoss(verdict.loss_sum)

    def _update(self, verdict, step_samples: int, maths: StepMaths) -> StepResult:
        """Clip, step, zero the gradients."""
        params = self.params if not self.fsdp else list(self.model.parameters())
        grad_norm = float(maths.grad_norm(self.acc.clip_grad_norm_, params))
        if self.check_grad_norm and not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteLoss(grad_norm, "gradient norm")
        maths.update(self.optimizer)
        skipped = bool(getattr(self.optimizer, "step_was_skipped", False))
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(loss=verdict.loss_sum / step_samples, correct=verdict.correct, samples=step_samples,
                          grad_norm=grad_norm, skipped=skipped, bad_files=verdict.bad_files,
                          signum=verdict.signum)

    def _shrink(self, why: str) -> None:
        if not self.state.lower(why, self.min_micro_batch):
            raise MicroBatchExhausted(why)

    def _after_thrash(self) -> None:
        """The allocator had to free cached blocks to fit: split smaller next time. At the smallest
        micro-batch there is nothing smaller; the step did finish, so it is a warning, never an error."""
        if self.state.micro_batch > self.min_micro_batch:
            self._shrink("allocator thrashing")
        elif not self.thrash_warned:
            import logging

            self.thrash_warned = True
            logging.getLogger("vramfit").warning(
                "memory: the allocator had to free its cache to fit the smallest micro-batch (steps are slower); "
                "a lighter --model, --precision bf16 or --grad-checkpointing would leave more room")

    def _fsdp_step(self, images, labels, step_samples, shares, stop_requested, bad_files, maths: StepMaths):
        """FSDP reduce-scatters gradients inside backward, so no manual reduction and no retry: an
        OOM stops the run. Every process runs the same number of forwards (a process with an empty
        share runs weightless ones), or the others would wait in FSDP's gathers; a signal is
        honoured after the step, never between micro-batches, for the same reason."""
        count = batching.num_chunks(shares, self.state.micro_batch)
        bounds = batching.chunk_bounds(labels.shape[0], count) or [(0, 0)] * count
        if self.horizon:
            self.horizon.per_step(count)
        loss_sum, correct = self.zero_loss.clone(), self.zero_hits.clone()
        try:
            for k, (s, e) in enumerate(bounds):
                with gradient_sync(self.model, k == len(bounds) - 1):
                    if e > s:
                        loss, right = maths.micro_batch(self.model, self._backward, images[s:e], labels[s:e],
                                                        step_samples, fsdp_world=world_size())
                        loss_sum += loss
                        correct += right
                    else:
                        self._weightless_forward(images)
        except Exception as e:  # noqa: BLE001
            if is_oom(e):
                raise MicroBatchExhausted("out of memory under FSDP (no retry: gradients are sharded)") from e
            raise
        verdict = self.vote.vote(Status.OK, _signal(stop_requested), bad_files, loss_sum, correct)
        self._check(verdict, _Undo(None, self.device))
        return self._update(verdict, step_samples, maths)

    def _weightless_forward(self, images) -> None:
        """Join FSDP's collectives with no sample: two blank images in eval mode (no BatchNorm
        update), loss times zero."""
        x = torch.zeros((2, *images.shape[1:]), dtype=images.dtype, device=self.device)
        self.model.eval()
        try:
            self.acc.backward(self.model(x).float().sum() * 0.0)
        finally:
            self.model.train()


def _signal(stop_requested) -> int:
    return int(stop_requested()) if stop_requested is not None else 0


class Buffers:
    """A copy of a model's buffers (BatchNorm running statistics), to put back later. One flat copy
    per dtype: two kernels, not hundreds."""

    def __init__(self, model):
        groups: dict = {}
        for b in (model.buffers() if model is not None else ()):
            groups.setdefault((b.dtype, b.device), []).append(b)
        self.groups = [(bufs, torch.cat([b.detach().reshape(-1) for b in bufs])) for bufs in groups.values()]

    @torch.no_grad()
    def restore(self) -> None:
        for bufs, flat in self.groups:
            for b, saved in zip(bufs, flat.split([b.numel() for b in bufs])):
                b.copy_(saved.view_as(b))


class _Undo:
    """What an abandoned attempt must put back: BatchNorm running statistics (a train-mode forward
    updates them, so a half-done attempt would count its micro-batches twice) and the RNG state (a
    retry draws the same dropout / drop-path randomness however many attempts it took)."""

    def __init__(self, model, device):
        self.device = device
        self.rng = (torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None)
        self.buffers = Buffers(model)

    def restore(self) -> None:
        torch.set_rng_state(self.rng[0])
        if self.rng[1] is not None:
            torch.cuda.set_rng_state(self.rng[1], self.device)
        self.buffers.restore()


def _alloc_retries(device) -> int:
    if device.type != "cuda":
        return 0
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))


def oom_message(plan_text: str | None, smallest: int = 1) -> VramfitError:
    why = " (train-mode BatchNorm needs 2 samples per forward)" if smallest > 1 else ""
    return VramfitError(
        f"Out of memory even at micro-batch {smallest}{why}: this model/image size/precision does not fit "
        "this device." + (f"\n{plan_text}" if plan_text else ""),
        hint="try --precision bf16, --grad-checkpointing, a smaller --set data.image_size, frozen "
             "early stages (--set model.freeze=[...]) or a lighter --model; `vramfit plan` shows "
             "the predicted peak of each", exit_code=3)
