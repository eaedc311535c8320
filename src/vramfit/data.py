"""HF `datasets` sources -> decoded, augmented uint8 batches, in an order that is a pure function of
(seed, epoch), so a resumed or rescaled run sees exactly the same samples."""

from __future__ import annotations

import hashlib
import logging
import os
import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .builtin_data import BUILTIN, ensure_digits
from .config import DataConfig
from .decode import BadImage, decode_image, describe
from .errors import VramfitError

log = logging.getLogger(__name__)

IMAGE_COLUMNS = ("image", "img", "images", "pixel_values", "picture", "photo", "jpg", "png", "webp")
LABEL_COLUMNS = ("label", "labels", "fine_label", "target", "targets", "class", "category",
                 "coarse_label", "cls", "y")
VAL_SPLITS = ("validation", "val", "valid", "test", "eval")


# ---------------------------------------------------------------------------------------------
# Sources


@dataclass
class Splits:
    train: "datasets.Dataset"  # noqa: F821 - image column cast to Image(decode=False), int labels
    val: "datasets.Dataset"  # noqa: F821
    class_names: list[str]
    image_column: str
    label_column: str
    description: str
    notes: list[str] = field(default_factory=list)


def _looks_like_path(s: str) -> bool:
    return s.startswith((".", "/", "~")) or os.sep in s.strip("/").split("/", 1)[-1] or \
        s.endswith((".parquet", ".arrow")) or s.count("/") > 1


def _load_raw(cfg: DataConfig):
    """Return (DatasetDict-or-Dataset, description) for any supported source."""
    import datasets

    src = cfg.source
    if src in BUILTIN:
        path = ensure_digits(cfg.cache_dir)
        return _load_folder(path), f"built-in digits ({path})"
    p = Path(src).expanduser()
    if p.exists():
        if p.is_file():
            kind = "parquet" if p.suffix == ".parquet" else "arrow" if p.suffix == ".arrow" else None
            if kind is None:
                raise VramfitError(f"--data {src} is a file, not a folder or dataset.",
                                   hint="pass an image folder, a dataset saved with save_to_disk, "
                                        "or a .parquet/.arrow file")
            return datasets.load_dataset(kind, data_files=str(p)), f"{kind} file {p}"
        if (p / "dataset_dict.json").exists() or (p / "state.json").exists():
            return datasets.load_from_disk(str(p)), f"saved dataset {p}"
        for kind, ext in (("parquet", "parquet"), ("arrow", "arrow")):
            files = sorted(p.rglob(f"*.{ext}"))
            if files:
                return _load_files(kind, p, files), f"{kind} files under {p}"
        return _load_folder(p), f"image folder {p}"
    if _looks_like_path(src):
        raise VramfitError(
            f"--data {src}: no such file or folder.",
            hint="pass an existing image folder (class sub-folders, optionally under train/ and val/), "
                 "a dataset saved with save_to_disk, a parquet/arrow file, a Hub dataset id such as "
                 "`uoft-cs/cifar10`, or `digits` for the built-in dataset")
    kwargs = {}
    if cfg.trust_remote_code:
        kwargs["trust_remote_code"] = True
    try:
        return datasets.load_dataset(src, cfg.config, **kwargs), f"hub dataset {src}"
    except Exception as e:  # noqa: BLE001 - every hub failure becomes one actionable message
        offline = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("HF_DATASETS_OFFLINE")
        raise VramfitError(
            f"Could not load dataset `{src}`{' (config ' + cfg.config + ')' if cfg.config else ''}: "
            f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}",
            hint=("offline mode is on; " if offline else "")
            + "check the id on the Hub (and data.config for multi-config datasets), or download it "
              "once and pass the local folder / saved dataset with --data") from None


def _load_files(kind: str, root: Path, files: list[Path]):
    import datasets

    by_split: dict[str, list[str]] = {}
    for f in files:
        rel = f.relative_to(root).parts
        split = next((s for s in ("train",) + VAL_SPLITS if any(s == part or part.startswith(s + "-")
                                                               or part.startswith(s + "_") for part in rel)), "train")
        by_split.setdefault(split, []).append(str(f))
    return datasets.load_dataset(kind, data_files=by_split)


