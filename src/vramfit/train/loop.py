"""The training loop: epochs of steps, an evaluation and a checkpoint at each epoch's end.

`Trainer.fit()` reads top to bottom: for each epoch, each batch is augmented, stepped
(train.step.TrainStep), counted and logged; then the epoch is evaluated, the best weights exported and
the state saved. A stop signal is honoured at a step boundary (or undoes the step it arrives in)
and ends `fit()` with the signal number, after a checkpoint.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..errors import VramfitError
from ..runtime.collectives import agree_max, agreed, average_batchnorm, full_state_dict, world_size
from ..store import checkpoint
from ..tuning.fit import refit, table as fit_table
from ..tuning.size_plans import segment_start
from .optim import head_lr
from .progress import Progress, stage
from .step import MicroBatchExhausted, NonFiniteLoss, StepInterrupted, oom_message
from .validation import evaluate, recalibrate_batchnorm

if TYPE_CHECKING:
    from ..runtime.signals import SignalFlag
    from ..store.tracking import RunLog
    from .build import Run
    from .phases import Phase
    from .state import TrainerState

log = logging.getLogger("vramfit")


@dataclass
class Clock:
    """Training time and images (excluding evaluation and saving: images/s in the summary) and wall
    time, over every segment of a run: a resumed run starts from what its checkpoint recorded."""

    train_seconds: float = 0.0
    train_samples: int = 0
    wall_before: float = 0.0  # wall seconds of the segments before this one
    data_wait: float = 0.0
    started: float = field(default_factory=time.time)

    @classmethod
    def resumed(cls, state: TrainerState) -> "Clock":
        return cls(state.train_seconds, state.train_samples, state.wall_seconds)

    def record(self, state: TrainerState) -> None:
        state.train_seconds, state.train_samples = self.train_seconds, self.train_samples
        state.wall_seconds = self.wall_seconds

    @property
    def wall_seconds(self) -> float:
        return self.wall_before + time.time() - self.started

    @property
    def images_per_second(self) -> float | None:
        return self.train_samples / self.train_seconds if self.train_seconds else None


@dataclass
class Trainer:
    """Trains a `train.build.Run` to its last epoch, logging to `runlog` and stopping on `flag`."""

    run: Run
    runlog: RunLog
    flag: SignalFlag
    clock: Clock = None
    consecutive_skips: int = 0

    progress: Progress = None
    epoch_started: float = 0.0
    phase: Phase = None  # what trains now
    size: int | None = None  # the image size the last step trained at (None: no step yet)
    segment: tuple | None = None  # (phase name, first size) of the fit segment it is in (tuning.size_plans)
    # The main process's failed write of the record (a full disk, a removed run folder), told to the
    # others at the next point all processes meet (the next step's vote, or the epoch's end).
    unwritten: Exception | None = None

    def __post_init__(self):
        from .phases import phase_at

        self.clock = Clock.resumed(self.state)
        self.phase = phase_at(self.run.phases, self.state.epoch)  # train.build.build_training entered it
        self.progress = Progress(self.L.main, self.cfg.train.epochs, len(self.loaders.sampler),
                                 self.cfg.train.log_every_steps, self.L.acc.device, self.run.plan.predicted_peak_bytes,
                                 first_step=self.state.global_step)

    # What the loop reads of its run, by the names it uses.
    cfg = property(lambda self: self.run.cfg)
    L = property(lambda self: self.run.launch)
    model = property(lambda self: self.run.model)
    optimizer = property(lambda self: self.run.optimizer)
    ema = property(lambda self: self.run.ema)
    step = property(lambda self: self.run.step)
    state = property(lambda self: self.run.state)
    loaders = property(lambda self: self.run.loaders)
    splits = property(lambda self: self.run.splits)
    faults = property(lambda self: self.run.faults)
    ckpt_dir = property(lambda self: self.run.paths.checkpoints)

    def fit(self) -> int:
        """Train to the last epoch; returns the stop signal's number, 0 when training completed."""
        self.model.train()
        for epoch in range(self.state.epoch, self.cfg.train.epochs):
            start = self.state.step_in_epoch if epoch == self.state.epoch else 0
            self.loaders.sampler.set_epoch(epoch, start)
            self.state.epoch = epoch
            signum = self.train_epoch(epoch) or self.end_epoch(epoch)
            if signum:
                return signum
        return 0

    def settle(self, epoch: int) -> float:
        """Before each step: staged fine-tuning (at a phase's first step, train what it trains) and
        progressive resizing (the step's image size), each at its own plan's micro-batch. Within a
        fit segment a growing size never raises the micro-batch an out-of-memory retry lowered.
        Returns the seconds a fit's measurement took (not the step's time: it is kept out of the
        images/s and the ETA)."""
        from .phases import enter, phase_at

        phase, size = phase_at(self.run.phases, epoch), self.run.sizes.size_at(self.state.global_step)
        if (phase, size) == (self.phase, self.size):
            return 0.0
        if self.L.device_type == "cuda" and self.size is not None:  # the segment that ends: its measured peak
            self.run.phase_peaks[(self.phase.name, self.size)] = torch.cuda.max_memory_reserved(self.L.acc.device)
            torch.cuda.reset_peak_memory_stats(self.L.acc.device)
        new_phase, fitted = phase != self.phase, None
        if new_phase:
            enter(self.L.acc.unwrap_model(self.model), phase, self.phase)
            self.model.train()
        segment = (phase.name, segment_start(self.run, phase.name, size))
        if segment != self.segment:
            # train.fit: fastest measures this segment's micro-batch (no further candidate after a signal)
            fitted = refit(self.run, phase, self.run.fit, size, stop=lambda: self.flag.signum)
            self.segment = segment
        plan = self.run.phase_plan(phase, size)
        first, before = self.size is None, self.step.state.micro_batch
        # else a growing size keeps a micro-batch an out-of-memory retry lowered (batching.InEffect)
        micro = self.step.state.enter(plan.micro.size, fresh=first or new_phase or fitted is not None)
        said = not first and (new_phase or micro != before or self.run.sizes.on)
        self.step.retarget(plan.min_micro_batch)
        self.progress.planned = plan.predicted_peak_bytes
        self.phase, self.size = phase, size
        if said and self.L.main:
            self.say_segment(epoch, plan, micro, new_phase)
        if fitted is not None and self.L.main:
            log.info("%s", fit_table(fitted, named=len(self.run.phases) > 1, sized=self.run.sizes.on))
        return fitted.probe_seconds if fitted is not None else 0.0

    def say_segment(self, epoch: int, plan, micro: int, new_phase: bool) -> None:
        from .build import phase_line

        if new_phase:
            log.info("epoch %d: now training %s", epoch + 1, phase_line(self.cfg, plan))
        if self.run.sizes.on:
            log.info("global step %d: now at %d px, micro-batch %d", self.state.global_step + 1, self.size, micro)

    # ------------------------------------------------------------------------------ one epoch
    def train_epoch(self, epoch: int) -> int:
        self.epoch_started = time.time()
        batches = iter(self.loaders.train)
        t_wait = time.time()
        with self.progress.epoch(epoch, self.state.step_in_epoch):
            while True:
                try:
                    batch = next(batches)
                except StopIteration:
                    return 0
                except Exception as e:  # noqa: BLE001 - the others must not wait in this step's vote
                    self.step.fail_together(e)
                if self.unwritten is not None:
                    self.step.fail_together(self.unwritten)
                t_got = time.time()
                self.clock.data_wait += t_got - t_wait
                signum = self.train_one(batch, epoch, t_wait)
                if signum:
                    return signum
                t_wait = time.time()

    def train_one(self, batch, epoch: int, t_wait: float) -> int:
        st, cfg = self.state, self.cfg
        checked = self.size
        probing = self.settle(epoch)
        if st.global_step == 0 or st.step_in_epoch == 0 or self.size != checked:
            from ..data import check_batch_shape

            check_batch_shape(batch.images, self.size)
        images, labels = self.run.augment(self.loaders.normalize(batch.images),
                                      batch.labels.to(self.L.acc.device, non_blocking=True), epoch,
                                      st.step_in_epoch, jitter=batch.jitter)
        lr = head_lr(self.optimizer)  # the LR this step uses (the head's; logged as such)
        changes = len(self.step.state.history)
        try:
            res = self.step(images, labels, batch.step_samples, bad_files=len(batch.bad),
                            stop_requested=self.faults.in_step(self.flag, st.global_step + 1),
                            loss_fn=self.faults.loss_fn(st.global_step + 1))
        except StepInterrupted as e:
            # Undone on every process: save the last completed step; a resume redoes this one.
            return self.stop(e.signum, f"during global step {st.global_step + 1}: the step was undone "
                                       "between micro-batches")
        except MicroBatchExhausted:
            self.dump_memory()
            raise oom_message(self.run.plan_text(), self.step.min_micro_batch) from None
        except NonFiniteLoss as e:
            raise self.nonfinite_error(e, batch) from None
        self.say_changes(changes)
        self.count(res, batch)
        if self.ema is not None:
            self.ema.update(self.L.acc.unwrap_model(self.model), step=st.global_step + 1)
        st.global_step += 1
        st.step_in_epoch += 1
        st.samples_seen += res.samples
        self.run.scheduler.step_update(num_updates=st.global_step)
        self.clock.train_samples += res.samples
        seconds = time.time() - t_wait - probing  # data wait and step
        self.clock.train_seconds += seconds  # before the report reads it
        self.report(res, epoch, lr)
        self.progress.step(st.global_step, epoch, st.step_in_epoch, res.loss, res.samples, seconds,
                           self.step.state.micro_batch)
        self.faults.after_step(self.flag, st.global_step)
        if res.signum:
            return self.stop(res.signum, f"after global step {st.global_step}")
        every = cfg.checkpoint.every_steps
        if every and st.global_step % every == 0:
            self.save()
        return 0

    def count(self, res, batch) -> None:
        """Unreadable files (every process counts every process's, so all stop together above the
        limit; counted once the step is done, so an undone step is not counted twice) and fp16
        skipped steps."""
        st = self.state
        if res.bad_files:
            names = _gather_names(batch.bad)
            st.count_bad_files(names)
            if self.L.main:
                for name in names:
                    log.warning("unreadable image replaced: %s", name)
            _check_bad_fraction(st.bad_files, len(self.splits.train), self.cfg.data.max_bad_fraction)
        st.skipped_steps += int(res.skipped)
        self.consecutive_skips = self.consecutive_skips + 1 if res.skipped else 0
        if self.consecutive_skips >= self.cfg.train.max_consecutive_skipped_steps:
            raise VramfitError(
                f"fp16: {self.consecutive_skips} optimizer steps in a row were skipped for inf/NaN "
                f"gradients (global step {st.global_step}): the run has diverged.",
                hint="use --precision bf16 (no loss scaling) or lower --lr; resume from the last "
                     f"checkpoint in {self.ckpt_dir}", exit_code=4)

    def say_changes(self, before: int) -> None:
        """An out-of-memory retry or a micro-batch change, said the moment it happened."""
        if not self.L.main:
            return
        at = f" ({self.size} px)" if self.run.sizes.on else ""
        for change in self.step.state.history[before:]:
            log.warning("%s at micro-batch %d%s: global step %d ran again at micro-batch %d, as every step will "
                        "from here on (same batch, same maths)", change["why"], change["from"], at,
                        self.state.global_step + 1, change["to"])

    def report(self, res, epoch: int, lr: float) -> None:
        st, mb = self.state, self.step.state.micro_batch
        if st.global_step % self.cfg.train.log_every_steps and st.global_step != 1:
            return
        record = {"kind": "train", "epoch": epoch, "loss": res.loss,
                  "accuracy": res.correct / res.samples, "lr": lr, "grad_norm": res.grad_norm,
                  "micro_batch": mb, "image_size": self.size, "oom_retries": self.step.state.oom_retries,
                  "images_per_second": self.clock.images_per_second or 0.0,
                  "data_wait_fraction": self.clock.data_wait / max(self.clock.train_seconds, 1e-9),
                  **_memory_figures(self.L.acc.device)}
        try:
            self.runlog.log(record, st.global_step)
        except Exception as e:  # noqa: BLE001 - only the main process writes: the others are told, not left
            if world_size() == 1:
                raise
            self.unwritten = e

    # ------------------------------------------------------------------------------ epoch end
    def end_epoch(self, epoch: int) -> int:
        t0 = time.time()
        with agreed("writing the run's record", self.L.acc.device):
            if self.unwritten is not None:
                raise self.unwritten
        average_batchnorm(self.model)
        if self.ema is not None:  # its BatchNorm statistics follow each process's own: one model
            average_batchnorm(self.ema.module)
        eval_model = self.ema.module if self.ema is not None else self.model
        try:
            with stage(f"epoch {epoch + 1}/{self.cfg.train.epochs}: validating ({len(self.splits.val)} images)",
                       main=self.L.main):
                res = self._validate(eval_model, epoch)
        except StepInterrupted as e:
            # The epoch's steps are done and saved as such: a resume goes straight to evaluation.
            return self.stop(e.signum, f"during the evaluation of epoch {epoch + 1}: saving the trained state")
        return self._after_validation(epoch, eval_model, res, t0)

    def _validate(self, eval_model, epoch: int):
        self.precise_statistics(eval_model, epoch)
        return evaluate(self.L.acc, eval_model, self.loaders.val, len(self.splits.class_names),
                        self.loaders.normalize, self.run.eval_state,
                        stop_requested=self.faults.in_eval(self.flag, epoch + 1),
                        keep_logits=self.runlog.use_trackers, maths=self.step.maths)

    def _after_validation(self, epoch: int, eval_model, res, t0: float) -> int:
        st = self.state
        skipped = st.epoch_skipped_samples
        improved = st.end_epoch(res.accuracy, self.cfg.train.epochs, res.unreadable,
                                self.progress.epoch_train_loss)
        if improved:
            self.export_best(eval_model)
        self.runlog.log({"kind": "eval", "epoch": epoch + 1, "val_loss": res.loss, "val_accuracy": res.accuracy,
                         "val_top5": res.top5, "val_samples": res.samples, "val_unreadable": len(res.unreadable),
                         "skipped_samples": skipped, "epoch_seconds": time.time() - t0}, st.global_step)
        if self.runlog.use_trackers and res.logits is not None:
            from ..store.tracking import dataset_images, log_evaluation

            log_evaluation(self.L.acc, res.logits, res.labels, self.splits.class_names, st.global_step,
                           indices=res.indices, load_image=dataset_images(self.splits.val, self.splits.image_column))
        self.progress.epoch_line(epoch + 1, res, improved, time.time() - (self.epoch_started or t0))
        self.progress.rising_loss(st.epoch_losses)
        self.save()
        signum = agree_max(self.flag.signum, self.L.acc.device)
        return self.stop(signum, "at the end of an epoch", save=False) if signum else 0

    def precise_statistics(self, eval_model, epoch: int) -> None:
        """model.precise_bn: the evaluated model's BatchNorm statistics recomputed over its train
        images, then one average over processes (validation.recalibrate_batchnorm)."""
        if not self.cfg.model.precise_bn:
            return
        recalibrate_batchnorm(self.L.acc, eval_model, self.loaders.statistics, self.loaders.normalize,
                              self.run.eval_state, seed=self.cfg.train.seed * 100_003 + epoch,
                              stop_requested=self.faults.in_eval(self.flag, epoch + 1))
        average_batchnorm(eval_model)

    def export_best(self, eval_model) -> None:
        """model/: the best weights, timm-loadable. Sharded (FSDP) parameters are gathered into a
        full state dict on every process, and written by one."""
        from ..models.create import export
        from ..runtime.storage import atomic_folder, tensor_bytes
        from .step import is_fsdp

        module = self.L.acc.unwrap_model(eval_model)
        full = full_state_dict(eval_model) if is_fsdp(eval_model) else None
        with agreed("exporting the best model", self.L.acc.device):
            if self.L.main:
                if full is not None:
                    module = _full_copy(self.cfg, len(self.splits.class_names), full)
                with atomic_folder(self.run.paths.model, "the best model", tensor_bytes(module)) as folder:
                    export(module, folder, self.splits.class_names, self.run.data_cfg)

    # ------------------------------------------------------------------------------ saving, stopping
    def save(self) -> None:
        """A checkpoint of the last completed step. Each process also keeps its own BatchNorm
        statistics (live and EMA; they follow its own batches between evaluations), so a resumed
        run continues exactly where every process was, and saving changes nothing in the run."""
        st = self.state
        self.clock.record(st)
        st.phase = self.phase.name
        keep = (st.best_step,) if st.best_step is not None else ()
        extra = {"ema": self.ema.module.state_dict()} if self.ema is not None else {}
        local = local_buffers(self.model, self.ema) if world_size() > 1 else None
        checkpoint.save(self.L.acc, self.ckpt_dir, st.global_step, st.state_dict(),
                        self.cfg.checkpoint.keep_last, keep, extra, local)

    def stop(self, signum: int, where: str, save: bool = True) -> int:
        import signal

        signum = signum or int(signal.SIGTERM)
        if self.L.main:
            log.warning("signal %d %s", signum, where)
        if save:
            self.save()
        return signum

    def nonfinite_error(self, e, batch) -> VramfitError:
        st, last = self.state, checkpoint.latest(self.ckpt_dir)
        ids = batch.indices.tolist()
        return VramfitError(
            f"Non-finite {e.what} ({e.value}) at global step {st.global_step + 1} (epoch "
            f"{st.epoch_number}); the update was not applied. Sample ids of this process's batch: {ids[:64]}"
            f"{' ...' if len(ids) > 64 else ''}. Last good checkpoint: {last or 'none'}.",
            hint="lower --lr, keep clip_grad_norm on, or try --precision bf16 / no; resume from the "
                 "checkpoint with --resume auto", exit_code=4)

    def dump_memory(self) -> None:
        if self.L.main and torch.cuda.is_available():
            from ..runtime.storage import write_text

            write_text(self.run.paths.memory_summary, torch.cuda.memory_summary(self.L.acc.device),
                       "the memory summary")


