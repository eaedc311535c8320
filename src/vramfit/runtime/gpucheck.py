"""Why torch sees no GPU, and whether that must stop a run: a recipe written for a card
(`hardware.memory_gib`) trained on the CPU takes days instead of minutes, so it stops at once with
the reason, the fix, and the command of a short trial of the same recipe here (`cpu_trial`;
`hardware.allow_cpu: true` trains anyway)."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from ..errors import VramfitError

# The oldest Linux driver each CUDA major version runs on (NVIDIA's minor-version compatibility:
# any 12.x wheel on a 525 driver), from the CUDA Toolkit release notes.
MIN_DRIVER = {11: (450, 80, 2), 12: (525, 60, 13), 13: (580, 65, 6)}


def driver_version() -> str | None:
    """The NVIDIA driver's version as nvidia-smi says it, or None (no driver, no GPU)."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(".") if p.isdigit())


def driver_too_old(driver: str | None, cuda: str | None) -> str | None:
    """What to say when `driver` is older than torch's CUDA build `cuda` needs, else None."""
    if not driver or not cuda:
        return None
    need = MIN_DRIVER.get(_version(cuda)[0])
    if need is None or _version(driver) >= need:
        return None
    return (f"the NVIDIA driver {driver} is older than this torch's CUDA {cuda} needs "
            f"(>= {'.'.join(map(str, need))})")


def no_gpu_reason(cuda_build: str | None, visible: str | None, driver: str | None) -> str:
    """Why torch sees no CUDA device: its build (`torch.version.cuda`), CUDA_VISIBLE_DEVICES, the
    driver, in that order."""
    if cuda_build is None:
        return "this torch is built without CUDA (a CPU-only wheel)"
    if visible is not None and visible.strip() in ("", "-1", "none", "NoDevFiles"):
        return f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU"
    old = driver_too_old(driver, cuda_build)
    if old:
        return old
    if driver is None:
        return "no NVIDIA driver answers (nvidia-smi is missing or fails): no GPU is installed, or its driver is not"
    return f"torch (CUDA {cuda_build}) cannot use the GPU that driver {driver} reports"


FIXES = {
    "built without CUDA": "install torch's CUDA build (pip install torch --index-url "
                          "https://download.pytorch.org/whl/cu126, see pytorch.org)",
    "hides every GPU": "unset CUDA_VISIBLE_DEVICES, or set it to the GPUs to use (e.g. 0)",
    "older than": "update the NVIDIA driver, or install a torch built for an older CUDA",
}


# A short trial of a GPU recipe on the CPU: its model, augmentation, precision rule and fit as
# written, shrunk to a few minutes on 2 cores (ResNet50 at 64 px trains 3-5 images/s on 2 busy
# cores, and the fit measures a whole global batch): small images, a global batch of at most 64
# (the LR follows it as optim.lr_base_batch says), 4 steps per epoch, one epoch per phase.
TRIAL_IMAGE_SIZE = 64
TRIAL_STEPS_PER_EPOCH = 4
TRIAL_MAX_GLOBAL_BATCH = 64
TRIAL_VAL_SAMPLES = 128


def cpu_trial(cfg) -> list[str]:
    """The arguments that shrink the recipe of `cfg` to a short trial on the CPU."""
    batch = min(cfg.train.global_batch, TRIAL_MAX_GLOBAL_BATCH)
    return ["--set", "hardware.allow_cpu=true", "--image-size", str(TRIAL_IMAGE_SIZE),
            "--epochs", str(cfg.staged_epochs + 1),  # each phase of a staged recipe one epoch
            *(["--global-batch", str(batch)] if batch < cfg.train.global_batch else []),
            "--set", f"data.limit_train_samples={TRIAL_STEPS_PER_EPOCH * batch}",
            "--set", f"data.limit_val_samples={TRIAL_VAL_SAMPLES}"]


def trial_command(cfg, argv: list[str] | None = None) -> str:
    """The command this process was started with (`argv`, default sys.argv), plus `cpu_trial`: the
    later flags win. Started some other way (a notebook, a test), `vramfit train` with the recipe and
    data."""
    argv = list(sys.argv if argv is None else argv)
    if argv and Path(argv[0]).name == "train.py":
        prefix, given = ["accelerate", "launch", "-q", "train.py"], argv[1:]
    elif argv[1:2] == ["train"]:  # the `vramfit` script, `python -m vramfit`
        prefix, given = ["vramfit", "train"], argv[2:]
    else:
        prefix, given = ["vramfit", "train"], ["--recipe", cfg.recipe or "", "--data", cfg.data.source]
    return shlex.join([*prefix, *given, *cpu_trial(cfg)])


def check_gpu_recipe(cfg, cuda_available: bool, argv: list[str] | None = None) -> None:
    """Stop a recipe written for a GPU on a machine where torch sees none (exit 2, the reason, the
    fix, and the command of a short trial here); `hardware.allow_cpu: true` trains anyway."""
    if cuda_available or cfg.hardware.memory_gib is None or cfg.hardware.allow_cpu:
        return
    import torch

    reason = no_gpu_reason(torch.version.cuda, os.environ.get("CUDA_VISIBLE_DEVICES"), driver_version())
    fix = next((f for key, f in FIXES.items() if key in reason), "check the GPU with `nvidia-smi` and `vramfit doctor`")
    card = cfg.hardware.name or f"a {cfg.hardware.memory_gib:g} GiB GPU"
    trial = (f"A short trial of it runs here in a few minutes ({cfg.model.name} with the recipe's "
             f"augmentation, precision and fit, at {TRIAL_IMAGE_SIZE} px on a few hundred images); "
             "`--recipe quickstart` trains a whole run on built-in digits in about a minute.")
    raise VramfitError(f"This recipe is written for {card}, but torch sees no GPU: {reason}. On the CPU it "
                       f"would train for days. {trial}",
                       hint=f"{fix}. To try the recipe here first: {trial_command(cfg, argv)}")
