"""`micro_batch: auto` on a GPU: plan, verify with a real probe step, adjust, cache the answer.

The planner predicts without a device; the probe measures one forward/backward of the real model on
the real card at the planned micro-batch (`max_memory_reserved`, plus the optimizer state that the
first real step will allocate), then searches the whole numbers around it (a few probes: a widening
step out from the pick, then bisection between the last fit and the first out-of-memory) for the
largest that fits. Results are cached per (device, model, image size, precision, checkpointing, ...).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

import torch

from ..batching import largest_chunk
from ..config import Config
from ..data.builtin import cache_root
from ..store.caches import read_entry, write_entry

log = logging.getLogger("vramfit")


def cache_key(cfg: Config, device_name: str, per_proc: int, num_classes: int) -> str:
    from ..runtime.precision import resolve

    m = cfg.model
    return "|".join(map(str, (device_name, m.name, cfg.data.image_size, resolve(cfg.train.precision, "cuda").name,
                              m.grad_checkpointing, m.channels_last, ",".join(m.freeze), m.bn,
                              cfg.optim.name, num_classes, per_proc)))


def _cache_file() -> Path:
    return cache_root() / "micro_batch_cache.json"


def cached(key: str) -> int | None:
    try:
        return int(read_entry(_cache_file(), key))
    except (TypeError, ValueError):
        return None


def store(key: str, micro: int) -> None:
    write_entry(_cache_file(), key, micro)


def search(per_proc: int, start: int, budget: int, probe: Callable[[int], int | None]) -> tuple[int, list]:
    """Largest micro-batch in 1..per_proc whose measured peak fits `budget`, starting at the plan's pick.

    `probe(m)` returns the measured peak of a forward of m samples in bytes, or None when it ran out
    of memory. Only the largest forward of each split is probed (micro-batches 43..63 of a share of
    128 all run forwards of at most 43), each once. From `start` the step out widens (1/8 of the
    pick, doubling) until one fits and one does not, then bisection closes the gap. Raises
    RuntimeError if 1 does not fit.
    """
    seen: dict[int, bool] = {}
    trace: list[dict] = []

    def fits(m: int) -> bool:
        c = largest_chunk(per_proc, m)
        if c not in seen:
            peak = probe(c)
            seen[c] = peak is not None and peak <= budget
            trace.append({"micro_batch": c, "measured_peak_bytes": peak, "fits": seen[c]})
        return seen[c]

    m = min(max(1, start), per_proc)
    lo, hi = _bracket(m, per_proc, fits)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    if lo == 0:
        raise RuntimeError("micro-batch 1 does not fit")
    return largest_chunk(per_proc, lo), trace


def _bracket(m: int, per_proc: int, fits: Callable[[int], bool]) -> tuple[int, int]:
    """(a micro-batch that fits or 0, the next larger one known not to fit or per_proc + 1)."""
    step = max(1, m // 8)
    if fits(m):
        lo = m
        while lo < per_proc:
            nxt = min(per_proc, lo + step)
            if not fits(nxt):
                return lo, nxt
            lo, step = nxt, step * 2
        return lo, per_proc + 1
    hi = m
    while hi > 1:
        nxt = max(1, hi - step)
        if fits(nxt):
            return nxt, hi
        hi, step = nxt, step * 2
    return 0, 1


def cuda_probe(model, optimizer_state_bytes: int, image_size: int, num_classes: int, channels_last: bool,
               device, maths=None) -> Callable[[int], int | None]:
    """One forward+backward at micro-batch m on random data, as the run's step makes it (`maths`:
    train.step.StepMaths, its loss); the model's weights, BatchNorm statistics and the global random
    streams are left exactly as they were."""
    from ..train.step import StepMaths

    maths = maths or StepMaths()

    def probe(m: int) -> int | None:
        buffers = {k: v.detach().clone() for k, v in model.state_dict().items() if not v.is_floating_point()
                   or k.endswith(("running_mean", "running_var"))}
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        try:
            with torch.random.fork_rng(devices=[device]):
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
                x = torch.randn(m, 3, image_size, image_size, device=device).contiguous(memory_format=fmt)
                y = torch.randint(0, num_classes, (m,), device=device)
                maths.micro_batch(model, torch.Tensor.backward, x, y, m)
                peak = torch.cuda.max_memory_reserved(device)
            return peak + optimizer_state_bytes
        except torch.OutOfMemoryError:
            return None
        finally:
            for p in model.parameters():
                p.grad = None
            model.load_state_dict(buffers, strict=False)
            torch.cuda.empty_cache()

    return probe


def usable_bytes(device, *, warn: bool = True) -> int:
    """What this process can have: the card's free memory plus what it already holds (its cache and,
    as the planner counts it, its CUDA context). Memory held by other processes (a desktop, another
    run, a notebook kernel) is not usable, and is named in a warning (`warn`)."""
    from ..planner import CUDA_CONTEXT_BYTES

    free, total = torch.cuda.mem_get_info(device)
    usable = min(total, free + torch.cuda.memory_reserved(device) + CUDA_CONTEXT_BYTES)
    others = total - usable
    if warn and others > 0.05 * total:
        log.warning("other processes hold about %.1f GiB of this GPU (see nvidia-smi): planning for the "
                    "%.1f GiB left", others / 2**30, usable / 2**30)
    return usable


def allocator_cap_bytes(device, total: int) -> int:
    """The caching allocator's cap on this process (`torch.cuda.set_per_process_memory_fraction`,
    1.0 unless someone set it), in bytes of the card's `total`."""
    try:
        fraction = torch.cuda.get_per_process_memory_fraction(device)
    except (AttributeError, AssertionError, RuntimeError):  # an older torch, or no CUDA to ask
        fraction = 1.0
    return int(total * min(1.0, max(0.0, fraction)))


