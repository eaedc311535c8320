"""`vramfit train`: one linear, sectioned training run, readable top to bottom."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path

import torch

from . import checkpoint
from .config import Config, grad_accum_steps, largest_divisor_at_most, per_process_batch
from .errors import VramfitError
from .tracking import RunLog, environment, write_json

log = logging.getLogger("vramfit")

_STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1")


class SignalFlag:
    """The handler only records the signal; the loop agrees and saves at the next step boundary."""

    def __init__(self):
        self.signum = 0
        self._old = {}

    def install(self):
        for name in _STOP_SIGNALS:
            s = getattr(signal, name, None)
            if s is not None:
                self._old[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum, _frame):
        self.signum = signum

    def restore(self):
        for s, h in self._old.items():
            signal.signal(s, h)


def resolve_precision(requested: str, device_type: str) -> tuple[str, str | None]:
    if device_type == "cuda":
        bf16 = torch.cuda.is_bf16_supported()
        if requested == "auto":
            return ("bf16" if bf16 else "fp16"), None
        if requested == "bf16" and not bf16:
            return "fp16", "this GPU has no bf16 support: using fp16 (with loss scaling) instead"
        return requested, None
    if requested == "auto":
        return "no", None
    if requested == "fp16":
        return "no", f"fp16 needs a CUDA GPU; on {device_type} training runs in fp32 (`no`)"
    return requested, None


def _memory_figures(device) -> dict:
    import psutil

    out = {"host_rss_bytes": psutil.Process().memory_info().rss}
    if device.type == "cuda":
        out.update(mem_allocated_bytes=torch.cuda.memory_allocated(device),
                   mem_reserved_bytes=torch.cuda.memory_reserved(device),
                   mem_peak_bytes=torch.cuda.max_memory_reserved(device))
    return out


def _simulate_oom(limit: int | None, rank_only: int | None, rank: int):
    def hook(_module, args):
        x = args[0]
        if limit is not None and x.shape[0] > limit and (rank_only is None or rank_only == rank):
            raise torch.OutOfMemoryError(
                f"simulated out of memory: forward with {x.shape[0]} > debug.simulate_oom_above={limit}")
    return hook


def train(cfg: Config) -> dict:
    # Must be set before CUDA initialises; expandable segments cut fragmentation-driven OOMs.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs, set_seed

    from . import data as D
    from .augment import DeviceAugment
    from .engine import (MicroBatchExhausted, NonFiniteLoss, StepInterrupted, StepState, agree_max, evaluate,
                         oom_message, train_step)
    from .models import create_model, data_config, export
    from .optim import create_optimizer, create_scheduler

    t_start = time.time()
    # ---------------------------------------------------------------- accelerator
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    precision, precision_note = resolve_precision(cfg.train.precision, device_type)
    use_wandb = cfg.tracking.tracker == "wandb"
    acc = Accelerator(
        mixed_precision=precision,
        cpu=device_type == "cpu",  # without it Accelerate ignores a torchrun world on CPU
        log_with="wandb" if use_wandb else None,
        # Buffers are not broadcast in forward: that would be a collective inside each micro-batch,
        # where a rank that ran out of memory could no longer join. BN statistics are averaged
        # across processes before every evaluation and save instead.
        kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False)],
        step_scheduler_with_optimizer=False,
    )
    main = acc.is_main_process
    world, rank = acc.num_processes, acc.process_index
    logging.basicConfig(level=logging.INFO if main else logging.WARNING,
                        format="%(message)s", stream=sys.stderr)
    for noisy in ("accelerate", "datasets", "timm"):  # their per-save INFO lines drown the run's own
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if precision_note and main:
        log.warning("precision: %s", precision_note)
    if device_type == "cuda":
        torch.backends.cudnn.benchmark = cfg.train.cudnn_benchmark
    if device_type == "cpu" and os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true") and main:
        log.warning("distributed: the launch config asks for FSDP, which needs CUDA GPUs; on CPU the "
                    "%d process(es) run plain data parallel (every process holds the whole model)", world)

    run_name = cfg.resolved_run_name()
    run_dir = Path(cfg.output) / run_name
    ckpt_dir = run_dir / "checkpoints"

    # ---------------------------------------------------------------- resume decision
    resume_from = None
    if cfg.resume == "never":
        if ckpt_dir.exists() and checkpoint.list_steps(ckpt_dir):
            raise VramfitError(f"Run folder {run_dir} already holds checkpoints and --resume never was given.",
                               hint="re-run with --resume auto to continue it, or pick another --run-name")
    elif cfg.resume == "auto":
        if main:
            checkpoint.latest(ckpt_dir, cleanup=True)
        acc.wait_for_everyone()
        resume_from = checkpoint.latest(ckpt_dir)
    else:
        resume_from = Path(cfg.resume)
        if not checkpoint.is_complete(resume_from):
            raise VramfitError(f"--resume {cfg.resume} is not a complete checkpoint folder.",
                               hint=f"use --resume auto, or one of {ckpt_dir}/step-N")
    resumed_state = checkpoint.read_state(resume_from) if resume_from else None
    if (resumed_state and resumed_state.get("finished") and (run_dir / "summary.json").exists()
            and resumed_state.get("epoch", 0) >= cfg.train.epochs):
        import json
        summary = json.loads((run_dir / "summary.json").read_text())
        if main:
            log.info("Run %s already finished (%d epochs, best accuracy %.4f); nothing to do. "
                     "Use another --run-name to train again.", run_dir, summary.get("epochs", 0),
                     summary.get("best_accuracy") or 0.0)
        return summary
    if resumed_state:
        _check_resume_compatible(cfg, resumed_state, world)

    set_seed(cfg.train.seed)  # same initial weights on every process

    # ---------------------------------------------------------------- data
    with acc.main_process_first():
        splits = D.load_splits(cfg.data, cfg.train.seed)
    for part, limit in (("train", cfg.data.limit_train_samples), ("val", cfg.data.limit_val_samples)):
        ds = getattr(splits, part)
        if limit is not None and limit < len(ds):
            setattr(splits, part, ds.shuffle(seed=cfg.train.seed).select(range(limit)))
            splits.notes.append(f"data.limit_{part}_samples: using a seeded random {limit} of {len(ds)} "
                                f"{part} images")
    num_classes = len(splits.class_names)
    if resumed_state and resumed_state.get("class_names") not in (None, splits.class_names):
        raise VramfitError(
            f"The dataset's classes {splits.class_names[:10]}... differ from the checkpoint's "
            f"{resumed_state['class_names'][:10]}...: the model head would not match.",
            hint="resume with the same data, or start a new run (--run-name)")

    # ---------------------------------------------------------------- model
    model = create_model(cfg.model, num_classes)
    data_cfg = data_config(model, cfg.data.image_size, cfg.data.crop_pct)
    if cfg.debug.simulate_oom_above is not None:
        model.register_forward_pre_hook(_simulate_oom(cfg.debug.simulate_oom_above,
                                                      cfg.debug.fault_rank, rank))

    # ---------------------------------------------------------------- batch arithmetic
    per_proc = per_process_batch(cfg.train.global_batch, world)
    plan = _choose_micro_batch(cfg, num_classes, per_proc, world, device_type)
    steps_per_epoch = D.steps_per_epoch(len(splits.train), cfg.train.global_batch, world)
    if steps_per_epoch == 0:
        raise VramfitError(
            f"The training split has {len(splits.train)} images, fewer than one global batch "
            f"({cfg.train.global_batch}).", hint="lower --global-batch or add data")

    # ---------------------------------------------------------------- optimizer, schedule
    optimizer = create_optimizer(model, cfg.optim)
    scheduler = create_scheduler(optimizer, cfg.optim, steps_per_epoch, cfg.train.epochs)
    model, optimizer = acc.prepare(model, optimizer)
    # The scheduler is neither prepared (Accelerate would step it once per process) nor saved: the
    # LR is a pure function of the global step, restored by `step_update` on resume.
    ema = None
    if cfg.model.ema_decay:
        from timm.utils import ModelEmaV3

        ema = ModelEmaV3(acc.unwrap_model(model), decay=cfg.model.ema_decay, use_warmup=True)
    if cfg.train.micro_batch == "auto" and device_type == "cuda":
        plan.update(_auto_probe(cfg, num_classes, per_proc, acc, model))
    micro = plan["micro_batch"]
    accum = grad_accum_steps(cfg.train.global_batch, micro, world)
    plan.update(_predict(cfg, num_classes, micro, per_proc, world, precision))
    set_seed(cfg.train.seed + rank)  # per-process streams for dropout / drop-path from here on

    # ---------------------------------------------------------------- loaders
    train_tf, val_tf = D.build_transforms(cfg.data, data_cfg)
    workers = D.resolve_workers(cfg.data, device_type, acc.state.num_processes if world > 1 else 1)
    pin = device_type == "cuda"
    sampler = D.StepBatchSampler(len(splits.train), cfg.train.global_batch, rank, world, cfg.train.seed)
    train_ds = D.ImageDataset(splits.train, splits.image_column, splits.label_column, train_tf,
                              cfg.data.image_size, cfg.train.seed, train=True)
    train_loader = D.make_loader(train_ds, batch_sampler=sampler, workers=workers, pin=pin)
    val_ds = D.ImageDataset(splits.val, splits.image_column, splits.label_column, val_tf,
                            cfg.data.image_size, cfg.train.seed, train=False)
    eval_batch = cfg.train.eval_batch or max(micro, min(per_proc, 256))
    eval_micro = [eval_batch]  # shrinks on an evaluation OOM and stays shrunk
    val_loader = acc.prepare_data_loader(D.make_loader(val_ds, batch_size=eval_batch, workers=workers, pin=pin))
    normalize = D.normalizer(data_cfg, acc.device, cfg.model.channels_last)
    augment = DeviceAugment(cfg.data, num_classes, cfg.train.label_smoothing, cfg.train.seed, rank)

    # ---------------------------------------------------------------- state and resume
    st = {"global_step": 0, "epoch": 0, "step_in_epoch": 0, "samples_seen": 0, "best_accuracy": None,
          "best_step": None, "final_accuracy": None, "oom_retries": 0, "skipped_samples": 0,
          "epoch_skipped_samples": 0, "bad_files": {},
          "skipped_steps": 0, "micro_batch": micro, "class_names": splits.class_names,
          "world_size": world, "global_batch": cfg.train.global_batch, "finished": False,
          "fingerprint": _fingerprint(cfg)}
    if resume_from:
        try:  # Accelerate loads every pickle with weights_only=True (numpy RNG types allow-listed)
            acc.load_state(str(resume_from))
        except Exception as e:  # noqa: BLE001 - a checkpoint that cannot be loaded safely is reported, not run
            raise VramfitError(
                f"Could not load checkpoint {resume_from}: {type(e).__name__}: {str(e).splitlines()[0][:300]}",
                hint="resume from an older checkpoint (--resume PATH), or start over with --resume never "
                     "(files there may have been written by another program: nothing in them was executed)"
            ) from None
        checkpoint.verify_rng_restored(resume_from, rank)
        if ema is not None:
            checkpoint.load_extra(resume_from, "ema", ema.module)
        st.update({k: v for k, v in resumed_state.items() if k in st and k not in ("micro_batch", "world_size")})
        for key in ("epoch", "step_in_epoch", "global_step"):
            if not isinstance(resumed_state.get(key), int):
                raise VramfitError(f"Checkpoint {resume_from} has no valid `{key}`: the data position "
                                   "cannot be restored.", hint="resume from another checkpoint (--resume PATH)")
        scheduler.step_update(num_updates=st["global_step"])
        if main:
            log.info("Resumed from %s (epoch %d, step %d of the epoch, global step %d)", resume_from,
                     st["epoch"], st["step_in_epoch"], st["global_step"])
    step_state = StepState(micro_batch=micro, per_process_batch=per_proc, oom_retries=st["oom_retries"])
    came_down_to = (resumed_state or {}).get("micro_batch")
    if (resume_from and isinstance(came_down_to, int) and came_down_to < micro and per_proc % came_down_to == 0
            and resumed_state.get("world_size") == world and not cfg.allow_resume_change):
        # The interrupted run had to split its batches further after running out of memory; going
        # back up would run out again, and with train-mode BatchNorm would change the maths.
        step_state.micro_batch = came_down_to
        if main:
            log.info("continuing at micro-batch %d, where the interrupted run had come down to after "
                     "out-of-memory errors (--set allow_resume_change=true starts from %d again)",
                     came_down_to, micro)

    # ---------------------------------------------------------------- run folder
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(cfg.to_yaml())
        write_json(run_dir / "env.json", environment(acc))
        write_json(run_dir / "plan.json", {**plan, "grad_accum_steps": accum, "num_processes": world,
                                           "per_process_batch": per_proc, "precision": precision})
    if use_wandb:
        from .tracking import scrub
        acc.init_trackers(cfg.tracking.project, config=scrub(cfg.model_dump(mode="json")),
                          init_kwargs={"wandb": {"name": run_name, "dir": str(run_dir.resolve()),
                                                 **({"entity": cfg.tracking.entity} if cfg.tracking.entity else {}),
                                                 "resume": "allow", "id": _wandb_id(run_dir)}})
    runlog = RunLog(acc, run_dir, use_wandb)
    if main:
        log.info("vramfit: %s | %s | %d classes, %d train / %d val images%s",
                 run_name, splits.description, num_classes, len(splits.train), len(splits.val),
                 "".join(f"\n  note: {n}" for n in splits.notes))
        log.info("batch: global %d = micro %d x accum %d x %d process(es) | precision %s | device %s | "
                 "%d steps/epoch, %d workers", cfg.train.global_batch, step_state.micro_batch,
                 per_proc // step_state.micro_batch, world, precision,
                 acc.device, steps_per_epoch, workers)

    # ---------------------------------------------------------------- loop
    flag = SignalFlag().install()
    model.train()
    total_train_time, total_train_samples, data_wait = 0.0, 0, 0.0
    exit_signal = 0
    consecutive_skips = 0
    try:
        for epoch in range(st["epoch"], cfg.train.epochs):
            sampler.set_epoch(epoch, st["step_in_epoch"] if epoch == st["epoch"] else 0)
            st["epoch"] = epoch
            pbar = _progress(main, len(sampler), epoch, cfg.train.epochs)
            t_epoch = time.time()
            t_wait = time.time()
            for batch in train_loader:
                t_got = time.time()
                data_wait += t_got - t_wait
                if st["global_step"] == 0 or st["step_in_epoch"] == 0:
                    D.check_batch_shape(batch.images, cfg.data.image_size)
                images, labels = augment(normalize(batch.images), batch.labels.to(acc.device, non_blocking=True),
                                         epoch, st["step_in_epoch"])
                try:
                    res = train_step(acc, model, optimizer, images, labels, batch.step_samples, step_state,
                                     label_smoothing=cfg.train.label_smoothing,
                                     clip_grad_norm=cfg.train.clip_grad_norm,
                                     check_grad_norm=precision != "fp16",
                                     loss_fn=_nan_injector(cfg, st["global_step"] + 1, rank),
                                     stop_requested=_stop_check(
                                         flag, cfg.debug.signal_in_step == st["global_step"] + 1))
                except StepInterrupted:
                    # Undone on every process: save the last completed step; a resume redoes this one.
                    exit_signal = agree_max(flag.signum, acc.device) or signal.SIGTERM
                    if main:
                        log.warning("signal %d during global step %d: the step was undone between "
                                    "micro-batches", exit_signal, st["global_step"] + 1)
                    _save(acc, model, ckpt_dir, st, cfg, ema)
                    break
                except MicroBatchExhausted:
                    _dump_memory(run_dir, acc)
                    raise oom_message(step_state, _advice_text(cfg, num_classes, world)) from None
                except NonFiniteLoss as e:
                    raise _nonfinite_error(e, st, batch, ckpt_dir) from None
                # Every rank counts every rank's bad files, so the counts are whole and all ranks
                # stop together when there are too many (kept in the checkpoint across resumes;
                # counted once the step is done, so an undone step is not counted twice).
                for b in _gather_bad(batch.bad, acc):
                    st["bad_files"][b] = st["bad_files"].get(b, 0) + 1
                    st["skipped_samples"] += 1
                    st["epoch_skipped_samples"] += 1
                    if main:
                        log.warning("unreadable image replaced: %s", b)
                _check_bad_fraction(st["bad_files"], len(splits.train), cfg.data.max_bad_fraction)
                st["skipped_steps"] += int(res.skipped)
                consecutive_skips = consecutive_skips + 1 if res.skipped else 0
                if consecutive_skips >= cfg.train.max_consecutive_skipped_steps:
                    raise VramfitError(
                        f"fp16: {consecutive_skips} optimizer steps in a row were skipped for inf/NaN "
                        f"gradients (global step {st['global_step']}): the run has diverged.",
                        hint="use --precision bf16 (no loss scaling) or lower --lr; resume from the last "
                             f"checkpoint in {ckpt_dir}", exit_code=4)
                if ema is not None:
                    ema.update(acc.unwrap_model(model), step=st["global_step"] + 1)
                st["global_step"] += 1
                st["step_in_epoch"] += 1
                st["samples_seen"] += res.samples
                st["oom_retries"], st["micro_batch"] = step_state.oom_retries, step_state.micro_batch
                scheduler.step_update(num_updates=st["global_step"])
                dt = time.time() - t_got
                total_train_time += time.time() - t_wait
                total_train_samples += res.samples
                lr = optimizer.param_groups[0]["lr"]
                if pbar is not None:
                    pbar.update(1)
                    pbar.set_postfix(loss=f"{res.loss:.4f}", lr=f"{lr:.2e}",
                                     ips=f"{res.samples / max(dt, 1e-9):.0f}", mb=step_state.micro_batch)
                if st["global_step"] % cfg.train.log_every_steps == 0 or st["global_step"] == 1:
                    runlog.log({"kind": "train", "epoch": epoch, "loss": res.loss,
                                "accuracy": res.correct / res.samples, "lr": lr,
                                "grad_norm": res.grad_norm, "micro_batch": step_state.micro_batch,
                                "oom_retries": step_state.oom_retries,
                                "images_per_second": total_train_samples / max(total_train_time, 1e-9),
                                "data_wait_fraction": data_wait / max(total_train_time, 1e-9),
                                **_memory_figures(acc.device)}, st["global_step"])
                if cfg.debug.signal_at_step == st["global_step"]:
                    flag.signum = signal.SIGTERM
                stop = agree_max(flag.signum, acc.device)
                every = cfg.checkpoint.every_steps
                if stop or (every and st["global_step"] % every == 0):
                    _save(acc, model, ckpt_dir, st, cfg, ema)
                if stop:
                    exit_signal = stop
                    break
                t_wait = time.time()
            if pbar is not None:
                pbar.close()
            if exit_signal:
                break
            # ---- end of epoch: evaluate, keep the best weights, checkpoint
            _sync_bn(acc, model)
            eval_model = ema.module if ema is not None else model
            try:
                metrics = evaluate(acc, eval_model, val_loader, num_classes, eval_micro, normalize,
                                   stop_requested=_stop_check(flag, cfg.debug.signal_in_eval == epoch + 1))
            except StepInterrupted:
                # The epoch's steps are done and saved as such: a resume goes straight to evaluation.
                exit_signal = agree_max(flag.signum, acc.device) or signal.SIGTERM
                if main:
                    log.warning("signal %d during the evaluation of epoch %d: saving the trained state",
                                exit_signal, epoch + 1)
                _save(acc, model, ckpt_dir, st, cfg, ema)
                break
            unreadable_val = metrics.pop("unreadable")
            st["final_accuracy"] = metrics["accuracy"]
            st["epoch"], st["step_in_epoch"] = epoch + 1, 0
            improved = st["best_accuracy"] is None or metrics["accuracy"] > st["best_accuracy"]
            if improved:
                st["best_accuracy"], st["best_step"] = metrics["accuracy"], st["global_step"]
                if main:
                    export(acc.unwrap_model(eval_model), run_dir / "model", splits.class_names, data_cfg)
            runlog.log({"kind": "eval", "epoch": epoch + 1, "val_loss": metrics["loss"],
                        "val_accuracy": metrics["accuracy"], "val_top5": metrics["top5"],
                        "val_samples": metrics["samples"], "val_unreadable": len(unreadable_val),
                        "skipped_samples": st["epoch_skipped_samples"],
                        "epoch_seconds": time.time() - t_epoch}, st["global_step"])
            st["epoch_skipped_samples"] = 0
            if main:
                log.info("epoch %d/%d: val accuracy %.4f (top5 %.4f, %d images), loss %.4f%s",
                         epoch + 1, cfg.train.epochs, metrics["accuracy"], metrics["top5"],
                         metrics["samples"], metrics["loss"], " (best)" if improved else "")
            st["finished"] = epoch + 1 == cfg.train.epochs
            _save(acc, model, ckpt_dir, st, cfg, ema)
            if agree_max(flag.signum, acc.device):
                exit_signal = flag.signum or signal.SIGTERM
                break
    finally:
        flag.restore()

    # ---------------------------------------------------------------- summary
    summary = {
        "run_name": run_name, "best_accuracy": st["best_accuracy"], "final_accuracy": st["final_accuracy"],
        "epochs": st["epoch"], "global_step": st["global_step"], "global_batch": cfg.train.global_batch,
        "micro_batch": step_state.micro_batch, "grad_accum_steps": per_proc // step_state.micro_batch,
        "num_processes": world, "precision": precision,
        "images_per_second": total_train_samples / total_train_time if total_train_time else None,
        "peak_memory_bytes": torch.cuda.max_memory_reserved(acc.device) if device_type == "cuda" else None,
        # The planner's figure for the same quantity (allocator reserve, no CUDA context), at the
        # micro-batch the run started with: the two side by side show how good the plan was.
        "predicted_peak_memory_bytes": (plan.get("estimate") or {}).get("reserved_bytes"),
        "skipped_samples": st["skipped_samples"], "skipped_steps": st["skipped_steps"],
        "oom_retries": step_state.oom_retries, "micro_batch_changes": step_state.history,
        "wall_seconds": time.time() - t_start, "finished": st["finished"],
        "unreadable_files": sorted(st["bad_files"]),
    }
    if main:
        write_json(run_dir / "summary.json", summary)
    if use_wandb:
        runlog.summary(summary)
        acc.end_training()
    if exit_signal:
        if main:
            log.warning("Stopped by signal %d at global step %d; checkpoint saved. Re-run the same "
                        "command to resume.", exit_signal, st["global_step"])
        raise SystemExit(128 + int(exit_signal))
    if main:
        peak, predicted = summary["peak_memory_bytes"], summary["predicted_peak_memory_bytes"]
        ips = summary["images_per_second"]
        if peak and predicted:
            peak_text = f"{peak / 2**30:.2f} GiB reserved (planned {predicted / 2**30:.2f})"
        else:
            peak_text = f"{peak / 2**30:.2f} GiB reserved" if peak else "n/a (CPU)"
        log.info("done in %.0f s: best val accuracy %.4f (step %s), %s img/s, device peak %s, %d skipped "
                 "image(s), %d OOM retr%s\n  run folder: %s (summary.json; best weights in model/)",
                 summary["wall_seconds"], st["best_accuracy"] or 0.0, st["best_step"],
                 f"{ips:.0f}" if ips else "n/a", peak_text,
                 summary["skipped_samples"], summary["oom_retries"],
                 "y" if summary["oom_retries"] == 1 else "ies", run_dir)
    return summary


# -------------------------------------------------------------------------------------------------
# Helpers of the loop (kept here: they only make sense inside it)


def _choose_micro_batch(cfg: Config, num_classes: int, per_proc: int, world: int, device_type: str) -> dict:
    mb = cfg.train.micro_batch
    plan: dict = {"requested_micro_batch": mb}
    if mb is None or (mb == "auto" and device_type != "cuda"):
        # Without a device to size against, the whole per-process batch runs at once.
        plan["micro_batch"] = per_proc
        plan["reason"] = "whole per-process batch" if mb is None else "auto on CPU: whole per-process batch"
        return plan
    if mb == "auto":  # sized after the model is on the device (run.train: `_auto_probe`)
        plan["micro_batch"] = per_proc
        plan["reason"] = "auto: pending the device probe"
        return plan
    if mb > per_proc:
        # A recipe's micro-batch is what fits the card; with more processes each one holds fewer
        # samples, so the same recipe runs unchanged on 8 GPUs with the whole share at once.
        plan["micro_batch"] = per_proc
        plan["reason"] = f"configured {mb} > per-process batch {per_proc}: whole share at once"
        return plan
    grad_accum_steps(cfg.train.global_batch, mb, world)  # raises with valid values when it does not divide
    plan["micro_batch"] = mb
    plan["reason"] = "configured"
    return plan


def _auto_probe(cfg: Config, num_classes: int, per_proc: int, acc, model) -> dict:
    from .memory import auto_micro_batch

    found = auto_micro_batch(cfg, num_classes, per_proc, acc.unwrap_model(model), acc.device)
    if acc.num_processes > 1:  # every process must use the same split: take the smallest fit
        import torch.distributed as dist

        t = torch.tensor([found["micro_batch"]], device=acc.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        found["micro_batch"] = int(t.item())
    return found


def _predict(cfg: Config, num_classes: int, micro: int, per_proc: int, world: int, precision: str) -> dict:
    """The planner's prediction for the micro-batch in use (plan.json), compared later with the peak."""
    from .planner import estimate

    try:
        est = estimate(cfg, num_classes, micro, precision, num_processes=world, per_process_batch=per_proc)
    except VramfitError:
        raise
    except Exception as e:  # noqa: BLE001 - a model the tracer cannot follow still trains
        log.warning("memory plan unavailable for %s (%s: %s)", cfg.model.name, type(e).__name__, e)
        return {"predicted_peak_bytes": None}
    return {"predicted_peak_bytes": est.peak_bytes, "estimate": est.as_dict()}


