"""Building a run, one piece a function, into one typed `Run`: the resume point, the data, the
model and its optimizer, the micro-batch and its plan, the trainer state, the step, the loaders.
`run.train` builds it with `build`; lr-find builds the same `Run`, and the benches the same
`Training` (everything but the data), so there is one way to assemble a run.

Each block that holds no collective of its own runs inside `collectives.agreed`, so an error on
one process (a path missing on one machine, a full disk on the main process) stops every process
with that error printed, instead of leaving the others waiting in the next collective.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .. import batching
from ..config import Config
from ..data.progressive import Schedule, schedule_of
from ..errors import VramfitError
from ..runtime.collectives import agreed, broadcast_module
from ..runtime import storage
from ..runtime.storage import make_folder, write_json, write_text
from ..store import checkpoint, resume
from ..store.runfolder import RunPaths
from ..store.tracking import environment, scrub
from .progress import stage
from .state import TrainerState

if TYPE_CHECKING:
    from ..data import Loaders, Splits
    from ..runtime.launch import Launch
    from ..tuning.fit import FitResult
    from .faults import Faults
    from .phases import Phase
    from .step import TrainStep
    from .validation import EvalState

log = logging.getLogger("vramfit")


@dataclass
class Start:
    """Where a launch starts: the checkpoint it continues (None: a fresh run), what to say about
    it, this launch's identity (resume.identity; computed once: it lists the files of a local data
    source) and the change of it a resume was allowed (None: none)."""

    point: resume.ResumePoint | None = None
    notes: list[str] = field(default_factory=list)
    identity: resume.Identity = field(default_factory=lambda: resume.Identity({}, {}))
    change: dict | None = None


@dataclass
class Plan:
    """The micro-batch a run starts with and what the planner predicts for it (plan.json)."""

    micro: batching.MicroBatch
    requested_micro_batch: int | str | None
    num_processes: int
    precision: str  # what runs, as Accelerate names it (no | bf16 | fp16)
    predicted_peak_bytes: int | None = None
    estimate: dict | None = None  # planner.MemoryEstimate.as_dict()
    probe: dict = field(default_factory=dict)  # `auto` on a GPU: what the probe found
    notes: list[str] = field(default_factory=list)  # said at start
    phase: str = "all"  # the phase it is for (phases.Phase.name)
    trainable_params: int = 0  # in that phase
    min_micro_batch: int = 1  # freezing.min_micro_batch in that phase: the floor of its OOM retry
    image_size: int | None = None  # progressive resizing: the size it is for (None: data.image_size)
    predicted_at_size: int | None = None  # the size its predicted peak was traced at (tuning.size_plans)

    @property
    def reserved_bytes(self) -> int | None:
        """The planner's allocator reserve (no CUDA context): what `peak_memory_bytes` measures."""
        return (self.estimate or {}).get("reserved_bytes")

    def as_dict(self) -> dict:
        return {"requested_micro_batch": self.requested_micro_batch, **self.micro.as_dict(), **self.probe,
                "num_processes": self.num_processes, "precision": self.precision, "phase": self.phase,
                "trainable_params": self.trainable_params,
                "predicted_peak_bytes": self.predicted_peak_bytes,
                **({"estimate": self.estimate} if self.estimate is not None else {}), "notes": self.notes}


