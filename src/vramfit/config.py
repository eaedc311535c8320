"""Typed run configuration: defaults < recipe YAML < `--set key=value` < explicit flags.

Every section rejects unknown keys and suggests the closest valid one, so a typo such as
`train.global_bacth` fails before anything starts instead of silently training with a default.
"""

from __future__ import annotations

import difflib
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import VramfitError

# The recipes vramfit ships, as package data: there after `pip install` from a wheel too.
PACKAGE_RECIPES = Path(__file__).resolve().parent / "recipes"

# Other names of a precision: `no` is Accelerate's name for fp32, `32` Lightning's; YAML reads a
# bare `no` (`precision: no`, `--set train.precision=no`) as false.
_PRECISION_ALIASES = {"no": "fp32", "32": "fp32", "false": "fp32"}


def normalize_precision(value):
    """The one name of a precision (`no` and `32` are fp32); anything else is left to validation."""
    return _PRECISION_ALIASES.get(str(value).lower(), value) if isinstance(value, (str, int)) else value


class Refused(ValueError):
    """A value check's refusal: the message says what is wrong and the limit, `hint` how to fix it
    (the CLI's HINT line; see `_explain`)."""

    def __init__(self, message: str, hint: str):
        super().__init__(message)
        self.hint = hint


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(Section):
    name: str = "resnet18"
    pretrained: bool = False
    pretrained_path: str | None = None
    grad_checkpointing: bool = False
    channels_last: bool = False
    drop_rate: float = Field(0.0, ge=0.0, lt=1.0)
    drop_path_rate: float = Field(0.0, ge=0.0, lt=1.0)
    # BatchNorm policy: `train` normalises each micro-batch by its own statistics and updates the
    # running ones; `freeze` keeps every statistic and affine fixed (timm's FrozenBatchNorm2d), which
    # also makes every batch split give the same maths; `sync` computes the statistics over the
    # micro-batches of all processes (SyncBatchNorm; one process: as `train`).
    bn: Literal["train", "freeze", "sync"] = "train"
    # Running-statistics momentum of every BatchNorm (None: the model's own, 0.1 in timm).
    bn_momentum: float | None = Field(None, gt=0.0, le=1.0)
    # `step`: a step split into k micro-batches updates the running statistics with a k-th root
    # momentum, so they move per step as with the whole batch in one forward
    # (freezing.StatisticsHorizon); `micro_batch`: the momentum as set, once per forward.
    bn_momentum_per: Literal["step", "micro_batch"] = "step"
    # Names (prefixes) of modules or parameters to freeze for the whole run, e.g. ["conv1", "bn1",
    # "layer1"]: not trained, and their BatchNorm keeps its statistics (eval mode).
    freeze: list[str] = Field(default_factory=list)
    # Precise BatchNorm: at the end of every epoch, before evaluating, every BatchNorm's running
    # statistics are recomputed as an equal-weight average over this many train images (a fixed
    # subset, the validation transform; 0: off), so evaluation and the exported model normalise by
    # statistics of the final weights rather than a momentum average of small micro-batches.
    precise_bn: int = Field(0, ge=0)

    @field_validator("precise_bn", mode="before")
    @classmethod
    def _precise_bn_count(cls, v):
        if isinstance(v, bool) or isinstance(v, str) and v.strip().lower() in ("true", "false", "yes", "no", "on", "off"):
            # `true` would read as 1: statistics of a single image, which wreck every BatchNorm
            raise Refused(f"model.precise_bn takes a number of train images (0: off), not {v!r}",
                          hint="give a count, e.g. --set model.precise_bn=2048 (or 0 for off)")
        return v
    # Exponential moving average of the weights (timm ModelEmaV3, with decay warmup); evaluated and
    # exported instead of the raw weights when set. Typical: 0.999 for fine-tuning.
    ema_decay: float | None = Field(None, gt=0.0, lt=1.0)

    @property
    def loads_weights(self) -> bool:
        """Whether the model starts from trained weights (the Hub's or model.pretrained_path)."""
        return self.pretrained or self.pretrained_path is not None


