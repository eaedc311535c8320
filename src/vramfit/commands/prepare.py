"""`vramfit prepare`: decode and shrink a dataset once, instead of every epoch.

Every image is decoded (EXIF rotation, alpha, 16-bit ... handled by `decode_image`), shrunk so its
longer side is at most `max_side`, re-encoded as a JPEG and written, with its ClassLabel, into an
Arrow dataset (`save_to_disk`) that `--data DST` then loads. Splits are kept as the source has them
(train, validation if it has one, and held-out splits such as test under their own names; a source
without a validation split is still split at training time).
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
from typing import Iterable

import numpy as np
from PIL import Image

from ..config import DataConfig
from ..data import load_eval_split, load_source, load_splits
from ..data.decode import BadImage, decode_image, describe
from ..data.ordering import mix_seed
from ..errors import VramfitError

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
    log = log or sys.stdout
    out = _check_request(output, max_side, quality)
    t0 = time.time()
    src = load_source(cfg)
    notes = list(src.notes)
    parts = _parts(cfg, src, notes)
    workers = workers or _cpus()
    print(f"prepare: {src.description} -> {out} (longer side <= {max_side} px, JPEG q{quality}, "
          f"{workers} worker(s))", file=log)
    for note in notes:
        print(f"  note: {note}", file=log)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        written, dropped, bytes_out = _convert(parts, src, tmp, max_side, quality, workers)
        if written["train"] == 0:
            raise VramfitError("prepare: no readable training image, nothing written.",
                               hint="run `vramfit scan-data --data SRC` to see why")
        report = {"source": cfg.source, "description": src.description, "max_side": max_side,
                  "quality": quality, "class_names": src.class_names, "written": written,
                  "bytes": bytes_out, "dropped": dropped, "notes": notes,
                  "seconds": round(time.time() - t0, 2)}
        _save(tmp, written, report, out)
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


def _check_request(output: str, max_side: int, quality: int) -> Path:
    if max_side < 8:
        raise VramfitError(f"--max-side {max_side} is too small.",
                           hint="use at least the training image size, e.g. --max-side 320 for 224 px")
    if not 1 <= quality <= 100:
        raise VramfitError(f"--quality {quality} is outside 1..100.", hint="90 keeps JPEG artefacts invisible")
    out = Path(output).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise VramfitError(f"--output {out} already exists and is not empty.",
                           hint="pick a new folder; prepare never overwrites")
    return out


def _parts(cfg: DataConfig, src, notes: list[str]) -> dict:
    """The splits to write: train, validation, and the held-out splits (e.g. test) under their own
    names, so the prepared dataset keeps them for a final evaluation (never as validation)."""
    parts = {"train": src.train, **({"validation": src.val} if src.val is not None else {})}
    for name in src.held_out:
        try:
            parts[name] = load_eval_split(cfg, name, src.class_names)
        except VramfitError as e:  # e.g. an unlabelled Hub test split: train and validation still go
            notes.append(f"{name} split not written: {e.message}")
    return parts


def _convert(parts: dict, src, tmp: Path, max_side: int, quality: int, workers: int):
    """Shrink every image of `parts` into one Arrow file per split under tmp:
    (written per split, dropped files, bytes written)."""
    import datasets
    from datasets.arrow_writer import ArrowWriter

    # `file`: where each image came from (save_to_disk keeps only the base name in the image's path).
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=src.class_names),
                                  "file": datasets.Value("string")})
    root = str(src.root) + os.sep if src.root else None
    jobs = [(k, s, min(s + CHUNK, len(ds))) for k, ds in parts.items() for s in range(0, len(ds), CHUNK)]
    dropped: list[dict] = []
    written = {k: 0 for k in parts}
    bytes_out = 0
    writers = {k: ArrowWriter(features=features, path=str(tmp / f"{k}.arrow")) for k in parts}
    init = (parts, src.image_column, src.label_column, max_side, quality)
    if workers <= 1:
        _init_worker(*init)
        results, pool = map(_prepare_chunk, jobs), None
    else:
        pool = mp.get_context().Pool(workers, _init_worker, init)
        results = pool.imap(_prepare_chunk, jobs)  # ordered: the output keeps the source order
    try:
        for split, rows in results:
            for index, name, data, label, reason in rows:
                if data is None:
                    dropped.append({"split": split, "index": index, "file": name, "reason": reason})
                    continue
                if name.startswith("<"):  # no file name: bytes inside a dataset
                    name = f"{split}-{index:08d}.jpg"
                elif root and name.startswith(root):
                    name = name[len(root):]
                # Written as is, not through features.encode_example: that keeps only the path when
                # it names an existing file, and save_to_disk would then embed the original file.
                writers[split].write({"image": {"bytes": data, "path": name}, "label": label, "file": name})
                written[split] += 1
                bytes_out += len(data)
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    for w in writers.values():
        w.finalize()
        w.close()
    return written, dropped, bytes_out


def _save(tmp: Path, written: dict, report: dict, out: Path) -> None:
    """The written splits as one saved dataset, moved into place whole (never half-written)."""
    import datasets

    dd = datasets.DatasetDict({k: datasets.Dataset.from_file(str(tmp / f"{k}.arrow"))
                               for k, n in written.items() if n})
    staging = tmp / "dataset"
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # one bar per split; our summary line says it all
    try:
        dd.save_to_disk(str(staging))
    finally:
        if bars:
            datasets.enable_progress_bars()
    (staging / REPORT).write_text(json.dumps(report, indent=1))
    if out.exists():
        out.rmdir()  # empty (checked above)
    os.replace(staging, out)


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


# Shard rule: a new shard once the next sample would take it past `shard_mb` MB (128 MB: ImageNet's
# 140 GB in ~1,100 shards, each read in well under a second on local disks, so shuffling the shard
# order each epoch mixes well), or past `shard_samples` samples when that is set.
SHARD_MB = 128


def prepare_shards(cfg: DataConfig, output: str, shard_mb: float = SHARD_MB, shard_samples: int = 0,
                   log=None) -> dict:
    """Write a dataset as WebDataset tar shards (`train-000000.tar`, `val-000000.tar`, ...) and
    `index.json`; train with `--data OUTPUT`. Images are stored as they are (the bytes of the file
    or of the dataset, never re-encoded), with a `.cls` label; the train split in a seeded random
    order (`_shuffled`), the others in the source's."""
    from ..data.shards import INDEX

    log = log or sys.stdout
    out = _check_request(output, 320, 90)
    t0 = time.time()
    src = load_source(cfg)
    notes = list(src.notes)
    parts = _parts(cfg, src, notes)
    if src.val is None:  # shards are not split at training time: hold validation out here, as a run would
        held = load_splits(cfg)
        parts.update(train=held.train, validation=held.val)
        notes += [n for n in held.notes if n not in notes]
    print(f"prepare: {src.description} -> {out} (WebDataset tar shards of at most {shard_mb:g} MB"
          + (f" / {shard_samples} samples" if shard_samples else "")
          + f", train samples shuffled by data.split_seed {cfg.split_seed})", file=log)
    for note in notes:
        print(f"  note: {note}", file=log)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        splits = {}
        for name, ds in parts.items():
            prefix = "val" if name == "validation" else name
            order = _shuffled(len(ds), cfg.split_seed) if name == "train" else range(len(ds))
            splits[prefix] = _write_shards(ds, src, prefix, tmp, shard_mb * 1e6, shard_samples, order)
            splits[prefix].update({"order": "shuffled", "split_seed": cfg.split_seed} if name == "train"
                                  else {"order": "source"})
        index = {"format": "webdataset", "source": cfg.source, "description": src.description,
                 "class_names": src.class_names, "splits": splits, "notes": notes}
        (tmp / INDEX).write_text(json.dumps(index, indent=1))
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    counts = ", ".join(f"{k} {v['samples']} in {len(v['shards'])} shard(s)" for k, v in splits.items())
    print(f"wrote {counts} ({len(src.class_names)} classes) in {time.time() - t0:.1f} s", file=log)
    print(f"train on it with: vramfit train --data {out}", file=log)
    log.flush()
    return index