@dataclass
class Training:
    """What trains, for one process: the model on the device, its optimizer, LR schedule and EMA,
    the micro-batch plan, the trainer state (fresh or resumed) and the optimizer step."""

    cfg: Config
    launch: Launch
    class_names: list[str]
    steps_per_epoch: int
    model: torch.nn.Module
    data_cfg: dict  # timm's data config: mean, std, crop, interpolation
    optimizer: torch.optim.Optimizer
    scheduler: object  # timm CosineLRScheduler, stepped per optimizer step
    ema: object  # timm ModelEmaV3 or None
    plan: Plan  # the plan of the phase the run starts in
    state: TrainerState
    step: TrainStep
    seconds_per_sample: float | None  # measured on a CPU for `data.num_workers: auto`
    phases: list[Phase]
    plans: list[Plan]  # one per phase
    notes: list[str]  # said at start: the optimizer's groups, BatchNorm at small micro-batches
    # Measured device peak (max_memory_reserved) of each phase this launch finished, by name.
    phase_peaks: dict[str, int]
    fit: FitResult | None  # train.fit: how the execution settings were chosen (fit.choose)
    sizes: Schedule  # the image size of every step (progressive resizing; else the full size)
    # Progressive resizing: the plan of each phase at each size below the full one, by (phase
    # name, size) (tuning.size_plans.plan_sizes; a fit's choice is held in them).
    size_plans: dict
    # The first size of the fit segment of each (phase name, size) (tuning.size_plans.fit_segments).
    fit_segments: dict

    @property
    def micro(self) -> batching.MicroBatch:
        return self.plan.micro

    def phase_plan(self, phase: Phase, size: int | None = None) -> Plan:
        """The plan of `phase` at image size `size` (None: the full size)."""
        return self.size_plans.get((phase.name, size)) or self.plans[self.phases.index(phase)]

    @property
    def planned_reserved_bytes(self) -> int | None:
        """The planned peak a person reads (summary.json, compare, the model card, the start line):
        the largest allocator reserve over every phase and image size, as `peak_memory_bytes`
        measures it (each phase's own is in summary.json `phases`). None: nothing was planned."""
        figures = [p.reserved_bytes for p in [*self.plans, *self.size_plans.values()] if p.reserved_bytes]
        return max(figures, default=None)

    def plan_text(self) -> str | None:
        """The memory plan as `vramfit plan` prints it, for the out-of-memory error."""
        import io

        from ..planner import run_plan

        try:
            buf = io.StringIO()
            run_plan(self.cfg, len(self.class_names), num_processes=self.launch.world, out=buf)
            return buf.getvalue()
        except Exception:  # noqa: BLE001 - the error itself is what matters; the plan only adds detail
            return None


@dataclass
class Run(Training):
    """A whole training run: `Training` with its folder, start, data and what feeds the step."""

    paths: RunPaths
    start: Start
    splits: Splits
    loaders: Loaders
    augment: object  # augment.DeviceAugment
    faults: Faults
    eval_state: EvalState


def build(cfg: Config, L: Launch, paths: RunPaths, start: Start | None = None) -> Run:
    """Everything a run needs, in order: data, model and optimizer, micro-batch, state, step, loaders."""
    from ..data import build_loaders, step_partitions
    from ..data.augment import DeviceAugment
    from .faults import Faults
    from .validation import EvalState

    start = start or Start()
    splits, steps_per_epoch = load_data(cfg, L, start.point)
    partitions = step_partitions(cfg, splits, L.world)
    t = build_training(cfg, L, splits.class_names, steps_per_epoch, start, partitions=partitions)
    faults = Faults(cfg.debug, L.rank)
    faults.install(t.model, t.step)
    eval_batch = batching.eval_batch(cfg.train.eval_batch, t.micro)
    loaders = build_loaders(cfg, splits, t.data_cfg, L.acc, eval_batch, t.seconds_per_sample,
                            size_at=t.sizes.size_at if t.sizes.on else None)
    augment = DeviceAugment(cfg.data, len(splits.class_names), cfg.train.label_smoothing, cfg.train.seed,
                            L.rank, mean=t.data_cfg["mean"], std=t.data_cfg["std"], device_type=L.acc.device.type)
    return Run(**{f.name: getattr(t, f.name) for f in fields(Training)}, paths=paths, start=start,
               splits=splits, loaders=loaders, augment=augment, faults=faults, eval_state=EvalState(eval_batch))


