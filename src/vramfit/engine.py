"""One optimizer step (split into micro-batches, OOM-safe) and one evaluation pass.

The loader hands each process its share of one optimizer batch; only the split into micro-batches
changes when memory runs out, so the maths of the run never does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .config import largest_divisor_at_most
from .errors import VramfitError
from .metrics import ClassificationMetrics

# Flags every process reports after its micro-batches; all agree on the largest (see _agree).
OK, THRASH, OOM, NONFINITE, STOP = 0, 1, 2, 3, 4


@dataclass
class StepState:
    micro_batch: int  # current micro-batch size on this process (shrinks on OOM, never grows)
    per_process_batch: int
    oom_retries: int = 0
    alloc_retries: int = 0
    history: list = field(default_factory=list)


@dataclass
class StepResult:
    loss: float  # mean loss over the global batch
    correct: int
    samples: int
    grad_norm: float | None
    skipped: bool  # fp16 GradScaler skipped the update


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def agree_max(flag: int, device) -> int:
    """Every process learns the largest value any process holds (the worst status flag, a signal
    number): one collective every process calls, so no rank is left waiting."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    t = torch.tensor([flag], device=device, dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


BUCKET_BYTES = 25 * 2**20  # DDP's default bucket size


class GradReducer:
    """Sums gradients over processes in fixed flat buckets, overlapped with the last backward.

    Written by hand because DDP's reducer cannot be told to stand down when some other rank ran out
    of memory: a rank that never reaches the reduction leaves the others waiting in a collective.
    Here every bucket is an async all-reduce launched, in a fixed order, as soon as the last
    micro-batch's backward has finished its gradients (as DDP overlaps communication with backward);
    a process that stops early (out of memory, a signal) launches the buckets it has not launched
    with whatever its gradients hold. So every process issues the same collectives in the same
    order, the status flag agreed after them can never be left waiting, and the sums are used only
    when every process succeeded. A trainable parameter the forward did not use holds its bucket
    (and the ones after it) until the backward ends: still correct, only not overlapped.
    """

    def __init__(self, params: list, bucket_bytes: int | None = None):
        bucket_bytes = bucket_bytes or BUCKET_BYTES
        self.active = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.params = params
        # Reverse registration order: roughly the order backward finishes gradients in.
        order = list(range(len(params)))[::-1]
        self.buckets, bucket, size = [], [], 0
        for i in order:
            bucket.append(i)
            size += params[i].numel() * params[i].element_size()
            if size >= bucket_bytes:
                self.buckets.append(bucket)
                bucket, size = [], 0
        if bucket:
            self.buckets.append(bucket)
        self.bucket_of = {i: b for b, idx in enumerate(self.buckets) for i in idx}
        self._reset()

    def _reset(self) -> None:
        self.pending = [set(b) for b in self.buckets]
        self.launched: list = []  # (bucket, flat, work)
        self.hooks: list = []

    def arm(self) -> None:
        """Before the last micro-batch: launch each bucket when its gradients are final."""
        if not self.active:
            return
        self._reset()
        for i, p in enumerate(self.params):
            self.hooks.append(p.register_post_accumulate_grad_hook(lambda _p, i=i: self._ready(i)))

    def _ready(self, i: int) -> None:
        self.pending[self.bucket_of[i]].discard(i)
        while len(self.launched) < len(self.buckets) and not self.pending[len(self.launched)]:
            self._launch(len(self.launched))

    def _launch(self, b: int) -> None:
        grads = [self.params[i].grad if self.params[i].grad is not None else torch.zeros_like(self.params[i])
                 for i in self.buckets[b]]
        flat = _flatten_dense_tensors(grads)
        self.launched.append((b, flat, dist.all_reduce(flat, async_op=True)))

    def launch_rest(self) -> None:
        """After the micro-batches, however they ended: every bucket not yet launched, in order."""
        if not self.active:
            return
        for h in self.hooks:
            h.remove()
        self.hooks = []
        while len(self.launched) < len(self.buckets):
            self._launch(len(self.launched))

    def finish(self, apply: bool) -> None:
        """Wait for the sums; write them into the gradients only if the step goes ahead."""
        if not self.active:
            return
        for b, flat, work in self.launched:
            work.wait()
            if apply:
                ps = [self.params[i] for i in self.buckets[b]]
                for p, r in zip(ps, _unflatten_dense_tensors(flat, [p.data for p in ps])):
                    if p.grad is not None:
                        p.grad.copy_(r)
                    elif bool(r.any()):  # used on another process only; unused everywhere: stays
                        p.grad = r.clone()  # None, so the optimizer skips it as it would alone
        self._reset()


