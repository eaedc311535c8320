"""Every supported source -> the train and validation splits a run uses.

Sources (docs/data.md): the built-in `digits`; an image folder (split folders or one class tree,
nested class folders, any mix of image extensions); a dataset saved with `save_to_disk`; parquet /
arrow files or folders of them; a Hub dataset id. All of them end as the same `Splits`: two
`datasets.Dataset`s with an image column cast to `Image(decode=False)` and a `ClassLabel` column.

Which images are validation images is fixed by `data.split_seed` alone (never by the run seed), so
runs of a seed sweep are compared on one validation set that none of them trained on.
"""

from __future__ import annotations

import difflib
import math
import os
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..config import DataConfig
from ..errors import VramfitError
from .builtin import BUILTIN, cache_root, ensure_digits, local_source, shadow_note
from .folders import ImageFolder, read_image_folder, walk
from . import stores, tables
from .shards import IndexedSamples, ShardSamples, is_shards, limited, read_index
from .schema import (HELD_OUT_SPLITS, SPLIT_NAMES, TRAIN_SPLITS, VAL_SPLITS, column, encode_labels,
                     pick_image_column, pick_label_column, split_of)

if TYPE_CHECKING:  # type names only; datasets is imported where it is used
    import datasets


@dataclass
class Splits:
    train: "datasets.Dataset"  # image column cast to Image(decode=False), int labels
    val: "datasets.Dataset"
    class_names: list[str]
    image_column: str
    label_column: str
    description: str
    notes: list[str] = field(default_factory=list)
    empty_classes: list[str] = field(default_factory=list)  # class folders left out: no images


@dataclass
class Source:
    """A source before any holdout: `val` is None when it has no validation split."""

    train: "datasets.Dataset"
    val: "datasets.Dataset | None"
    class_names: list[str]
    image_column: str
    label_column: str
    description: str
    notes: list[str] = field(default_factory=list)
    root: Path | None = None  # the local folder or file it came from, for short file names
    val_name: str | None = None  # the source's own name of the validation split
    empty_classes: list[str] = field(default_factory=list)
    held_out: list[str] = field(default_factory=list)  # test / eval splits left for `load_eval_split`


@dataclass
class _Raw:
    splits: "datasets.DatasetDict"
    description: str
    notes: list[str] = field(default_factory=list)
    root: Path | None = None
    empty_classes: list[str] = field(default_factory=list)


def load_splits(cfg: DataConfig, *, apply_limits: bool = True) -> Splits:
    """The train and validation splits of a run: the source's own validation split, or a stratified
    hold-out of train seeded by `data.split_seed`; then the `data.limit_*_samples` subsets (same seed).
    The run seed plays no part: it must not decide which images are validation images.
    """
    if is_shards(cfg.source):
        return _shard_splits(cfg)
    if cfg.streaming:
        return _streamed_splits(cfg)
    src = load_source(cfg)
    train, val, notes = src.train, src.val, list(src.notes)
    if val is None:
        train, val = _holdout(train, src.label_column, cfg.val_fraction, cfg.split_seed)
        notes.append(f"no validation split found: held out {cfg.val_fraction:.0%} of train "
                     f"({len(val)} images), stratified by class (data.split_seed {cfg.split_seed})")
    if apply_limits:
        train = _limit(train, "train", cfg.limit_train_samples, cfg.split_seed, notes)
        val = _limit(val, "val", cfg.limit_val_samples, cfg.split_seed, notes)
    if len(train) == 0 or len(val) == 0:
        raise VramfitError(f"{src.description}: the train or validation split is empty.",
                           hint="add images, or lower/raise data.val_fraction")
    return Splits(train, val, src.class_names, src.image_column, src.label_column, src.description,
                  notes, list(src.empty_classes))