def build_training(cfg: Config, L: Launch, class_names: list[str], steps_per_epoch: int,
                   start: Start | None = None, partitions: int | None = None) -> Training:
    """The model, optimizer, schedule, EMA, a micro-batch plan per phase, state and step, without
    any data (the benches feed it synthetic batches)."""
    from .phases import enter, phase_at, phases_of
    from .step import TrainStep, step_maths

    start = start or Start()
    model, data_cfg = build_model(cfg, L, len(class_names))
    with agreed("naming the model's head", L.acc.device):
        phases = phases_of(cfg, model)
    model, optimizer, scheduler, ema = prepare_training(cfg, L, model, steps_per_epoch, phases)
    plans = plan_phases(cfg, L, len(class_names), model, phases, start.point)
    current = phase_at(phases, start.point.state.epoch if start.point else 0)
    enter(L.acc.unwrap_model(model), current, phases[-1])
    plan = plans[phases.index(current)]
    seconds = cpu_seconds_per_sample(cfg, L, model, plan.micro)
    model = compile_model(cfg, L, model)
    state = restore_state(cfg, L, start, plan.micro, class_names, model, scheduler, ema)
    step = TrainStep(L.acc, model, optimizer, state.in_effect, maths=step_maths(cfg.train),
                     check_grad_norm=not L.precision.scales_loss, recomputes=cfg.model.grad_checkpointing,
                     min_micro_batch=plan.min_micro_batch,
                     bn_momentum_per_step=cfg.model.bn_momentum_per == "step", partitions=partitions)
    notes = [*(p.note for p in phases if p.note), *training_notes(cfg, L, len(class_names), optimizer, plans)]
    return Training(cfg, L, class_names, steps_per_epoch, model, data_cfg, optimizer, scheduler, ema, plan,
                    state, step, seconds, phases, plans, notes, phase_peaks={}, fit=None,
                    sizes=schedule_of(cfg, steps_per_epoch), size_plans={}, fit_segments={})


def plan_phases(cfg: Config, L: Launch, num_classes: int, model, phases: list[Phase], point) -> list[Plan]:
    """A micro-batch plan for each phase, made with the model training what that phase trains (the
    head-only phase has no gradients or optimizer state for the rest: a larger micro-batch fits).
    The global batch, and so the maths of a step, is the same in every phase. A checkpoint's
    reduced micro-batch applies to the phase it was saved in. Leaves the model in the last phase."""
    module = L.acc.unwrap_model(model)
    what = "planning memory (tracing one step" + (f" of each of {len(phases)} phases" if len(phases) > 1 else "") + \
        (", then checking the pick on the card" if cfg.train.micro_batch == "auto" and L.device_type == "cuda" else "")
    with stage(what + ")", main=L.main):
        return _plan_each(cfg, L, num_classes, model, module, phases, point)


def _plan_each(cfg: Config, L: Launch, num_classes: int, model, module, phases: list[Phase], point) -> list[Plan]:
    from ..models.freezing import min_micro_batch, trainable_parameters
    from .phases import enter

    plans, previous = [], None
    for phase in phases:
        enter(module, phase, previous)
        previous = phase
        smallest = min_micro_batch(module)  # the plan's floor and the OOM retry's
        saved_here = point if point is not None and point.state.phase == phase.name else None
        plan = choose_micro_batch(phase.config(cfg), L, num_classes, model, saved_here, smallest)
        plan.phase, plan.trainable_params, plan.min_micro_batch = phase.name, trainable_parameters(module), smallest
        plans.append(plan)
    return plans


def training_notes(cfg: Config, L: Launch, num_classes: int, optimizer, plans: list[Plan]) -> list[str]:
    """Said at start: the LR scaling and layer-decay groups, the phases and their micro-batches,
    BatchNorm at small micro-batches."""
    from ..planner.advice import small_batch_norm_note
    from .optim import lr_range_note, scaled_lr

    notes = [n for n in (scaled_lr(cfg.optim, cfg.train.global_batch)[1], lr_range_note(optimizer, cfg.optim)) if n]
    if len(plans) > 1:
        notes.append("staged fine-tuning: " + "; then ".join(phase_line(cfg, p) for p in plans))
    last = plans[-1]
    if cfg.model.bn != "freeze" and last.min_micro_batch > 1:  # BatchNorm normalises by the batch
        from ..tuning.probe import card_budget_bytes

        budget = card_budget_bytes(cfg, L.acc.device)
        note = small_batch_norm_note(cfg, num_classes, last.micro.size, last.micro.per_process_batch, L.world,
                                     sync=cfg.model.bn == "sync" and L.world > 1 and L.device_type == "cuda",
                                     precision=L.precision.accelerate, budget_bytes=budget)
        if note:
            notes.append(note)
    return notes


def phase_line(cfg: Config, plan: Plan) -> str:
    """One phase's plan in a line (at start, and when the phase begins)."""
    what = "the classifier head only" if plan.phase == "head" else "the whole network" + (
        " less model.freeze" if cfg.model.freeze else "")
    peak = f", predicted peak {plan.predicted_peak_bytes / 2**30:.2f} GiB" if plan.predicted_peak_bytes else ""
    return f"{what} ({plan.trainable_params:,} parameters), micro-batch {plan.micro.size}{peak}"


