"""`vramfit scan-data`: decode every image of a dataset once, before a run depends on it.

Lists the files training would skip (unreadable) and the ones that train but deserve a look
(tiny, huge, extreme aspect, 16-bit, CMYK, alpha ...), then one summary line. Exit status 1 when any
file is unreadable, so it can gate a pipeline.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass

from PIL import Image

from ..config import DataConfig
from ..data import Source, load_source
from ..data.decode import BadImage, decode_image, describe, quiet_bomb_warnings, read_file

# Thresholds of the "unusual" flags (docs/data.md): none of them stops training.
TINY_SIDE = 32  # px: upscaled a lot to any useful image_size
HUGE_PIXELS = 40_000_000  # 40 Mpx: slow to decode every epoch; `vramfit prepare` fixes it
EXTREME_ASPECT = 10.0  # long / short side: a centre crop keeps a small part of it
EXAMPLES_PER_KIND = 10  # rows of the table per unusual kind; the summary counts all of them
CHUNK = 64


@dataclass
class Finding:
    split: str
    index: int
    name: str
    size: str  # "WxH" or ""
    mode: str
    problem: str  # unreadable reason, or "" when readable
    flags: tuple[str, ...]  # unusual kinds


def inspect_item(item) -> tuple[str, str, str, tuple[str, ...]]:
    """(size, mode, problem, flags) of one dataset image item."""
    size, mode, flags = "", "", []
    data = item
    try:
        if isinstance(item, dict) and item.get("bytes") is None and item.get("path"):
            data = {"bytes": read_file(item["path"]), "path": item["path"]}  # read once, use twice
        raw = data.get("bytes") if isinstance(data, dict) else data
        if isinstance(raw, (bytes, bytearray)) and raw:
            with quiet_bomb_warnings():  # the `huge` flag says it, once per file
                img = Image.open(io.BytesIO(raw))  # header only: mode, size, frames
            with img:
                size, mode = f"{img.width}x{img.height}", img.mode
                flags += _flags(img)
        elif isinstance(raw, Image.Image):
            size, mode = f"{raw.width}x{raw.height}", raw.mode
            flags += _flags(raw)
    except BadImage as e:
        return size, mode, e.reason, ()
    except Exception:  # noqa: BLE001 - the full decode below gives the reason
        pass
    try:
        decode_image(data)  # the decoder training uses, full size: every pixel is read
    except BadImage as e:
        return size, mode, e.reason, ()
    return size, mode, "", tuple(flags)


def _flags(img: Image.Image) -> list[str]:
    w, h = img.size
    out = []
    if min(w, h) < TINY_SIDE:
        out.append("tiny")
    if w * h > HUGE_PIXELS:
        out.append("huge")
    if max(w, h) >= EXTREME_ASPECT * max(1, min(w, h)):
        out.append("extreme aspect")
    m = img.mode
    if m.startswith("I;16") or m == "I":
        out.append("16-bit" if m.startswith("I;16") else "32-bit int")
    elif m == "F":
        out.append("32-bit float")
    elif m == "CMYK":
        out.append("CMYK")
    elif m in ("L", "1"):
        out.append("grayscale")
    elif m not in ("RGB", "RGBA", "LA", "La", "PA", "RGBa", "P"):
        out.append(f"mode {m}")
    if m in ("RGBA", "LA", "La", "PA", "RGBa") or "transparency" in img.info:
        out.append("alpha")
    elif m == "P":
        out.append("palette")
    if getattr(img, "n_frames", 1) > 1:
        out.append("animated (first frame used)" if img.format in ("GIF", "PNG", "WEBP") else "multi-frame")
    return out


# ---- the pool: each worker holds the splits (inherited or unpickled once), gets index chunks ----

_WORKER: dict = {}


def _init_worker(parts: dict, image_col: str) -> None:
    _WORKER.update(parts=parts, image_col=image_col)


def _scan_chunk(job: tuple[str, int, int]) -> list[Finding]:
    split, start, stop = job
    ds, col = _WORKER["parts"][split], _WORKER["image_col"]
    out = []
    for i in range(start, stop):
        item = ds[i][col]
        size, mode, problem, flags = inspect_item(item)
        if problem or flags:
            out.append(Finding(split, i, describe(item), size, mode, problem, flags))
    return out


def scan_source(src: Source, workers: int | None = None) -> tuple[list[Finding], dict[str, int]]:
    parts = {"train": src.train, **({src.val_name or "val": src.val} if src.val is not None else {})}
    counts = {k: len(v) for k, v in parts.items()}
    jobs = [(k, s, min(s + CHUNK, n)) for k, n in counts.items() for s in range(0, n, CHUNK)]
    workers = workers or _cpus()
    findings: list[Finding] = []
    if workers <= 1 or sum(counts.values()) <= 2 * CHUNK:
        _init_worker(parts, src.image_column)
        for job in jobs:
            findings.extend(_scan_chunk(job))
    else:
        with mp.get_context().Pool(workers, _init_worker, (parts, src.image_column)) as pool:
            for found in pool.imap(_scan_chunk, jobs):
                findings.extend(found)
    return findings, counts


def scan_data(cfg: DataConfig, workers: int | None = None, out=None) -> int:
    out = out or sys.stdout
    t0 = time.time()
    src = load_source(cfg)
    findings, counts = scan_source(src, workers)
    total = sum(counts.values())
    bad = [f for f in findings if f.problem]
    unusual = [f for f in findings if f.flags]
    root = str(src.root) + os.sep if src.root else None

    def name(f: Finding) -> str:
        n = f.name
        if root and n.startswith(root):
            return n[len(root):]
        return n if not n.startswith("<") else f"{f.split}[{f.index}] {n}"

    rows = [(f.split, name(f), f.size or "?", f.mode or "?", f"UNREADABLE: {f.problem}") for f in bad]
    kinds = Counter(k for f in unusual for k in f.flags)
    shown: Counter = Counter()
    for f in unusual:
        new = [k for k in f.flags if shown[k] < EXAMPLES_PER_KIND]
        if new:
            for k in f.flags:
                shown[k] += 1
            rows.append((f.split, name(f), f.size, f.mode, ", ".join(f.flags)))
    print(f"scan-data: {src.description}", file=out)
    for note in src.notes:
        print(f"  note: {note}", file=out)
    if rows:
        _table(("SPLIT", "FILE", "SIZE", "MODE", "PROBLEM"), rows, out)
        hidden = {k: n - shown[k] for k, n in kinds.items() if n > shown[k]}
        if hidden:
            print("  (not listed: " + ", ".join(f"{n} more {k}" for k, n in sorted(hidden.items())) + ")",
                  file=out)
    per_split = " / ".join(f"{k} {n}" for k, n in counts.items())
    kinds_text = ", ".join(f"{k} {n}" for k, n in kinds.most_common())
    print(f"{total} images ({per_split}) in {time.time() - t0:.1f} s: {len(bad)} unreadable, "
          f"{len(unusual)} unusual{' (' + kinds_text + ')' if kinds_text else ''}", file=out)
    if bad:
        print(f"HINT: training replaces unreadable train images and stops above "
              f"data.max_bad_fraction={cfg.max_bad_fraction:.1%}; fix or delete the files above.",
              file=out)
    out.flush()
    return 1 if bad else 0


def _table(header, rows, out) -> None:
    widths = [min(60, max(len(str(r[i])) for r in (header, *rows))) for i in range(len(header) - 1)]
    for r in (header, *rows):
        cells = [str(c) if len(str(c)) <= w else "..." + str(c)[-(w - 3):] for c, w in zip(r, widths)]
        print("  " + "  ".join(c.ljust(w) for c, w in zip(cells, widths)) + "  " + str(r[-1]), file=out)


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
