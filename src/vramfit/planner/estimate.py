"""The estimate: allocation sizes as a function of the micro-batch, the peak, and the pick.

1. Every allocation of a CNN step is `a + b * batch` bytes and the op sequence does not depend on
   the batch, so two traces (`tracing.Tracer`) give every allocation's size at *any* batch exactly
   (checked: the sequences must match and the slopes must be whole numbers; a model that breaks
   this falls back to one trace per size). A table of micro-batches then costs milliseconds.
2. Live bytes after each op, rounded up to the CUDA caching allocator's 512-byte blocks, give the
   peak of one steady-state step; + the gradient reducer's buckets on several processes.
3. Peak + a named allocator-overhead fraction + a named CUDA-context constant = the predicted peak
   as nvidia-smi would show it.

Not seen by the trace (and therefore in the named constants): the CUDA context, cuBLAS/cuDNN
workspaces, kernel-internal scratch memory, and allocator fragmentation.
"""

from __future__ import annotations

import json
import math
import threading
import time
from dataclasses import asdict, dataclass

import numpy as np

from ..batching import grad_accum_steps, largest_chunk
from ..config import Config
from ..errors import VramfitError
from ..runtime.collectives import BLOCK_BYTES, reducer_buffer_bytes
from ..runtime.precision import planned
from .tracing import (BUFFER, BWD, CATEGORY_NAMES, GRAD, HOST, INPUT, OPT, PARAM, STEP, WCAST, ACT,
                      AllocationLog, Tracer)

GiB = 2**30
MiB = 2**20

# ---------------------------------------------------------------------------------------------
# Named constants. The trace is exact for what PyTorch allocates; these cover what it cannot see.
# Fitted to every public fit / out-of-memory pair in bench/published_memory.csv (267 rows: timm's
# RTX 3090 training benchmarks, Lambda's and NVIDIA's per-card ResNet50 batches), see
# `python bench/memory_check.py --published --fit` and docs/memory.md "Calibration": with these, no
# batch that ran is predicted over its card and 81 of the 90 out-of-memory batches are.

# Only the sum of the context and the workspaces shows in a fit / out-of-memory outcome: 1958 MiB
# fitted. Split as: the CUDA context with the kernels a whole network loads, as the public rows saw
# it (torch 1.10-1.13, most without lazy kernel loading, which makes it hundreds of MiB larger than
# a current torch's 300-700 MiB)...
CUDA_CONTEXT_BYTES = 1638 * MiB
# ...and the workspaces from the caching allocator, live at the peak and unseen by the trace:
# cuBLAS (8 MiB; 32 MiB on Hopper) + cuBLASLt (1-4 MiB; 32 MiB on Hopper) + cuDNN's convolution
# workspace under benchmark mode (up to a few hundred MiB).
CUDA_WORKSPACE_BYTES = 320 * MiB
# max_memory_reserved / max_memory_allocated - 1 beyond the 2 MiB segment rounding modelled below:
# the public rows leave no room for more than 0.08 with any context, and the three measured peaks
# among them are nearest at 0 (fragmentation in a CNN step that repeats the same sizes is small).
ALLOCATOR_OVERHEAD_FRACTION = 0.0
# What PyTorch reports as the total memory of a card sold as N GB (the "total capacity" of its
# out-of-memory message, `get_device_properties().total_memory`): the driver keeps the rest. Other
# sizes: REPORTED_FRACTION of the size as sold (the lowest ratio of the larger cards above).
REPORTED_GIB = {6: 5.79, 8: 7.79, 10: 9.78, 11: 10.76, 12: 11.75, 16: 15.78, 24: 23.68, 32: 31.74,
                40: 39.39, 80: 79.1}
REPORTED_FRACTION = 0.975
# Caching-allocator segments are multiples of 2 MiB (blocks of BLOCK_BYTES inside them).
SEGMENT_BYTES = 2 * MiB
# `plan` without a dataset: size the classifier head for ImageNet.
DEFAULT_NUM_CLASSES = 1000
# The two micro-batch sizes traced for the linear model (>= 2: BatchNorm refuses batch 1 on 1x1 maps).
TRACE_BATCHES = (2, 4)