@contextlib.contextmanager
def claimed(cfg: Config, L: Launch, paths: RunPaths):
    """Before anything else: --output is writable, and the run folder is this run's (locked by the
    main process until the block ends: runfolder.locked)."""
    from ..store.runfolder import locked

    with contextlib.ExitStack() as stack:
        with agreed("claiming the run folder", L.acc.device):
            if L.main:
                check_writable(Path(cfg.output))
                stack.enter_context(locked(paths))
        yield


def preflight(cfg: Config, L: Launch) -> None:
    """What the settings refuse, said before any data is loaded or weights are fetched: BatchNorm
    sync or staged fine-tuning under FSDP, a `model.freeze` / staged fine-tuning the model
    cannot take (its names checked on a weightless copy) and image sizes it cannot take
    (progressive resizing). Every process refuses alike."""
    from accelerate.utils import DistributedType

    fsdp = L.acc.distributed_type == DistributedType.FSDP or os.environ.get(
        "ACCELERATE_USE_FSDP", "").lower() in ("1", "true")
    if fsdp and cfg.model.bn == "sync":
        raise VramfitError("model.bn: sync cannot run under FSDP (each process holds a shard of the model, and "
                           "the step runs no collective inside a forward).",
                           hint="use --set model.bn=freeze (or train) with FSDP, or launch plain data parallel "
                                "(without the FSDP config) to synchronise BatchNorm")
    if fsdp and cfg.staged_epochs:
        raise VramfitError("train.freeze_epochs cannot run under FSDP: its flat parameter shards cannot change "
                           "what trains in the middle of a run.",
                           hint="freeze stages for the whole run with --set model.freeze=[...], or launch plain "
                                "data parallel (without the FSDP config) for staged fine-tuning")
    if (cfg.staged_epochs or cfg.model.freeze) and not cfg.model.name.startswith("hf-hub:"):
        from ..models.create import create_model
        from .phases import phases_of

        with torch.device("meta"):
            model = create_model(cfg.model, 2, load_weights=False, image_size=cfg.data.image_size)
        phases_of(cfg, model)
    if cfg.data.progressive_resize is not None:
        from ..data.progressive import check_backbone

        check_backbone(cfg)


def find_start(cfg: Config, L: Launch, paths: RunPaths) -> Start:
    """The checkpoint to continue from, the notes to say about it, and this launch's identity."""
    with agreed("looking for checkpoints", L.acc.device):
        if L.main:
            if cfg.resume == "auto":
                checkpoint.latest(paths.checkpoints, cleanup=True)
    with agreed("reading the checkpoint", L.acc.device):
        point = resume.find(cfg, paths.checkpoints)
        identity = resume.identity(cfg, L.precision.name)
        notes, change = resume.check(cfg, point, L.world, identity) if point else ([], None)
    return Start(point, notes, identity, change)


def check_writable(output: Path) -> None:
    """A write probe of --output before any data is loaded or model built: a read-only folder, a
    file in the way or a full disk is said at once, not after minutes of setup."""
    probe = output / f".vramfit-write-probe-{os.getpid()}"
    try:
        output.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise VramfitError(f"Cannot write into --output {output}: {storage.os_cause(e)}"
                           f"{storage.free_space(output) if e.errno == errno.ENOSPC else ''}.",
                           hint="pick a writable folder with free space with --output PATH (or free space, "
                                "fix the permissions)") from None
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()


def finished_summary(cfg: Config, L: Launch, start: Start, paths: RunPaths) -> dict | None:
    """The summary of a run that already finished with these settings (re-running its command
    does nothing); None when there is training to do."""
    point = start.point
    if not (point and point.state.finished and paths.summary.exists() and point.state.epoch >= cfg.train.epochs):
        return None
    done = json.loads(paths.summary.read_text())
    if L.main:
        log.info("Run %s already finished (%d epochs, best accuracy %s); nothing to do. Use another "
                 "--run-name to train again.", paths.dir, done.get("epochs", 0), done.get("best_accuracy"))
    return done