def _load_folder(path: Path):
    import datasets

    n_files = sum(1 for q in path.rglob("*") if q.is_file() and not q.name.startswith("."))
    if n_files == 0:
        raise VramfitError(f"--data {path} is an empty folder.",
                           hint="put images in one sub-folder per class (e.g. cats/, dogs/), "
                                "optionally under train/ and val/")
    try:
        return datasets.load_dataset("imagefolder", data_dir=str(path))
    except Exception as e:  # noqa: BLE001
        raise VramfitError(
            f"Could not read {path} as an image folder: {type(e).__name__}: "
            f"{str(e).splitlines()[0][:300] if str(e) else ''}",
            hint="expected one sub-folder per class containing .jpg/.png/... files, "
                 "optionally under train/ and val/ split folders") from None


def _pick_column(names, features, wanted, kind_check, override, what):
    import datasets

    if override:
        if override not in names:
            raise VramfitError(f"data.{what}_column `{override}` is not a column of this dataset.",
                               hint=f"columns: {', '.join(names)}")
        return override
    for n in names:
        if kind_check(features[n]):
            return n
    for w in wanted:
        for n in names:
            if n.lower() == w:
                return n
    raise VramfitError(f"Could not find the {what} column among {', '.join(names)}.",
                       hint=f"name it with --set data.{what}_column=COLUMN")


def load_splits(cfg: DataConfig, seed: int) -> Splits:
    import datasets

    raw, desc = _load_raw(cfg)
    if isinstance(raw, datasets.Dataset):
        raw = datasets.DatasetDict({"train": raw})
    names = list(raw.keys())
    train_name = cfg.train_split or ("train" if "train" in raw else names[0])
    if train_name not in raw:
        raise VramfitError(f"data.train_split `{train_name}` is not a split of {desc}.",
                           hint=f"splits: {', '.join(names)}")
    val_name = cfg.val_split or next((s for s in VAL_SPLITS if s in raw and s != train_name), None)
    if cfg.val_split and val_name not in raw:
        raise VramfitError(f"data.val_split `{val_name}` is not a split of {desc}.",
                           hint=f"splits: {', '.join(names)}")

    train = raw[train_name]
    cols, feats = train.column_names, train.features
    image_col = _pick_column(cols, feats, IMAGE_COLUMNS, lambda f: isinstance(f, datasets.Image),
                             cfg.image_column, "image")
    label_col = _pick_column([c for c in cols if c != image_col], feats, LABEL_COLUMNS,
                             lambda f: isinstance(f, datasets.ClassLabel), cfg.label_column, "label")
    keep = [image_col, label_col]
    parts = {"train": train.select_columns(keep)}
    if val_name:
        parts["val"] = raw[val_name].select_columns(keep)
    dd = datasets.DatasetDict(parts)
    dd, class_names = _encode_labels(dd, label_col)
    if len(class_names) < 2:
        raise VramfitError(
            f"{desc} has only one class ({class_names[0] if class_names else 'none'}): a classifier "
            f"needs at least two.",
            hint="put each class's images in its own sub-folder (e.g. data/cats/*.jpg, data/dogs/*.jpg)")
    if isinstance(dd["train"].features[image_col], datasets.Image):
        dd = dd.cast_column(image_col, datasets.Image(decode=False))
    notes = []
    if "val" not in dd:
        split = dd["train"].train_test_split(test_size=cfg.val_fraction, seed=seed,
                                             stratify_by_column=label_col)
        dd = datasets.DatasetDict({"train": split["train"], "val": split["test"]})
        notes.append(f"no validation split found: held out {cfg.val_fraction:.0%} of train, "
                     f"stratified by class (seed {seed})")
    if len(dd["train"]) == 0 or len(dd["val"]) == 0:
        raise VramfitError(f"{desc}: the train or validation split is empty.",
                           hint="add images, or lower/raise data.val_fraction")
    return Splits(dd["train"], dd["val"], class_names, image_col, label_col, desc, notes)