class ProgressiveResize(Section):
    """Progressive resizing, with Composer's names and defaults: the first `delay_fraction` of the
    steps train at `initial_scale` x data.image_size, the size then grows linearly (in steps of
    `size_increment` px) to the full size, reached when `finetune_fraction` of the steps is left.
    Setting any one key turns it on with the others at their defaults (data.progressive.Schedule)."""

    initial_scale: float = Field(0.5, gt=0.0, le=1.0)
    delay_fraction: float = Field(0.5, ge=0.0, le=1.0)
    finetune_fraction: float = Field(0.2, ge=0.0, le=1.0)
    size_increment: int = Field(4, ge=1, le=256)

    @model_validator(mode="after")
    def _fractions(self):
        if self.delay_fraction + self.finetune_fraction > 1.0:
            total = self.delay_fraction + self.finetune_fraction
            raise Refused(f"delay_fraction + finetune_fraction is {total:g}, "
                          "over 1: they are the shares of the steps before the ramp and after it",
                          hint="lower one of them so that the two add up to 1 at most, e.g. --set "
                               "data.progressive_resize.delay_fraction=0.5 --set "
                               "data.progressive_resize.finetune_fraction=0.2")
        return self


class DataConfig(Section):
    # `digits` (built in), a local folder, a saved dataset / parquet path, or a Hub dataset id.
    source: str = "digits"
    config: str | None = None
    train_split: str | None = None
    val_split: str | None = None
    val_fraction: float = Field(0.1, gt=0.0, lt=1.0)
    # Seeds the validation hold-out and the limit_* subsets; never the run seed, so every run of a
    # seed sweep is validated on the same images.
    split_seed: int = Field(0, ge=0)
    image_column: str | None = None
    label_column: str | None = None
    trust_remote_code: bool = False
    image_size: int = Field(224, ge=8, le=2048)
    # Train augmentation (timm create_transform arguments).
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    hflip: float = Field(0.5, ge=0.0, le=1.0)
    auto_augment: str | None = None
    color_jitter: float = Field(0.4, ge=0.0)  # timm's default; 0: off
    # Where it runs (data.loader.color_jitter_on): auto = on the device when training on an
    # accelerator (vramfit.data.augment, batched), in the loader workers (timm's, PIL) on the CPU.
    color_jitter_on: Literal["auto", "loader", "device"] = "auto"
    # On-device batch augmentation (vramfit.data.augment, timm RandomErasing / Mixup): erasing
    # probability per sample; mixup and cutmix Beta alphas (0: off); chance a batch is mixed at all;
    # chance a mixed batch uses cutmix when both are on.
    reprob: float = Field(0.0, ge=0.0, le=1.0)
    mixup: float = Field(0.0, ge=0.0)
    cutmix: float = Field(0.0, ge=0.0)
    mixup_prob: float = Field(1.0, ge=0.0, le=1.0)
    mixup_switch_prob: float = Field(0.5, ge=0.0, le=1.0)
    crop_pct: float | None = Field(None, gt=0.0, le=1.0)
    num_workers: int | Literal["auto"] = "auto"
    max_bad_fraction: float = Field(0.01, ge=0.0, le=1.0)
    cache_dir: str | None = None
    # Train/evaluate on a seeded random subset of this many images (smoke tests, quick sweeps).
    limit_train_samples: int | None = Field(None, ge=1)
    limit_val_samples: int | None = Field(None, ge=1)
    # Train at smaller sizes early (ProgressiveResize; `true` or `{}`: Composer's defaults);
    # evaluation stays at image_size. None: off.
    progressive_resize: ProgressiveResize | None = None
    # Tar shards (data.shards): locations (not images: ~50 bytes each) in the shuffle buffers of
    # the partitions together (each holds shuffle_buffer // shard_partitions; a process, those of
    # its partitions). Larger mixes samples across more shards; it changes the order, so the run.
    shuffle_buffer: int = Field(16384, ge=1)
    # Parquet / arrow files or a Hub dataset read in place (data.tables) in the tar shards' order
    # (shuffle_buffer) instead of loaded whole; a source without a validation split is refused. It
    # changes the order of the samples, so the run.
    streaming: bool = False
    # Tar shards: the fixed partitions of each epoch's order (data.shards), shared out over the
    # processes, so the order is the same at every process count that divides it. 8: one to eight
    # processes, a few shards open per process; a run on more (several machines) sets a multiple of
    # its process count (64 for 2-8 machines of 8). It changes the order, so the run.
    shard_partitions: int = Field(8, ge=1)
    # Seconds a loader worker may take over one batch before the run says the stream stalled
    # (a hung network file system) instead of waiting for ever.
    read_timeout_s: float = Field(600.0, gt=0.0)
    # Parquet streamed (data.tables): MiB of decoded row groups each loader worker (and the main
    # process) keeps. It should hold a process's window of the shuffle buffer (a start note says
    # when the files' footers say it does not); it changes reads and host memory, never the order.
    table_cache_mb: int = Field(256, ge=1)

    @field_validator("progressive_resize", mode="before")
    @classmethod
    def _resize_switch(cls, v):
        if isinstance(v, bool):  # `--set data.progressive_resize=true`: every default
            return {} if v else None
        return v

    @field_validator("num_workers")
    @classmethod
    def _workers(cls, v):
        if isinstance(v, int) and not 0 <= v <= 64:
            raise Refused(f"data.num_workers takes `auto` or a whole number from 0 to 64, not {v}",
                          hint="e.g. --workers auto (sized to the cores) or --workers 4 (0: load in the "
                               "training process)")
        return v


