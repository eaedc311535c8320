"""Everything processes say to each other: step agreement, sums, the gradient reducer, buffer sync.

Each function here is a collective that every process calls at the same point with the same
arguments' shapes, so no process is ever left waiting in one. `agreed()` extends that to errors:
a block that fails on some processes only still ends on every process, and each process learns
which ones failed.
"""

from __future__ import annotations

import contextlib
import enum

import torch
import torch.distributed as dist

from .signals import STOP_SIGNALS

BUCKET_BYTES = 25 * 2**20  # DDP's default bucket size
BLOCK_BYTES = 512  # the CUDA caching allocator rounds every allocation up to this


class Status(enum.IntEnum):
    """How one process's part of a step ended; every process adopts the worst (largest)."""

    OK = 0
    THRASH = 1  # fitted, but only after the allocator freed its cache: split smaller next time
    OOM = 2
    NONFINITE = 3
    STOP = 4  # a signal arrived: undo the step, save, exit
    ERROR = 5  # an exception other than OOM on some process: every process stops


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def agree_max(value: int, device) -> int:
    """Every process learns the largest value any process holds."""
    return _agree(value, device, dist.ReduceOp.MAX)


def agree_min(value: int, device) -> int:
    """Every process learns the smallest value any process holds."""
    return _agree(value, device, dist.ReduceOp.MIN)


def _agree(value: int, device, op) -> int:
    if world_size() == 1:
        return value
    t = torch.tensor([value], device=device, dtype=torch.int32)
    dist.all_reduce(t, op=op)
    return int(t.item())


def sum_over_processes(t: torch.Tensor) -> torch.Tensor:
    """In place; a no-op on one process."""
    if world_size() > 1:
        dist.all_reduce(t)
    return t


class StepVote:
    """What every process must agree on after a step's micro-batches, in ONE collective: the status
    (as counts per Status), the signal that asked to stop (as counts per signal), this step's
    unreadable files, and the summed loss and hits. One SUM all-reduce of a small float64 vector,
    read back with one host synchronisation; its buffer is allocated once and reused, so voting
    after an out-of-memory error allocates nothing."""

    def __init__(self, device):
        import signal

        self.signals = [getattr(signal, n) for n in STOP_SIGNALS if hasattr(signal, n)]
        self._n_status = len(Status)
        self.buf = torch.zeros(self._n_status + len(self.signals) + 3, dtype=torch.float64, device=device)

    def vote(self, status: Status, signum: int, bad: int, loss_sum: torch.Tensor,
             correct: torch.Tensor) -> "Verdict":
        b, k = self.buf, self._n_status
        b.zero_()
        b[int(status)] = 1
        if signum in self.signals:
            b[k + self.signals.index(signum)] = 1
        b[-3] = bad
        b[-2].copy_(loss_sum.detach().reshape(()))
        b[-1].copy_(correct.detach().reshape(()))
        sum_over_processes(b)
        v = b.tolist()
        worst = max(s for s in Status if v[int(s)] > 0)
        sig = max((s for s, c in zip(self.signals, v[k:k + len(self.signals)]) if c > 0), default=0)
        return Verdict(worst, int(sig), int(v[-3]), v[-2], int(v[-1]))


class Verdict:
    __slots__ = ("status", "signum", "bad_files", "loss_sum", "correct")

    def __init__(self, status: Status, signum: int, bad_files: int, loss_sum: float, correct: int):
        self.status, self.signum, self.bad_files = status, signum, bad_files
        self.loss_sum, self.correct = loss_sum, correct


def bucket_layout(sizes: list[tuple[int, torch.dtype]], bucket_bytes: int | None = None) -> list[list[int]]:
    """Parameter indices per bucket, in reverse registration order (roughly the order backward
    finishes gradients in); a bucket holds one dtype and closes once it reaches `bucket_bytes`."""
    bucket_bytes = bucket_bytes or BUCKET_BYTES
    buckets, bucket, size, dtype = [], [], 0, None
    for i in reversed(range(len(sizes))):
        nbytes, dt = sizes[i]
        if bucket and dt != dtype:
            buckets.append(bucket)
            bucket, size = [], 0
        bucket.append(i)
        size, dtype = size + nbytes, dt
        if size >= bucket_bytes:
            buckets.append(bucket)
            bucket, size = [], 0
    if bucket:
        buckets.append(bucket)
    return buckets


