"""`train.fit: fastest`: of the execution settings that leave a step's maths unchanged (the
micro-batch, channels_last, gradient checkpointing; torch.compile with `train.compile: auto`), the
fastest that fits, chosen by measurement. The precision is not one of them: `train.precision: auto`
is a rule (runtime/precision.py), and bench/fit_sweep.py `--precisions` measures bf16 against fp16.

The planner drops what will not fit; the rest are timed on the run's own first batches, on the
device it trains on, with the step it trains with (`TrainStep.rehearse`: forwards, backwards and
gradient sums, no update, everything put back), so the weights of the run are those of a run given
the winning settings directly. The search is greedy from the settings as written, one setting at a
time, the most promising first, and stops when the probe has used its share of the run's expected
wall time (`train.fit_probe_fraction`, 3%): a short run probes little, and one whose steps cannot
pay for measuring even the settings as written (WARMUP_STEPS + TIMED_STEPS steps: at 3%, a fit
segment of fewer than 100 steps) measures nothing and says so; after each candidate, one that would
take longer than what is left (as long as the longest so far) is not started. Every process probes the
same candidates and takes the slowest process's time, so all agree on one choice. The result is
cached per machine, model, image size, precision, batch split and library versions (a rerun or a
resume does not probe again).

Staged fine-tuning (`train.freeze_epochs`) changes what a step costs when the backbone starts to
train: its gradients, optimizer state and saved activations. So each later phase has its micro-batch
chosen again as it begins (`refit`), by the same measurement on its own first batches, with the
memory layout, checkpointing and compilation the start chose kept (a change of layout mid-run would
re-lay the parameters the optimizer already holds). The choices are recorded per phase (`later`), so
a resume inside a later phase takes its own.

Progressive resizing changes what a step costs with every size, and where the planner's
micro-batch changes so do the candidates: the sizes of a phase that share the planner's
micro-batch are one fit segment (tuning.size_plans.fit_segments), and each has its micro-batch chosen as
it begins, in the same way; a segment whose steps cannot pay for measuring one candidate within
its share joins the one before. The choice holds at every size of the segment, never above the
planner's micro-batch at a size.

`run` is a `train.build.Run` throughout (not imported: build records the FitResult).

Written here because no library does it: DeepSpeed's autotuner runs separate experiments, and
Lightning's BatchSizeFinder and Accelerate's find_executable_batch_size pick the largest batch,
not the fastest.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import platform
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
import torch

from .. import batching
from ..config import execution_settings
from ..runtime.collectives import agree_max, agree_min
from ..store.caches import read_entry, write_entry
from ..train.phases import phase_named
from .size_plans import first_plan, hold, segment_start, segment_steps

log = logging.getLogger("vramfit")

WARMUP_STEPS = 1  # a new layout or split allocates and (cuDNN) benchmarks on its first step
TIMED_STEPS = 2  # the fastest of these is the candidate's time (least disturbed by other jobs)
# What the probe sets aside for compiling a candidate (`train.compile: auto`) before its first
# step: its warm-up pays the whole compilation, whose length is only known afterwards. inductor
# takes ~40 s for test_resnet on 2 CPU cores (tests/test_compile.py) and about as long for a
# ResNet50 on a GPU host; the probe compiles only where its budget has this much left.
COMPILE_PROBE_SECONDS = 60.0
STOPPED = "not probed (a stop signal arrived)"  # a candidate's outcome once a stop signal came mid-run
TOO_SHORT = "not probed (the run is too short to pay for measuring)"
clock = time.perf_counter  # the probe's clock (a stand-in in tests)


@dataclass(frozen=True)
class Settings:
    micro_batch: int
    channels_last: bool
    grad_checkpointing: bool
    compile: bool = False

    def label(self) -> str:
        return (f"micro {self.micro_batch}" + (", channels_last" if self.channels_last else "")
                + (", checkpointing" if self.grad_checkpointing else "") + (", compiled" if self.compile else ""))


@dataclass
class Candidate:
    settings: Settings
    predicted_peak_bytes: int | None = None
    images_per_second: float | None = None  # None: not probed (budget) or out of memory
    outcome: str = "not probed"  # measured | out of memory | not probed | dropped by the planner

    def as_dict(self) -> dict:
        return {"settings": asdict(self.settings), "predicted_peak_bytes": self.predicted_peak_bytes,
                "images_per_second": self.images_per_second, "outcome": self.outcome}


@dataclass
class FitResult:
    mode: str
    candidates: list[Candidate] = field(default_factory=list)
    chosen: Settings | None = None
    probe_seconds: float = 0.0
    cached: bool = False
    phase: str = "all"  # the phase it was chosen for (phases.Phase.name): the one the run started in
    image_size: int | None = None  # the first size of its fit segment (None: written before segments)
    later: list["FitResult"] = field(default_factory=list)  # each later segment's, as it began (refit)
    skipped: str | None = None  # why nothing was measured (a run too short to pay for it)

    def as_dict(self) -> dict:
        out = {"mode": self.mode, "phase": self.phase, "image_size": self.image_size,
               "candidates": [c.as_dict() for c in self.candidates],
               "chosen": asdict(self.chosen) if self.chosen else None,
               "probe_seconds": self.probe_seconds, "cached": self.cached, "skipped": self.skipped}
        if self.later:
            out["later_phases"] = [r.as_dict() for r in self.later]
        return out

    def is_for(self, phase: str, start: int) -> bool:
        """Whether it is the choice of the fit segment of `phase` beginning at size `start`."""
        return self.phase == phase and self.image_size in (None, start)

    def of(self, phase: str, start: int) -> "FitResult | None":
        """The choice of that fit segment, if one was made."""
        return next((r for r in (self, *self.later) if r.is_for(phase, start)), None)


def current(run) -> Settings:
    m = run.cfg.model
    return Settings(run.step.state.micro_batch, m.channels_last, m.grad_checkpointing, run.cfg.train.compile is True)


def choose(run) -> FitResult:
    """Choose and apply the run's fit (a no-op for `largest`, FSDP, and a fixed everything)."""
    cfg = run.cfg
    if cfg.train.fit != "fastest" or run.step.fsdp:
        return FitResult("largest", chosen=current(run))
    phase = phase_named(run.phases, run.plan.phase)
    start = segment_start(run, phase.name, run.sizes.size_at(run.state.global_step))
    saved = resumed(run, start)
    if saved is not None and not saved.is_for(phase.name, start):  # resumed in a later segment
        return _resume_later(run, saved, phase, start)
    result = FitResult("fastest", phase=phase.name, image_size=start, later=saved.later if saved else [])
    steps = segment_steps(run, phase, start)  # a later phase's or size's measurement is paid by its own steps
    with _segment(run, phase, start) as plan:
        base = replace(current(run), micro_batch=plan.micro.size)
        _probe_or_cache(run, result, saved, lambda: search(run, base, steps), steps)
        _take(run, phase, start, result)
    run.state.fit = result.as_dict()
    return result


