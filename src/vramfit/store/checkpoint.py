"""Atomic checkpoints: complete or absent, never half-written.

Accelerate's `save_state` writes files in place; a kill mid-save leaves a folder that looks like a
checkpoint and does not load. We write into a temporary folder, add a completion marker holding
every file's checksum, then rename, and only then delete older checkpoints.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..errors import VramfitError
from ..runtime.storage import free_space, fsync, make_folder, removed_root, run_folder_removed, storage_fault

log = logging.getLogger(__name__)

MARKER = "COMPLETE.json"
STATE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def portable(tensors: dict) -> dict:
    """Tensors as every weight file holds them: detached, on the CPU, in the default (contiguous)
    memory format. A channels_last weight is the same values under permuted strides, which
    safetensors refuses to write; loaders (timm, torch, onnx) expect the default layout anyway."""
    return {k: v.detach().cpu().contiguous() if isinstance(v, torch.Tensor) else v for k, v in tensors.items()}


@contextlib.contextmanager
def portable_state_dict(model: torch.nn.Module):
    """While open, `model.state_dict()` returns `portable` tensors: for writers that take the model
    itself (timm's `save_for_hf`, `push_to_hf_hub`). The model's own parameters are left as they are."""
    def hook(module, state_dict, prefix, local_metadata):
        state_dict.update(portable(state_dict))

    handle = model.register_state_dict_post_hook(hook)
    try:
        yield model
    finally:
        handle.remove()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def save(accelerator, root: Path, step: int, trainer_state: dict, keep_last: int,
         keep_steps: tuple[int, ...] = (), extra: dict | None = None, local: dict | None = None) -> Path:
    """Collective: every process calls it. Returns the final folder. A failure on any process (a
    full disk) stops every process with a clear error; the previous checkpoint stays as it was."""
    from accelerate.utils import DistributedType

    from ..runtime.collectives import agreed

    root, device, main = Path(root), accelerator.device, accelerator.is_main_process
    tmp, final = root / f".tmp-step-{step}", root / f"step-{step}"
    with agreed("preparing a checkpoint", device), _writing(root, tmp):
        if main:
            make_folder(root)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
    # FSDP gathers inside save_state (collectives of its own): it cannot run inside `agreed`.
    sharded = accelerator.distributed_type == DistributedType.FSDP
    with (contextlib.nullcontext() if sharded else agreed("writing a checkpoint", device)), _writing(root, tmp):
        accelerator.save_state(str(tmp), safe_serialization=True)
        if local:  # this process's own tensors (see `load_local`)
            save_file(portable(local), tmp / f"local_{accelerator.process_index}.safetensors")
    with agreed("finishing a checkpoint", device), _writing(root, tmp):
        if main:
            _complete(tmp, final, root, step, trainer_state, extra)
            prune(root, keep_last, keep_steps)
    return final


def _complete(tmp: Path, final: Path, root: Path, step: int, trainer_state: dict, extra: dict | None) -> None:
    (tmp / STATE).write_text(json.dumps(trainer_state, indent=1))
    for name, tensors in (extra or {}).items():  # e.g. EMA weights: safetensors, no pickle
        save_file(portable(tensors), tmp / f"{name}.safetensors")
    files = sorted(p for p in tmp.rglob("*") if p.is_file())
    sums = {str(p.relative_to(tmp)): _sha256(p) for p in files}
    for p in files:  # data on disk before the marker that vouches for it
        with open(p, "rb+") as f:
            os.fsync(f.fileno())
    marker = tmp / MARKER
    marker.write_text(json.dumps({"step": step, "files": sums}, indent=1))
    with open(marker, "rb+") as f:
        os.fsync(f.fileno())
    if final.exists():  # re-saving the same step (e.g. a signal right after a periodic save)
        shutil.rmtree(final)
    os.rename(tmp, final)
    fsync(root)


@contextlib.contextmanager
def _writing(root: Path, tmp: Path):
    """A checkpoint that cannot be written (full disk, a file size limit, lost permissions) is an
    error that says so and keeps the last complete checkpoint; the half-written one is removed at
    once. The cause is read from the storage (errno, the file size limit, a write probe, the free
    space), not from the writer's wording: torch's zip writer says a full disk as `unexpected pos`."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - a storage fault is reported below; anything else re-raises
        gone = removed_root(root)
        cause = None if gone or isinstance(e, VramfitError) else storage_fault(e, root, tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        if gone is not None:
            raise run_folder_removed(gone) from None
        if cause is None:
            raise
        last = latest(root)
        raise VramfitError(
            f"Could not write a checkpoint into {root}: {cause}{free_space(root)}. Last complete checkpoint: "
            f"{last or 'none'} (kept).",
            hint="free space (or raise the limit, fix the folder's permissions, or move the run folder to "
                 "another --output) and re-run the same command: "
                 "it resumes from the last complete checkpoint") from None


def is_complete(path: Path, verify: bool = True) -> bool:
    marker = Path(path) / MARKER
    if not marker.is_file():
        return False
    try:
        sums = json.loads(marker.read_text())["files"]
    except (ValueError, KeyError):
        return False
    for rel, digest in sums.items():
        f = Path(path) / rel
        if not f.is_file() or (verify and _sha256(f) != digest):
            return False
    return True


def list_steps(root: Path) -> list[tuple[int, Path]]:
    root = Path(root)
    if not root.is_dir():
        return []
    out = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(out)


def latest(root: Path, cleanup: bool = False) -> Path | None:
    """Newest complete checkpoint; damaged ones are skipped with a warning, stale temporaries removed."""
    root = Path(root)
    if cleanup and root.is_dir():
        for p in root.glob(".tmp-step-*"):
            final = root / p.name[len(".tmp-"):]
            if not final.exists() and is_complete(p):
                # Killed between removing an older copy of the same step and the rename (a re-save
                # at an epoch end): the marker vouches for every file, so finish the rename.
                log.warning("completing checkpoint %s (its save was interrupted after it was written)", final)
                os.rename(p, final)
                continue
            log.warning("removing unfinished checkpoint %s (a save was interrupted)", p)
            shutil.rmtree(p, ignore_errors=True)
    for step, path in reversed(list_steps(root)):
        if is_complete(path):
            return path
        log.warning("skipping damaged checkpoint %s (missing marker or checksum mismatch)", path)
    return None


def prune(root: Path, keep_last: int, keep_steps: tuple[int, ...] = ()) -> None:
    complete = [(s, p) for s, p in list_steps(root) if is_complete(p, verify=False)]
    keep = {s for s, _ in complete[-max(keep_last, 1):]} | set(keep_steps)
    for s, p in complete:
        if s not in keep:
            shutil.rmtree(p, ignore_errors=True)


def read_state(path: Path) -> dict:
    return json.loads((Path(path) / STATE).read_text())


def load_extra(path: Path, name: str, module: torch.nn.Module) -> None:
    f = Path(path) / f"{name}.safetensors"
    if not f.is_file():
        raise VramfitError(f"Checkpoint {path} has no {name} state ({f.name}), but this run uses it.",
                           hint="resume with the settings the checkpoint was written with")
    module.load_state_dict(load_file(f))


def load_local(path: Path, rank: int) -> dict | None:
    """The tensors process `rank` saved as its own (`save(local=...)`): None when there are none."""
    f = Path(path) / f"local_{rank}.safetensors"
    return load_file(f) if f.is_file() else None


def verify_rng_restored(path: Path, rank: int) -> None:
    """Accelerate logs and carries on when random states cannot be loaded; for an exact resume that
    is an error. Compare the live CPU generator with what the checkpoint holds (weights_only load)."""
    from accelerate.utils import load

    f = Path(path) / f"random_states_{rank}.pkl"
    try:
        saved = load(f)["torch_manual_seed"]
    except Exception as e:  # noqa: BLE001
        raise VramfitError(f"Could not restore the random state of process {rank} from {f}: "
                           f"{type(e).__name__}: {e}",
                           hint="the checkpoint is incomplete or from another process count; resume from "
                                "another checkpoint, or start a new run") from None
    if not torch.equal(saved, torch.get_rng_state()):
        raise VramfitError(f"The random state of process {rank} was not restored from {f}.",
                           hint="resume from another checkpoint, or start a new run")