def _encode_labels(dd, label_col):
    import datasets

    feat = dd["train"].features[label_col]
    if isinstance(feat, datasets.ClassLabel):
        return dd, list(feat.names)
    values = sorted({v for split in dd.values() for v in split.unique(label_col)}, key=str)
    if all(isinstance(v, (int, np.integer)) for v in values) and values == list(range(len(values))):
        names = [str(v) for v in values]
        cl = datasets.ClassLabel(names=names)
        return dd.cast_column(label_col, cl), names
    # Strings (or sparse ints) map onto a sorted class list, the same for every split.
    names = [str(v) for v in values]
    index = {v: i for i, v in enumerate(values)}
    dd = dd.map(lambda b: {label_col: [index[v] for v in b[label_col]]}, batched=True,
                features=None, desc="encode labels")
    return dd.cast_column(label_col, datasets.ClassLabel(names=names)), names


# ---------------------------------------------------------------------------------------------
# Order: a pure function of (seed, epoch); each rank takes a fixed slice of each optimizer batch.


def steps_per_epoch(n: int, global_batch: int, world: int) -> int:
    full, rest = divmod(n, global_batch)
    # A short final batch is kept (and weighted by its true size) when every rank still gets >= 2
    # samples; a 1-sample train-mode BatchNorm batch would fail.
    return full + (1 if rest >= 2 * world else 0)