def _micro_chunks(n: int, micro: int):
    return [(s, min(s + micro, n)) for s in range(0, n, micro)]


def train_step(accelerator, model, optimizer, images, labels, step_samples: int, state: StepState,
               *, label_smoothing: float, clip_grad_norm: float | None, loss_fn=None,
               check_grad_norm: bool = True, stop_requested=None) -> StepResult:
    """Forward/backward the process's share in micro-batches, agree, reduce, clip, step.

    Each micro-batch loss is a SUM over its samples divided by the samples of the whole optimizer
    batch (all processes), and gradients are SUMMED over processes: the update is the exact mean
    over the global batch for any split, including a short last micro-batch or a short last batch.

    `stop_requested()` (a signal arrived) is checked between micro-batches: the step is abandoned on
    every process, gradients and RNG state are put back as they were before it, and StepInterrupted
    is raised, so the caller saves the state of the last completed step and a resumed run redoes
    this one exactly. An OOM retry puts back the same: BatchNorm running statistics (a train-mode
    forward updates them, so a half-done attempt would count its micro-batches twice) and the RNG
    state (the retry draws the same dropout / drop-path randomness however many attempts it took).
    """
    device = accelerator.device
    n = labels.shape[0]
    params = [p for p in model.parameters() if p.requires_grad]
    if _is_fsdp(accelerator):
        return _fsdp_step(accelerator, model, optimizer, images, labels, step_samples, state,
                          label_smoothing, clip_grad_norm, loss_fn, check_grad_norm)
    rng, buffers, reducer = _rng_state(device), _Buffers(model), GradReducer(params)
    while True:
        flag, loss_sum, correct = OK, torch.zeros((), device=device), 0
        retries_before = _alloc_retries(device)
        try:
            with accelerator.no_sync(model):
                chunks = _micro_chunks(n, state.micro_batch)
                for k, (s, e) in enumerate(chunks):
                    if stop_requested is not None and stop_requested():
                        flag = STOP
                        break
                    if k == len(chunks) - 1:
                        reducer.arm()
                    x, y = images[s:e], labels[s:e]
                    logits = model(x)
                    loss = (loss_fn or _loss)(logits, y, label_smoothing)
                    accelerator.backward(loss / step_samples)
                    loss_sum += loss.detach()
                    correct += _hits(logits, y)
                    del logits, loss
        except Exception as e:  # noqa: BLE001 - only OOM is handled; anything else re-raises
            if not _is_oom(e):
                raise
            flag = OOM
        reducer.launch_rest()
        if flag == OK and not math.isfinite(float(loss_sum)):
            flag = NONFINITE
        if flag == OK and _alloc_retries(device) > retries_before:
            flag = THRASH
        flag = agree_max(flag, device)
        reducer.finish(apply=flag in (OK, THRASH))
        if flag == STOP:
            optimizer.zero_grad(set_to_none=True)
            _set_rng_state(device, rng)
            buffers.restore()
            raise StepInterrupted()
        if flag == OOM:
            _free(optimizer, device)
            _set_rng_state(device, rng)
            buffers.restore()
            _shrink(state, "out of memory")
            continue
        if flag == NONFINITE:
            optimizer.zero_grad(set_to_none=True)
            raise NonFiniteLoss(float(loss_sum))
        break

    result = _update(accelerator, optimizer, params, loss_sum, correct, step_samples, clip_grad_norm,
                     check_grad_norm)
    if flag == THRASH:  # the allocator had to free cached blocks to fit: split smaller next time
        _shrink(state, "allocator thrashing")
    return result


