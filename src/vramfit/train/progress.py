"""What a person watching a run sees between the start lines and the closing line.

In a terminal: one tqdm bar per epoch (smoothed loss and images/s, the memory in use against the
plan, the ETA of the whole run), with log lines printed above it rather than into it (tqdm's
logging redirection). Anywhere else (a job log, a pipe): a plain line every `train.log_every_steps`
steps, and at least every PIPED_SECONDS, with the same figures, as timm's train.py prints (no
`\r`: those are for a terminal). Either way each epoch leaves one line with its training loss,
validation accuracy, time and throughput. Main process only.

Never quiet for long: each setup stage says what it is doing as it begins (`stage`), and while a
stage or a step lasts a heartbeat thread keeps the screen or the log moving: the bar's clock is
redrawn every second in a terminal, and a job log gets a "still ..." line after HEARTBEAT_SECONDS
without one, so a watcher never waits 10 s for a sign of life.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time

log = logging.getLogger("vramfit")
SMOOTHING = 0.1  # weight of the newest step in the running averages (tqdm's own default is 0.3)
HEARTBEAT_SECONDS = 5.0  # the longest a job log goes without a line (half what a watcher tolerates)
PIPED_SECONDS = 5.0  # a job log's progress line at least this often, however slow the steps
STEP_GRACE_SECONDS = 2.0  # a step running this long gets a "running" line once the log is due one
TICK_SECONDS = 1.0  # how often the heartbeat looks (a terminal's bar clock moves at this pace)


class Heartbeat:
    """`beat()` every `every` seconds on a daemon thread while the block runs. Hand-written: a
    stage that is one blocking call (an import, a trace, a dataset scan, one long step) has no loop
    of its own to report from, and neither tqdm's monitor nor logging has a periodic hook."""

    def __init__(self, beat, every: float = TICK_SECONDS):
        self.beat, self.every = beat, every
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="vramfit-heartbeat")

    def _run(self) -> None:
        while not self.done.wait(self.every):
            try:
                self.beat()
            except Exception:  # noqa: BLE001 - a progress line must never stop a run
                return

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join(timeout=2 * self.every)


class Quiet:
    """How long since the last line a watcher saw; `due()` once HEARTBEAT_SECONDS passed (then
    counted from now). `clock` is injectable (tests)."""

    def __init__(self, clock=time.monotonic, every: float = HEARTBEAT_SECONDS):
        self.clock, self.every = clock, every
        self.last = clock()

    def said(self) -> None:
        self.last = self.clock()

    def due(self) -> bool:
        if self.clock() - self.last < self.every:
            return False
        self.said()
        return True


@contextlib.contextmanager
def stage(what: str, expect: str = "", main: bool = True, clock=time.monotonic, tick: float = TICK_SECONDS):
    """A setup stage a person sees: its line as it begins (`expect`: how long it should take, where
    known), a "still ..." line after every HEARTBEAT_SECONDS of silence, and its time when it was
    long enough to need one. Main process only (`main`)."""
    if not main:
        yield
        return
    t0, quiet = clock(), Quiet(clock)
    log.info("%s%s ...", what, f" ({expect})" if expect else "")

    def beat():
        if quiet.due():
            log.info("  ... still %s (%.0f s)", what, clock() - t0)

    with Heartbeat(beat, tick):
        yield
    took = clock() - t0
    if took >= HEARTBEAT_SECONDS:
        log.info("  %s: %.0f s", what, took)
# Epochs in a row whose mean train loss rose before it is remarked on: one rise is noise (an
# unfreeze, a harder augmentation), a run of them is a learning rate too high or labels wrong.
RISING_EPOCHS = 3


def memory_text(device, planned_bytes: int | None) -> str:
    """Device memory in use (allocated / reserved, against the plan's peak), or the host's on a CPU."""
    import torch  # here: the run's first line (cli._starting) comes before torch loads

    gib = 2**30
    if device.type == "cuda":
        text = f"{torch.cuda.memory_allocated(device) / gib:.1f}/{torch.cuda.memory_reserved(device) / gib:.1f} GiB"
        return text + (f" (plan {planned_bytes / gib:.1f})" if planned_bytes else "")
    import psutil

    return f"host {psutil.Process().memory_info().rss / gib:.1f} GiB"


