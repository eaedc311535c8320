"""The trainer's own state: where the run is, what it has seen, what it found. Saved in every
checkpoint (trainer_state.json) and restored on resume; the weights, optimizer and RNG states are
Accelerate's."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from .errors import VramfitError

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
    oom_retries: int = 0
    skipped_samples: int = 0
    epoch_skipped_samples: int = 0
    bad_files: dict[str, int] = field(default_factory=dict)
    skipped_steps: int = 0  # fp16 GradScaler skipped the update
    micro_batch: int = 0  # where the run was at the checkpoint (after any out-of-memory reductions)
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

    # What resume must not take from the checkpoint: it belongs to the new launch.
    LAUNCH_FIELDS = ("micro_batch", "phase", "world_size", "identity", "execution")

    def state_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_saved(cls, saved: dict, where: str) -> "TrainerState":
        """A checkpoint's trainer_state.json as saved (unknown keys of a newer or older version are
        ignored; missing ones keep their defaults). Without a valid data position it cannot be
        resumed: said here, before anything is loaded."""
        for key in POSITION_FIELDS:
            if not isinstance(saved.get(key), int) or isinstance(saved.get(key), bool):
                raise VramfitError(f"Checkpoint {where} has no valid `{key}`: the data position cannot be "
                                   "restored.", hint="resume from another checkpoint (--resume PATH)")
        state = cls()
        for f in fields(cls):
            if f.name in saved:
                setattr(state, f.name, saved[f.name])
        return state

    def continue_from(self, saved: "TrainerState") -> None:
        """Take everything from a checkpoint's state except what belongs to this launch."""
        for f in fields(self):
            if f.name not in self.LAUNCH_FIELDS:
                setattr(self, f.name, getattr(saved, f.name))

    def count_bad_files(self, names: list[str]) -> None:
        for name in names:
            self.bad_files[name] = self.bad_files.get(name, 0) + 1
        self.skipped_samples += len(names)
        self.epoch_skipped_samples += len(names)

    def end_epoch(self, accuracy: float | None, epochs: int) -> bool:
        """Record an evaluated epoch; True when it is the best so far (never on 0 images)."""
        self.final_accuracy = accuracy
        self.epoch, self.step_in_epoch = self.epoch + 1, 0
        self.epoch_skipped_samples = 0
        self.finished = self.epoch == epochs
        improved = accuracy is not None and (self.best_accuracy is None or accuracy > self.best_accuracy)
        if improved:
            self.best_accuracy, self.best_step = accuracy, self.global_step
        return improved