@dataclass
class MemoryEstimate:
    micro_batch: int
    params_bytes: int  # all parameters (fp32 master weights) + buffers (BatchNorm statistics)
    grads_bytes: int  # grads of trainable params (+ the gradient reducer's buckets on several processes)
    optimizer_bytes: int  # AdamW: exp_avg + exp_avg_sq; SGD momentum: momentum_buffer
    activations_bytes: int  # alive at the peak, created in the forward (incl. the normalized input batch)
    temporaries_bytes: int  # alive at the peak, created in backward/step (+ autocast weight casts)
    cuda_context_bytes: int  # CUDA_CONTEXT_BYTES + CUDA_WORKSPACE_BYTES
    allocator_overhead_bytes: int  # ALLOCATOR_OVERHEAD_FRACTION of the allocated peak, rounded
    peak_bytes: int  # predicted max_memory_reserved + context: what nvidia-smi would show
    precision: str = "no"  # resolved: no (fp32) | bf16 | fp16
    per_process_batch: int = 0
    accumulating: bool = False  # grads of earlier micro-batches already live during backward
    allocated_bytes: int = 0  # predicted torch.cuda.max_memory_allocated
    reserved_bytes: int = 0  # predicted torch.cuda.max_memory_reserved
    peak_phase: str = ""  # forward | backward | optimizer: where the peak happens
    largest_forward: int = 0  # samples of the largest forward at this micro-batch (batching.largest_chunk)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["peak_gib"] = round(self.peak_bytes / GiB, 3)
        return d