def _encoded(item) -> tuple[bytes, str]:
    """The stored bytes of an image item and the extension they are named by (from the file name,
    else from what PIL recognises); unrecognisable bytes go as `.bin` and count as unreadable at
    training time, like any unreadable image."""
    from ..data import IMAGE_EXTENSIONS

    data, path = (item.get("bytes"), item.get("path")) if isinstance(item, dict) else (None, item)
    if data is None:
        with open(path, "rb") as f:
            data = f.read()
    ext = os.path.splitext(str(path or ""))[1].lower()
    if ext not in IMAGE_EXTENSIONS:
        try:
            with Image.open(io.BytesIO(data)) as im:
                ext = "." + {"JPEG": "jpg"}.get(im.format, (im.format or "bin").lower())
        except Exception:  # noqa: BLE001 - PIL raises many types for what is not an image
            ext = ".bin"
    return data, ext


def _shuffled(n: int, split_seed: int) -> list[int]:
    """The train split's order in its shards: seeded by data.split_seed, so that a run's shuffle
    buffer, which holds a few shards' samples, mixes classes even where the source is sorted by
    class (a folder); the same on every run (`prepare` twice writes the same
    bytes). The order a run reads them in is then the sampler's (data.shards)."""
    return np.random.default_rng(mix_seed(split_seed, "shard order")).permutation(n).tolist()


def _write_shards(ds, src, prefix: str, tmp: Path, max_bytes: float, max_samples: int,
                  order: Iterable[int]) -> dict:
    """One split as tar shards under tmp, its rows in `order`, each sample keyed by its row number
    in the split: {"samples", "shards": [{"name", "samples", "bytes", "offsets"}]}. Beside each shard,
    its samples' header offsets (data.shards.write_offsets), so a run never scans its headers."""
    import tarfile

    from ..data.shards import OFFSETS, write_offsets

    shards: list[dict] = []
    offsets: list[list[int]] = []
    tar, size = None, 0
    for i in order:
        row = ds[i]
        data, ext = _encoded(row[src.image_column])
        cls = str(int(row[src.label_column])).encode()
        full = shards and (size + len(data) > max_bytes or max_samples and shards[-1]["samples"] >= max_samples)
        if tar is None or full:
            if tar is not None:
                tar.close()
            name = f"{prefix}-{len(shards):06d}"
            shards.append({"name": f"{name}.tar", "samples": 0, "bytes": 0, "offsets": f"{name}{OFFSETS}"})
            offsets.append([])
            tar, size = tarfile.open(tmp / shards[-1]["name"], "w", format=tarfile.USTAR_FORMAT), 0
        offsets[-1].append(tar.offset)  # where the archive ends now: the sample's first header
        for name, payload in ((f"{i:08d}{ext}", data), (f"{i:08d}.cls", cls)):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(payload), 0o444, 0  # same bytes on every run
            tar.addfile(info, io.BytesIO(payload))
        size += len(data)
        shards[-1]["samples"] += 1
    if tar is not None:
        tar.close()
    for s, offs in zip(shards, offsets):
        s["bytes"] = (tmp / s["name"]).stat().st_size
        write_offsets(tmp / s["offsets"], offs)
    return {"samples": sum(s["samples"] for s in shards), "shards": shards}