class Progress:
    def __init__(self, main: bool, epochs: int, steps_per_epoch: int, log_every: int, device,
                 planned_bytes: int | None, first_step: int, terminal: bool | None = None, clock=time.monotonic):
        self.main, self.epochs, self.steps_per_epoch, self.log_every = main, epochs, steps_per_epoch, log_every
        self.device, self.planned = device, planned_bytes
        self.terminal = sys.stderr.isatty() if terminal is None else terminal
        self.total_steps = epochs * steps_per_epoch
        self.first_step, self.t0 = first_step, time.time()
        self.loss = self.ips = None
        self.bar = None
        self.epoch_loss = self.epoch_samples = self.epoch_seconds = 0.0
        self.clock = clock
        self.quiet = Quiet(clock, PIPED_SECONDS)  # since the last progress line in a job log
        self.at = (0, 0, clock())  # (epoch, steps done in it, when the last ended): what the heartbeat says

    @contextlib.contextmanager
    def epoch(self, epoch: int, start_step: int):
        """Around one epoch's steps: the bar (a terminal) with log lines routed above it."""
        self.epoch_loss = self.epoch_samples = self.epoch_seconds = 0.0
        self.at = (epoch, start_step, self.clock())
        if not self.main:
            yield
            return
        if not self.terminal:
            self.quiet.said()
            with Heartbeat(self.beat):
                yield
            return
        from tqdm.auto import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        self.bar = tqdm(total=self.steps_per_epoch, initial=start_step, desc=f"epoch {epoch + 1}/{self.epochs}",
                        dynamic_ncols=True, leave=False)
        try:
            with logging_redirect_tqdm(loggers=[logging.root]), Heartbeat(self.beat):  # where the console handler is
                yield
        finally:
            self.bar.close()
            self.bar = None

    def step(self, global_step: int, epoch: int, step_in_epoch: int, loss: float, samples: int, seconds: float,
             micro_batch: int) -> None:
        self.epoch_loss += loss * samples
        self.epoch_samples += samples
        self.epoch_seconds += seconds
        ips = samples / max(seconds, 1e-9)
        self.loss = loss if self.loss is None else (1 - SMOOTHING) * self.loss + SMOOTHING * loss
        self.ips = ips if self.ips is None else (1 - SMOOTHING) * self.ips + SMOOTHING * ips
        self.at = (epoch, step_in_epoch, self.clock())
        line_due = self.bar is None and (global_step % self.log_every == 0 or global_step == 1 or self.quiet.due())
        if not self.main or not (self.bar is not None or line_due):
            return
        figures = (f"loss {self.loss:.4f} | {self.ips:.0f} img/s | {memory_text(self.device, self.planned)} | "
                   f"mb {micro_batch} | ETA {_clock(self.eta(global_step))}")
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(figures, refresh=False)
        else:
            log.info("epoch %d/%d step %d/%d | %s", epoch + 1, self.epochs, step_in_epoch, self.steps_per_epoch,
                     figures)
            self.quiet.said()

    def beat(self) -> None:
        """The heartbeat within an epoch: the bar's clock redrawn (a terminal), or a line after
        PIPED_SECONDS without one (a job log: a step, or the wait for a batch, still running)."""
        bar = self.bar
        if bar is not None:
            bar.refresh()
            return
        epoch, done, since = self.at
        # A step just begun ends soon with its own line (within STEP_GRACE_SECONDS + its time).
        if self.clock() - since >= STEP_GRACE_SECONDS and self.quiet.due():
            log.info("epoch %d/%d step %d/%d running (%.0f s so far)", epoch + 1, self.epochs, done + 1,
                     self.steps_per_epoch, self.clock() - since)

    def eta(self, global_step: int) -> float:
        """Seconds to the end of the run at the pace of this launch so far."""
        done = global_step - self.first_step
        if done <= 0:
            return float("nan")
        return (time.time() - self.t0) / done * (self.total_steps - global_step)

    @property
    def epoch_train_loss(self) -> float | None:
        """The epoch's mean train loss over the steps this launch ran (None: none ran)."""
        return self.epoch_loss / self.epoch_samples if self.epoch_samples else None

    def rising_loss(self, losses: list[float]) -> None:
        """Said once a run of RISING_EPOCHS rises of the epochs' mean train loss is complete."""
        recent = losses[-(RISING_EPOCHS + 1):]
        rose = len(recent) == RISING_EPOCHS + 1 and all(b > a for a, b in zip(recent, recent[1:]))
        before = losses[-(RISING_EPOCHS + 2):-(RISING_EPOCHS + 1)]
        if self.main and rose and not (before and before[0] < recent[0]):  # once per run of rises
            log.warning("the train loss rose %d epochs in a row (%s): the run is not learning. Try a lower "
                        "--lr (vramfit lr-find suggests one), and check the data: labels that match the "
                        "images (vramfit scan-data), classes that are not empty", RISING_EPOCHS,
                        " -> ".join(f"{v:.4f}" for v in recent))

    def epoch_line(self, epoch: int, res, improved: bool, seconds: float) -> None:
        """The line each epoch leaves: training loss, validation accuracy, time, throughput."""
        if not self.main:
            return
        loss = self.epoch_train_loss
        train = f"train loss {loss:.4f}, " if loss is not None else ""
        pace = f", {self.epoch_samples / self.epoch_seconds:.0f} img/s" if self.epoch_seconds else ""
        if res.accuracy is None:
            log.warning("epoch %d/%d: %sno validation image could be read (%d unreadable): no accuracy, and this "
                        "epoch is not taken as the best; first files:\n  %s", epoch, self.epochs, train,
                        len(res.unreadable), "\n  ".join(res.unreadable[:10]))
            return
        log.info("epoch %d/%d: %sval accuracy %.4f (top5 %.4f, %d images), val loss %.4f%s | %.0f s%s", epoch,
                 self.epochs, train, res.accuracy, res.top5, res.samples, res.loss, " (best)" if improved else "",
                 seconds, pace)


def _clock(seconds: float) -> str:
    if seconds != seconds:  # nan: nothing measured yet
        return "?"
    seconds = int(seconds)
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"
