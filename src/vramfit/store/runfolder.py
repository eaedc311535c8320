"""Where a run lives: its name and folder, and the name of every file in it (the run-folder
contract: README, "Run folder"). The one place these paths are worked out; the trainer writes them,
and `eval`, `predict`, `export`, `compare` and the model card read them."""

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
DATA_MAX_BYTES = 48  # a longer data name keeps its start and a hash of the whole
NAME_MAX_DEFAULT = 160  # well inside a folder name's 255 bytes (runtime.storage.NAME_MAX_BYTES)


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
        name += f"-{_fitted(data, DATA_MAX_BYTES)}"
    readable = "-".join(f"{key.rsplit('.', 1)[-1]}{_short(value)}" for key, value in settings)
    if len(readable) > MAX_READABLE:
        readable = "cfg" + _hash(repr(settings))
    name = f"{name}-{_safe(readable)}" if readable else name
    return _fitted(name, NAME_MAX_DEFAULT)


def _fitted(text: str, max_bytes: int) -> str:
    """`text` when it fits in `max_bytes` (UTF-8), else its start cut at a character and a hash of
    the whole: readable, and the same text always gives the same name."""
    if len(text.encode()) <= max_bytes:
        return text
    tail = "-" + _hash(text)
    return text.encode()[:max_bytes - len(tail)].decode(errors="ignore") + tail


def _hash(text: str) -> str:
    import hashlib

    return hashlib.blake2b(text.encode(), digest_size=4).hexdigest()


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
        return self.dir / LOCK_NAME


LOCK_NAME = ".vramfit.lock"


def is_run_folder(folder: Path) -> bool:
    """Whether `folder` is a run folder (every run holds its lock file from its first moment): what
    vramfit wrote, never data, even where --output is a data folder."""
    return (Path(folder) / LOCK_NAME).is_file()


# The lock files this process holds. A forked child (a loader worker, a `datasets` map process)
# shares the parent's open file, and with it the flock: a trainer killed by SIGKILL would leave its
# folder locked until its orphaned workers noticed and ended (5 s, longer under load), and the same
# command rerun at once was refused as "in use". Each child closes its copy as it starts.
_HELD: list = []


def _drop_inherited_locks() -> None:
    # dup2 rather than close: the child's file object stays valid (its fd now /dev/null) and can
    # never close a number reused by another file. Only this copy goes; the parent keeps its lock.
    for f in _HELD:
        null = os.open(os.devnull, os.O_RDWR)
        try:
            os.dup2(null, f.fileno())
        finally:
            os.close(null)
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_drop_inherited_locks)


@contextlib.contextmanager
def locked(paths: RunPaths):
    """Hold the run folder for one run: an advisory lock (flock) on its lock file, which the OS
    releases when the process ends however it ends, so a SIGKILL never leaves a stale lock (no
    forked child keeps it: `_drop_inherited_locks`). A second run into the same folder stops at
    once, naming the run that holds it."""
    import fcntl

    from ..runtime import storage

    storage.unwatch(paths.dir)  # a run folder removed under an earlier run of this process
    storage.make_folder(paths.dir)
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
        _HELD.append(f)
        storage.watch(paths.dir)
        try:
            yield
        except Exception as e:  # noqa: BLE001 - a library's own writer (TensorBoard's) failed in the folder
            told = storage.escaped_fault(e, near=paths.dir)
            if told is None or told is e:
                raise
            raise told from None
    finally:
        storage.unwatch(paths.dir, keep_removed=True)
        with contextlib.suppress(ValueError):
            _HELD.remove(f)
        fcntl.flock(f, fcntl.LOCK_UN)
        f.close()
