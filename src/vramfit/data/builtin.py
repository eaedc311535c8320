"""The built-in `digits` dataset: scikit-learn's 1,797 real 8x8 handwritten digits, 10 classes.

Written once as an ordinary class-folder tree of PNGs, so the quickstart goes through exactly the
same HF `datasets` image-folder path as a user's photos, with no download.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

BUILTIN = ("digits",)
_VERSION = "v1"


def local_source(source: str) -> Path | None:
    """The file or folder on this machine a --data value names; None for a Hub id and for a built-in
    name, which always means the built-in data wherever the command runs (a local folder of that
    name is reached as `./digits`). The one rule the data loading (data.sources) and the run's
    identity (store.resume) follow, so a run resumes from any folder it is rerun in."""
    if source in BUILTIN:
        return None
    path = Path(source).expanduser()
    return path if path.exists() else None


def shadow_note(source: str) -> str | None:
    """What to say when a built-in name is also a file or folder here (which is not read)."""
    if source not in BUILTIN or not Path(source).exists():
        return None
    return (f"--data {source} is the built-in dataset; the {source} here ({Path(source).resolve()}) is not "
            f"read (pass ./{source} to train on it)")


def cache_root(override: str | None = None) -> Path:
    if override:
        return Path(override).expanduser()
    base = os.environ.get("VRAMFIT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "vramfit")
    return Path(base)


def ensure_digits(cache_dir: str | None = None) -> Path:
    """Return the folder of the digits image tree, writing it on first use (atomically)."""
    root = cache_root(cache_dir)
    final = root / f"digits-{_VERSION}"
    if (final / ".complete").exists():
        return final
    from sklearn.datasets import load_digits  # ships the data inside the package

    digits = load_digits()
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".digits-", dir=root))
    # Pixel values are 0..16; scale to the full uint8 range like a scanned grey image.
    images = np.clip(digits.images * (255.0 / 16.0), 0, 255).astype(np.uint8)
    for i, (img, target) in enumerate(zip(images, digits.target)):
        d = tmp / str(int(target))
        d.mkdir(exist_ok=True)
        Image.fromarray(img, mode="L").save(d / f"{i:04d}.png")
    (tmp / ".complete").write_text(f"{len(images)}\n")
    try:
        tmp.rename(final)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
        if not (final / ".complete").exists():
            raise
    return final
