"""Resume policy: which checkpoint a run continues from, whether it may, and loading it.

A run folder belongs to one run. Re-running the same command continues it exactly (`--resume auto`);
a command whose identity differs (any setting that changes the maths or the data: every one not
declared execution-only in config.EXECUTION_ONLY, and the data's own listing) stops with what changed
and how to start fresh, before anything is loaded or written, even when the run had finished; one
that only changes how the run executes (the micro-batch, the workers, ...) is said at start.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

from ..config import Config, execution_settings, maths_settings
from ..data.builtin import local_source
from ..data.folders import walk
from ..data.shards import is_shards
from ..errors import VramfitError
from ..train.state import TrainerState
from . import checkpoint

log = logging.getLogger("vramfit")


@dataclass
class ResumePoint:
    path: Path
    state: TrainerState  # trainer_state.json as saved


@dataclass(frozen=True)
class Identity:
    """A launch's identity (docs/recipes.md, "A run's identity"): `maths`, every setting that changes the
    run's maths or data (config.maths_settings, with the precision that runs and the data's own
    identity), which a resumed run must share; `execution`, how it runs, which it may change."""

    maths: dict
    execution: dict


def identity(cfg: Config, precision: str) -> Identity:
    """`precision`: what runs (precision.resolve's name), so `auto` that ran bf16 and `bf16` are one
    run. Lists the files of a local data source: computed once a launch (train.build.find_start)."""
    maths = maths_settings(cfg)
    maths["train.precision"] = precision
    local = local_source(cfg.data.source)
    maths["data.source"] = str(local.resolve()) if local is not None else cfg.data.source
    maths["data.listing"] = data_identity(cfg.data.source, skip=Path(cfg.output).expanduser())
    return Identity(maths, execution_settings(cfg))


def data_identity(source: str, skip: Path | None = None) -> str | None:
    """More than the path string: for a local folder or file (data.builtin.local_source: a built-in
    name is never one), its file count and a hash of the listing (names and sizes; no file is read),
    so new data under the same path is seen. The listing is the loader's (data.folders.walk: what
    vramfit wrote is not data), less `skip`: the run's own --output, whose checkpoints would
    otherwise change the data's identity at every save."""
    p = local_source(source)
    if is_shards(source) and not Path(source).expanduser().is_dir():
        # A brace pattern or one .tar: its folder's files (the shards, their index or info file),
        # so a changed shard set is seen like a changed folder.
        p = local_source(str(Path(source).expanduser().parent))
    if p is None:
        return None
    if p.is_file():
        entries = [(p.name, p.stat().st_size)]
    else:
        entries = []
        for f in walk(p, skip=skip).files:
            with contextlib.suppress(FileNotFoundError):  # removed while listed: not data any more
                entries.append((str(f.relative_to(p)), f.stat().st_size))
        entries.sort()
    h = hashlib.blake2b(digest_size=8)
    for name, size in entries:
        h.update(f"{name}:{size}\n".encode())
    return f"{len(entries)} files, {h.hexdigest()}"


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


def check(cfg: Config, point: ResumePoint, world: int, new: Identity) -> tuple[list[str], dict | None]:
    """Refuse a resume whose maths or data changed (unless allowed), before anything is written.
    Returns the notes to say (what changed in how it runs; an allowed change) and, for an allowed
    change, its record: the step it takes effect at and each setting's old and new value."""
    saved, run_dir = point.state, point.path.parent.parent
    if not saved.identity and not cfg.allow_resume_change:
        raise VramfitError(f"Cannot resume {run_dir}: its checkpoint does not record the settings it ran with "
                           "(written by an earlier vramfit), so a change of them cannot be ruled out.",
                           hint=CHANGE_HINT)
    changed = differences(saved.identity, new.maths) if saved.identity else {}
    said = "; ".join(f"{k}: {_shown(old)} -> {_shown(now)}" for k, (old, now) in changed.items())
    if changed and not cfg.allow_resume_change:
        raise VramfitError(f"Cannot resume {run_dir}: {len(changed)} setting(s) that change the run's maths or "
                           f"data differ from the run's ({said}).", hint=CHANGE_HINT)
    notes, record = [], None
    if changed:
        record = {"step": saved.global_step, "settings": {k: list(v) for k, v in changed.items()}}
        notes.append(f"resuming with changed settings from step {saved.global_step} ({said}): "
                     "allow_resume_change; recorded in summary.json and config.yaml")
    notes += execution_notes(saved.execution, new.execution)
    saved_world = saved.world_size
    if saved_world not in (None, world):
        msg = (f"the checkpoint was written by {saved_world} process(es), this run has {world}: the "
               "global batch and sample order are unchanged, but per-process random states cannot be "
               "carried over, so the result will not be bitwise identical")
        if not cfg.allow_resume_change:
            raise VramfitError(f"Cannot resume: {msg}.", hint=f"launch with {saved_world} process(es), or "
                                                             "accept it with --set allow_resume_change=true")
        notes.append(f"resuming anyway: {msg}")
    return notes, record


CHANGE_HINT = ("to start a new run, give it a new --run-name (or --output); to continue this one with the "
               "change on purpose, add --set allow_resume_change=true (the change is recorded with its step)")


def differences(old: dict, new: dict) -> dict[str, tuple]:
    """{key: (old value, new value)} for every key whose value differs (None where one lacks it)."""
    return {k: (old.get(k), new.get(k)) for k in sorted(old.keys() | new.keys()) if old.get(k) != new.get(k)}


def execution_notes(old: dict, new: dict) -> list[str]:
    """What a resume changes in how the run executes: said, not refused."""
    if not old:
        return []
    changed = differences(old, new)
    notes = []
    if "train.micro_batch" in changed:
        was, now = changed.pop("train.micro_batch")
        notes.append(f"resumed with micro_batch {now!r} (the checkpoint's run used {was!r}); with "
                     "train-mode BatchNorm the statistics are taken over other groups from here on")
    if changed:
        notes.append("resumed with other execution settings (the maths is unchanged): "
                     + "; ".join(f"{k}: {_shown(a)} -> {_shown(b)}" for k, (a, b) in changed.items()))
    return notes


def _shown(value) -> str:
    return "(not set)" if value is None else repr(value)


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
