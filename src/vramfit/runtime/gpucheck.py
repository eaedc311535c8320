"""Why torch sees no GPU, and whether that must stop a run: a recipe written for a card
(`hardware.memory_gib`) trained on the CPU takes days instead of minutes, so it stops at once with
the reason and the fix (`hardware.allow_cpu: true` trains anyway)."""

from __future__ import annotations

import os
import shutil
import subprocess

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


def check_gpu_recipe(cfg, cuda_available: bool) -> None:
    """Stop a recipe written for a GPU on a machine where torch sees none (exit 2, the reason and
    the fix); `hardware.allow_cpu: true` trains anyway."""
    if cuda_available or cfg.hardware.memory_gib is None or cfg.hardware.allow_cpu:
        return
    import torch

    reason = no_gpu_reason(torch.version.cuda, os.environ.get("CUDA_VISIBLE_DEVICES"), driver_version())
    fix = next((f for key, f in FIXES.items() if key in reason), "check the GPU with `nvidia-smi` and `vramfit doctor`")
    card = cfg.hardware.name or f"a {cfg.hardware.memory_gib:g} GiB GPU"
    raise VramfitError(f"This recipe is written for {card}, but torch sees no GPU: {reason}. On the CPU it "
                       "would train for days.",
                       hint=f"{fix}; or train on the CPU anyway with --set hardware.allow_cpu=true")