@contextmanager
def _segment(run, phase, start: int):
    """While choosing a fit segment's settings, `run.plan` is the plan of its first size (the
    helpers read it: the micro-batch to start from, what is the planner's to pick, the peak)."""
    started_plan = run.plan
    run.plan = first_plan(run, phase, start)
    try:
        yield run.plan
    finally:
        run.plan = started_plan


def _take(run, phase, start: int, result: FitResult) -> None:
    """Execute with `result`'s choice, held at every size of its segment (inside `_segment`)."""
    apply(run, result.chosen)
    peak = _chosen_peak(result)
    hold(run, phase, start, result.chosen.micro_batch, peak if peak is not None else predicted_peak(run, result.chosen))


def _chosen_peak(result: FitResult) -> int | None:
    return next((c.predicted_peak_bytes for c in result.candidates if c.settings == result.chosen), None)


def _probe_or_cache(run, result: FitResult, saved: FitResult | None, probe, steps: int) -> FitResult:
    """Fill `result` from a checkpoint's choice (`saved`), the cache, or `probe()`; where `steps`
    cannot pay for measuring anything, from the settings as planned (said, not cached)."""
    key = cache_key(run)
    hit = saved or _agreed_hit(run, cached(key))
    if hit is not None:
        result.candidates, result.chosen, result.cached, result.skipped = hit.candidates, hit.chosen, True, hit.skipped
        return result
    if not pays_for_measuring(run.cfg, steps):
        base = replace(current(run), micro_batch=run.plan.micro.size)
        result.candidates, result.chosen = [Candidate(base, run.plan.predicted_peak_bytes, outcome=TOO_SHORT)], base
        result.skipped = too_short(run.cfg, steps)
        return result
    started = clock()
    result.candidates, result.chosen = probe()
    result.probe_seconds = clock() - started
    cut_short = any(c.outcome == STOPPED for c in result.candidates)
    if run.launch.main and not cut_short:
        store(key, result)
    return result