def round_blocks(sizes: np.ndarray) -> np.ndarray:
    return np.where(sizes > 0, -(-sizes // BLOCK_BYTES) * BLOCK_BYTES, 0)


@dataclass
class _Peak:
    allocated: int
    by_cat: np.ndarray  # bytes per category at the peak
    phase: str


class Profile:
    """Per-allocation sizes `a + b * micro_batch`, from two traces; exact fallback otherwise."""

    def __init__(self, cfg: Config, num_classes: int, precision: str, model_fn=None):
        t0 = time.perf_counter()
        self.tracer = Tracer(cfg, num_classes, precision, model_fn)
        b1, b2 = TRACE_BATCHES
        try:
            l1 = self.tracer.trace(b1)
        except VramfitError:
            raise
        except Exception:  # noqa: BLE001
            # Models that compute with tensor data at init, or keep plain tensor attributes, cannot
            # be built on the meta device: build them for real (slower), then trace the same way.
            try:
                self.tracer.build(on_meta=False)
                l1 = self.tracer.trace(b1)
            except VramfitError:
                raise
            except Exception as e:  # noqa: BLE001
                raise VramfitError(
                    f"Could not run one training step of `{cfg.model.name}` at {cfg.data.image_size} px "
                    f"to plan its memory: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}",
                    hint="the trainer would fail the same way; check that the model accepts this "
                         "image size (e.g. a multiple of a ViT's patch size) and the model.* settings") from None
        l2 = self.tracer.trace(b2)
        self.linear = (len(l1.sizes) == len(l2.sizes) and np.array_equal(l1.events, l2.events)
                       and np.array_equal(l1.cats, l2.cats) and np.array_equal(l1.grads, l2.grads)
                       and l1.end_backward == l2.end_backward and l1.end_forward == l2.end_forward
                       and not np.any((l2.sizes - l1.sizes) % (b2 - b1)))
        if self.linear:
            self.slope = (l2.sizes - l1.sizes) // (b2 - b1)
            self.const = l1.sizes - self.slope * b1
            self.log = l1
        self._exact: dict[int, AllocationLog] = {b1: l1, b2: l2}
        self.trace_seconds = time.perf_counter() - t0
        self.num_params = sum(p.numel() for p in self.tracer.model.parameters())
        self.num_trainable = sum(p.numel() for p in self.tracer.trainable)
        # (bytes, dtype) of each trainable parameter in registration order: what the gradient
        # reducer buckets, and the gradients' size once all exist.
        self.param_sizes = [(p.numel() * p.element_size(), p.dtype) for p in self.tracer.trainable]
        self.trainable_bytes = int(round_blocks(np.array([n for n, _ in self.param_sizes], dtype=np.int64)).sum())

    def _log_at(self, micro: int) -> tuple[AllocationLog, np.ndarray]:
        if self.linear:
            return self.log, self.const + self.slope * micro
        if micro not in self._exact:
            self._exact[micro] = self.tracer.trace(micro)
        log = self._exact[micro]
        return log, log.sizes

    def peak(self, micro: int, per_process: int, accumulating: bool) -> _Peak:
        return self._evaluate(micro, per_process, accumulating)[0]

    def live_at_end_of_forward(self, micro: int, per_process: int | None = None) -> np.ndarray:
        """Bytes per category alive when the forward (and loss) is done: the saved activations."""
        return self._evaluate(micro, per_process or micro, False)[1]

    def _evaluate(self, micro: int, per_process: int, accumulating: bool) -> tuple[_Peak, np.ndarray]:
        log, sizes = self._log_at(micro)
        sizes = sizes.copy()
        # The input batch (images, labels) is the per-process batch; micro-batches are views of it.
        inputs = log.cats == INPUT
        sizes[inputs] = sizes[inputs] // micro * per_process
        sizes[log.cats == HOST] = 0  # optimizer step counters live on the host
        sizes = round_blocks(sizes)
        cats = log.cats.copy()
        cats[log.grads] = GRAD
        ev = log.events
        alloc = ev >= 0
        idx = np.where(alloc, ev, ~ev)
        delta = np.where(alloc, sizes[idx], -sizes[idx])
        ev_cat = cats[idx]
        is_grad = ev_cat == GRAD
        nongrad = np.where(is_grad, 0, delta)
        grad_live = np.cumsum(np.where(is_grad, delta, 0))
        if accumulating and len(log.grads):
            # Micro-batches after the first: every grad already exists during forward/backward, and
            # AccumulateGrad adds each new grad in place (the new grad is a one-op temporary).
            before = np.arange(len(ev)) < log.end_backward
            all_grads = int(sizes[log.grads].sum())
            transient = np.where(before & is_grad & alloc, delta, 0)
            grad_term = np.where(before, all_grads + transient, grad_live)
        else:
            grad_term = grad_live
        live = np.cumsum(nongrad) + grad_term
        k = int(np.argmax(live))
        by_cat = np.zeros(len(CATEGORY_NAMES), dtype=np.int64)
        np.add.at(by_cat, ev_cat[: k + 1], nongrad[: k + 1])
        by_cat[GRAD] = int(grad_term[k])
        if k >= log.end_backward:
            phase = "optimizer"
        elif np.any(alloc[: k + 1] & (ev_cat[: k + 1] == BWD)):
            phase = "backward"
        else:
            phase = "forward"
        at_fwd = np.zeros(len(CATEGORY_NAMES), dtype=np.int64)
        np.add.at(at_fwd, ev_cat[: log.end_forward], delta[: log.end_forward])
        return _Peak(allocated=int(live[k]), by_cat=by_cat, phase=phase), at_fwd


_PROFILES: dict[str, Profile] = {}
_PROFILE_LOCK = threading.Lock()


def _profile_key(cfg: Config, num_classes: int, precision: str) -> str:
    t = cfg.train
    return json.dumps([cfg.model.model_dump(mode="json"), cfg.optim.model_dump(mode="json"),
                       cfg.data.image_size, num_classes, precision, bool(t.clip_grad_norm),
                       t.label_smoothing > 0], sort_keys=True)


def get_profile(cfg: Config, num_classes: int, precision: str) -> Profile:
    """The profile of this model/optimizer/size/precision, traced once per process (kept for 32)."""
    key = _profile_key(cfg, num_classes, precision)
    with _PROFILE_LOCK:
        prof = _PROFILES.get(key)
        if prof is None:
            prof = Profile(cfg, num_classes, precision)
            if len(_PROFILES) >= 32:
                _PROFILES.pop(next(iter(_PROFILES)))
            _PROFILES[key] = prof
        return prof



def clear_profiles() -> None:
    """Forget every traced profile (the next estimate traces again)."""
    with _PROFILE_LOCK:
        _PROFILES.clear()


# ---------------------------------------------------------------------------------------------
# API


def allocator_reserve(allocated: int, fraction: float | None = None) -> int:
    """What the caching allocator holds for an allocated peak: + the overhead fraction (default
    ALLOCATOR_OVERHEAD_FRACTION), in whole segments. bench/published.py fits `fraction` with it."""
    f = ALLOCATOR_OVERHEAD_FRACTION if fraction is None else fraction
    return int(math.ceil(allocated * (1 + f) / SEGMENT_BYTES) * SEGMENT_BYTES)


def _estimate_from(prof: Profile, micro: int, per_process: int, num_processes: int,
                   precision: str) -> MemoryEstimate:
    per_process = max(per_process, micro)
    # The step splits the share into near-equal chunks (batching): its largest forward is what
    # the micro-batch costs, and it accumulates when there is more than one chunk.
    forward = largest_chunk(per_process, micro)
    accumulating = grad_accum_steps(per_process, micro) > 1
    pk = prof.peak(forward, per_process, accumulating=accumulating)
    c = pk.by_cat
    # The gradient reducer's flat buckets (collectives.GradReducer), allocated once for the run.
    reducer = reducer_buffer_bytes(prof.param_sizes) if num_processes > 1 else 0
    allocated = pk.allocated + reducer
    reserved = allocator_reserve(allocated)
    context = CUDA_CONTEXT_BYTES + CUDA_WORKSPACE_BYTES
    return MemoryEstimate(
        micro_batch=micro,
        params_bytes=int(c[PARAM] + c[BUFFER]),
        grads_bytes=int(c[GRAD]) + reducer,
        optimizer_bytes=int(c[OPT]),
        activations_bytes=int(c[INPUT] + c[ACT]),
        temporaries_bytes=int(c[WCAST] + c[BWD] + c[STEP]),
        cuda_context_bytes=context,
        allocator_overhead_bytes=reserved - allocated,
        peak_bytes=reserved + context,
        precision=precision,
        per_process_batch=per_process,
        accumulating=accumulating,
        allocated_bytes=allocated,
        reserved_bytes=reserved,
        peak_phase=pk.phase,
        largest_forward=forward,
    )


def _per_process(cfg: Config, num_processes: int, per_process_batch: int | None) -> int:
    if per_process_batch is not None:
        return per_process_batch
    return max(1, cfg.train.global_batch // max(1, num_processes))


def estimate(cfg: Config, num_classes: int, micro_batch: int, precision: str | None = None, *,
             num_processes: int = 1, per_process_batch: int | None = None) -> MemoryEstimate:
    """Predicted memory of one steady-state step at `micro_batch` (see MemoryEstimate).

    `precision` None -> cfg.train.precision, resolved by `precision.planned` (`auto` plans as bf16). The per-process batch (default
    global_batch / num_processes) sizes the input batch and how the share is split.
    """
    if micro_batch < 1:
        raise VramfitError(f"micro_batch must be >= 1, got {micro_batch}")
    prec = planned(precision or cfg.train.precision).accelerate
    prof = get_profile(cfg, num_classes, prec)
    return _estimate_from(prof, micro_batch, _per_process(cfg, num_processes, per_process_batch),
                          num_processes, prec)


def estimate_model(model_fn, cfg: Config, micro_batch: int, precision: str | None = None, *,
                   per_process_batch: int | None = None) -> MemoryEstimate:
    """`estimate` for any `nn.Module` built by `model_fn()` (not cached; used by the tests to check
    the trace against hand counts). The model must take (N, 3, image_size, image_size) images."""
    prec = planned(precision or cfg.train.precision).accelerate
    prof = Profile(cfg, 0, prec, model_fn)
    return _estimate_from(prof, micro_batch, _per_process(cfg, 1, per_process_batch), 1, prec)


def estimate_table(cfg: Config, num_classes: int, micro_batches: list[int], precision: str | None = None, *,
                   num_processes: int = 1, per_process_batch: int | None = None) -> list[MemoryEstimate]:
    """One estimate per micro-batch, from one traced model (two traces in all)."""
    prec = planned(precision or cfg.train.precision).accelerate
    prof = get_profile(cfg, num_classes, prec)
    per = _per_process(cfg, num_processes, per_process_batch)
    return [_estimate_from(prof, m, per, num_processes, prec) for m in micro_batches]


def pick_micro_batch(cfg: Config, num_classes: int, per_process_batch: int, budget_bytes: int, *,
                     precision: str | None = None, num_processes: int = 1
                     ) -> tuple[int | None, list[MemoryEstimate]]:
    """Largest micro-batch in 1..per_process_batch (any whole number) whose predicted peak fits.

    Returns (micro_batch or None when even 1 does not fit, the estimates tried, by micro-batch).
    Micro-batches that split the share into the same chunks cost the same; the pick is the
    smallest of them, the size of its largest chunk (a share of 128 where 64 fits and 65 does
    not: 64, not 127, which splits the same way).
    """
    prec = planned(precision or cfg.train.precision).accelerate
    prof = get_profile(cfg, num_classes, prec)
    per = per_process_batch
    tried: dict[int, MemoryEstimate] = {}

    def fits(m: int) -> bool:
        if m not in tried:
            tried[m] = _estimate_from(prof, m, per, num_processes, prec)
        return tried[m].peak_bytes <= budget_bytes

    if fits(per):  # the whole share at once does not accumulate: check it on its own
        pick = per
    else:
        # Below the share every step accumulates, and the peak grows with the micro-batch (each
        # allocation is a + b * batch, b >= 0): bisect for the last one that fits.
        lo, hi = 0, per - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        pick = largest_chunk(per, lo) if lo else None
        if pick is not None:
            fits(pick)  # the pick's own estimate is among those returned
    return pick, [tried[m] for m in sorted(tried)]


def bytes_text(n) -> str:
    """A memory figure as a person reads it: GiB to two places, or MiB below a tenth of a GiB
    (a small model's plan would otherwise read 0.00); `n/a` for no figure."""
    if not isinstance(n, (int, float)) or isinstance(n, bool):
        return "n/a"
    return f"{n / GiB:.2f} GiB" if n >= GiB / 10 else f"{n / MiB:.1f} MiB"


def reported_total_bytes(memory_gib: float) -> int:
    """What PyTorch reports as the total of a card sold as `memory_gib` GB (REPORTED_GIB)."""
    return int(REPORTED_GIB.get(memory_gib, memory_gib * REPORTED_FRACTION) * GiB)


def budget_bytes_for(cfg: Config, memory_gib: float | None = None, total_bytes: int | None = None) -> int | None:
    """What a step may use on a card sold as `memory_gib` GB (default: the recipe's card), or on
    one whose reported total is `total_bytes` (a detected card): that total less the safety margin.
    The only place the margin is taken; a run on its own card asks tuning.probe.card_budget_bytes, which
    measures the card and comes here."""
    gib = memory_gib if memory_gib is not None else cfg.hardware.memory_gib
    if total_bytes is None and gib is None:
        return None
    total = total_bytes if total_bytes is not None else reported_total_bytes(gib)
    return int(total * (1 - cfg.hardware.safety_margin))