def local_buffers(model, ema) -> dict:
    """This process's buffers of the live model and of its EMA, by name."""
    out = {f"model.{k}": v for k, v in model.named_buffers()}
    if ema is not None:
        out.update({f"ema.{k}": v for k, v in ema.module.named_buffers()})
    return out


def _gather_names(bad: list[str]) -> list[str]:
    """This step's unreadable train files from every process (only called when there are some)."""
    if world_size() == 1:
        return list(bad)
    from accelerate.utils import gather_object

    return gather_object(list(bad))


def _check_bad_fraction(bad: dict, n: int, limit: float) -> None:
    if len(bad) > limit * n:
        files = "\n  ".join(sorted(bad)[:50])
        raise VramfitError(
            f"{len(bad)} unreadable images out of {n} (more than data.max_bad_fraction={limit:.1%}):\n  {files}",
            hint="fix or remove these files (`vramfit scan-data --data SRC` lists all), or raise "
                 "--set data.max_bad_fraction=...")


def _full_copy(cfg, num_classes: int, state_dict: dict):
    from ..models.create import create_model

    module = create_model(cfg.model, num_classes, load_weights=False, image_size=cfg.data.image_size,
                          any_size=cfg.data.progressive_resize is not None)
    module.load_state_dict(state_dict)
    return module


def _memory_figures(device) -> dict:
    import psutil

    out = {"host_rss_bytes": psutil.Process().memory_info().rss}
    if device.type == "cuda":
        out.update(mem_allocated_bytes=torch.cuda.memory_allocated(device),
                   mem_reserved_bytes=torch.cuda.memory_reserved(device),
                   mem_peak_bytes=torch.cuda.max_memory_reserved(device))
    return out