def resumed(run, start: int) -> FitResult | None:
    """The choices the checkpoint's run made (same process count): a resume continues with them,
    in the segment it resumes in (beginning at size `start`) at the micro-batch an out-of-memory
    retry had come down to if it did."""
    point = run.start.point
    saved = point.state.fit if point is not None and point.state.world_size == run.launch.world else None
    try:
        result = from_dict(saved)
    except (TypeError, KeyError):
        return None
    own = result.of(run.plan.phase, start)
    if own is not None:  # where an out-of-memory retry had come down further
        own.chosen = replace(own.chosen, micro_batch=run.step.state.capped(own.chosen.micro_batch))
    return result


def _resume_later(run, saved: FitResult, phase, start: int) -> FitResult:
    """A resume in a fit segment after the first: the layout the run started with, and the
    segment's own micro-batch (chosen now when the checkpoint was written before it began, where
    it is measured; else the planner's)."""
    own = saved.of(phase.name, start)
    for earlier in (saved, *saved.later):  # the plans record what every segment trained at
        if earlier is not own and earlier.image_size is not None:
            hold(run, phase_named(run.phases, earlier.phase), earlier.image_size,
                 earlier.chosen.micro_batch, _chosen_peak(earlier))
    with _segment(run, phase, start) as plan:
        _take(run, phase, start, replace(own or FitResult("fastest"), chosen=replace(
            saved.chosen, micro_batch=own.chosen.micro_batch if own else plan.micro.size)))
    run.state.fit = saved.as_dict()
    if own is None:
        refit(run, phase, saved, run.sizes.size_at(run.state.global_step))
    return saved


def refit(run, phase, result: FitResult | None, size: int, stop=None) -> FitResult | None:
    """A fit segment begins (staged fine-tuning: the backbone starts to train; progressive resizing:
    the planner's micro-batch changes) at image size `size`: its micro-batch chosen by measurement
    on its own first batches, the other settings kept (see the module docstring), recorded in
    `result.later` and returned. Does nothing (None) under `largest`, for a segment that already
    has its choice, or where its micro-batch is not vramfit's. `stop`: as `search`'s (a choice
    cut short by a signal is recorded for the resume, not cached)."""
    start = segment_start(run, phase.name, size)
    if result is None or result.mode != "fastest" or result.of(phase.name, start) is not None:
        return None
    steps = segment_steps(run, phase, start)
    with _segment(run, phase, start) as plan:
        if not _vramfits_micro(plan):
            return None
        base = replace(current(run), micro_batch=plan.micro.size)
        later = FitResult("fastest", phase=phase.name, image_size=start)
        _probe_or_cache(run, later, None, lambda: search(run, base, steps, layouts=False, stop=stop), steps)
        _take(run, phase, start, later)
    result.later.append(later)
    run.state.fit = result.as_dict()
    return later


def min_segment_steps(cfg) -> float:
    """The fewest steps a fit segment needs to pay for measuring one candidate within its share:
    measuring takes WARMUP_STEPS + TIMED_STEPS steps of the same size, so the run's expected wall
    time (at least its steps' time) pays for it only from this many steps on, whatever a step
    costs. A shorter segment measures nothing (a progressively resized run's keeps the segment
    before's choice)."""
    return (WARMUP_STEPS + TIMED_STEPS) / cfg.train.fit_probe_fraction