class StepBatchSampler:
    """Yields this rank's share of each optimizer batch, as (index, epoch) keys.

    Written by hand because the order must not depend on the world size (the same global batch at
    1 or 8 processes) and must restart at any step; samplers from torch/Accelerate shard per rank
    before batching, so neither holds.
    """

    def __init__(self, n: int, global_batch: int, rank: int, world: int, seed: int):
        self.n, self.global_batch, self.rank, self.world, self.seed = n, global_batch, rank, world, seed
        self.epoch, self.start_step = 0, 0

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        self.epoch, self.start_step = epoch, start_step

    def __len__(self) -> int:
        return steps_per_epoch(self.n, self.global_batch, self.world) - self.start_step

    def global_order(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(_mix(self.seed, epoch, "order"))
        return torch.randperm(self.n, generator=g).tolist()

    def __iter__(self):
        order = self.global_order(self.epoch)
        for step in range(self.start_step, steps_per_epoch(self.n, self.global_batch, self.world)):
            chunk = order[step * self.global_batch:(step + 1) * self.global_batch]
            yield [(i, self.epoch, len(chunk)) for i in rank_slice(chunk, self.rank, self.world)]


def rank_slice(chunk: list, rank: int, world: int) -> list:
    per, extra = divmod(len(chunk), world)
    start = rank * per + min(rank, extra)
    return chunk[start:start + per + (1 if rank < extra else 0)]


def _mix(*parts) -> int:
    h = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & (2**63 - 1)


class _SeededRNG:
    """Seed python/numpy/torch RNGs for one sample and restore them after, so augmentation is a pure
    function of (seed, epoch, index), whatever the worker count, and the caller's RNGs are untouched."""

    def __init__(self, seed: int):
        self.seed = seed

    def __enter__(self):
        self._py, self._np, self._t = random.getstate(), np.random.get_state(), torch.get_rng_state()
        random.seed(self.seed)
        np.random.seed(self.seed % 2**32)
        torch.manual_seed(self.seed)

    def __exit__(self, *exc):
        random.setstate(self._py)
        np.random.set_state(self._np)
        torch.set_rng_state(self._t)


# ---------------------------------------------------------------------------------------------
# Datasets and loaders


def build_transforms(cfg: DataConfig, data_cfg: dict):
    from timm.data import create_transform

    common = dict(input_size=data_cfg["input_size"], interpolation=data_cfg.get("interpolation", "bilinear"),
                  mean=data_cfg["mean"], std=data_cfg["std"], use_prefetcher=True)
    train = create_transform(is_training=True, scale=tuple(cfg.scale), ratio=tuple(cfg.ratio),
                             hflip=cfg.hflip, auto_augment=cfg.auto_augment, re_prob=0.0, **common)
    val = create_transform(is_training=False, crop_pct=data_cfg.get("crop_pct", 0.875), **common)
    return train, val


class ImageDataset(torch.utils.data.Dataset):
    """Decodes in the loader worker through our guarded decoder; a bad file is replaced by a
    deterministic other sample (train) or masked out (eval), and reported by name."""

    def __init__(self, hf, image_col, label_col, transform, image_size, seed, train: bool):
        self.hf, self.image_col, self.label_col = hf, image_col, label_col
        self.transform, self.image_size, self.seed, self.train = transform, image_size, seed, train

    def __len__(self):
        return len(self.hf)

    def _load(self, i):
        row = self.hf[int(i)]
        return decode_image(row[self.image_col], self.image_size), int(row[self.label_col])

    def __getitem__(self, key):
        if self.train:
            index, epoch, step_n = key
        else:
            index, epoch, step_n = key, 0, 0
        bad = ""
        try:
            img, label = self._load(index)
        except BadImage as e:
            bad = f"{describe(self.hf[int(index)][self.image_col])}: {e}"
            if not self.train:
                return (torch.zeros(3, self.image_size, self.image_size, dtype=torch.uint8), -1,
                        index, step_n, bad)
            img, label = self._replacement(index)
        with _SeededRNG(_mix(self.seed, epoch, index, "aug")):
            x = self.transform(img)
        return x, label, index, step_n, bad

    def _replacement(self, index):
        # Same replacement on every run (a function of the index only), so resume stays exact.
        n = len(self.hf)
        for k in range(1, 65):
            j = (index + k * 7919) % n
            try:
                return self._load(j)
            except BadImage:
                continue
        raise VramfitError("Could not find a readable replacement image: most files are unreadable.",
                           hint="run `vramfit scan-data --data SRC` to list the broken files")


@dataclass
class Batch:
    images: torch.Tensor  # uint8 NCHW
    labels: torch.Tensor
    indices: torch.Tensor
    step_samples: int  # samples in the whole optimizer batch across processes (0 for eval)
    bad: list[str]


def collate(items) -> Batch:
    imgs = torch.stack([torch.as_tensor(x) for x, *_ in items])
    return Batch(imgs, torch.tensor([it[1] for it in items], dtype=torch.long),
                 torch.tensor([it[2] for it in items], dtype=torch.long),
                 int(items[0][3]) if items else 0, [it[4] for it in items if it[4]])


def resolve_workers(cfg: DataConfig, device_type: str, local_processes: int) -> int:
    if cfg.num_workers != "auto":
        return int(cfg.num_workers)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    per_proc = cpus // max(1, local_processes)
    if device_type == "cpu" and per_proc <= 2:
        return 0  # compute already uses every core; worker processes would only contend
    return max(0, min(8, per_proc - 1))


def make_loader(ds, batch_sampler=None, batch_size=None, workers=0, pin=False, seed=0):
    kw = dict(num_workers=workers, pin_memory=pin, collate_fn=collate)
    if workers > 0:
        kw.update(persistent_workers=True, prefetch_factor=4,
                  worker_init_fn=_ignore_signals_in_worker)
    if batch_sampler is not None:
        return torch.utils.data.DataLoader(ds, batch_sampler=batch_sampler, **kw)
    return torch.utils.data.DataLoader(ds, batch_size=batch_size, shuffle=False, **kw)


def _ignore_signals_in_worker(_worker_id: int) -> None:
    # The main process decides when to stop and save; a SIGTERM/SIGINT delivered to the whole process
    # group must not kill the workers first (the checkpoint would then die with them).
    import signal

    for s in (signal.SIGTERM, signal.SIGINT, getattr(signal, "SIGUSR1", None)):
        if s is not None:
            signal.signal(s, signal.SIG_IGN)
    torch.set_num_threads(1)


def normalizer(data_cfg: dict, device, channels_last: bool):
    mean = torch.tensor(data_cfg["mean"], device=device).view(1, 3, 1, 1) * 255.0
    std = torch.tensor(data_cfg["std"], device=device).view(1, 3, 1, 1) * 255.0
    fmt = torch.channels_last if channels_last else torch.contiguous_format

    def norm(x: torch.Tensor) -> torch.Tensor:
        return ((x.to(device, non_blocking=True).float() - mean) / std).contiguous(memory_format=fmt)

    return norm


def check_batch_shape(images: torch.Tensor, image_size: int) -> None:
    """The 'resize written but never applied' guard: stop at step 1, not at an OOM later."""
    if images.dim() != 4 or tuple(images.shape[1:]) != (3, image_size, image_size):
        raise VramfitError(
            f"Training batches have shape {tuple(images.shape)}, expected (N, 3, {image_size}, "
            f"{image_size}): the resize/crop transform is not being applied to the images.",
            hint="check data.image_size and that the dataset goes through the train transform")