def _shard_splits(cfg: DataConfig) -> Splits:
    """Tar shards (data.shards): train read in place, in the order of its sampler; validation by
    position, from one scan of its shards' headers. The limits take a seeded subset of shards."""
    index, val_name = _shard_index(cfg)
    notes = []
    train = limited(index.split("train"), cfg.limit_train_samples, cfg.split_seed)
    val = limited(index.split(val_name), cfg.limit_val_samples, cfg.split_seed)
    for part, limit, whole, shards in (("train", cfg.limit_train_samples, "train", train),
                                       ("val", cfg.limit_val_samples, val_name, val)):
        total = sum(s.samples for s in index.split(whole))
        if limit is not None and limit < total:
            notes.append(f"data.limit_{part}_samples: the first {limit} of {total} {part} samples in a "
                         f"seeded order of the shards ({len(shards)} shard(s), data.split_seed "
                         f"{cfg.split_seed})")
    desc = f"tar shards {cfg.source} ({len(train)} train, {len(val)} {val_name})"
    train_samples = index.samples("train", train, cfg.read_timeout_s)
    val_samples = IndexedSamples(index.samples(val_name, val, cfg.read_timeout_s))
    len(val_samples.locs)  # its headers read now: a damaged validation shard stops the run at start
    return Splits(train_samples, val_samples, index.class_names, "image", "label", desc, notes)


def _read_shard_index(cfg: DataConfig):
    """read_index under the read watch: at a URL, a stalled store ends the run rather than waits."""
    return stores.within(cfg.read_timeout_s, f"reading the shard index of {cfg.source}", read_index,
                         cfg.source)


def _shard_val_name(cfg: DataConfig, index) -> str | None:
    return cfg.val_split or next((s for s in VAL_SPLITS if index.listed.get(s)), None)


def _shard_index(cfg: DataConfig):
    """The shards' index and the name of their validation split (data.val_split, or the first of
    VAL_SPLITS); shards are never held out at training time."""
    index = _read_shard_index(cfg)
    if not index.listed.get("train"):
        raise VramfitError(f"The shards of {index.root} have no train split.",
                           hint="name the train shards (a brace pattern such as train-{000000..000127}.tar, "
                                "or files named train-*.tar), or write them with `vramfit prepare --format "
                                "webdataset`")
    val_name = _shard_val_name(cfg, index)
    if val_name not in index.listed:
        raise VramfitError(f"The shards of {index.root} have no validation split"
                           + (f" `{val_name}`" if val_name else "") + ".",
                           hint=f"splits: {', '.join(index.listed)}; validation shards are the folder's "
                                f"files named with a split word (val-000000.tar, "
                                f"imagenet-validation-0000.tar) "
                                f"or the info file's `validation` split; `vramfit prepare` writes val-*.tar")
    return index, val_name


def _shard_source(cfg: DataConfig) -> Source:
    """Tar shards as a `Source` whose splits are read by position (scan-data, eval): each split's
    shards are checked and their headers read once (no image bytes) when a row of it is first
    asked for, so `eval --data SHARDS` or `--split test` reads only the split it evaluates."""
    index = _read_shard_index(cfg)
    val_name = _shard_val_name(cfg, index)
    if cfg.val_split and val_name not in index.listed:
        raise VramfitError(f"data.val_split `{val_name}` is not a split of tar shards {cfg.source}.",
                           hint=f"splits: {', '.join(index.listed)}")
    parts = {k: IndexedSamples(partial(index.samples, k, None, cfg.read_timeout_s)) for k in index.listed}
    train = parts["train"] if "train" in parts else IndexedSamples(ShardSamples([]))
    held = [s for s in index.listed if s in HELD_OUT_SPLITS and s != val_name]
    return Source(train, parts.get(val_name) if val_name else None, index.class_names, "image", "label",
                  f"tar shards {cfg.source}", [], index.root, val_name, [], held)


def _streamed_splits(cfg: DataConfig) -> Splits:
    """Parquet / arrow files or a Hub dataset read in place (data.streaming, data.tables), in the tar
    shards' order; validation by position, from the source's own validation split."""
    if cfg.limit_train_samples or cfg.limit_val_samples:
        raise VramfitError("data.limit_train_samples / data.limit_val_samples do not apply with "
                           "data.streaming.", hint="pass fewer files (a glob) instead")
    streamed = tables.resolve(cfg)
    return Splits(streamed.train, IndexedSamples(streamed.val), streamed.class_names, "image", "label",
                  streamed.description, streamed.notes)


def load_eval_split(cfg: DataConfig, split: str, class_names: list[str]):
    """One named split (e.g. `test`) of the source, labelled like the training run's classes, for an
    evaluation after training; never used to choose anything during training."""
    try:
        src = load_source(cfg.model_copy(update={"val_split": split}))
    except VramfitError as e:
        if not e.message.startswith("data.val_split"):
            raise
        raise VramfitError(f"--split {split}: {e.message.split('` ', 1)[1]}", hint=e.hint.replace(
            "splits:", "use --split with one of its splits:")) from None
    if src.class_names != list(class_names):
        raise VramfitError(
            f"Split `{split}` of {src.description} gives the classes {src.class_names[:10]}, the model "
            f"was trained on {list(class_names)[:10]}.",
            hint="evaluate on a split of the dataset the model was trained on")
    return src.val