class TrainConfig(Section):
    epochs: int = Field(10, ge=1)
    # Samples per optimizer step across all processes. Fixed by the recipe; everything else derives.
    global_batch: int = Field(64, ge=1)
    micro_batch: int | Literal["auto"] | None = None
    eval_batch: int | None = Field(None, ge=1)
    # fp32 (`no`, Accelerate's name, is accepted too), bf16 or fp16 autocast; `auto`: bf16 where the
    # GPU has it (with `fit: fastest`, whichever of bf16 and fp16 measures faster), else fp16; fp32
    # on a CPU.
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    label_smoothing: float = Field(0.1, ge=0.0, lt=1.0)
    clip_grad_norm: float | None = Field(1.0, gt=0.0)
    seed: int = Field(0, ge=0)
    log_every_steps: int = Field(10, ge=1)
    # CUDA: let cuDNN time its convolution algorithms for each input shape and keep the fastest
    # (input shapes are fixed here, so it pays off after the first step; as timm's train.py does).
    cudnn_benchmark: bool = True
    # torch.compile the model once the micro-batch is settled (its first steps then pay the
    # compilation: worth it on long GPU runs, rarely on short CPU ones). `auto`: `train.fit:
    # fastest` measures it against eager where the probe budget pays for a compilation (tuning/fit.py);
    # off otherwise.
    compile: bool | Literal["auto"] = False
    # fp16 only: this many GradScaler-skipped steps in a row means the run diverged; stop.
    max_consecutive_skipped_steps: int = Field(25, ge=1)
    # Staged fine-tuning: the first N epochs train only the classifier head (the rest frozen, its
    # BatchNorm statistics fixed), then the whole network less model.freeze. 0: off.
    freeze_epochs: int = Field(0, ge=0)
    # How the execution settings that leave the maths unchanged (micro-batch, channels_last,
    # gradient checkpointing) are chosen: `largest` runs the largest micro-batch that fits with the
    # settings as written; `fastest` measures the candidates that fit on the run's own first
    # batches, with no update, and keeps the fastest (tuning/fit.py).
    fit: Literal["fastest", "largest"] = "largest"
    # `fit: fastest`: the share of the run's expected wall time its probe may take.
    fit_probe_fraction: float = Field(0.03, gt=0.0, le=1.0)

    @field_validator("precision", mode="before")
    @classmethod
    def _precision_name(cls, v):
        return normalize_precision(v)

    @field_validator("micro_batch")
    @classmethod
    def _positive(cls, v):
        if isinstance(v, int) and v < 1:
            raise Refused(f"micro_batch must be >= 1 (or `auto`), not {v}",
                          hint="e.g. --micro-batch auto (the largest that fits) or --micro-batch 16")
        return v


class OptimConfig(Section):
    name: Literal["adamw", "sgd"] = "adamw"
    lr: float = Field(1e-3, gt=0.0)
    # The global batch `lr` is stated at: the run's LR follows its global batch (optim.scaled_lr:
    # sqrt for AdamW, linear for SGD); None: `lr` as given at any batch.
    lr_base_batch: int | None = Field(None, ge=1)
    weight_decay: float = Field(0.05, ge=0.0)
    momentum: float = Field(0.9, ge=0.0, lt=1.0)
    betas: tuple[float, float] = (0.9, 0.999)
    schedule: Literal["cosine", "constant"] = "cosine"
    warmup_epochs: float = Field(1.0, ge=0.0)
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)
    # Per-layer LR multipliers (timm's param_groups_layer_decay): the head at the full LR, each
    # earlier layer group times this. None: one LR for the whole network.
    layer_decay: float | None = Field(None, gt=0.0, le=1.0)
    # train.freeze_epochs: the parameters that start training at the unfreeze ramp up to the
    # schedule's LR over this many epochs (the head continues its schedule unchanged).
    unfreeze_warmup_epochs: float = Field(0.5, ge=0.0)