def load_data(cfg: Config, L: Launch, point: resume.ResumePoint | None) -> tuple[Splits, int]:
    """The main process first (it may build caches the others then read). Returns the splits and
    the steps per epoch."""
    from ..data import load_splits

    splits = None
    with agreed("loading the data", L.acc.device), stage(f"reading the data ({cfg.data.source})", main=L.main):
        if L.main:
            splits = load_splits(cfg.data)
    with agreed("loading the data", L.acc.device):
        if not L.main:
            splits = load_splits(cfg.data)
    if point:
        resume.class_names_match(point, splits.class_names)
    steps = batching.steps_per_epoch(len(splits.train), cfg.train.global_batch)
    if 0 < len(splits.train) < cfg.train.global_batch:
        splits.notes.append(f"the global batch ({cfg.train.global_batch}) is larger than the training split "
                            f"({len(splits.train)} images): each epoch is one step of {len(splits.train)}, while "
                            f"the LR is scaled for {cfg.train.global_batch}; a --global-batch of at most "
                            f"{len(splits.train)} trains as the recipe means")
    if steps == 0:
        raise VramfitError(f"The training split has {len(splits.train)} images, fewer than one global batch "
                           f"({cfg.train.global_batch}).", hint="lower --global-batch or add data")
    return splits, steps


def build_model(cfg: Config, L: Launch, num_classes: int) -> tuple[torch.nn.Module, dict]:
    from accelerate.utils import set_seed

    from ..models.create import create_model, data_config

    set_seed(cfg.train.seed)  # same initial weights on every process (and broadcast below)
    weights = "pretrained weights" if cfg.model.pretrained else "random weights"
    with agreed("building the model", L.acc.device), stage(f"building {cfg.model.name} ({weights})", main=L.main):
        model = create_model(cfg.model, num_classes, image_size=cfg.data.image_size,
                             any_size=cfg.data.progressive_resize is not None)
        data_cfg = data_config(model, cfg.data.image_size, cfg.data.crop_pct)
    if cfg.model.bn == "sync":
        model = sync_norms(model, L)
    if cfg.model.precise_bn:
        from ..models.freezing import batch_statistics_norms

        L.notes.append(f"BatchNorm: statistics recomputed at every epoch's end over {cfg.model.precise_bn} "
                       "train images (precise_bn)" if batch_statistics_norms(model) else
                       "BatchNorm: precise_bn changes nothing here (no BatchNorm follows its batches)")
    return model, data_cfg


def sync_norms(model, L: Launch):
    """`model.bn: sync` on several GPU processes: SyncBatchNorm (before the optimizer is built: the
    conversion keeps the parameters). Said at start where it changes nothing."""
    from ..models.create import sync_batchnorm

    if L.world > 1 and L.device_type == "cuda":
        L.notes.append(f"BatchNorm: synchronised over the {L.world} processes (statistics of the whole "
                       "per-step micro-batch group, one all-gather per BatchNorm layer and micro-batch)")
        return sync_batchnorm(model)
    L.notes.append("BatchNorm: bn: sync changes nothing here (" + (
        "one process: its statistics are already the whole micro-batch's)" if L.world == 1 else
        "torch's SyncBatchNorm runs on GPUs only: each CPU process normalises its own micro-batch)"))
    return model


def prepare_training(cfg: Config, L: Launch, model, steps_per_epoch: int, phases: list[Phase]):
    """Optimizer, schedule, EMA; the model on the device. Gradients are summed by the step's own
    reducer (train.step.TrainStep), so the model is not wrapped in DDP (whose buckets would hold a
    second gradient copy for nothing): the starting weights are broadcast once instead. FSDP
    models are prepared by Accelerate, which shards them."""
    from accelerate.utils import DistributedType

    from .optim import create_optimizer, create_scheduler
    from .phases import unfreeze_step

    # Over every parameter any phase trains (a phase's frozen ones get no gradient: no update, no
    # optimizer state), so the head's optimizer state carries over the unfreeze.
    optimizer = create_optimizer(model, cfg.optim, cfg.train.global_batch)  # LR scaled to the batch
    # The scheduler is neither prepared (Accelerate would step it once per process) nor saved: the
    # LR is a pure function of the global step, restored by `step_update` on resume.
    scheduler = create_scheduler(optimizer, cfg.optim, steps_per_epoch, cfg.train.epochs, cfg.train.global_batch,
                                 unfreeze_step=unfreeze_step(phases, steps_per_epoch))
    if L.acc.distributed_type == DistributedType.FSDP:
        model, optimizer = L.acc.prepare(model, optimizer)
    else:
        model = L.acc.prepare_model(model, evaluation_mode=True)  # device + autocast, no DDP wrapper
        optimizer = L.acc.prepare_optimizer(optimizer)
        broadcast_module(model)
    ema = None
    if cfg.model.ema_decay:
        from timm.utils import ModelEmaV3

        ema = ModelEmaV3(L.acc.unwrap_model(model), decay=cfg.model.ema_decay, use_warmup=True)
    return model, optimizer, scheduler, ema


