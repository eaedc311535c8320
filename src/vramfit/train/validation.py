"""One evaluation pass over the validation loader: exact accuracy across processes, OOM-safe; and
the BatchNorm statistics it normalises by, recomputed first where model.precise_bn asks."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import batching
from ..models.freezing import batch_statistics_norms
from ..runtime.collectives import Status, StepVote, world_size
from ..store.accuracy import ClassificationMetrics
from .step import StepInterrupted, StepMaths, is_oom


@dataclass
class EvalState:
    micro_batch: int  # shrinks on an evaluation OOM and stays shrunk for the rest of the run


@dataclass
class EvalResult:
    accuracy: float | None  # None when no image could be read
    top5: float | None
    loss: float | None
    samples: int
    unreadable: list[str] = field(default_factory=list)
    predictions: torch.Tensor | None = None  # top-1 class per sample (CPU), in gathered order
    labels: torch.Tensor | None = None
    logits: torch.Tensor | None = None  # (N, C) float on the CPU, for per-class figures
    indices: torch.Tensor | None = None  # dataset row of each sample (with logits)


@torch.no_grad()
def evaluate(accelerator, model, loader, num_classes: int, normalize, state: EvalState,
             stop_requested=None, keep_logits: bool = False, maths: StepMaths | None = None) -> EvalResult:
    """`gather_for_metrics` drops the samples the sharded loader repeats to even out the last batch.
    Each batch is agreed between processes (one small collective): an OOM on any process retries
    the batch on every process with a smaller micro-batch (so every process runs the same forwards,
    which FSDP needs), and a stop signal raises StepInterrupted on all of them: evaluation changes
    nothing, so the caller saves the trained state at once and a resumed run evaluates again.
    `maths`: the step the run trains with (train.step.step_maths), whose loss is reported unsmoothed."""
    model.eval()
    try:
        return _evaluate(accelerator, model, loader, num_classes, normalize, state, stop_requested, keep_logits,
                         (maths or StepMaths()).evaluated())
    finally:
        model.train()


def _evaluate(acc, model, loader, num_classes, normalize, state, stop_requested, keep_logits,
              maths: StepMaths) -> EvalResult:
    metrics = ClassificationMetrics(num_classes)
    vote = StepVote(acc.device) if world_size() > 1 else None
    bad, loss_sum, kept = [], 0.0, {"p": [], "y": [], "l": [], "i": []}
    for batch in loader:
        x, y = normalize(batch.images), batch.labels.to(acc.device)
        logits = _forward_agreed(model, x, state, vote, stop_requested, acc.device)
        logits, y, idx = acc.gather_for_metrics((logits, y, batch.indices.to(acc.device)))
        valid = y >= 0  # -1 marks an unreadable validation image (masked, reported)
        if valid.any():
            lv, yv = logits[valid], y[valid]
            metrics.add(lv, yv)
            loss_sum += float(maths.loss(lv, yv))
            kept["p"].append(lv.argmax(1).cpu())
            kept["y"].append(yv.cpu())
            if keep_logits:
                kept["l"].append(lv.cpu())
                kept["i"].append(idx[valid].cpu())
        bad.extend(batch.bad)
    # No readable image at all: no figures (evaluate cannot compute over nothing), never NaN.
    out = metrics.compute() if metrics.count else {"samples": 0}
    n = out["samples"]
    cat = (lambda xs: torch.cat(xs) if xs else None)  # noqa: E731
    return EvalResult(accuracy=out["accuracy"] if n else None, top5=out["top5"] if n else None,
                      loss=loss_sum / n if n else None, samples=n, unreadable=bad,
                      predictions=cat(kept["p"]), labels=cat(kept["y"]), logits=cat(kept["l"]),
                      indices=cat(kept["i"]))


def _forward_agreed(model, x, state: EvalState, vote, stop_requested, device):
    while True:
        status, logits = _forward_voted(model, x, state, vote, stop_requested, device)
        if status != Status.OOM:
            return logits


def _forward_voted(model, x, state: EvalState, vote, stop_requested, device):
    """One forward of `x`, agreed between processes: a stop raises StepInterrupted everywhere; an
    OOM anywhere shrinks the evaluation micro-batch everywhere and is returned for the caller to
    retry."""
    signum = int(stop_requested()) if stop_requested is not None else 0
    status, logits = (Status.STOP, None) if signum else _forward(model, x, state.micro_batch)
    if vote is not None:
        zero = torch.zeros((), device=device)
        verdict = vote.vote(status, signum, 0, zero, zero)
        status, signum = verdict.status, verdict.signum or signum
    if status == Status.STOP:
        raise StepInterrupted(signum)
    if status == Status.OOM:
        if state.micro_batch == 1:
            raise torch.OutOfMemoryError("out of memory evaluating one image at a time")
        state.micro_batch = batching.smaller_micro_batch(state.micro_batch)
    return status, logits


@torch.no_grad()
def recalibrate_batchnorm(acc, model, loader, normalize, state: EvalState, seed: int,
                          stop_requested=None) -> int:
    """model.precise_bn: every BatchNorm that follows its batches (frozen ones keep theirs) gets
    running statistics recomputed from scratch over `loader` (train images, validation transform),
    each forward weighing the same (momentum None, what "precise BN" and swa_utils.update_bn do),
    then averaged over processes by the caller. Train-mode forwards without gradients, under a
    random state of their own (seeded), so dropout draws leave the training's stream alone. An
    OOM restarts the pass at a smaller split (a half-counted pass would weigh batches unequally); a
    stop puts the statistics back as they were, so the saved state is the trained one and a resumed
    run recalibrates again. Hand-written rather than swa_utils.update_bn: that one resets the
    statistics of frozen norms too and knows nothing of processes, OOM or stops. Returns the
    number of forwards of the pass that counted."""
    norms = batch_statistics_norms(model)
    if not norms or loader is None:
        return 0
    before = [(m.momentum, {k: b.clone() for k, b in m.named_buffers()}) for m in norms]
    vote = StepVote(acc.device) if world_size() > 1 else None
    devices = [acc.device] if acc.device.type == "cuda" else []
    was_training = model.training
    model.train()
    try:
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            while True:
                forwards = _statistics_pass(acc, model, loader, normalize, state, vote, stop_requested, norms)
                if forwards is not None:
                    return forwards
    except BaseException:
        for m, (_, bufs) in zip(norms, before):
            for k, b in m.named_buffers():
                b.copy_(bufs[k])
        raise
    finally:
        for m, (momentum, _) in zip(norms, before):
            m.momentum = momentum
        model.train(was_training)


def _statistics_pass(acc, model, loader, normalize, state, vote, stop_requested, norms) -> int | None:
    """One pass of recalibrate_batchnorm from reset statistics; None when an OOM asks for another."""
    for m in norms:
        m.reset_running_stats()
        m.momentum = None
    forwards = 0
    for batch in loader:
        x = normalize(_blanks_replaced(batch.images, batch.labels))
        # A batch without one readable image is forwarded (every process runs the same forwards:
        # FSDP's collectives) with the norms in eval mode, so it counts for nothing.
        counted = bool((batch.labels >= 0).any())
        for m in norms:
            m.train(counted)
        try:
            status, _ = _forward_voted(model, x, state, vote, stop_requested, acc.device)
        finally:
            for m in norms:
                m.train(True)
        if status == Status.OOM:
            return None
        forwards += -(-x.shape[0] // state.micro_batch) if counted else 0
    return forwards


def _blanks_replaced(images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A statistics batch with each unreadable image (a blank, label -1) stood in for by a readable
    one of the same batch: no blank enters the statistics, and every process still forwards the
    same shapes in the same number of chunks (FSDP's collectives). A batch of blanks only is left
    as it is (its caller does not count it)."""
    readable = (labels >= 0).nonzero().flatten().to(images.device)
    if len(readable) == 0 or len(readable) == len(labels):
        return images
    blanks = (labels < 0).nonzero().flatten().to(images.device)
    out = images.clone()
    out[blanks] = images[readable[torch.arange(len(blanks), device=images.device) % len(readable)]]
    return out


def _forward(model, x, micro: int):
    bounds = batching.chunk_bounds(x.shape[0], -(-x.shape[0] // micro)) or [(0, 0)]
    try:
        return Status.OK, torch.cat([model(x[s:e]).float() for s, e in bounds])
    except Exception as e:  # noqa: BLE001
        if not is_oom(e):
            raise
    if x.device.type == "cuda":
        torch.cuda.empty_cache()
    return Status.OOM, None