def _advice_text(cfg: Config, num_classes: int, world: int) -> str | None:
    import io

    from .planner import run_plan

    try:
        buf = io.StringIO()
        run_plan(cfg, num_classes, num_processes=world, out=buf)
        return buf.getvalue()
    except Exception:  # noqa: BLE001 - the error below is what matters; the plan only adds detail
        return None


def _check_bad_fraction(bad: dict, n: int, limit: float) -> None:
    if len(bad) > limit * n:
        files = "\n  ".join(sorted(bad)[:50])
        raise VramfitError(
            f"{len(bad)} unreadable images out of {n} (more than data.max_bad_fraction={limit:.1%}):\n  {files}",
            hint="fix or remove these files (`vramfit scan-data --data SRC` lists all), or raise "
                 "--set data.max_bad_fraction=...")


def _gather_bad(bad: list[str], acc) -> list[str]:
    """This step's unreadable train files from every process (one small all-reduce a step; the
    names travel only when there are any)."""
    if acc.num_processes == 1:
        return list(bad)
    from accelerate.utils import gather_object

    from .engine import agree_max

    return gather_object(list(bad)) if agree_max(len(bad), acc.device) else []


def _stop_check(flag: SignalFlag, inject: bool):
    """Asked before each micro-batch of a step, or each batch of an evaluation. `inject`
    (debug.signal_in_step / signal_in_eval) raises the flag before the second one, as a SIGTERM
    arriving in the middle would."""
    asked = [0]

    def stop() -> bool:
        asked[0] += 1
        if inject and asked[0] == 2:
            flag.signum = flag.signum or signal.SIGTERM
        return flag.signum != 0
    return stop