def choose_micro_batch(cfg: Config, L: Launch, num_classes: int, model, point, smallest: int = 1) -> Plan:
    """The one micro-batch rule (batching.resolve_micro_batch): configured, whole share, `auto`
    (planner, then a probe on the device: tuning.probe.auto_pick), or where an interrupted run had come
    down to, never below `smallest` (freezing.min_micro_batch). Returns it in the plan (plan.json)
    with the lines to say at start about it."""
    from ..tuning.probe import auto_pick

    per_proc = batching.per_process_batch(cfg.train.global_batch, L.world)
    probe: dict = {}  # what the probe found, for plan.json
    auto_here = cfg.train.micro_batch == "auto" and L.device_type == "cuda"
    pick = auto_pick(cfg, num_classes, L.acc.unwrap_model(model), L.acc.device, probe) if auto_here else None
    resumed = resume.resumed_micro_batch(point, L.world, cfg.allow_resume_change)
    mb = batching.resolve_micro_batch(cfg.train.micro_batch, per_proc, pick=pick, resumed=resumed,
                                      min_size=smallest)
    plan = Plan(mb, cfg.train.micro_batch, L.world, L.precision.accelerate,
                probe={k: v for k, v in probe.items() if k != "micro_batch"}, **_predict(cfg, num_classes, mb, L))
    plan.notes = fit_notes(cfg, L, num_classes, mb, plan.predicted_peak_bytes)
    return plan


def fit_notes(cfg: Config, L: Launch, num_classes: int, mb: batching.MicroBatch, peak: int | None) -> list[str]:
    """Said at start: the auto pick and its predicted peak, and a fixed micro-batch the planner
    predicts will not fit the card (with the one that does)."""
    from ..planner import pick_micro_batch
    from ..tuning.probe import card_budget_bytes

    notes = [mb.note] if mb.note else []
    if L.device_type != "cuda" or peak is None:  # without a card there is nothing to fit
        return notes
    budget = card_budget_bytes(cfg, L.acc.device)
    if mb.source == "auto":
        notes.append(f"micro-batch {mb.size} picked for this card: predicted peak {peak / 2**30:.2f} GiB of "
                     f"{budget / 2**30:.2f} GiB")
    elif peak > budget:
        fits, _ = pick_micro_batch(cfg, num_classes, mb.per_process_batch, budget, precision=L.precision.accelerate,
                                   num_processes=L.world)
        notes.append(f"micro-batch {mb.size} is predicted to need {peak / 2**30:.2f} GiB, more than the "
                     f"{budget / 2**30:.2f} GiB this card allows: "
                     + (f"--micro-batch {fits} fits (or micro_batch: auto)" if fits else
                        "not even micro-batch 1 fits; see `vramfit plan`")
                     + "; out-of-memory errors will be retried smaller")
    return notes


def compile_model(cfg: Config, L: Launch, model):
    """`train.compile`: torch.compile the model in place (models.create.compile_in_place), after the
    micro-batch is settled, so the memory probe runs eagerly and the first compiled shapes are the
    run's own. A smaller micro-batch after an out-of-memory retry, a short last batch and evaluation
    each compile once more."""
    from ..models.create import compile_in_place

    if cfg.train.compile is True:
        compile_in_place(model)
        L.notes.append("torch.compile: on (the first steps and the first evaluation include compiling)")
    elif cfg.train.compile == "auto" and cfg.train.fit != "fastest":
        L.notes.append("torch.compile: off (train.compile: auto is measured by train.fit: fastest only)")
    return model