def pays_for_measuring(cfg, steps: int) -> bool:
    return steps >= min_segment_steps(cfg)


def too_short(cfg, steps: int) -> str:
    """The one line said when a segment is too short to measure: why, and what runs instead."""
    share = cfg.train.fit_probe_fraction
    return (f"not measured: {steps} steps x {share:g} (train.fit_probe_fraction) pay for "
            f"{steps * share:.1f} of the {WARMUP_STEPS + TIMED_STEPS} steps measuring takes "
            f"({min_segment_steps(cfg):.0f} steps would); training with the planned settings")


def _vramfits_micro(plan) -> bool:
    """Whether the micro-batch of `plan` is vramfit's to choose (not written, not resumed)."""
    return plan.micro.source == "whole share" or plan.micro.source.startswith("auto")


def search(run, base: Settings, steps: int | None = None, layouts: bool = True,
           stop=None) -> tuple[list[Candidate], Settings]:
    """Greedy: from the settings as written, try one change at a time while the budget lasts (the
    budget: a share of `steps` steps, the whole run's by default; `layouts`: try the other memory
    layout too). `stop()` true on any
    process (a stop signal mid-run): no further candidate, so the run saves within a step or so."""
    device, compile_auto = run.launch.acc.device, run.cfg.train.compile == "auto"  # before apply records a choice

    def stopping() -> bool:  # agreed: every process asks at the same point
        return stop is not None and bool(agree_max(int(bool(stop())), device))

    started = clock()
    batches = first_batches(run, WARMUP_STEPS + TIMED_STEPS)
    load_seconds = (clock() - started) / len(batches)  # reading one batch in one process
    best = Candidate(base, predicted_peak(run, base))
    measuring = clock()
    best.images_per_second = timed(run, base, batches)
    best.outcome = "measured" if best.images_per_second else "out of memory"
    tried = [best]
    # Decided on figures every process shares, so that all probe the same candidates.
    cost = [_agreed_seconds(clock() - measuring, device)]  # what probing each candidate took
    step_seconds = batches[0].step_samples / best.images_per_second if best.images_per_second else cost[0]
    steps = steps if steps is not None else run.steps_per_epoch * run.cfg.train.epochs
    budget = run.cfg.train.fit_probe_fraction * steps * _agreed_seconds(
        expected_step_seconds(step_seconds, load_seconds, run.loaders.workers), device)
    others = neighbours(run, base, layouts)
    if run.launch.main and others:
        log.info("fit: fastest: up to %d more settings to measure, within %.0f s (%g of ~%d steps), ~%.0f s each",
                 len(others), budget, run.cfg.train.fit_probe_fraction, steps, cost[0])

    def probe(settings: Settings) -> None:
        cand = Candidate(settings, predicted_peak(run, settings))
        tried.append(cand)
        if not agree_min(int(fits(run, cand)), device):
            cand.outcome = "dropped by the planner"
        elif any(c.images_per_second for c in tried) and stopping():
            cand.outcome = STOPPED
        elif not any(c.images_per_second for c in tried) or \
                _agreed_seconds(clock() - started, device) + max(cost) <= budget:
            # Until one fits, the probe does what the out-of-memory retry would do anyway. Else a
            # candidate starts only where it ends within the budget, were it as slow as the slowest so far.
            t0 = clock()
            cand.images_per_second = timed(run, settings, batches)
            cand.outcome = "measured" if cand.images_per_second else "out of memory"
            cost.append(_agreed_seconds(clock() - t0, device))

    for settings in others:
        probe(settings)
    measured = [c for c in tried if c.images_per_second]
    if measured and compile_auto and not stopping():
        tried.append(probe_compiled(run, leader(measured), batches,
                                    budget - _agreed_seconds(clock() - started, device)))
        measured = [c for c in tried if c.images_per_second]
    apply(run, base)
    if not measured:  # even the settings as written ran out of memory: the OOM retry takes over
        return tried, base
    return tried, leader(measured).settings


def timed(run, s: Settings, batches: list) -> float | None:
    """`measure`, said as it begins and, where it takes a while, kept alive in a job log."""
    from ..train.progress import stage

    with stage(f"fit: fastest: measuring {s.label()} on {len(batches)} batches", main=run.launch.main):
        return measure(run, s, batches)


