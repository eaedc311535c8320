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

from ..errors import VramfitError


# The settings the start of a default run name carries (the rest of the run's identity that differs
# from its recipe follows them: config.maths_settings).
NAMED_IN_BASE = {"model.name", "data.image_size", "train.global_batch", "train.precision", "train.seed", "data.source"}
MAX_READABLE = 40  # longer differences are named by a short hash


def default_run_name(cfg, precision_name: str) -> str:
    """Named from what distinguishes runs, so they line up side by side in W&B and on disk: the
    recipe, model, image size, global batch, the precision that runs (not `auto`) and the seed; then
    the data when it is not the recipe's, and the settings that change the run where they differ
    from the recipe's. The same command on the same machine gives the same name (re-running it
    resumes); commands that train differently never share a folder."""
    recipe = Path(cfg.recipe).stem if cfg.recipe else "custom"
    model = cfg.model.name.replace("/", "_").replace(":", "_")
    name = (f"{recipe}-{model}-{cfg.data.image_size}px-gb{cfg.train.global_batch}"
            f"-{precision_name}-s{cfg.train.seed}")
    data, settings = _differences(cfg)
    if data:
        name += f"-{data}"
    readable = "-".join(f"{key.rsplit('.', 1)[-1]}{_short(value)}" for key, value in settings)
    if len(readable) > MAX_READABLE:
        import hashlib

        readable = "cfg" + hashlib.blake2b(repr(settings).encode(), digest_size=4).hexdigest()
    return f"{name}-{_safe(readable)}" if readable else name


def _differences(cfg) -> tuple[str | None, list[tuple[str, object]]]:
    """(the data's short name when it is not the recipe's, the settings of the run's identity that
    differ from the recipe's with the same model), sorted by key."""
    from ..config import Config, build_config, maths_settings

    base = build_config(cfg.recipe, flags={"model.name": cfg.model.name}, say=False) if cfg.recipe else \
        Config.model_validate({"model": {"name": cfg.model.name}})
    ours, theirs = maths_settings(cfg), maths_settings(base)
    data = None
    if ours.get("data.source") != theirs.get("data.source"):
        data = _safe(data_short_name(ours["data.source"]))
    settings = [(k, v) for k, v in sorted(ours.items()) if theirs.get(k, object()) != v and k not in NAMED_IN_BASE]
    return data, settings


def data_short_name(source) -> str:
    """The data a run trains on, short: `digits`, a folder's or file's own name, a Hub id's last
    part (what run names and `compare` show)."""
    text = str(source).rstrip("/")
    return Path(text).name or text


def _short(value) -> str:
    if isinstance(value, (list, tuple)):
        return "+".join(map(str, value)) or "none"
    return {True: "on", False: "off", None: "none"}.get(value, str(value)) if not isinstance(value, (int, float)) \
        or isinstance(value, bool) else f"{value:g}"


def _safe(text: str) -> str:
    return "".join(c if c.isalnum() or c in "._=+-" else "_" for c in text)


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

    def config_until(self, step: int) -> Path:
        """The settings the run ran with up to `step`, where a resume there was allowed to change them."""
        return self.dir / f"config-to-step-{step}.yaml"

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
    def lr_find_plot(self) -> Path:
        """`vramfit lr-find`'s plot for these settings: beside the run folder they train into (not in
        it: lr-find makes no run, and the folder stays the training run's)."""
        return self.dir.parent / f"{self.name}.lr_find.png"

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