class CheckpointConfig(Section):
    every_steps: int = Field(0, ge=0)  # 0: only at epoch ends
    keep_last: int = Field(2, ge=1)


class TrackingConfig(Section):
    # Accelerate trackers: W&B, TensorBoard (written to <run>/tensorboard/), or both.
    tracker: Literal["none", "wandb", "tensorboard", "wandb,tensorboard", "tensorboard,wandb"] = "none"
    project: str = "vramfit"
    entity: str | None = None


class HardwareConfig(Section):
    """The card a recipe targets; the planner checks the recipe fits it."""

    name: str | None = None
    memory_gib: float | None = Field(None, gt=0)  # per card
    gpus: int = Field(1, ge=1)  # cards the recipe is written for (`vramfit plan` plans per card)
    # The smallest (>= 0.05) that keeps the default pick below every public out-of-memory batch
    # (bench/published.py); the margin-0 peak is the planner's best estimate.
    safety_margin: float = Field(0.05, ge=0.0, lt=1.0)
    # Train a recipe written for a GPU (memory_gib set) on a machine where torch sees none.
    allow_cpu: bool = False


class DebugConfig(Section):
    # Any forward with more than N samples raises torch.OutOfMemoryError (tests the OOM path on CPU).
    simulate_oom_above: int | None = None
    # With simulate_oom_above: the process that ran out of memory runs out once more inside the
    # recovery, while the failed step's gradient sums go out (the other processes must not wait).
    simulate_oom_in_recovery: bool = False
    # Make the loss NaN at this global step (tests that the update is refused before it happens).
    nan_at_step: int | None = None
    # Only this process rank injects the faults above (None: every rank): ranks must still agree.
    fault_rank: int | None = None
    # Behave as if SIGTERM arrived right after this global step (tests interruption and resume).
    signal_at_step: int | None = None
    # SIGKILL this process right after this global step, in the first attempt of a torchrun job only
    # (TORCHELASTIC_RESTART_COUNT 0): a machine lost mid-epoch, for the elastic-restart test.
    kill_at_step: int | None = None
    # Behave as if SIGTERM arrived inside this global step, before its second micro-batch.
    signal_in_step: int | None = None
    # Behave as if SIGTERM arrived during the evaluation after this epoch (1-based), before its 2nd batch.
    signal_in_eval: int | None = None
    # Run `train.precision: fp16` on a CPU as a GPU would (fp16 autocast and GradScaler loss
    # scaling), instead of in fp32: lets the fp16 recipes' own path run end to end without a GPU.
    fp16_on_cpu: bool = False