def leader(measured: list[Candidate]) -> Candidate:
    """The fastest of the measured candidates."""
    top = max(c.images_per_second for c in measured)
    # Within 1% is a tie (timing noise): the one needing less memory wins; a candidate without a
    # prediction (a CPU plans only the settings as written) never wins a tie on memory it was not given.
    close = [c for c in measured if c.images_per_second >= 0.99 * top]
    return min(close, key=lambda c: (c.predicted_peak_bytes is None, c.predicted_peak_bytes or 0,
                                     -c.images_per_second))


def probe_compiled(run, best: Candidate, batches: list, left: float) -> Candidate:
    """`train.compile: auto`: the leader compiled, measured where the budget has
    COMPILE_PROBE_SECONDS left; a compilation that fails (no compiler, an unsupported op) is a
    candidate that lost, said in its outcome. Every process decides on the same agreed figures."""
    cand = Candidate(replace(best.settings, compile=True), best.predicted_peak_bytes)
    if left < COMPILE_PROBE_SECONDS:
        cand.outcome = f"not probed (compiling needs ~{COMPILE_PROBE_SECONDS:.0f} s, {max(left, 0):.0f} s of budget left)"
        return cand
    try:
        cand.images_per_second = timed(run, cand.settings, batches)
        cand.outcome = "measured" if cand.images_per_second else "out of memory"
    except Exception as e:  # noqa: BLE001 - whatever stops torch.compile, the eager candidates stand
        cand.outcome = f"compile failed ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"
    failed = agree_max(int(cand.outcome.startswith("compile failed")), run.launch.acc.device)
    if failed and cand.images_per_second:  # another process's compilation failed
        cand.images_per_second, cand.outcome = None, "compile failed on another process"
    return cand


def expected_step_seconds(compute: float, load: float, workers: int) -> float:
    """A training step's wall time: the step, and the loading it waits for (all of it without
    loader workers; with them, what they cannot hide behind the step)."""
    return compute + load if workers == 0 else max(compute, load / workers)


def _agreed_seconds(seconds: float, device) -> float:
    return agree_max(int(seconds * 1000), device) / 1000


def neighbours(run, base: Settings, layouts: bool = True) -> list[Settings]:
    """The candidates besides `base`, most promising first: the other memory layout, one and two
    halvings of the micro-batch (when vramfit chose it), and gradient checkpointing only where it
    fits a larger micro-batch than the largest without it (at an equal micro-batch it only adds a
    forward). `layouts` False: `base`'s memory layout only."""
    flips = (False, True) if layouts else (False,)
    out = [replace(base, channels_last=not base.channels_last)] if layouts else []
    if _vramfits_micro(run.plan):
        smallest, m = run.plan.min_micro_batch, base.micro_batch
        for _ in range(2):
            m = batching.smaller_micro_batch(m)
            if m < smallest or m == base.micro_batch:
                break
            out += [replace(base, micro_batch=m, channels_last=base.channels_last != flip) for flip in flips]
    larger = larger_with_checkpointing(run, base)
    if larger:
        out += [Settings(larger, base.channels_last != flip, True) for flip in flips]
    return out


def larger_with_checkpointing(run, base: Settings) -> int | None:
    """The largest micro-batch that fits the card with gradient checkpointing, when it is larger
    than `base`'s (None on a CPU: nothing to fit against, the whole share already runs at once)."""
    from ..planner import pick_micro_batch

    L, per = run.launch, run.plan.micro.per_process_batch
    if base.grad_checkpointing or L.device_type != "cuda" or base.micro_batch >= per:
        return None
    cfg = _config(run, replace(base, grad_checkpointing=True))
    try:
        pick, _ = pick_micro_batch(cfg, len(run.class_names), per, card_budget(run),
                                   precision=L.precision.accelerate, num_processes=L.world)
    except Exception:  # noqa: BLE001 - a model the tracer cannot follow: no checkpointing candidate
        return None
    return pick if pick and pick > base.micro_batch else None