def load_source(cfg: DataConfig) -> Source:
    """Load any supported source, pick its splits and columns, and encode labels as ClassLabel."""
    import datasets

    if is_shards(cfg.source):
        return _shard_source(cfg)
    raw = _load_raw(cfg)
    desc, notes = raw.description, list(raw.notes)
    train_name, val_name, held_out = _pick_splits(cfg, list(raw.splits.keys()), desc, notes)
    train = raw.splits[train_name]
    image_col = pick_image_column(train, cfg.image_column)
    label_col = pick_label_column(train, image_col, cfg.label_column)
    parts = {"train": train}
    if val_name:
        for col in (image_col, label_col):
            if col not in raw.splits[val_name].column_names:
                raise VramfitError(f"Split `{val_name}` of {desc} has no column `{col}`.",
                                   hint="pick another with --set data.val_split=SPLIT")
        parts["val"] = raw.splits[val_name]
    parts = {k: v.select_columns([image_col, label_col]) for k, v in parts.items()}
    parts, class_names = encode_labels(parts, label_col, desc)
    if len(class_names) < 2:
        empty = f" (class folders without images: {', '.join(raw.empty_classes[:5])})" if raw.empty_classes else ""
        raise VramfitError(
            f"{desc} has only one class ({class_names[0] if class_names else 'none'}){empty}: a "
            f"classifier needs at least two.",
            hint="put each class's images in its own sub-folder (e.g. data/cats/*.jpg, data/dogs/*.jpg)")
    for k, ds in parts.items():
        if isinstance(ds.features[image_col], datasets.Image) and ds.features[image_col].decode:
            parts[k] = ds.cast_column(image_col, datasets.Image(decode=False))
    root = Path(os.path.abspath(raw.root)) if raw.root is not None else None  # dataset paths are absolute
    return Source(parts["train"], parts.get("val"), class_names, image_col, label_col, desc, notes,
                  root, val_name, list(raw.empty_classes), held_out)


def _pick_splits(cfg: DataConfig, names: list[str], desc: str, notes: list[str]):
    """(train split, validation split or None, held-out splits); says which are left, and for what."""
    train_name = cfg.train_split or ("train" if "train" in names else names[0])
    if train_name not in names:
        raise VramfitError(f"data.train_split `{train_name}` is not a split of {desc}.",
                           hint=f"splits: {', '.join(names)}")
    val_name = cfg.val_split or next((s for s in VAL_SPLITS if s in names and s != train_name), None)
    if cfg.val_split and val_name not in names:
        raise VramfitError(f"data.val_split `{val_name}` is not a split of {desc}.",
                           hint=f"splits: {', '.join(names)}")
    unused = [s for s in names if s not in (train_name, val_name)]
    held = [s for s in unused if s in HELD_OUT_SPLITS]
    for s in held:
        notes.append(f"{s} split left for `vramfit eval --split {s}` (not used to pick the best epoch; "
                     f"--set data.val_split={s} validates on it)")
    other = [s for s in unused if s not in held]
    if other:
        notes.append(f"unused split(s): {', '.join(other)} (choose with data.train_split / "
                     f"data.val_split)")
    return train_name, val_name, held


def _looks_like_path(s: str) -> bool:
    # Hub ids are `name` or `owner/name`; anything else that is not on disk was meant as a path.
    return s.startswith((".", "/", "~")) or "\\" in s or s.count("/") > 1 or \
        s.endswith((".parquet", ".arrow", ".jpg", ".png"))


def _load_raw(cfg: DataConfig) -> _Raw:
    """Any supported source as a DatasetDict, with its description and notes."""
    src = cfg.source
    if src in BUILTIN:
        path = ensure_digits(cfg.cache_dir)
        # Its folder's notes would only mention the `.complete` marker; a local namesake is said.
        note = shadow_note(src)
        return _Raw(_image_folder_dict(read_image_folder(path)), f"built-in digits ({path})",
                    [note] if note else [], path)
    local = local_source(src)
    if local is not None:
        return _load_local(cfg, local)
    p = Path(src).expanduser()
    parent = Path(src).parent
    if _looks_like_path(src) or (str(parent) != "." and parent.is_dir()):
        raise _missing_path(src, p)
    return _Raw(_load_hub(cfg), f"hub dataset {src}")