class Config(Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    hardware: HardwareConfig = Field(default_factory=HardwareConfig)
    debug: DebugConfig = Field(default_factory=DebugConfig)
    recipe: str | None = None
    output: str = "runs"
    run_name: str | None = None
    # `auto`: continue from the newest complete checkpoint of this run if there is one.
    # `never`: refuse to reuse an existing run folder. Or a path to a checkpoint folder.
    resume: str = "auto"
    # Continue a run with settings that change its maths or data (recorded with the step they took
    # effect: summary.json `resume_changes`, config.yaml), or with another process count.
    allow_resume_change: bool = False

    @field_validator("run_name")
    @classmethod
    def _one_folder_name(cls, v):
        # The run folder is --output/run_name: a name with a path in it would write elsewhere.
        if v is not None and (not v.strip() or v in (".", "..") or "/" in v or "\\" in v or "\0" in v):
            raise Refused(f"run_name {v!r} must be one folder name (no `/`, not `.` or `..`): "
                          "the run folder is --output/<run_name>",
                          hint="put the path in --output and the last folder's name in --run-name, e.g. "
                               "--output runs/cats --run-name first")
        from .runtime.storage import NAME_MAX_BYTES

        if v is not None and len(v.encode()) > NAME_MAX_BYTES:
            raise Refused(f"run_name is {len(v.encode())} bytes long ({len(v)} characters); a folder name "
                          f"holds at most {NAME_MAX_BYTES} bytes",
                          hint=f"give a --run-name of at most {NAME_MAX_BYTES} bytes (a letter such as é "
                               "takes 2), or leave it out: the default name always fits")
        return v

    @model_validator(mode="after")
    def _check(self):
        if self.model.pretrained and self.model.pretrained_path:
            raise Refused("model.pretrained and model.pretrained_path are exclusive",
                          hint="keep one: --no-pretrained with model.pretrained_path=FILE, or "
                               "--pretrained without model.pretrained_path")
        if self.staged_epochs and self.staged_epochs >= self.train.epochs:
            fewer = max(1, self.train.epochs // 4) if self.train.epochs > 1 else 0
            raise Refused(f"train.freeze_epochs ({self.train.freeze_epochs}) must be fewer than train.epochs "
                          f"({self.train.epochs}): the epochs after it train the whole network",
                          hint=f"use --set train.freeze_epochs={fewer} or more --epochs")
        return self

    @property
    def staged_epochs(self) -> int:
        """The epochs that train the classifier head alone first: train.freeze_epochs on trained
        weights; none on random ones, where a head alone learns from random features what the
        whole network must relearn anyway (train.phases says so at start)."""
        return self.train.freeze_epochs if self.model.loads_weights else 0

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


# ---------------------------------------------------------------------------------------------
# A run's identity (docs/recipes.md): every setting changes the run's maths or data unless it is declared
# here as execution-only. Resume refuses a change of any other setting (`maths_settings`), the
# default run name carries them, and the fit cache is keyed by them. A dotted key names one
# setting; one ending in `.` a whole section; the longest match decides.

EXECUTION_ONLY = {
    # How one training step runs: the fit chooses these or is bounded by them (its cache holds them).
    "step": ("train.micro_batch", "train.compile", "train.cudnn_benchmark", "train.fit", "train.fit_probe_fraction",
             "model.grad_checkpointing", "model.channels_last", "data.num_workers", "hardware.",
             "debug.simulate_oom_above", "debug.simulate_oom_in_recovery"),
    # Where the run writes, what it keeps and says, when it gives up, and the faults tests inject.
    "run": ("recipe", "output", "run_name", "resume", "allow_resume_change", "train.eval_batch",
            "train.log_every_steps", "train.max_consecutive_skipped_steps", "data.max_bad_fraction",
            "data.cache_dir", "data.read_timeout_s", "data.table_cache_mb", "checkpoint.", "tracking.",
            "debug."),
}


def execution_group(key: str) -> str | None:
    """The execution-only group a dotted config key belongs to (None: it changes the run)."""
    best, group = 0, None
    for name, keys in EXECUTION_ONLY.items():
        for k in keys:
            if (key == k or k.endswith(".") and key.startswith(k)) and len(k) > best:
                best, group = len(k), name
    return group


def flat(tree: dict, prefix: str = "") -> dict:
    """A nested mapping as {dotted key: value}."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def maths_settings(cfg: "Config") -> dict:
    """Every setting of `cfg` that changes the run's maths or data, as {dotted key: value}."""
    return {k: v for k, v in flat(cfg.model_dump(mode="json")).items() if execution_group(k) is None}


def execution_settings(cfg: "Config", group: str | None = None) -> dict:
    """The execution-only settings of `cfg` (of one group, or all), as {dotted key: value}."""
    return {k: v for k, v in flat(cfg.model_dump(mode="json")).items()
            if execution_group(k) is not None and (group is None or execution_group(k) == group)}


# ---------------------------------------------------------------------------------------------
# Loading and overriding


def recipe_dirs() -> list[Path]:
    """Where `--recipe NAME` looks: `./recipes` (your own) first, then the ones vramfit ships."""
    return [Path.cwd() / "recipes", PACKAGE_RECIPES]


def find_recipe(name: str) -> Path:
    """`--recipe NAME` finds `NAME.yaml` in `recipe_dirs()`, or takes a path to a YAML file."""
    p = Path(name)
    if p.suffix in (".yaml", ".yml") and p.is_file():
        return p
    for base in recipe_dirs():
        cand = base / f"{name}.yaml"
        if cand.is_file():
            return cand
    known = sorted({q.stem for base in recipe_dirs() if base.is_dir() for q in base.glob("*.yaml")})
    close = difflib.get_close_matches(name, known, n=3)
    raise VramfitError(
        f"Recipe `{name}` was not found (looked for a YAML file, ./recipes/{name}.yaml and the "
        f"recipes vramfit ships in {PACKAGE_RECIPES}).",
        hint=(f"did you mean {', '.join(close)}? " if close else "")
        + f"Known recipes: {', '.join(known) or 'none'}; or pass a path to a YAML file.")


def load_recipe(name: str) -> dict[str, Any]:
    path = find_recipe(name)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as e:
        raise VramfitError(f"Recipe {path} is not UTF-8 text (byte {e.start}: {e.reason}).",
                           hint=f"save {path} as UTF-8 (e.g. `iconv -f latin1 -t utf-8`), or name the YAML "
                                "recipe you meant") from None
    except OSError as e:
        raise VramfitError(f"Recipe {path} cannot be read: {e.strerror or e}.",
                           hint="check the path and its permissions") from None
    except yaml.YAMLError as e:
        raise VramfitError(f"Recipe {path} is not valid YAML: {e}", hint="fix the file's syntax") from e
    if not isinstance(data, dict):
        raise VramfitError(f"Recipe {path} must be a mapping of sections, got {type(data).__name__}.",
                           hint=f"write {path} as sections of keys, e.g. `train:` then `  epochs: 10` on the "
                                "next line (docs/recipes.md)")
    return data


def _set_path(tree: dict, dotted: str, value: Any, given: str = "") -> None:
    """`given`: how the user wrote it (`--set a.b=1`), for the message."""
    keys = dotted.split(".")
    node = tree
    for i, k in enumerate(keys[:-1]):
        nxt = node.setdefault(k, {})
        if not isinstance(nxt, dict):
            held = ".".join(keys[:i + 1])
            raise VramfitError(f"Cannot set `{dotted}`{' (' + given + ')' if given else ''}: `{held}` was "
                               f"given a value ({nxt!r}), so it is not a section any more.",
                               hint=f"drop the `--set {held}=...` (or the recipe's `{held}:` value) and "
                                    f"set its keys one by one, e.g. --set {dotted}=...")
        node = nxt
    node[keys[-1]] = value


def _check_sections(dotted: str, given: str) -> None:
    """`optim.lr.x` names a key under a value: said here, naming `optim.lr` (validation would only
    say that a number was expected). Unknown keys are left to validation, which suggests the closest."""
    model: type[BaseModel] = Config
    parts = dotted.split(".")
    for i, part in enumerate(parts[:-1]):
        field = model.model_fields.get(part)
        if field is None:
            return
        sections = [a for a in (field.annotation, *typing.get_args(field.annotation))
                    if isinstance(a, type) and issubclass(a, BaseModel)]
        if sections:
            model = sections[0]
            continue
        if dict in (field.annotation, typing.get_origin(field.annotation)):
            return
        held = ".".join(parts[:i + 1])
        raise VramfitError(f"`{given}`: `{held}` is a value, not a section, so `{dotted}` does not exist.",
                           hint=f"set the value itself, e.g. --set {held}=VALUE (docs/recipes.md lists "
                                "the keys)")


def parse_set(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise VramfitError(f"`--set {item}` is not of the form key=value.",
                               hint="write e.g. --set optim.lr=3e-4 --set data.image_size=160")
        key, raw = item.split("=", 1)
        key = key.strip()
        _check_sections(key, f"--set {item}")
        try:
            value = yaml.safe_load(raw) if raw != "" else None
        except yaml.YAMLError as e:
            why = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise VramfitError(f"`--set {item}`: the value `{raw}` is not valid YAML ({why}).",
                               hint="quote text for YAML inside the shell's quotes: "
                                    f"--set '{key}=\"{raw}\"'; "
                                    "a list is written [a, b], a number as 3e-4") from None
        _set_path(out, key, value, f"--set {item}")
    return out


def deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def _model_at(loc: tuple) -> type[BaseModel] | None:
    model: type[BaseModel] = Config
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        ann = getattr(field, "annotation", None) if field else None
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        model = ann
    return model


def _explain(err: ValidationError) -> VramfitError:
    lines, hints, fixes = [], [], {}
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"])
        if e["type"] == "extra_forbidden":
            model = _model_at(e["loc"])
            valid = list(model.model_fields) if model else []
            close = difflib.get_close_matches(str(e["loc"][-1]), valid, n=1, cutoff=0.5)
            prefix = ".".join(str(x) for x in e["loc"][:-1])
            lines.append(f"unknown key `{loc}`")
            if close:
                hints.append(f"did you mean `{prefix + '.' if prefix else ''}{close[0]}`?")
            else:
                hints.append(f"valid keys{' in `' + prefix + '`' if prefix else ''}: {', '.join(valid)}")
            continue
        msg = e["msg"].removeprefix("Value error, ")
        given = repr(e.get("input"))
        lines.append(msg if not loc and e["type"] == "value_error"  # a rule over several keys: it says it all
                     else f"`{loc}`: {msg} (got {given if len(given) <= 80 else given[:60] + '...'})")
        refused = (e.get("ctx") or {}).get("error")
        if isinstance(refused, Refused):
            hints.append(refused.hint)
        else:
            _add_fix(fixes, e)
    for key, (musts, default) in fixes.items():  # a union's members (int or `auto`) in one hint
        example = f", e.g. --set {key}={_yaml_value(default)} (the default)" if default is not None else ""
        hints.append(f"give {key} {' or '.join(musts)}{example}")
    return VramfitError("Invalid configuration: " + "; ".join(lines) + ".",
                        hint="; ".join(dict.fromkeys(hints))
                        or "see docs/recipes.md for the keys and their types")


# pydantic's value errors: what the value must be (a constraint's limit from the error's context).
_LIMITS = {"greater_than_equal": ("ge", "a value of at least {}"), "greater_than": ("gt", "a value above {}"),
           "less_than_equal": ("le", "a value of at most {}"), "less_than": ("lt", "a value below {}"),
           "literal_error": ("expected", "one of {}")}
_KINDS = {"int_parsing": "a whole number", "int_from_float": "a whole number", "int_type": "a whole number",
          "float_parsing": "a number", "float_type": "a number", "bool_parsing": "true or false",
          "bool_type": "true or false", "string_type": "text", "list_type": "a list",
          "tuple_type": "a pair of numbers", "dict_type": "keys under it (a section)"}


def _add_fix(fixes: dict, e: dict) -> None:
    """What one refused value must be instead, under its field's key, with the field's default."""
    key, default = _field_at(e["loc"])
    if key is None:
        return
    if e["type"] in _LIMITS:
        name, text = _LIMITS[e["type"]]
        must = text.format((e.get("ctx") or {}).get(name))
    elif e["type"] in _KINDS:
        must = _KINDS[e["type"]]
    else:
        return
    musts = fixes.setdefault(key, ([], default))[0]
    if must not in musts:
        musts.append(must)


def _field_at(loc: tuple) -> tuple[str | None, Any]:
    """The dotted key of the config field an error's location names (a union's member or a list's
    index dropped) and the field's default; (None, None) where it names none."""
    model: type[BaseModel] = Config
    for i, part in enumerate(loc):
        field = model.model_fields.get(str(part))
        if field is None:
            return None, None
        section = next((a for a in (field.annotation, *typing.get_args(field.annotation))
                        if isinstance(a, type) and issubclass(a, BaseModel)), None)  # also `Section | None`
        if section is None or i == len(loc) - 1:
            return ".".join(str(x) for x in loc[:i + 1]), field.get_default(call_default_factory=True)
        model = section
    return None, None


def _yaml_value(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def build_config(recipe: str | None = None, sets: list[str] | None = None,
                 flags: dict[str, Any] | None = None, say: bool = True) -> Config:
    """Resolve the config. `flags` maps dotted keys to values given as explicit CLI flags.
    `--recipe auto` is resolved before this, by `cli.resolve_config`. `say`: name the backbone's
    defaults it filled in (only for the config a command runs with)."""
    tree: dict[str, Any] = load_recipe(recipe) if recipe else {}
    tree = deep_merge(tree, parse_set(sets or []))
    for dotted, value in (flags or {}).items():
        if value is not None:
            _set_path(tree, dotted, value)
    from .models.backbones import fill_backbone_defaults

    tree = fill_backbone_defaults(tree, say)  # what neither the recipe nor the command line says
    if recipe:
        tree["recipe"] = recipe
    try:
        return Config.model_validate(tree)
    except ValidationError as e:
        raise _explain(e) from None