def card_budget_bytes(cfg: Config, device, *, warn: bool = False) -> int | None:
    """What one training step may use on `device`, the one budget every pick of a run is made
    against (the start's micro-batch, each progressive size's, the fit's candidates, the notes):
    the least of the card's total, the recipe's card (`hardware.memory_gib`: a 12 GB recipe plans
    for 12 GB on a larger card too), the allocator's cap, and what other processes leave, less
    `hardware.safety_margin` (the planner's arithmetic, planner.budget_bytes_for, which `vramfit
    plan` uses for a card it is not running on). Without a CUDA device: the recipe's card (None
    where it names none). `warn`: say when other processes hold part of the card."""
    from ..planner import budget_bytes_for

    if device is None or torch.device(device).type != "cuda":
        return budget_bytes_for(cfg)
    total = torch.cuda.get_device_properties(device).total_memory
    return budget_bytes_for(cfg, total_bytes=usable_total_bytes(
        cfg, total, allocator_cap_bytes(device, total), usable_bytes(device, warn=warn)))


def usable_total_bytes(cfg: Config, total: int, *limits: int | None) -> int:
    """The card memory a run of `cfg` plans within, before the safety margin: the least of the
    card's total, the recipe's card (`hardware.memory_gib`) and the other `limits` known (the
    allocator's cap, what other processes leave). `vramfit doctor` asks it too, so its plan is the run's."""
    from ..planner import reported_total_bytes

    known = [total, *(b for b in limits if b is not None)]
    if cfg.hardware.memory_gib:
        known.append(reported_total_bytes(cfg.hardware.memory_gib))
    return min(known)


def auto_micro_batch(cfg: Config, num_classes: int, per_proc: int, model=None, device=None) -> dict:
    """Plan (and on a GPU with `model` given, probe) the micro-batch for `micro_batch: auto`."""
    from ..planner import pick_micro_batch

    device = device or torch.device("cuda")
    budget = card_budget_bytes(cfg, device, warn=True)
    name = torch.cuda.get_device_name(device)
    key = cache_key(cfg, name, per_proc, num_classes)
    hit = cached(key)
    if hit is not None and 1 <= hit <= per_proc:
        return {"micro_batch": hit, "reason": f"auto: cached for {name}", "budget_bytes": budget}
    pick, table = pick_micro_batch(cfg, num_classes, per_proc, budget)
    plan = {"micro_batch": pick or 1, "reason": "auto: planner", "budget_bytes": budget,
            "predicted": [e.as_dict() for e in table if e.micro_batch == (pick or 1)]}
    if model is None:
        return plan
    opt_bytes = sum(p.numel() for p in model.parameters() if p.requires_grad) * (
        8 if cfg.optim.name == "adamw" else 4)
    from ..train.step import step_maths

    probe = cuda_probe(model, opt_bytes, cfg.data.image_size, num_classes, cfg.model.channels_last, device,
                       step_maths(cfg.train))
    try:
        micro, trace = search(per_proc, pick or 1, budget, probe)
    except RuntimeError:
        micro, trace = 1, [{"micro_batch": 1, "fits": False}]
        log.warning("auto micro-batch: even 1 sample did not fit in the probe; starting at 1")
    store(key, micro)
    plan.update(micro_batch=micro, reason=f"auto: planner {pick}, verified on {name}", probe=trace)
    return plan


def auto_pick(cfg: Config, num_classes: int, model=None, device=None,
              found: dict | None = None) -> Callable[[int], int]:
    """The `pick` that `batching.resolve_micro_batch("auto", share, pick=...)` takes on a GPU: the
    planner's pick for the card, confirmed by the probe when `model` is given, and the smallest over
    processes (every process must split the same way). What it found (the reason, the budget, the
    prediction and the probes) is written into `found`, for plan.json."""
    from ..runtime.collectives import agree_min

    def pick(per_proc: int) -> int:
        res = auto_micro_batch(cfg, num_classes, per_proc, model, device)
        res["micro_batch"] = agree_min(res["micro_batch"], device or torch.device("cuda"))
        if found is not None:
            found.update(res)
        return res["micro_batch"]

    return pick

