"""The trainer's own state: where the run is, what it has seen, what it found. Saved in every
checkpoint (trainer_state.json) and restored on resume; the weights, optimizer and RNG states are
Accelerate's."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from ..batching import InEffect
from ..errors import VramfitError

# Where the data position is: a checkpoint without them cannot be resumed.
POSITION_FIELDS = ("epoch", "step_in_epoch", "global_step")


@dataclass
class TrainerState:
    global_step: int = 0
    epoch: int = 0  # epochs completed (the one in progress while training)
    step_in_epoch: int = 0
    samples_seen: int = 0
    best_accuracy: float | None = None
    best_step: int | None = None
    final_accuracy: float | None = None
    skipped_samples: int = 0
    epoch_skipped_samples: int = 0
    bad_files: dict[str, int] = field(default_factory=dict)  # train images replaced, by name
    # Validation images the last evaluation could not read (left out of its accuracy): the two
    # splits are counted apart, so summary.json never says "none" while validation dropped some.
    val_unreadable: list[str] = field(default_factory=list)
    epoch_losses: list[float] = field(default_factory=list)  # mean train loss of each finished epoch
    skipped_steps: int = 0  # fp16 GradScaler skipped the update
    # The run's micro-batch in effect (the step's own object): saved as `micro_batch` (where the run
    # was at the checkpoint, after any out-of-memory reductions) and `oom_retries`.
    in_effect: InEffect = field(default_factory=lambda: InEffect(0))
    phase: str = "all"  # the phase that micro-batch belongs to (phases.Phase.name)
    class_names: list[str] = field(default_factory=list)
    world_size: int | None = None  # the processes that wrote it (None: a checkpoint that did not say)
    global_batch: int = 0
    finished: bool = False
    # The launch's identity (resume.Identity): what a resume must share, and how it ran.
    identity: dict = field(default_factory=dict)
    execution: dict = field(default_factory=dict)
    # Changes of the identity a resume was allowed (allow_resume_change): {"step", "settings": {key: [old, new]}}.
    resume_changes: list[dict] = field(default_factory=list)
    wandb_run_id: str | None = None  # a resumed run appends to the same W&B run
    train_seconds: float = 0.0  # over every segment of the run, as of the checkpoint
    train_samples: int = 0
    wall_seconds: float = 0.0
    fit: dict = field(default_factory=dict)  # train.fit's choice (fit.FitResult.as_dict): a resume keeps it

    # What resume must not take from the checkpoint: it belongs to the new launch (of the micro-batch
    # in effect, only the run's count of out-of-memory retries carries over).
    LAUNCH_FIELDS = ("in_effect", "phase", "world_size", "identity", "execution")

    micro_batch = property(lambda self: self.in_effect.micro_batch)
    # The one epoch number a person reads (progress lines, the resume line, errors): counted from
    # 1, the epoch in progress, or the next one at an epoch's end; `epoch` counts those finished.
    epoch_number = property(lambda self: self.epoch + 1)
    oom_retries = property(lambda self: self.in_effect.oom_retries)

    def state_dict(self) -> dict:
        out = asdict(self)
        del out["in_effect"]
        return {**out, "micro_batch": self.micro_batch, "oom_retries": self.oom_retries}

    @classmethod
    def from_saved(cls, saved: dict, where: str) -> "TrainerState":
        """A checkpoint's trainer_state.json as saved (unknown keys of a newer or older version are
        ignored; missing ones keep their defaults). Without a valid data position it cannot be
        resumed: said here, before anything is loaded."""
        for key in POSITION_FIELDS:
            if not isinstance(saved.get(key), int) or isinstance(saved.get(key), bool):
                raise VramfitError(f"Checkpoint {where} has no valid `{key}`: the data position cannot be "
                                   "restored.", hint="resume from another checkpoint (--resume PATH)")
        state = cls(in_effect=InEffect(saved.get("micro_batch", 0), saved.get("oom_retries", 0)))
        for f in fields(cls):
            if f.name in saved:
                setattr(state, f.name, saved[f.name])
        return state

    def continue_from(self, saved: "TrainerState") -> None:
        """Take everything from a checkpoint's state except what belongs to this launch."""
        for f in fields(self):
            if f.name not in self.LAUNCH_FIELDS:
                setattr(self, f.name, getattr(saved, f.name))
        self.in_effect.oom_retries = saved.oom_retries

    def count_bad_files(self, names: list[str]) -> None:
        for name in names:
            self.bad_files[name] = self.bad_files.get(name, 0) + 1
        self.skipped_samples += len(names)
        self.epoch_skipped_samples += len(names)

    def end_epoch(self, accuracy: float | None, epochs: int, val_unreadable: list[str] = (),
                  train_loss: float | None = None) -> bool:
        """Record an evaluated epoch; True when it is the best so far (never on 0 images)."""
        self.final_accuracy = accuracy
        self.val_unreadable = sorted(val_unreadable)
        if train_loss is not None:
            self.epoch_losses.append(train_loss)
        self.epoch, self.step_in_epoch = self.epoch + 1, 0
        self.epoch_skipped_samples = 0
        self.finished = self.epoch == epochs
        improved = accuracy is not None and (self.best_accuracy is None or accuracy > self.best_accuracy)
        if improved:
            self.best_accuracy, self.best_step = accuracy, self.global_step
        return improved
