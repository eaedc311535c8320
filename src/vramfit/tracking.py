"""What every run records: the run folder files, metrics.jsonl, and W&B through Accelerate."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from pathlib import Path

import torch

SECRET_ENV = ("WANDB_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")


def environment(accelerator) -> dict:
    import accelerate
    import datasets
    import timm

    env = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torchvision": _version("torchvision"),
        "timm": timm.__version__,
        "accelerate": accelerate.__version__,
        "datasets": datasets.__version__,
        "evaluate": _version("evaluate"),
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "git_commit": _git_commit(),
        "num_processes": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type),
        "device": str(accelerator.device),
        "device_names": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available() else [platform.processor() or "cpu"],
        "cpu_count": os.cpu_count(),
    }
    return env


def _version(name: str):
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:  # noqa: BLE001
        return None


def _git_commit() -> str | None:
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True,
                             timeout=5)
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def scrub(obj):
    """Drop any value equal to a secret from the environment (defence in depth for config/logs)."""
    secrets = {os.environ[k] for k in SECRET_ENV if os.environ.get(k)}
    if not secrets:
        return obj
    if isinstance(obj, dict):
        return {k: scrub(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [scrub(v) for v in obj]
    if isinstance(obj, str) and any(s in obj for s in secrets):
        return "<redacted>"
    return obj


class RunLog:
    """metrics.jsonl on the main process, mirrored to the configured Accelerate trackers."""

    def __init__(self, accelerator, run_dir: Path, use_trackers: bool):
        self.acc, self.path, self.use_trackers = accelerator, Path(run_dir) / "metrics.jsonl", use_trackers
        self.t0 = time.time()

    def log(self, record: dict, step: int) -> None:
        if not self.acc.is_main_process:
            return
        rec = scrub({"step": step, "time": round(time.time() - self.t0, 3), **record})
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        if self.use_trackers:
            self.acc.log({k: v for k, v in rec.items() if isinstance(v, (int, float))}, step=step)


    def summary(self, summary: dict) -> None:
        """The run's final figures as the tracker's run summary (W&B's last-value default would show
        the final, not the best, accuracy when runs are compared)."""
        if not (self.acc.is_main_process and self.use_trackers):
            return
        figures = {k: v for k, v in scrub(summary).items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        for tracker in self.acc.trackers:
            if tracker.name == "wandb":
                tracker.tracker.summary.update(figures)


def write_json(path: Path, obj) -> None:
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(json.dumps(scrub(obj), indent=1, default=str))
    os.replace(tmp, path)
