"""Resume policy: which checkpoint a run continues from, whether it may, and loading it.

A run folder belongs to one run. Re-running the same command continues it exactly (`--resume auto`);
a command whose settings change the optimisation stops with what changed and how to start fresh,
before anything is loaded, even when the run had finished; a change that only changes how the run
is executed (the micro-batch, the process count with `allow_resume_change`) is said at start.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

from . import checkpoint
from .config import Config
from .errors import VramfitError
from .state import TrainerState

log = logging.getLogger("vramfit")

# Settings that change the maths of the run: a resumed run must share them.
MATHS_KEYS = ("model", "image_size", "source", "data_identity", "global_batch", "optimizer", "lr",
              "seed", "epochs", "precision", "ema_decay", "split_seed", "freeze", "freeze_epochs", "layer_decay",
              "unfreeze_warmup_epochs", "bn", "bn_momentum", "bn_momentum_per", "precise_bn", "progressive_resize")
# Settings that only change how the run is executed: a change is said, not refused.
EXECUTION_KEYS = ("micro_batch",)


@dataclass
class ResumePoint:
    path: Path
    state: TrainerState  # trainer_state.json as saved


def data_identity(source: str) -> str | None:
    """More than the path string: for a local folder or file, its file count and a hash of the
    listing (names and sizes; no file is read), so new data under the same path is seen."""
    p = Path(source)
    if not p.exists():
        return None
    files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file())
    h = hashlib.blake2b(digest_size=8)
    for f in files:
        h.update(f"{f.relative_to(p) if f != p else f.name}:{f.stat().st_size}\n".encode())
    return f"{len(files)} files, {h.hexdigest()}"


def fingerprint(cfg: Config, precision: str) -> dict:
    """What a resumed run must share with the run it continues, and what it records. `precision`:
    what runs (precision.resolve's name), so `auto` that ran bf16 and `bf16` are the same run."""
    return {"model": cfg.model.name, "image_size": cfg.data.image_size, "source": cfg.data.source,
            "data_identity": data_identity(cfg.data.source), "global_batch": cfg.train.global_batch,
            "optimizer": cfg.optim.name, "lr": cfg.optim.lr, "seed": cfg.train.seed,
            "epochs": cfg.train.epochs,  # epochs shape the LR schedule
            "precision": precision, "ema_decay": cfg.model.ema_decay,
            "split_seed": getattr(cfg.data, "split_seed", 0), "micro_batch": cfg.train.micro_batch,
            "freeze": list(cfg.model.freeze), "freeze_epochs": cfg.train.freeze_epochs,
            "layer_decay": cfg.optim.layer_decay, "unfreeze_warmup_epochs": cfg.optim.unfreeze_warmup_epochs,
            "bn": cfg.model.bn, "bn_momentum": cfg.model.bn_momentum,
            "bn_momentum_per": cfg.model.bn_momentum_per, "precise_bn": cfg.model.precise_bn,
            "progressive_resize": (cfg.data.progressive_resize.model_dump()
                                   if cfg.data.progressive_resize is not None else None)}


def find(cfg: Config, ckpt_dir: Path) -> ResumePoint | None:
    """The checkpoint this launch continues from (None: a fresh start)."""
    if cfg.resume == "never":
        if checkpoint.list_steps(ckpt_dir):
            raise VramfitError(f"Run folder {ckpt_dir.parent} already holds checkpoints and --resume never "
                               "was given.", hint="re-run with --resume auto to continue it, or pick "
                                                  "another --run-name")
        return None
    if cfg.resume == "auto":
        path = checkpoint.latest(ckpt_dir)
    else:
        path = Path(cfg.resume)
        if not checkpoint.is_complete(path):
            raise VramfitError(f"--resume {cfg.resume} is not a complete checkpoint folder.",
                               hint=f"use --resume auto, or one of {ckpt_dir}/step-N")
    return ResumePoint(path, TrainerState.from_saved(checkpoint.read_state(path), str(path))) if path else None


def check(cfg: Config, point: ResumePoint, world: int, new: dict) -> list[str]:
    """Refuse a resume that would change the run's maths (unless allowed); return the notes to
    print for what changes only its execution. `new`: this launch's `fingerprint(cfg)`."""
    old = point.state.fingerprint
    diffs = [f"{k}: {old.get(k)!r} -> {new[k]!r}" for k in MATHS_KEYS if k in old and old[k] != new[k]]
    notes = []
    if diffs and not cfg.allow_resume_change:
        raise VramfitError(
            f"Cannot resume {point.path.parent.parent}: the settings changed in ways that change the run ("
            + "; ".join(diffs) + ").",
            hint="restore those settings; or start fresh with another --run-name (or --output); or accept "
                 "the change with --set allow_resume_change=true")
    if diffs:
        notes.append("resuming despite changed settings (" + "; ".join(diffs) + "): allow_resume_change")
    for k in EXECUTION_KEYS:
        if k in old and old[k] != new[k]:
            notes.append(f"resumed with {k} {new[k]!r} (the checkpoint's run used {old[k]!r}); with "
                         "train-mode BatchNorm the statistics are taken over other groups from here on")
    saved_world = point.state.world_size
    if saved_world not in (None, world):
        msg = (f"the checkpoint was written by {saved_world} process(es), this run has {world}: the "
               "global batch and sample order are unchanged, but per-process random states cannot be "
               "carried over, so the result will not be bitwise identical")
        if not cfg.allow_resume_change:
            raise VramfitError(f"Cannot resume: {msg}.", hint=f"launch with {saved_world} process(es), or "
                                                             "accept it with --set allow_resume_change=true")
        notes.append(f"resuming anyway: {msg}")
    return notes


def class_names_match(point: ResumePoint, class_names: list[str]) -> None:
    saved = point.state.class_names
    if saved and saved != class_names:
        raise VramfitError(
            f"The dataset's classes {class_names[:10]}... differ from the checkpoint's {saved[:10]}...: "
            "the model head would not match.", hint="resume with the same data, or start a new run (--run-name)")


def load(accelerator, point: ResumePoint, world: int, seed: int, model, ema=None) -> None:
    """Weights, optimizer, scaler and RNG states (Accelerate), EMA weights, and each process's own
    BatchNorm statistics; the RNG states are checked, unless the process count changed (then each
    process is reseeded from the step, and takes the main process's statistics)."""
    try:  # Accelerate loads every pickle with weights_only=True (numpy RNG types allow-listed)
        accelerator.load_state(str(point.path))
    except Exception as e:  # noqa: BLE001 - a checkpoint that cannot be loaded safely is reported, not run
        raise VramfitError(
            f"Could not load checkpoint {point.path}: {type(e).__name__}: {str(e).splitlines()[0][:300]} "
            "(files there may have been written by another program: nothing in them was executed).",
            hint=unloadable_hint(point.path)) from None
    rank = accelerator.process_index
    same_shape = point.state.world_size in (None, world)
    if same_shape:
        checkpoint.verify_rng_restored(point.path, rank)
    else:
        from accelerate.utils import set_seed

        set_seed(seed + rank + 1000 * point.state.global_step)
    if ema is not None:
        checkpoint.load_extra(point.path, "ema", ema.module)
    own = checkpoint.load_local(point.path, rank) if same_shape else None
    if own:
        _restore_buffers(accelerator.unwrap_model(model), own, "model.")
        if ema is not None:
            _restore_buffers(ema.module, own, "ema.")


def unloadable_hint(path: Path) -> str:
    """What to run when checkpoint `path` cannot be loaded: an older complete one of the same run if
    there is one, else a fresh run in a new folder (`--resume never` refuses a folder that holds
    checkpoints, so it is never the way out)."""
    older = [p for s, p in checkpoint.list_steps(path.parent) if p != path and checkpoint.is_complete(p)]
    fresh = "start over in a new folder with --run-name NEW (this folder is left as it is)"
    return (f"resume from the checkpoint before it with --resume {older[-1]}, or {fresh}" if older
            else fresh[0].upper() + fresh[1:])


def _restore_buffers(module, saved: dict, prefix: str) -> None:
    import torch

    with torch.no_grad():
        for name, buf in module.named_buffers():
            if prefix + name in saved:
                buf.copy_(saved[prefix + name])


def resumed_micro_batch(point: ResumePoint | None, world: int, allow_change: bool) -> int | None:
    """The micro-batch the interrupted run had come down to after out-of-memory errors, when the
    new launch is the same shape (going back up would run out again, and with train-mode BatchNorm
    change the maths)."""
    if point is None or allow_change or point.state.world_size != world or not point.state.oom_retries:
        return None  # without an out-of-memory error the micro-batch was a choice, not a reduction
    mb = point.state.micro_batch
    return mb if isinstance(mb, int) and mb >= 1 else None