def _missing_path(src: str, p: Path) -> VramfitError:
    near = []
    if p.parent.is_dir():
        near = difflib.get_close_matches(p.name, sorted(os.listdir(p.parent)), n=3)
    return VramfitError(
        f"--data {src}: no such file or folder ({p.absolute()})"
        + (f"; {p.parent} holds {', '.join(near)}" if near else "") + ".",
        hint="pass an existing image folder (class sub-folders, optionally under train/ and val/), "
             "a dataset saved with save_to_disk, a parquet/arrow file, a Hub dataset id such as "
             "`uoft-cs/cifar10`, or `digits` for the built-in dataset")


def _load_local(cfg: DataConfig, p: Path) -> _Raw:
    import datasets

    if p.is_file():
        kind = {".parquet": "parquet", ".arrow": "arrow"}.get(p.suffix.lower())
        if kind is None:
            raise VramfitError(f"--data {cfg.source} is a file, not a folder or dataset.",
                               hint="pass an image folder, a dataset saved with save_to_disk, "
                                    "or a .parquet/.arrow file")
        return _Raw(_load_files(cfg, kind, p.parent, [p]), f"{kind} file {p}", [], p.parent)
    if (p / "dataset_dict.json").is_file() or (p / "state.json").is_file():
        try:
            dd = datasets.load_from_disk(str(p))
        except Exception as e:  # noqa: BLE001
            raise VramfitError(f"Could not load the saved dataset {p}: {_first_line(e)}",
                               hint="re-create it with Dataset.save_to_disk / `vramfit prepare`") from None
        return _Raw(_as_dict(dd), f"saved dataset {p}", [], p)
    listing = walk(p)
    for kind in ("parquet", "arrow"):
        found = [f for f in listing.files if f.suffix.lower() == f".{kind}"]
        if found:
            return _Raw(_load_files(cfg, kind, p, found), f"{kind} files under {p}", [], p)
    folder = read_image_folder(p, listing)
    return _Raw(_image_folder_dict(folder), f"image folder {p}", folder.notes, p, folder.empty_classes)


def _image_folder_dict(folder: ImageFolder):
    import datasets

    rows = folder.rows
    class_names = sorted({c for split_rows in rows.values() for _, c in split_rows})
    index = {c: i for i, c in enumerate(class_names)}
    features = datasets.Features({"image": datasets.Image(decode=False),
                                  "label": datasets.ClassLabel(names=class_names)})
    order = [s for s in ("train",) + SPLIT_NAMES if s in rows]
    return datasets.DatasetDict({
        s: datasets.Dataset.from_dict({"image": [p for p, _ in rows[s]],
                                       "label": [index[c] for _, c in rows[s]]}, features=features)
        for s in dict.fromkeys(order)})


def _load_hub(cfg: DataConfig):
    import datasets

    kwargs = {}
    if cfg.trust_remote_code:
        major = int(datasets.__version__.split(".")[0])
        if major >= 4:
            # datasets 4.0 removed loading scripts; passing the flag on would only fail deeper down.
            raise VramfitError(
                f"data.trust_remote_code is set, but datasets {datasets.__version__} no longer runs "
                f"dataset loading scripts (removed in datasets 4.0).",
                hint="drop --set data.trust_remote_code=true: most Hub datasets also ship parquet "
                     "files that load without code; otherwise convert it once with datasets<4 "
                     "(load_dataset(...).save_to_disk(DIR)) and pass --data DIR")
        kwargs["trust_remote_code"] = True
    if cfg.cache_dir:
        kwargs["cache_dir"] = str(cache_root(cfg.cache_dir) / "hf-datasets")
    try:
        return _as_dict(datasets.load_dataset(cfg.source, cfg.config, **kwargs))
    except Exception as e:  # noqa: BLE001 - every hub failure becomes one actionable message
        offline = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("HF_DATASETS_OFFLINE")
        # Both readings of the name failed: say both, the local one first (the common typo).
        raise VramfitError(
            f"--data {cfg.source}: no such local folder ({Path(cfg.source).absolute()}), and loading "
            f"it as a Hub dataset id"
            f"{' (config ' + cfg.config + ')' if cfg.config else ''} failed: {_first_line(e)}",
            hint="for a local folder, check the path (relative to the current folder; write "
                 f"./{cfg.source} to never look on the Hub); for a Hub dataset, "
            + ("offline mode is on; " if offline else "")
            + "check the id (and data.config for multi-config datasets), or download it once and "
              "pass the local folder / saved dataset with --data") from None