def reducer_buffer_bytes(sizes: list[tuple[int, torch.dtype]], bucket_bytes: int | None = None) -> int:
    """Device bytes the gradient reducer holds for parameters of these (bytes, dtype), as the CUDA
    allocator reserves them (one flat buffer per bucket, rounded up to 512-byte blocks). The memory
    planner counts exactly this for runs with more than one process."""
    total = 0
    for bucket in bucket_layout(sizes, bucket_bytes):
        n = sum(sizes[i][0] for i in bucket)
        total += -(-n // BLOCK_BYTES) * BLOCK_BYTES
    return total


class GradReducer:
    """Sums gradients over processes in fixed flat buckets, overlapped with the last backward.

    Written by hand because DDP's reducer cannot be told to stand down when some other process ran
    out of memory: a process that never reaches the reduction leaves the others waiting. Here every
    bucket is an async all-reduce launched, in a fixed order, as soon as the last micro-batch's
    backward has finished its gradients (as DDP overlaps communication with backward); a process
    that stops early (out of memory, a signal) launches the buckets it has not launched with
    whatever its gradients hold. So every process issues the same collectives in the same order,
    and the sums are written back only when every process succeeded.

    The flat buffers are allocated once (one gradient copy, as DDP's buckets) and reused: launching
    and finishing a step allocate nothing, so they cannot run out of memory after an OOM.
    """

    def __init__(self, params: list, bucket_bytes: int | None = None):
        self.active = world_size() > 1
        self.params = params
        sizes = [(p.numel() * p.element_size(), p.dtype) for p in params]
        self.buckets = bucket_layout(sizes, bucket_bytes)
        self.bucket_of = {i: b for b, idx in enumerate(self.buckets) for i in idx}
        self.flats, self.views = [], []
        if self.active:
            for idx in self.buckets:
                flat = torch.empty(sum(params[i].numel() for i in idx), dtype=params[idx[0]].dtype,
                                   device=params[idx[0]].device)
                views, offset = [], 0
                for i in idx:
                    n = params[i].numel()
                    views.append(flat[offset:offset + n].view_as(params[i]))
                    offset += n
                self.flats.append(flat)
                self.views.append(views)
        self.hooks: list = []
        self.fault = None  # debug: called where a real OOM could strike while a bucket is filled
        self._reset()

    @property
    def buffer_bytes(self) -> int:
        return sum(-(-f.numel() * f.element_size() // BLOCK_BYTES) * BLOCK_BYTES for f in self.flats)

    def _reset(self) -> None:
        self.pending = [set(b) for b in self.buckets]
        self.launched: list = []  # (bucket, work)

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
        views = self.views[b]
        try:
            if self.fault is not None:
                self.fault()
            with torch.no_grad():
                for i, v in zip(self.buckets[b], views):
                    g = self.params[i].grad
                    if g is None:
                        v.zero_()
                    else:
                        v.copy_(g)
        except Exception:  # noqa: BLE001 - the sum is discarded anyway; the collective must go out
            self.flats[b].zero_()
        self.launched.append((b, dist.all_reduce(self.flats[b], async_op=True)))

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
        for b, work in self.launched:
            work.wait()
            if not apply:
                continue
            with torch.no_grad():
                for i, v in zip(self.buckets[b], self.views[b]):
                    p = self.params[i]
                    if p.grad is not None:
                        p.grad.copy_(v)
                    elif bool(v.any()):  # used on another process only; unused everywhere: stays
                        p.grad = v.clone()  # None, so the optimizer skips it as it would alone
        self._reset()


def broadcast_module(module: torch.nn.Module, src: int = 0) -> None:
    """Every process starts from process `src`'s weights and buffers (what DDP's constructor does)."""
    if world_size() == 1:
        return
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(t.data, src)


def average_batchnorm(module: torch.nn.Module) -> None:
    """Average BatchNorm running statistics over processes (as timm's distribute_bn, in one
    collective per dtype). Buffers are not broadcast in forward (that would be a collective inside
    each micro-batch, where a process that ran out of memory could no longer join), so every
    evaluation and save calls this first, for the live model and for its EMA alike. Frozen norms
    (freezing.holds_statistics) are left out: their statistics are the same everywhere, and an
    average over 3 or 6 processes could round them."""
    n = world_size()
    if n == 1:
        return
    from ..models.freezing import batch_statistics_norms

    groups: dict = {}
    for m in batch_statistics_norms(module):
        for b in (m.running_mean, m.running_var):
            if b is not None:
                groups.setdefault(b.dtype, []).append(b)
    with torch.no_grad():
        for bufs in groups.values():
            flat = torch.cat([b.reshape(-1) for b in bufs])
            dist.all_reduce(flat)
            flat /= n
            for b, avg in zip(bufs, flat.split([b.numel() for b in bufs])):
                b.copy_(avg.view_as(b))


class ProcessFailed(Exception):
    """Raised on the processes that did not fail when another one did (see `agreed`)."""

    def __init__(self, failed: list[int], what: str):
        super().__init__(f"process(es) {', '.join(map(str, failed))} stopped while {what}")
        self.failed, self.what = failed, what


def _failed_ranks(mine: bool, device) -> list[int]:
    n = world_size()
    t = torch.zeros(n, dtype=torch.int32, device=device)
    t[dist.get_rank()] = int(mine)
    dist.all_reduce(t)
    return [r for r, v in enumerate(t.tolist()) if v]


@contextlib.contextmanager
def agreed(what: str, device):
    """Run a block that holds no collective of its own; afterwards every process learns whether any
    process failed in it. The failing processes re-raise their own error (marked with `.failed`, the
    ranks that failed, so the command line can print it on the process that has it); the others
    raise ProcessFailed. Without it, an error on one process leaves the others waiting forever in
    the next collective."""
    if world_size() == 1:
        yield
        return
    error = None
    try:
        yield
    except BaseException as e:  # noqa: BLE001 - re-raised below, after the others were told
        error = e
    failed = _failed_ranks(error is not None, device)
    if error is not None:
        error.failed_ranks = failed
        raise error
    if failed:
        raise ProcessFailed(failed, what)


def full_state_dict(model: torch.nn.Module) -> dict:
    """The whole model's state dict on the main process (CPU tensors), from sharded (FSDP)
    parameters too; a collective when the model is sharded. Other processes get an empty dict."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