def cpu_seconds_per_sample(cfg: Config, L: Launch, model, micro: batching.MicroBatch) -> float | None:
    """What one training sample costs this CPU run's model, for `data.num_workers: auto` (None
    where nothing is measured: a fixed worker count, a GPU, or no core to spare). A forward without
    gradients in eval mode (no BatchNorm statistics move, no random draw) on a seeded batch, timed
    after one warm-up and counted 3x for forward + backward; before torch.compile, so nothing is
    compiled for it."""
    from ..data.workers import local_processes, measures_workers

    if not measures_workers(cfg.data, L.device_type, local_processes(L.world)):
        return None
    import time

    n, size = max(1, min(micro.size, 16)), cfg.data.image_size
    x = torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(0))
    if cfg.model.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(x)
            t0 = time.perf_counter()
            model(x)
            return 3 * (time.perf_counter() - t0) / n
    finally:
        model.train(was_training)


def _predict(cfg: Config, num_classes: int, mb: batching.MicroBatch, L: Launch) -> dict:
    """The planner's prediction for the micro-batch in use (plan.json), compared later with the peak."""
    from ..planner import estimate

    try:
        est = estimate(cfg, num_classes, mb.size, L.precision.accelerate, num_processes=L.world,
                       per_process_batch=mb.per_process_batch)
    except VramfitError:
        raise
    except Exception as e:  # noqa: BLE001 - a model the tracer cannot follow still trains
        log.warning("memory plan unavailable for %s (%s: %s)", cfg.model.name, type(e).__name__, e)
        return {"predicted_peak_bytes": None}
    return {"predicted_peak_bytes": est.peak_bytes, "estimate": est.as_dict()}


def restore_state(cfg: Config, L: Launch, start: Start, micro: batching.MicroBatch, class_names: list[str],
                  model, scheduler, ema) -> TrainerState:
    """The trainer state: fresh, or the checkpoint's (with weights, optimizer, RNG and EMA)."""
    from accelerate.utils import set_seed

    from ..store.tracking import wandb_run_id

    point = start.point
    state = TrainerState(in_effect=micro.in_effect(), class_names=class_names, world_size=L.world,
                         global_batch=cfg.train.global_batch, identity=start.identity.maths,
                         execution=start.identity.execution,
                         wandb_run_id=wandb_run_id(point.state.wandb_run_id if point else None))
    if point is None:
        set_seed(cfg.train.seed + L.rank)  # per-process streams for dropout / drop-path from here on
        return state
    with agreed("loading the checkpoint", L.acc.device), \
            stage(f"loading the checkpoint {point.path.name}", main=L.main):
        resume.load(L.acc, point, L.world, cfg.train.seed, model, ema)
    state.continue_from(point.state)
    if start.change:
        state.resume_changes.append(start.change)
    scheduler.step_update(num_updates=state.global_step)
    return state


def write_config(paths: RunPaths, cfg: Config, changes: list[dict], change: dict | None) -> None:
    """config.yaml: the settings that run now. Where a resume was allowed to change them (`change`:
    this launch's), what ran until then stays beside it (config-to-step-N.yaml), and its header
    says every change, so the folder never claims the new settings for the whole run."""
    if change and paths.config.is_file() and not paths.config_until(change["step"]).exists():
        write_text(paths.config_until(change["step"]), paths.config.read_text(), "the earlier settings")
    header = "".join(f"# from step {c['step']} (allow_resume_change; until then: "
                     f"{paths.config_until(c['step']).name}): "
                     + "; ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in c["settings"].items()) + "\n"
                     for c in changes)
    write_text(paths.config, header + cfg.to_yaml(), "the run's settings")


def write_run_folder(run: Run) -> None:
    """config.yaml, env.json and plan.json (written after every override of the micro-batch), and
    the trackers started with them."""
    cfg, L, paths = run.cfg, run.launch, run.paths
    env = environment(L.acc)
    plan = run.plan.as_dict()
    if len(run.plans) > 1:  # staged fine-tuning: every phase's plan
        plan["phases"] = [p.as_dict() for p in run.plans]
    with agreed("writing the run folder", L.acc.device):
        if L.main:
            make_folder(paths.dir)
            write_config(paths, cfg, run.state.resume_changes, run.start.change)
            write_json(paths.env, scrub(env), "the run's environment")
            write_json(paths.plan, scrub(plan), "the memory plan")
    from ..store.tracking import start_trackers, tracker_names

    if tracker_names(cfg.tracking.tracker):
        start_trackers(L.acc, cfg, paths.dir, paths.name, run_id=run.state.wandb_run_id,
                       precision=L.precision.name, env=env, plan=plan)