def _update(accelerator, optimizer, params, loss_sum, correct: int, step_samples: int,
            clip_grad_norm: float | None, check_grad_norm: bool) -> StepResult:
    """Clip, step, zero the gradients, and total the loss and hits over processes (both paths)."""
    # The norm is computed even without clipping: it is logged, and a non-finite one (bf16/fp32;
    # fp16's GradScaler handles its own) must stop the run before the update, not after.
    grad_norm = float(accelerator.clip_grad_norm_(params, clip_grad_norm or float("inf")))
    if check_grad_norm and not math.isfinite(grad_norm):
        optimizer.zero_grad(set_to_none=True)
        raise NonFiniteLoss(grad_norm, "gradient norm")
    optimizer.step()
    skipped = bool(getattr(optimizer, "step_was_skipped", False))
    optimizer.zero_grad(set_to_none=True)
    device = accelerator.device
    total = _sum_over_processes(torch.stack([loss_sum.float(), torch.tensor(float(correct), device=device)]))
    return StepResult(loss=float(total[0]) / step_samples, correct=int(total[1]), samples=step_samples,
                      grad_norm=grad_norm, skipped=skipped)


def _loss(logits, y, label_smoothing: float):
    # A SUM over the micro-batch; the caller divides by the samples of the whole optimizer batch.
    # `y` is class indices, or class distributions (mixup/cutmix: smoothing is already inside them).
    return F.cross_entropy(logits.float(), y, reduction="sum",
                           label_smoothing=label_smoothing if y.dim() == 1 else 0.0)


def _hits(logits, y) -> int:
    target = y if y.dim() == 1 else y.argmax(1)
    return int((logits.detach().argmax(1) == target).sum())


def _is_fsdp(accelerator) -> bool:
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.FSDP


def _fsdp_step(accelerator, model, optimizer, images, labels, step_samples, state, label_smoothing,
               clip_grad_norm, loss_fn, check_grad_norm) -> StepResult:
    """FSDP reduce-scatters gradients inside backward, so the manual reduction (and with it the
    OOM retry) does not apply: all but the last micro-batch skip the sync, an OOM stops the run."""
    import contextlib

    device = accelerator.device
    chunks = _micro_chunks(labels.shape[0], state.micro_batch)
    loss_sum, correct = torch.zeros((), device=device), 0
    try:
        for i, (s, e) in enumerate(chunks):
            ctx = accelerator.no_sync(model) if i < len(chunks) - 1 else contextlib.nullcontext()
            with ctx:
                logits = model(images[s:e])
                loss = (loss_fn or _loss)(logits, labels[s:e], label_smoothing)
                # FSDP averages gradients over processes; scaling by the process count turns that
                # average back into the sum over the global batch that the DDP path computes.
                accelerator.backward(loss * accelerator.num_processes / step_samples)
            loss_sum += loss.detach()
            correct += _hits(logits, labels[s:e])
    except Exception as e:  # noqa: BLE001
        if _is_oom(e):
            raise MicroBatchExhausted("out of memory under FSDP (no retry: gradients are sharded)") from e
        raise
    if not math.isfinite(float(loss_sum)):
        optimizer.zero_grad(set_to_none=True)
        raise NonFiniteLoss(float(loss_sum))
    return _update(accelerator, optimizer, list(model.parameters()), loss_sum, correct, step_samples,
                   clip_grad_norm, check_grad_norm)


