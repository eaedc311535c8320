"""Where a run lives: its name and folder, and the name of every file in it (DESIGN.md's run-folder
contract). The one place these paths are worked out; the trainer writes them, and `eval`,
`predict`, `export`, `compare` and the model card read them."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from .errors import VramfitError


def default_run_name(cfg, precision_name: str) -> str:
    """Named from what distinguishes runs, so they line up side by side in W&B and on disk; the same
    command on the same machine gives the same name, so re-running it resumes. `precision_name` is
    what runs (precision.resolve: fp32 | bf16 | fp16), not `auto`."""
    recipe = Path(cfg.recipe).stem if cfg.recipe else "custom"
    model = cfg.model.name.replace("/", "_").replace(":", "_")
    return (f"{recipe}-{model}-{cfg.data.image_size}px-gb{cfg.train.global_batch}"
            f"-{precision_name}-s{cfg.train.seed}")


@dataclass(frozen=True)
class RunPaths:
    name: str
    dir: Path

    @classmethod
    def of(cls, cfg, precision_name: str) -> "RunPaths":
        """The run folder a training config writes: `--output` / (`--run-name` or the default name)."""
        name = cfg.run_name or default_run_name(cfg, precision_name)
        return cls(name, Path(cfg.output) / name)

    @classmethod
    def at(cls, run_dir: str | Path) -> "RunPaths":
        """An existing run folder, to read."""
        run_dir = Path(run_dir)
        return cls(run_dir.name, run_dir)

    @property
    def checkpoints(self) -> Path:
        return self.dir / "checkpoints"

    @property
    def model(self) -> Path:
        return self.dir / "model"

    @property
    def config(self) -> Path:
        return self.dir / "config.yaml"

    @property
    def env(self) -> Path:
        return self.dir / "env.json"

    @property
    def plan(self) -> Path:
        return self.dir / "plan.json"

    @property
    def summary(self) -> Path:
        return self.dir / "summary.json"

    @property
    def metrics(self) -> Path:
        return self.dir / "metrics.jsonl"

    @property
    def memory_summary(self) -> Path:
        return self.dir / "memory_summary.txt"

    @property
    def lock(self) -> Path:
        return self.dir / ".vramfit.lock"


@contextlib.contextmanager
def locked(paths: RunPaths):
    """Hold the run folder for one run: an advisory lock (flock) on its lock file, which the OS
    releases when the process ends however it ends, so a SIGKILL never leaves a stale lock. A
    second run into the same folder stops at once, naming the run that holds it."""
    import fcntl

    paths.dir.mkdir(parents=True, exist_ok=True)
    f = open(paths.lock, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise VramfitError(f"Run folder {paths.dir} is in use by another run ({holder}).",
                           hint="wait for that run to end (or stop it: it resumes later), or give this one "
                                "another --run-name or --output") from None
    try:
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        f.flush()
        yield
    finally:
        fcntl.flock(f, fcntl.LOCK_UN)
        f.close()
