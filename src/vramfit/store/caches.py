"""The folders written outside the run folder: vramfit's own cache (the built-in data, the
micro-batch fit cache) and the caches HF `datasets` and `evaluate` write (parquet and arrow
conversions, metric scratch files). A read-only or full HOME must not end a run halfway: each one
that cannot be written is moved, for this process, to a writable folder, and said once with the
setting that chooses it for good."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path


def _hf_home() -> str:
    return os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface")


def _vramfit_cache() -> str:
    from ..data.builtin import cache_root

    return str(cache_root())


# name: (the environment variable that sets it, the library's module and attribute that hold it
# once imported, its default)
CACHES = {
    "vramfit": ("VRAMFIT_CACHE", None, _vramfit_cache),
    "datasets": ("HF_DATASETS_CACHE", ("datasets.config", "HF_DATASETS_CACHE"),
                 lambda: os.path.join(_hf_home(), "datasets")),
    "evaluate": ("HF_METRICS_CACHE", ("evaluate.config", "HF_METRICS_CACHE"),
                 lambda: os.path.join(_hf_home(), "metrics")),
}


def writable(folder: str | Path) -> bool:
    """Whether a file can be created in `folder` (made if missing)."""
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".vramfit-probe-"):
            return True
    except OSError:
        return False


def current(name: str) -> str:
    env, attr, default = CACHES[name]
    module = sys.modules.get(attr[0]) if attr else None
    if module is not None:
        return str(getattr(module, attr[1]))
    return os.environ.get(env) or default()


def redirect_unwritable(base: Path | None = None) -> list[str]:
    """Point every cache that cannot be written at `<base>/.cache/<name>` (or a per-user temporary
    folder), for this process; returns what to say about each one moved."""
    fallback_root = Path(base) / ".cache" if base is not None else Path(tempfile.gettempdir()) / f"vramfit-{os.getuid()}"
    notes = []
    for name, (env, attr, _) in CACHES.items():
        folder = current(name)
        if writable(folder):
            continue
        moved = fallback_root / name
        if not writable(moved):
            moved = Path(tempfile.gettempdir()) / f"vramfit-{os.getuid()}" / name
            if not writable(moved):
                notes.append(f"the {name} cache {folder} cannot be written, nor any fallback: set {env} "
                             "to a writable folder")
                continue
        os.environ[env] = str(moved)
        module = sys.modules.get(attr[0]) if attr else None
        if module is not None:
            with contextlib.suppress(AttributeError):
                setattr(module, attr[1], type(getattr(module, attr[1]))(moved))
        notes.append(f"the {name} cache {folder} cannot be written: using {moved} for this run "
                     f"(set {env} to choose; HF_HOME or XDG_CACHE_HOME move them all)")
    return notes


def read_entry(path: Path, key: str):
    """One entry of a JSON cache file of entries (the micro-batch and fit caches); None when the
    file, the entry or its JSON is missing."""
    try:
        return json.loads(Path(path).read_text())[key]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_entry(path: Path, key: str, value) -> None:
    """Set one entry of a JSON cache file, replacing the file whole (a reader never sees half of
    it); an unreadable file starts over. Raises OSError when it cannot be written."""
    from ..runtime.storage import write_json

    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = {}
    data[key] = value
    write_json(path, data, tell=False)