def _config(run, s: Settings, planned: bool = True):
    """The run's config with `s`'s layout, checkpointing and compilation (and, for the planner, its
    micro-batch and the image size `run.plan` is for)."""
    cfg = run.cfg
    update = {"model": cfg.model.model_copy(update={"channels_last": s.channels_last,
                                                    "grad_checkpointing": s.grad_checkpointing})}
    train = {"compile": s.compile} if cfg.train.compile != s.compile else {}
    if planned:
        train["micro_batch"] = s.micro_batch
        if run.plan.image_size:  # a fit segment of a progressively resized run: planned at its size
            update["data"] = cfg.data.model_copy(update={"image_size": run.plan.image_size})
    if train:
        update["train"] = cfg.train.model_copy(update=train)
    return cfg.model_copy(update=update)


def predicted_peak(run, s: Settings) -> int | None:
    """The planner's peak for `s` on a GPU (a trace per layout: seconds for a large model). On a
    CPU nothing is fitted against, so only the plan the run already has is given."""
    from ..planner import estimate

    if s == current(run) and s.micro_batch == run.plan.micro.size:
        return run.plan.predicted_peak_bytes
    if run.launch.device_type != "cuda":
        return None
    try:
        return estimate(_config(run, s), len(run.class_names), s.micro_batch,
                        run.launch.precision.accelerate, num_processes=run.launch.world,
                        per_process_batch=run.plan.micro.per_process_batch).peak_bytes
    except Exception:  # noqa: BLE001 - a model the tracer cannot follow is still measured
        return None


def card_budget(run) -> int:
    """What a step may use on the run's card (tuning.probe.card_budget_bytes)."""
    from .probe import card_budget_bytes

    return card_budget_bytes(run.cfg, run.launch.acc.device)


def fits(run, cand: Candidate) -> bool:
    """The planner's verdict on a GPU (a CPU has no budget to fit)."""
    if run.launch.device_type != "cuda" or cand.predicted_peak_bytes is None:
        return True
    return cand.predicted_peak_bytes <= card_budget(run)


def first_batches(run, n: int) -> list:
    """The run's own next `n` batches as its loader's dataset and sampler make them (read in this
    process; each sample's augmentation is a function of the sample, so nothing moves)."""
    from ..data.loader import collate

    loaders, st = run.loaders, run.state
    loaders.sampler.set_epoch(st.epoch, st.step_in_epoch)
    ds = loaders.train.dataset
    shares = list(itertools.islice(iter(loaders.sampler), n))
    return [collate([ds[key] for key in share], getattr(ds, "image_size", None)) for share in shares]


def measure(run, s: Settings, batches: list) -> float | None:
    """Images per second of this process's share at `s` (the slowest process's figure, so every
    process holds the same); None when a step ran out of memory on any process."""
    apply(run, s)
    device, seconds = run.launch.acc.device, []
    ok = True
    for batch in batches:
        images = run.loaders.normalize(batch.images)
        labels = batch.labels.to(device)
        _sync(device)
        t0 = time.perf_counter()
        ok = run.step.rehearse(images, labels, batch.step_samples) and ok
        _sync(device)
        seconds.append(time.perf_counter() - t0)
        if not ok:
            break
    if agree_min(int(ok), device) == 0:
        return None
    fastest = agree_max(int(min(seconds[WARMUP_STEPS:] or seconds) * 1e6), device) / 1e6
    return batches[0].step_samples / fastest if fastest > 0 else None


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def apply(run, s: Settings) -> None:
    """Make the run execute with `s`: the model's memory format and checkpointing, the step's
    micro-batch, the normaliser's layout, and the config and plan that record them."""
    from ..data.loader import normalizer
    from ..models.create import compile_in_place

    module = run.launch.acc.unwrap_model(run.model)
    fmt = torch.channels_last if s.channels_last else torch.contiguous_format
    module.to(memory_format=fmt)
    compile_in_place(run.model, s.compile)
    if hasattr(module, "set_grad_checkpointing"):
        module.set_grad_checkpointing(s.grad_checkpointing)
    run.step.recomputes = s.grad_checkpointing and any(True for _ in module.buffers())
    run.step.state.micro_batch = s.micro_batch  # the run's micro-batch in effect (the checkpoint's too)
    run.loaders.normalize = normalizer(run.data_cfg, run.launch.acc.device, s.channels_last)
    run.cfg = _config(run, s, planned=False)  # config.yaml records what runs; micro_batch stays as written