def _as_dict(ds):
    import datasets

    return datasets.DatasetDict({"train": ds}) if isinstance(ds, datasets.Dataset) else ds


def _first_line(e: Exception) -> str:
    msg = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


def _load_files(cfg: DataConfig, kind: str, root: Path, files: list[Path]):
    import datasets

    by_split: dict[str, list[str]] = {}
    for f in sorted(files):
        by_split.setdefault(split_of(f.relative_to(root)), []).append(str(f))
    kwargs = {"cache_dir": str(cache_root(cfg.cache_dir) / "hf-datasets")} if cfg.cache_dir else {}
    try:
        return datasets.load_dataset(kind, data_files=by_split, **kwargs)
    except Exception as e:  # noqa: BLE001
        from ..runtime.storage import errno_fault

        if errno_fault(e) is not None:  # the cache the files are converted into, not the files
            raise
        bad = _unreadable_table(kind, files)
        what = f"{bad[0]} {bad[1]}" if bad else f"the {kind} files under {root}: {_first_line(e)}"
        raise VramfitError(f"Could not read {what}.",
                           hint=f"remove or replace it; the files must be valid {kind} (one split per file "
                                f"name, e.g. train-00000.{kind}, validation-00000.{kind})") from None


def _unreadable_table(kind: str, files: list[Path]) -> tuple[Path, str] | None:
    """The first of `files` that is empty or does not open as `kind`, with why."""
    import pyarrow.ipc as ipc
    import pyarrow.parquet as pq

    for f in sorted(files):
        if f.stat().st_size == 0:
            return f, "(an empty file)"
        try:
            if kind == "parquet":
                pq.read_metadata(f)
            else:
                with open(f, "rb") as stream:
                    try:
                        ipc.open_stream(stream).schema
                    except Exception:  # noqa: BLE001 - the other arrow layout
                        stream.seek(0)
                        ipc.open_file(stream).schema
        except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a damaged file
            return f, f"({type(e).__name__}: {_first_line(e)})"
    return None


def _limit(ds, part: str, limit: int | None, seed: int, notes: list[str]):
    """A seeded random `limit` images of a split (smoke tests, quick sweeps)."""
    if limit is None or limit >= len(ds):
        return ds
    notes.append(f"data.limit_{part}_samples: using a seeded random {limit} of {len(ds)} {part} images")
    return ds.shuffle(seed=seed).select(range(limit))


def _holdout(ds, label_col: str, fraction: float, seed: int):
    """Seeded, stratified train/validation split of one split."""
    try:
        # The library's stratified split (sklearn's StratifiedShuffleSplit semantics) whenever it
        # applies, so results match other tools given the same seed.
        parts = ds.train_test_split(test_size=fraction, seed=seed, stratify_by_column=label_col)
        return parts["train"], parts["test"]
    except ValueError:
        pass  # a class with 1 image, or fewer held-out images than classes: split by hand below
    labels = np.asarray(column(ds, label_col))
    n = len(labels)
    n_val = min(n - 1, max(1, math.ceil(fraction * n)))
    rng = np.random.default_rng(seed)
    classes, counts = np.unique(labels, return_counts=True)
    # Largest-remainder apportionment, keeping at least one training image per class.
    quota = fraction * counts
    take = np.minimum(np.floor(quota).astype(int), counts - 1)
    room = (counts - 1) - take
    for c in np.argsort(-(quota - np.floor(quota)), kind="stable"):
        if take.sum() >= n_val:
            break
        if room[c] > 0:
            take[c] += 1
            room[c] -= 1
    val_idx = []
    for c, k in zip(classes, take):
        members = np.flatnonzero(labels == c)
        val_idx.extend(members[rng.permutation(len(members))[:k]].tolist())
    val_set = set(val_idx)
    train_idx = [i for i in range(n) if i not in val_set]
    return ds.select(train_idx), ds.select(sorted(val_idx))