def _sync_bn(acc, model) -> None:
    if acc.num_processes > 1:
        from timm.utils import distribute_bn

        distribute_bn(model, acc.num_processes, reduce=True)


def _save(acc, model, ckpt_dir: Path, st: dict, cfg: Config, ema=None) -> None:
    _sync_bn(acc, model)
    keep = (st["best_step"],) if st.get("best_step") is not None else ()
    extra = {"ema": ema.module.state_dict()} if ema is not None else {}
    checkpoint.save(acc, ckpt_dir, st["global_step"], dict(st), cfg.checkpoint.keep_last, keep, extra)


def _nan_injector(cfg: Config, step: int, rank: int):
    if cfg.debug.nan_at_step != step or cfg.debug.fault_rank not in (None, rank):
        return None
    from .engine import _loss

    def loss_fn(logits, y, label_smoothing):
        return _loss(logits, y, label_smoothing) * float("nan")
    return loss_fn


def _fingerprint(cfg: Config) -> dict:
    """What a resumed run must share with the run it continues (the maths of the optimisation)."""
    return {"model": cfg.model.name, "image_size": cfg.data.image_size, "source": cfg.data.source,
            "global_batch": cfg.train.global_batch, "optimizer": cfg.optim.name, "lr": cfg.optim.lr,
            "seed": cfg.train.seed, "epochs": cfg.train.epochs,  # epochs shape the LR schedule
            "precision": cfg.train.precision, "ema_decay": cfg.model.ema_decay}