# ---------------------------------------------------------------------------------- the cache
def cache_key(run) -> str:
    """What a measured choice depends on: the machine, its device and library versions, the run's
    identity (its maths and data: resume.identity, as this launch computed it), the settings that
    bound how its step runs (config.EXECUTION_ONLY["step"]) and the phase's plan."""
    import timm

    cfg, L = run.cfg, run.launch
    dev = torch.cuda.get_device_name(L.acc.device) if L.device_type == "cuda" else platform.processor() or "cpu"
    plan = run.plan  # the phase's, at the size it is for
    parts = (platform.node(), dev, os.cpu_count(), torch.get_num_threads(), torch.__version__, timm.__version__,
             json.dumps(run.start.identity.maths, sort_keys=True),
             json.dumps(execution_settings(cfg, "step"), sort_keys=True),
             L.world, plan.micro.per_process_batch, plan.micro.size, plan.micro.source, plan.image_size, plan.phase,
             len(run.class_names))
    return hashlib.sha256("|".join(map(str, parts)).encode()).hexdigest()[:24]


def _cache_file() -> Path:
    from ..data.builtin import cache_root

    return cache_root() / "fit_cache.json"


def cached(key: str) -> FitResult | None:
    try:
        return from_dict(read_entry(_cache_file(), key))
    except (KeyError, TypeError):
        return None


def from_dict(saved: dict) -> FitResult:
    """A FitResult as `as_dict` wrote it (the cache, a checkpoint's trainer state)."""
    cands = [Candidate(Settings(**c["settings"]), c["predicted_peak_bytes"], c["images_per_second"], c["outcome"])
             for c in saved["candidates"]]
    return FitResult("fastest", cands, Settings(**saved["chosen"]), cached=True, phase=saved.get("phase", "all"),
                     image_size=saved.get("image_size"), later=[from_dict(r) for r in saved.get("later_phases", [])],
                     skipped=saved.get("skipped"))


def store(key: str, result: FitResult) -> None:
    """Best effort: a cache that cannot be written only means the next run probes again."""
    try:
        write_entry(_cache_file(), key, result.as_dict())
    except OSError as e:
        log.warning("note: the fit cache %s cannot be written (%s); the next run probes again",
                    _cache_file(), e.strerror or e)


def _agreed_hit(run, hit: FitResult | None) -> FitResult | None:
    """A cached choice is used only where every process holds the same one (the same machine
    kind everywhere); otherwise all probe."""
    device = run.launch.acc.device
    code = -1 if hit is None else int(hashlib.sha256(json.dumps(asdict(hit.chosen)).encode()).hexdigest()[:7], 16)
    if agree_min(code, device) != agree_max(code, device) or code < 0:
        return None
    return hit


# ---------------------------------------------------------------------------------- said at start
def table(result: FitResult, named: bool = False, sized: bool = False) -> str:
    """The candidates the choice was made from, one line each (`named`: say which phase's;
    `sized`: from which image size, for a progressively resized run)."""
    rows = []
    for c in result.candidates:
        peak = f"{c.predicted_peak_bytes / 2**30:.2f} GiB" if c.predicted_peak_bytes else "n/a"
        ips = f"{c.images_per_second:.0f} img/s" if c.images_per_second else c.outcome
        mark = "  <- chosen" if c.settings == result.chosen else ""
        rows.append(f"    {c.settings.label():<36} predicted {peak:>9}  {ips}{mark}")
    what = (f" for the `{result.phase}` phase" if named else "") + \
        (f" from {result.image_size} px" if sized and result.image_size else "")
    if result.skipped:
        return f"fit: fastest{what}: {result.skipped} ({result.chosen.label()})"
    how = "cached from an earlier run" if result.cached else f"probed in {result.probe_seconds:.1f} s"
    return f"fit: fastest{what} ({how}):\n" + "\n".join(rows)
