"""`vramfit prepare`: decode and shrink a dataset once, instead of every epoch.

Every image is decoded (EXIF rotation, alpha, 16-bit ... handled by `decode_image`), shrunk so its
longer side is at most `max_side`, re-encoded as a JPEG and written, with its ClassLabel, into an
Arrow dataset (`save_to_disk`) that `--data DST` then loads. Splits are kept as the source has them
(train, and validation if it has one; a source without one is still split at training time).
Unreadable files are dropped, counted and listed (also in DST/vramfit_prepare.json).
"""

from __future__ import annotations

import io
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from PIL import Image

from .config import DataConfig
from .data import load_source
from .decode import BadImage, decode_image, describe
from .errors import VramfitError

CHUNK = 32
REPORT = "vramfit_prepare.json"

_WORKER: dict = {}


def _init_worker(parts, image_col, label_col, max_side, quality) -> None:
    _WORKER.update(parts=parts, image_col=image_col, label_col=label_col, max_side=max_side,
                   quality=quality)


def shrink(item, max_side: int, quality: int) -> tuple[bytes, tuple[int, int]]:
    """JPEG bytes of the item with its longer side <= max_side (never enlarged)."""
    # Draft to a shorter side of max_side: enough for any aspect ratio, since the result's
    # shorter side is at most max_side.
    img = decode_image(item, max_side)
    w, h = img.size
    if max(w, h) > max_side:
        s = max_side / max(w, h)
        img = img.resize((max(1, round(w * s)), max(1, round(h * s))), Image.Resampling.LANCZOS,
                         reducing_gap=3.0)
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=quality)
    return buf.getvalue(), img.size


def _prepare_chunk(job: tuple[str, int, int]):
    split, start, stop = job
    w = _WORKER
    ds = w["parts"][split]
    rows = ds[start:stop]
    out = []
    for k, (item, label) in enumerate(zip(rows[w["image_col"]], rows[w["label_col"]])):
        name = describe(item)
        try:
            data, _ = shrink(item, w["max_side"], w["quality"])
            out.append((start + k, name, data, int(label), ""))
        except BadImage as e:
            out.append((start + k, name, None, int(label), e.reason))
    return split, out


def prepare(cfg: DataConfig, output: str, max_side: int = 320, quality: int = 90,
            workers: int | None = None, log=None) -> dict:
    import datasets
    from datasets.arrow_writer import ArrowWriter

    log = log or sys.stdout
    if max_side < 8:
        raise VramfitError(f"--max-side {max_side} is too small.",
                           hint="use at least the training image size, e.g. --max-side 320 for 224 px")
    if not 1 <= quality <= 100:
        raise VramfitError(f"--quality {quality} is outside 1..100.", hint="90 keeps JPEG artefacts invisible")
    out = Path(output).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise VramfitError(f"--output {out} already exists and is not empty.",
                           hint="pick a new folder; prepare never overwrites")
    t0 = time.time()
    src = load_source(cfg)
    parts = {"train": src.train, **({"validation": src.val} if src.val is not None else {})}
    # `file`: where each image came from (save_to_disk keeps only the base name in the image's path).
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=src.class_names),
                                  "file": datasets.Value("string")})
    root = str(src.root) + os.sep if src.root else None
    workers = workers or _cpus()
    jobs = [(k, s, min(s + CHUNK, len(ds))) for k, ds in parts.items() for s in range(0, len(ds), CHUNK)]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    dropped: list[dict] = []
    written = {k: 0 for k in parts}
    bytes_out = 0
    print(f"prepare: {src.description} -> {out} (longer side <= {max_side} px, JPEG q{quality}, "
          f"{workers} worker(s))", file=log)
    for note in src.notes:
        print(f"  note: {note}", file=log)
    try:
        writers = {k: ArrowWriter(features=features, path=str(tmp / f"{k}.arrow")) for k in parts}
        init = (parts, src.image_column, src.label_column, max_side, quality)
        if workers <= 1:
            _init_worker(*init)
            results = map(_prepare_chunk, jobs)
            pool = None
        else:
            pool = mp.get_context().Pool(workers, _init_worker, init)
            results = pool.imap(_prepare_chunk, jobs)  # ordered: the output keeps the source order
        try:
            for split, rows in results:
                for index, name, data, label, reason in rows:
                    if data is None:
                        dropped.append({"split": split, "index": index, "file": name,
                                        "reason": reason})
                        continue
                    if name.startswith("<"):  # no file name: bytes inside a dataset
                        name = f"{split}-{index:08d}.jpg"
                    elif root and name.startswith(root):
                        name = name[len(root):]
                    # Written as is, not through features.encode_example: that keeps only the
                    # path when it names an existing file, and save_to_disk would then embed
                    # the original, unshrunk file.
                    writers[split].write({"image": {"bytes": data, "path": name}, "label": label,
                                          "file": name})
                    written[split] += 1
                    bytes_out += len(data)
        finally:
            if pool is not None:
                pool.close()
                pool.join()
        for w in writers.values():
            w.finalize()
            w.close()
        if written["train"] == 0:
            raise VramfitError("prepare: no readable training image, nothing written.",
                               hint="run `vramfit scan-data --data SRC` to see why")
        dd = datasets.DatasetDict({k: datasets.Dataset.from_file(str(tmp / f"{k}.arrow"))
                                   for k in parts if written[k]})
        staging = tmp / "dataset"
        bars = datasets.is_progress_bar_enabled()
        datasets.disable_progress_bars()  # one bar per split; our summary line says it all
        try:
            dd.save_to_disk(str(staging))
        finally:
            if bars:
                datasets.enable_progress_bars()
        report = {"source": cfg.source, "description": src.description, "max_side": max_side,
                  "quality": quality, "class_names": src.class_names, "written": written,
                  "bytes": bytes_out, "dropped": dropped, "notes": src.notes,
                  "seconds": round(time.time() - t0, 2)}
        (staging / REPORT).write_text(json.dumps(report, indent=1))
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.replace(staging, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    total = sum(written.values())
    split_text = ", ".join(f"{k} {n}" for k, n in written.items())
    print(f"wrote {total} images ({split_text}, {len(src.class_names)} classes, "
          f"{bytes_out / 1e6:.1f} MB) in {time.time() - t0:.1f} s; dropped {len(dropped)} "
          f"unreadable file(s){':' if dropped else ''}", file=log)
    for d in dropped:
        print(f"  {d['split']}  {d['file']}: {d['reason']}", file=log)
    print(f"train on it with: vramfit train --data {out}", file=log)
    log.flush()
    return report


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