def _check_resume_compatible(cfg: Config, state: dict, world: int) -> None:
    old = state.get("fingerprint", {})
    new = _fingerprint(cfg)
    diffs = [f"{k}: {old.get(k)!r} -> {new[k]!r}" for k in new if k in old and old[k] != new[k]]
    if diffs and cfg.allow_resume_change:
        log.warning("resuming despite changed settings (%s): --set allow_resume_change=true", "; ".join(diffs))
    elif diffs:
        raise VramfitError("Cannot resume: the config changed in ways that change the run (" +
                           "; ".join(diffs) + ").",
                           hint="restore those settings, start a new run with another --run-name, or "
                                "accept the change with --set allow_resume_change=true")
    if state.get("world_size") not in (None, world):
        msg = (f"the checkpoint was written by {state['world_size']} process(es), this run has {world}: "
               "the global batch and sample order would be unchanged, but per-process random "
               "states cannot be carried over, so the result would not be bitwise identical")
        if not cfg.allow_resume_change:
            raise VramfitError(f"Cannot resume: {msg}.",
                               hint=f"launch with {state['world_size']} process(es), or accept it with "
                                    "--set allow_resume_change=true")
        log.warning("resuming anyway: %s", msg)


def _nonfinite_error(e, st: dict, batch, ckpt_dir: Path) -> VramfitError:
    last = checkpoint.latest(ckpt_dir)
    ids = batch.indices.tolist()
    return VramfitError(
        f"Non-finite {e.what} ({e.value}) at global step {st['global_step'] + 1} (epoch {st['epoch']}); "
        f"the update was not applied. Sample ids of this process's batch: {ids[:64]}"
        f"{' ...' if len(ids) > 64 else ''}. Last good checkpoint: {last or 'none'}.",
        hint="lower --lr, keep clip_grad_norm on, or try --precision bf16 / no; resume from the "
             "checkpoint with --resume auto", exit_code=4)


def _dump_memory(run_dir: Path, acc) -> None:
    if acc.is_main_process and torch.cuda.is_available():
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "memory_summary.txt").write_text(torch.cuda.memory_summary(acc.device))


def _wandb_id(run_dir: Path) -> str:
    import hashlib

    return hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:12]


def _progress(main: bool, total: int, epoch: int, epochs: int):
    if not main:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=f"epoch {epoch + 1}/{epochs}", dynamic_ncols=True, leave=False,
                disable=not sys.stderr.isatty() and os.environ.get("VRAMFIT_PROGRESS") != "1")