class _Buffers:
    """A copy of the model's buffers (BatchNorm running statistics) taken before a step, to undo
    the updates of an abandoned attempt. One flat copy per dtype: two kernels a step, not hundreds."""

    def __init__(self, model):
        groups: dict = {}
        for b in model.buffers():
            groups.setdefault((b.dtype, b.device), []).append(b)
        self.groups = [(bufs, _flatten_dense_tensors([b.detach() for b in bufs])) for bufs in groups.values()]

    @torch.no_grad()
    def restore(self) -> None:
        for bufs, flat in self.groups:
            for b, saved in zip(bufs, _unflatten_dense_tensors(flat, bufs)):
                b.copy_(saved)


class StepInterrupted(Exception):
    """A stop was requested between micro-batches; the step was undone on every process."""


def _rng_state(device):
    return (torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


def _set_rng_state(device, state) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


class NonFiniteLoss(Exception):
    def __init__(self, value: float, what: str = "loss"):
        super().__init__(f"non-finite {what} {value}")
        self.value, self.what = value, what


def _sum_over_processes(t: torch.Tensor) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t


def _alloc_retries(device) -> int:
    if device.type != "cuda":
        return 0
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))


def _free(optimizer, device) -> None:
    optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _shrink(state: StepState, why: str) -> None:
    if state.micro_batch <= 1:
        raise MicroBatchExhausted(why)
    new = largest_divisor_at_most(state.per_process_batch, state.micro_batch // 2)
    state.history.append({"from": state.micro_batch, "to": new, "why": why})
    state.micro_batch = new
    state.oom_retries += 1


class MicroBatchExhausted(Exception):
    """Even micro-batch 1 does not fit."""


@torch.no_grad()
def evaluate(accelerator, model, loader, num_classes: int, eval_micro: list[int], normalize,
             stop_requested=None) -> dict:
    """Exact accuracy over the validation set across processes (`gather_for_metrics` drops the
    samples the sharded loader repeats to even out the last batch). `eval_micro` is a one-element
    list so an OOM-driven reduction persists across calls. A stop requested during a long evaluation
    is agreed between batches and raises StepInterrupted: evaluation changes nothing, so the caller
    saves the trained state at once and a resumed run evaluates again."""
    model.eval()
    metrics = ClassificationMetrics(num_classes)
    bad, loss_sum = [], 0.0
    for batch in loader:
        if stop_requested is not None and agree_max(STOP if stop_requested() else OK, accelerator.device) == STOP:
            model.train()
            raise StepInterrupted()
        x, y = normalize(batch.images), batch.labels.to(accelerator.device)
        while True:
            try:
                logits = torch.cat([model(x[s:e]).float() for s, e in _micro_chunks(len(y), eval_micro[0])])
                break
            except Exception as e:  # noqa: BLE001
                if not _is_oom(e) or eval_micro[0] == 1:
                    raise
                _free_eval(accelerator.device)
                eval_micro[0] = max(1, eval_micro[0] // 2)
        logits, y = accelerator.gather_for_metrics((logits, y))
        valid = y >= 0  # -1 marks an unreadable validation image (masked, reported)
        metrics.add(logits[valid], y[valid])
        loss_sum += float(F.cross_entropy(logits[valid], y[valid], reduction="sum")) if valid.any() else 0.0
        bad.extend(batch.bad)
    out = metrics.compute()
    out["loss"] = loss_sum / max(1, out["samples"])
    out["unreadable"] = bad
    model.train()
    return out


def _free_eval(device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def oom_message(state: StepState, plan_text: str | None) -> VramfitError:
    return VramfitError(
        "Out of memory even at micro-batch 1: this model/image size/precision does not fit this "
        "device." + (f"\n{plan_text}" if plan_text else ""),
        hint="try --precision bf16, --grad-checkpointing, a smaller --set data.image_size, frozen "
             "early stages (--set model.freeze=[...]) or a lighter --model; `vramfit plan` shows "
             "the predicted peak of each", exit_code=3)
