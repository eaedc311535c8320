"""`vramfit train`: one run, read top to bottom: setup, resume, loop, finish.

The pieces live in their own modules: launch (the process: Accelerate, precision, threads), setup
(building the run), resume (which checkpoint, and whether it may be used), batching (the
micro-batch rule), engine (one optimizer step), validation (one evaluation), loop (the epochs),
summary (the figures a run is compared by), faults (debug injections).
"""

from __future__ import annotations

from pathlib import Path

from . import launch, setup, summary
from .config import Config


def train(cfg: Config) -> dict:
    from .augment import DeviceAugment
    from .data import build_loaders
    from .engine import TrainStep
    from .faults import Faults
    from .loop import Trainer
    from .signals import SignalFlag
    from .tracking import RunLog, tracker_names
    from .validation import EvalState

    # ---------------------------------------------------------------- setup
    L = launch.start(cfg)
    run_name = cfg.resolved_run_name()
    run_dir = Path(cfg.output) / run_name

    # ---------------------------------------------------------------- resume decision
    # The settings are checked against the checkpoint before anything else, even for a run that
    # finished: a changed command never silently does nothing.
    point, resume_notes, fingerprint = setup.find_resume(cfg, L, run_dir)
    done = setup.finished_summary(cfg, L, point, run_dir)
    if done is not None:
        return done

    # ---------------------------------------------------------------- data, model, optimizer, batch
    splits, steps_per_epoch = setup.load_data(cfg, L, point)
    num_classes = len(splits.class_names)
    model, data_cfg = setup.build_model(cfg, L, num_classes)
    model, optimizer, scheduler, ema = setup.prepare_training(cfg, L, model, steps_per_epoch)
    micro, plan = setup.choose_micro_batch(cfg, L, num_classes, model, point)
    compute_seconds = setup.cpu_seconds_per_sample(cfg, L, model, micro)
    model = setup.compile_model(cfg, L, model)
    state = setup.restore_state(cfg, L, point, micro, splits.class_names, model, scheduler, ema, fingerprint)
    step = TrainStep(L.acc, model, optimizer, micro.size, label_smoothing=cfg.train.label_smoothing,
                     clip_grad_norm=cfg.train.clip_grad_norm, check_grad_norm=L.precision != "fp16",
                     oom_retries=state.oom_retries, recomputes=cfg.model.grad_checkpointing)
    faults = Faults(cfg.debug, L.rank)
    faults.install(model, step)
    eval_batch = cfg.train.eval_batch or max(micro.size, min(micro.per_process_batch, 256))
    loaders = build_loaders(cfg, splits, data_cfg, L.acc, eval_batch, compute_seconds)
    augment = DeviceAugment(cfg.data, num_classes, cfg.train.label_smoothing, cfg.train.seed, L.rank,
                            mean=data_cfg["mean"], std=data_cfg["std"], device_type=L.acc.device.type)

    # ---------------------------------------------------------------- run folder
    setup.write_run_folder(cfg, L, run_dir, run_name, plan, state)
    runlog = RunLog(L.acc, run_dir, use_trackers=bool(tracker_names(cfg.tracking.tracker)))
    summary.say_start(cfg, L, run_name, splits, micro, plan, steps_per_epoch, loaders, resume_notes, point)

    # ---------------------------------------------------------------- loop
    flag = SignalFlag().install()
    trainer = Trainer(cfg, L, run_dir, model, optimizer, scheduler, ema, step, EvalState(eval_batch),
                      loaders, augment, faults, state, splits, data_cfg, runlog, flag,
                      plan_text=lambda: setup.plan_text(cfg, num_classes, L.world))
    try:
        signum = trainer.fit()
    finally:
        flag.restore()

    # ---------------------------------------------------------------- finish
    result = summary.build(run_name, cfg, L, state, step.state, plan, trainer.clock, splits.class_names,
                           splits.empty_classes)
    summary.finish(result, L, run_dir, signum, state)
    runlog.summary(result)
    if runlog.use_trackers:
        L.acc.end_training()
    if signum:
        raise SystemExit(128 + int(signum))
    return result
