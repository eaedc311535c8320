"""Building a run, one piece a function: the resume point, the data, the model and its optimizer,
the micro-batch, the run folder. `run.train` calls them in order.

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
from pathlib import Path

import torch

from . import batching, checkpoint, resume
from .collectives import agreed, broadcast_module
from .config import Config
from .errors import VramfitError
from .tracking import environment, write_json

log = logging.getLogger("vramfit")


def find_resume(cfg: Config, L, run_dir: Path) -> tuple[resume.ResumePoint | None, list[str], dict]:
    """The checkpoint to continue from, the notes to say about it, and this launch's fingerprint
    (computed once: it lists a local data source's files)."""
    ckpt_dir = run_dir / "checkpoints"
    with agreed("looking for checkpoints", L.acc.device):
        if L.main:
            check_writable(Path(cfg.output))
            if cfg.resume == "auto":
                checkpoint.latest(ckpt_dir, cleanup=True)
    with agreed("reading the checkpoint", L.acc.device):
        point = resume.find(cfg, ckpt_dir)
        fingerprint = resume.fingerprint(cfg)
        notes = resume.check(cfg, point, L.world, fingerprint) if point else []
    return point, notes, fingerprint


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
        what = {errno.ENOSPC: "the disk is full", errno.EROFS: "it is on a read-only file system",
                errno.EACCES: "it is not writable", errno.EEXIST: "a file of that name is in the way",
                errno.ENOTDIR: "a file of that name is in the way"}.get(e.errno, e.strerror or str(e))
        raise VramfitError(f"Cannot write into --output {output}: {what}.",
                           hint="pick a writable folder with free space with --output PATH") from None
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()


def finished_summary(cfg: Config, L, point: resume.ResumePoint | None, run_dir: Path) -> dict | None:
    """The summary of a run that already finished with these settings (re-running its command
    does nothing); None when there is training to do."""
    if not (point and point.state.get("finished") and (run_dir / "summary.json").exists()
            and point.state.get("epoch", 0) >= cfg.train.epochs):
        return None
    done = json.loads((run_dir / "summary.json").read_text())
    if L.main:
        log.info("Run %s already finished (%d epochs, best accuracy %s); nothing to do. Use another "
                 "--run-name to train again.", run_dir, done.get("epochs", 0), done.get("best_accuracy"))
    return done


def load_data(cfg: Config, L, point: resume.ResumePoint | None):
    """The main process first (it may build caches the others then read). Returns the splits and
    the steps per epoch."""
    from .data import load_splits

    splits = None
    with agreed("loading the data", L.acc.device):
        if L.main:
            splits = load_splits(cfg.data)
    with agreed("loading the data", L.acc.device):
        if not L.main:
            splits = load_splits(cfg.data)
    if point:
        resume.class_names_match(point, splits.class_names)
    steps = batching.steps_per_epoch(len(splits.train), cfg.train.global_batch)
    if steps == 0:
        raise VramfitError(f"The training split has {len(splits.train)} images, fewer than one global batch "
                           f"({cfg.train.global_batch}).", hint="lower --global-batch or add data")
    return splits, steps


def build_model(cfg: Config, L, num_classes: int):
    from accelerate.utils import set_seed

    from .models import create_model, data_config

    set_seed(cfg.train.seed)  # same initial weights on every process (and broadcast below)
    with agreed("building the model", L.acc.device):
        model = create_model(cfg.model, num_classes, image_size=cfg.data.image_size)
        data_cfg = data_config(model, cfg.data.image_size, cfg.data.crop_pct)
    return model, data_cfg


def prepare_training(cfg: Config, L, model, steps_per_epoch: int):
    """Optimizer, schedule, EMA; the model on the device. Gradients are summed by the step's own
    reducer (engine.TrainStep), so the model is not wrapped in DDP (whose buckets would hold a
    second gradient copy for nothing): the starting weights are broadcast once instead. FSDP
    models are prepared by Accelerate, which shards them."""
    from accelerate.utils import DistributedType

    from .optim import create_optimizer, create_scheduler

    optimizer = create_optimizer(model, cfg.optim, cfg.train.global_batch)  # LR scaled to the batch
    # The scheduler is neither prepared (Accelerate would step it once per process) nor saved: the
    # LR is a pure function of the global step, restored by `step_update` on resume.
    scheduler = create_scheduler(optimizer, cfg.optim, steps_per_epoch, cfg.train.epochs, cfg.train.global_batch)
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


def choose_micro_batch(cfg: Config, L, num_classes: int, model, point) -> tuple[batching.MicroBatch, dict]:
    """The one micro-batch rule (batching.resolve_micro_batch): configured, whole share, `auto`
    (planner, then a probe on the device), or where an interrupted run had come down to. Returns
    it with the plan (plan.json) and the lines to say at start about it."""
    per_proc = batching.per_process_batch(cfg.train.global_batch, L.world)
    probe: dict = {}  # what the probe found, for plan.json
    auto_here = cfg.train.micro_batch == "auto" and L.device_type == "cuda"
    pick = _probing_pick(cfg, num_classes, L, model, probe) if auto_here else None
    resumed = resume.resumed_micro_batch(point, L.world, cfg.allow_resume_change)
    mb = batching.resolve_micro_batch(cfg.train.micro_batch, per_proc, pick=pick, resumed=resumed)
    plan = {"requested_micro_batch": cfg.train.micro_batch, **mb.as_dict(), **probe,
            "num_processes": L.world, "precision": L.precision}
    plan.update(_predict(cfg, num_classes, mb, L))
    plan["notes"] = fit_notes(cfg, L, num_classes, mb, plan)
    return mb, plan


def fit_notes(cfg: Config, L, num_classes: int, mb: batching.MicroBatch, plan: dict) -> list[str]:
    """Said at start: the LR scaling, the auto pick and its predicted peak, and a fixed micro-batch
    the planner predicts will not fit the card (with the one that does)."""
    from .optim import scaled_lr
    from .planner import budget_bytes_for, pick_micro_batch

    notes = [n for n in (scaled_lr(cfg.optim, cfg.train.global_batch)[1], mb.note) if n]
    peak = plan.get("predicted_peak_bytes")
    if L.device_type != "cuda" or peak is None:  # without a card there is nothing to fit
        return notes
    budget = budget_bytes_for(cfg, total_bytes=torch.cuda.get_device_properties(L.acc.device).total_memory)
    if mb.source == "auto":
        notes.append(f"micro-batch {mb.size} picked for this card: predicted peak {peak / 2**30:.2f} GiB of "
                     f"{budget / 2**30:.2f} GiB")
    elif peak > budget:
        fits, _ = pick_micro_batch(cfg, num_classes, mb.per_process_batch, budget, precision=L.precision,
                                   num_processes=L.world)
        notes.append(f"micro-batch {mb.size} is predicted to need {peak / 2**30:.2f} GiB, more than the "
                     f"{budget / 2**30:.2f} GiB this card allows: "
                     + (f"--micro-batch {fits} fits (or micro_batch: auto)" if fits else
                        "not even micro-batch 1 fits; see `vramfit plan`")
                     + "; out-of-memory errors will be retried smaller")
    return notes


def compile_model(cfg: Config, L, model):
    """`train.compile`: torch.compile the model in place (`nn.Module.compile`), after the micro-batch
    is settled, so the memory probe runs eagerly and the first compiled shapes are the run's own.
    In place rather than a wrapper: parameter and state-dict names, checkpoints and the EMA copy
    stay as they are. A smaller micro-batch after an out-of-memory retry, a short last batch and
    evaluation each compile once more."""
    if cfg.train.compile:
        model.compile()
        L.notes.append("torch.compile: on (the first steps and the first evaluation include compiling)")
    return model


def cpu_seconds_per_sample(cfg: Config, L, model, micro: batching.MicroBatch) -> float | None:
    """What one training sample costs this CPU run's model, for `data.num_workers: auto` (None
    where nothing is measured: a fixed worker count, a GPU, or no core to spare). A forward without
    gradients in eval mode (no BatchNorm statistics move, no random draw) on a seeded batch, timed
    after one warm-up and counted 3x for forward + backward; before torch.compile, so nothing is
    compiled for it."""
    from .data.workers import local_processes, measures_workers

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


def _probing_pick(cfg: Config, num_classes: int, L, model, found: dict):
    """`auto` on a GPU: the planner's pick, confirmed by a probe on the device."""
    def pick(share: int) -> int:
        found.update(_auto_probe(cfg, num_classes, share, L, model))
        return found["micro_batch"]
    return pick


def _auto_probe(cfg: Config, num_classes: int, per_proc: int, L, model) -> dict:
    from .collectives import world_size
    from .memory import auto_micro_batch

    found = auto_micro_batch(cfg, num_classes, per_proc, L.acc.unwrap_model(model), L.acc.device)
    if world_size() > 1:  # every process must use the same split: take the smallest fit
        import torch.distributed as dist

        t = torch.tensor([found["micro_batch"]], device=L.acc.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        found["micro_batch"] = int(t.item())
    return found


def _predict(cfg: Config, num_classes: int, mb: batching.MicroBatch, L) -> dict:
    """The planner's prediction for the micro-batch in use (plan.json), compared later with the peak."""
    from .planner import estimate

    try:
        est = estimate(cfg, num_classes, mb.size, L.precision, num_processes=L.world,
                       per_process_batch=mb.per_process_batch)
    except VramfitError:
        raise
    except Exception as e:  # noqa: BLE001 - a model the tracer cannot follow still trains
        log.warning("memory plan unavailable for %s (%s: %s)", cfg.model.name, type(e).__name__, e)
        return {"predicted_peak_bytes": None}
    return {"predicted_peak_bytes": est.peak_bytes, "estimate": est.as_dict()}


def restore_state(cfg: Config, L, point, micro: batching.MicroBatch, class_names: list[str], model,
                  scheduler, ema, fingerprint: dict):
    """The trainer state: fresh, or the checkpoint's (with weights, optimizer, RNG and EMA)."""
    from accelerate.utils import set_seed

    from .state import TrainerState
    from .tracking import wandb_run_id

    state = TrainerState(micro_batch=micro.size, class_names=class_names, world_size=L.world,
                         global_batch=cfg.train.global_batch, fingerprint=fingerprint,
                         wandb_run_id=wandb_run_id(point.state if point else None))
    if point is None:
        set_seed(cfg.train.seed + L.rank)  # per-process streams for dropout / drop-path from here on
        return state
    with agreed("loading the checkpoint", L.acc.device):
        resume.load(L.acc, point, L.world, cfg.train.seed, model, ema)
    state.load_state_dict(point.state)
    scheduler.step_update(num_updates=state.global_step)
    return state


def write_run_folder(cfg: Config, L, run_dir: Path, run_name: str, plan: dict, state) -> None:
    """config.yaml, env.json and plan.json (written after every override of the micro-batch), and
    the trackers started with them."""
    env = environment(L.acc)
    with agreed("writing the run folder", L.acc.device):
        if L.main:
            try:
                run_dir.mkdir(parents=True, exist_ok=True)
                (run_dir / "config.yaml").write_text(cfg.to_yaml())
                write_json(run_dir / "env.json", env)
                write_json(run_dir / "plan.json", plan)
            except OSError as e:
                raise VramfitError(f"Cannot write the run folder {run_dir}: {e.strerror or e}.",
                                   hint="pick a writable --output with free space") from None
    from .tracking import start_trackers, tracker_names

    if tracker_names(cfg.tracking.tracker):
        start_trackers(L.acc, cfg, run_dir, run_name, run_id=state.wandb_run_id, env=env, plan=plan)


def plan_text(cfg: Config, num_classes: int, world: int) -> str | None:
    """The memory plan as `vramfit plan` prints it, for the out-of-memory error."""
    import io

    from .planner import run_plan

    try:
        buf = io.StringIO()
        run_plan(cfg, num_classes, num_processes=world, out=buf)
        return buf.getvalue()
    except Exception:  # noqa: BLE001 - the error itself is what matters; the plan only adds detail
        return None
