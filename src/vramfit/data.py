"""HF `datasets` sources -> decoded, augmented uint8 batches, in an order that is a pure function of
(seed, epoch), so a resumed or rescaled run sees exactly the same samples.

Sources (docs/data.md): the built-in `digits`; an image folder (split folders or one class tree,
nested class folders, any mix of image extensions); a dataset saved with `save_to_disk`; parquet /
arrow files or folders of them; a Hub dataset id. All of them end as the same `Splits`: two
`datasets.Dataset`s with an image column cast to `Image(decode=False)` and a `ClassLabel` column.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .builtin_data import BUILTIN, cache_root, ensure_digits
from .config import DataConfig
from .decode import BadImage, decode_image, describe
from .errors import VramfitError

log = logging.getLogger(__name__)

IMAGE_COLUMNS = ("image", "img", "images", "pixel_values", "picture", "photo", "jpg", "jpeg", "png",
                 "webp", "image_bytes", "file", "path", "image_path", "filepath")
LABEL_COLUMNS = ("label", "labels", "fine_label", "target", "targets", "class", "category",
                 "label_id", "class_id", "coarse_label", "cls", "y")
TRAIN_SPLITS = ("train", "training")
VAL_SPLITS = ("validation", "val", "valid", "test", "eval")

# Files an image folder may hold as samples (case-insensitive). Everything else (.txt, .DS_Store,
# Thumbs.db, .json sidecars ...) is ignored and counted in Splits.notes.
IMAGE_EXTENSIONS = frozenset({
    ".jpg", ".jpeg", ".jpe", ".jfif", ".png", ".webp", ".bmp", ".dib", ".gif", ".tif", ".tiff",
    ".ppm", ".pgm", ".pbm", ".pnm", ".tga", ".ico"})
# Phone formats PIL cannot open without a plugin: named in the notes so a user knows why.
_NEEDS_PLUGIN = frozenset({".heic", ".heif", ".avif"})
# Folder names that never hold classes (archive and editor debris).
_SKIP_DIRS = frozenset({"__macosx", "@eadir", ".ipynb_checkpoints"})

# RandomResizedCrop at scale s takes a crop whose side is ~sqrt(s) of the image's, so a JPEG is
# drafted (decoded at 1/2, 1/4, 1/8 size) to at most this multiple of the crop size. 1.5x is close
# to the pixel density RandomResizedCrop has on ImageNet itself (shorter side ~1.7x 224), where the
# usual recipes were tuned; decoding more of a 12 Mpx photo costs time (2x: +17%, full detail for
# every crop: +46%) for detail only the smallest crops would see. Measured in docs/data.md.
TRAIN_DRAFT_FACTOR = 1.5


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


@dataclass
class Source:
    """A source before any holdout: `val` is None when it has no validation split."""

    train: "datasets.Dataset"  # noqa: F821
    val: "datasets.Dataset | None"  # noqa: F821
    class_names: list[str]
    image_column: str
    label_column: str
    description: str
    notes: list[str] = field(default_factory=list)
    root: Path | None = None  # the local folder or file it came from, for short file names
    val_name: str | None = None  # the source's own name of the validation split


def load_splits(cfg: DataConfig, seed: int) -> Splits:
    src = load_source(cfg)
    train, val, notes = src.train, src.val, list(src.notes)
    if val is None:
        train, val = _holdout(train, src.label_column, cfg.val_fraction, seed)
        notes.append(f"no validation split found: held out {cfg.val_fraction:.0%} of train "
                     f"({len(val)} images), stratified by class (seed {seed})")
    if len(train) == 0 or len(val) == 0:
        raise VramfitError(f"{src.description}: the train or validation split is empty.",
                           hint="add images, or lower/raise data.val_fraction")
    return Splits(train, val, src.class_names, src.image_column, src.label_column, src.description,
                  notes)


def load_source(cfg: DataConfig) -> Source:
    """Load any supported source, pick its splits and columns, and encode labels as ClassLabel."""
    import datasets

    raw, desc, notes, root = _load_raw(cfg)
    names = list(raw.keys())
    train_name = cfg.train_split or ("train" if "train" in raw else names[0])
    if train_name not in raw:
        raise VramfitError(f"data.train_split `{train_name}` is not a split of {desc}.",
                           hint=f"splits: {', '.join(names)}")
    val_name = cfg.val_split or next((s for s in VAL_SPLITS if s in raw and s != train_name), None)
    if cfg.val_split and val_name not in raw:
        raise VramfitError(f"data.val_split `{val_name}` is not a split of {desc}.",
                           hint=f"splits: {', '.join(names)}")
    unused = [s for s in names if s not in (train_name, val_name)]
    if unused:
        notes.append(f"unused split(s): {', '.join(unused)} (choose with data.train_split / "
                     f"data.val_split)")

    train = raw[train_name]
    image_col = _pick_image_column(train, cfg.image_column)
    label_col = _pick_label_column(train, image_col, cfg.label_column)
    parts = {"train": train}
    if val_name:
        for col in (image_col, label_col):
            if col not in raw[val_name].column_names:
                raise VramfitError(f"Split `{val_name}` of {desc} has no column `{col}`.",
                                   hint="pick another with --set data.val_split=SPLIT")
        parts["val"] = raw[val_name]
    parts = {k: v.select_columns([image_col, label_col]) for k, v in parts.items()}
    parts, class_names = _encode_labels(parts, label_col, desc)
    if len(class_names) < 2:
        raise VramfitError(
            f"{desc} has only one class ({class_names[0] if class_names else 'none'}): a classifier "
            f"needs at least two.",
            hint="put each class's images in its own sub-folder (e.g. data/cats/*.jpg, data/dogs/*.jpg)")
    for k, ds in parts.items():
        if isinstance(ds.features[image_col], datasets.Image) and ds.features[image_col].decode:
            parts[k] = ds.cast_column(image_col, datasets.Image(decode=False))
    root = Path(os.path.abspath(root)) if root is not None else None  # dataset paths are absolute
    return Source(parts["train"], parts.get("val"), class_names, image_col, label_col, desc, notes,
                  root, val_name)


def _looks_like_path(s: str) -> bool:
    # Hub ids are `name` or `owner/name`; anything else that is not on disk was meant as a path.
    return s.startswith((".", "/", "~")) or "\\" in s or s.count("/") > 1 or \
        s.endswith((".parquet", ".arrow", ".jpg", ".png"))


def _load_raw(cfg: DataConfig):
    """(DatasetDict, description, notes, local root or None) for any supported source."""
    import datasets

    src = cfg.source
    if src in BUILTIN:
        path = ensure_digits(cfg.cache_dir)
        dd, _ = _load_image_folder(path)  # its notes would only mention the `.complete` marker
        return dd, f"built-in digits ({path})", [], path
    p = Path(src).expanduser()
    if p.exists():
        if p.is_file():
            kind = {".parquet": "parquet", ".arrow": "arrow"}.get(p.suffix.lower())
            if kind is None:
                raise VramfitError(f"--data {src} is a file, not a folder or dataset.",
                                   hint="pass an image folder, a dataset saved with save_to_disk, "
                                        "or a .parquet/.arrow file")
            return _load_files(cfg, kind, p.parent, [p]), f"{kind} file {p}", [], p.parent
        if (p / "dataset_dict.json").is_file() or (p / "state.json").is_file():
            try:
                dd = datasets.load_from_disk(str(p))
            except Exception as e:  # noqa: BLE001
                raise VramfitError(f"Could not load the saved dataset {p}: {_first_line(e)}",
                                   hint="re-create it with Dataset.save_to_disk / `vramfit prepare`") from None
            return _as_dict(dd), f"saved dataset {p}", [], p
        files = _walk(p)
        for kind in ("parquet", "arrow"):
            found = [f for f in files.files if f.suffix.lower() == f".{kind}"]
            if found:
                return _load_files(cfg, kind, p, found), f"{kind} files under {p}", [], p
        dd, notes = _load_image_folder(p, files)
        return dd, f"image folder {p}", notes, p
    if _looks_like_path(src):
        raise VramfitError(
            f"--data {src}: no such file or folder.",
            hint="pass an existing image folder (class sub-folders, optionally under train/ and val/), "
                 "a dataset saved with save_to_disk, a parquet/arrow file, a Hub dataset id such as "
                 "`uoft-cs/cifar10`, or `digits` for the built-in dataset")
    return _load_hub(cfg), f"hub dataset {src}", [], None


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
        raise VramfitError(
            f"Could not load dataset `{cfg.source}`"
            f"{' (config ' + cfg.config + ')' if cfg.config else ''}: {_first_line(e)}",
            hint=("offline mode is on; " if offline else "")
            + "check the id on the Hub (and data.config for multi-config datasets), or download it "
              "once and pass the local folder / saved dataset with --data") from None


def _as_dict(ds):
    import datasets

    return datasets.DatasetDict({"train": ds}) if isinstance(ds, datasets.Dataset) else ds


def _first_line(e: Exception) -> str:
    msg = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


def _split_of(rel: Path) -> str:
    """Split of a parquet/arrow file from its path: `train-00000-of-00002.parquet`,
    `data/validation/x.arrow`, `cifar10-test.arrow`; the file name wins over its folders."""
    import re

    known = TRAIN_SPLITS + VAL_SPLITS
    for part in reversed((*rel.parent.parts, rel.stem)):
        tokens = re.split(r"[-_.\s]+", part.lower())
        hit = next((s for s in known if s in tokens), None)
        if hit:
            return "train" if hit in TRAIN_SPLITS else hit
    return "train"


def _load_files(cfg: DataConfig, kind: str, root: Path, files: list[Path]):
    import datasets

    by_split: dict[str, list[str]] = {}
    for f in sorted(files):
        by_split.setdefault(_split_of(f.relative_to(root)), []).append(str(f))
    kwargs = {"cache_dir": str(cache_root(cfg.cache_dir) / "hf-datasets")} if cfg.cache_dir else {}
    try:
        return datasets.load_dataset(kind, data_files=by_split, **kwargs)
    except Exception as e:  # noqa: BLE001
        raise VramfitError(f"Could not read the {kind} files under {root}: {_first_line(e)}",
                           hint=f"check that the files are valid {kind} (one split per file name, "
                                f"e.g. train-00000.{kind}, validation-00000.{kind})") from None


# ---- image folders: the class of an image is the first-level folder under its split root ----


@dataclass
class _Listing:
    files: list[Path]
    skipped_dirs: list[str]


def _walk(root: Path) -> _Listing:
    """Every file under root, sorted, following folder links once (a link cycle cannot loop)."""
    out, skipped, seen = [], [], set()
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        real = os.path.realpath(dirpath)
        if real in seen:
            dirnames[:] = []
            continue
        seen.add(real)
        keep = []
        for d in sorted(dirnames):
            if d.startswith(".") or d.lower() in _SKIP_DIRS:
                skipped.append(os.path.relpath(os.path.join(dirpath, d), root))
            else:
                keep.append(d)
        dirnames[:] = keep
        out.extend(Path(dirpath) / f for f in filenames)
    out.sort()
    return _Listing(out, skipped)


def _kind_of(p: Path) -> str:
    name = p.name
    if name.startswith("._"):
        return "._* (macOS)"
    if name.startswith(".") or name.lower() in ("thumbs.db", "desktop.ini"):
        return name
    return p.suffix.lower() or "(no extension)"


def is_image_file(p: Path) -> bool:
    # Hidden files are never samples: macOS `._x.jpg` AppleDouble files carry an image extension.
    return p.suffix.lower() in IMAGE_EXTENSIONS and not p.name.startswith(".")


def _load_image_folder(root: Path, listing: _Listing | None = None):
    """Build the splits of an image folder from a file listing (not the `imagefolder` builder:
    it labels an image by its immediate parent folder, which splits nested classes apart).

    Rules (docs/data.md):
    - wrapper folders are skipped: while a folder holds exactly one sub-folder and no images
      (an unpacked archive's top folder), its sub-folder is the root;
    - if the root has a `train/` (or `training/`) folder, its first-level folders named train,
      validation, val, valid, test, eval are splits; otherwise the whole root is `train`;
    - the class of an image is the first-level folder under its split root, whatever the depth
      below it (cats/indoor/a.jpg is a `cats` image);
    - files that are not images are ignored and counted.
    """
    import datasets

    listing = listing or _walk(root)
    notes: list[str] = []
    if not listing.files:
        raise VramfitError(f"--data {root} is an empty folder.",
                           hint="put images in one sub-folder per class (e.g. cats/, dogs/), "
                                "optionally under train/ and val/")
    rels = [f.relative_to(root) for f in listing.files]
    # Wrapper folders: descend while everything lives under one single folder.
    prefix: tuple[str, ...] = ()
    while True:
        depth = len(prefix)
        under = [r for r in rels if r.parts[:depth] == prefix]
        top_dirs = {r.parts[depth] for r in under if len(r.parts) > depth + 1}
        top_images = [r for r in under if len(r.parts) == depth + 1 and is_image_file(r)]
        if len(top_dirs) != 1 or top_images:
            break
        (only,) = top_dirs
        if only.lower() in TRAIN_SPLITS + VAL_SPLITS:
            break
        sub_dirs = {r.parts[depth + 1] for r in under if r.parts[depth] == only and len(r.parts) > depth + 2}
        if not sub_dirs:  # `only` itself holds the images: it is a (single) class, not a wrapper
            break
        prefix = prefix + (only,)
    if prefix:
        notes.append(f"used {Path(*prefix)}/ inside {root} as the dataset root (the only folder there)")
    depth = len(prefix)

    top = {r.parts[depth] for r in rels if r.parts[:depth] == prefix and len(r.parts) > depth + 1}
    split_dirs = {d: ("train" if d.lower() in TRAIN_SPLITS else d.lower()) for d in top
                  if d.lower() in TRAIN_SPLITS + VAL_SPLITS}
    by_split = any(s == "train" for s in split_dirs.values())
    ignored: Counter = Counter()
    loose: list[Path] = []
    outside: set[str] = set()
    nested = False
    rows: dict[str, list[tuple[str, str]]] = {}
    for f, r in zip(listing.files, rels):
        parts = r.parts
        if not is_image_file(r):
            ignored[_kind_of(r)] += 1
            continue
        if parts[:depth] != prefix:
            loose.append(r)
            continue
        parts = parts[depth:]
        if by_split:
            if len(parts) < 2 or parts[0] not in split_dirs:
                (outside.add(parts[0]) if len(parts) > 1 else loose.append(r))
                continue
            split, parts = split_dirs[parts[0]], parts[1:]
        else:
            split = "train"
        if len(parts) < 2:  # an image directly in the split root has no class folder
            loose.append(r)
            continue
        nested |= len(parts) > 2
        rows.setdefault(split, []).append((os.path.abspath(f), parts[0]))

    if ignored:
        kinds = ", ".join(f"{k} {n}" for k, n in ignored.most_common(8))
        notes.append(f"ignored {sum(ignored.values())} file(s) that are not images ({kinds})")
        plugin = sorted(k for k in ignored if k in _NEEDS_PLUGIN)
        if plugin:
            notes.append(f"{', '.join(plugin)} files need a PIL plugin (e.g. pillow-heif) and were "
                         f"skipped: convert them to JPEG to train on them")
    if loose:
        notes.append(f"ignored {len(loose)} image(s) outside any class folder (e.g. {loose[0]})")
    if outside:
        notes.append(f"ignored folder(s) next to the split folders: {', '.join(sorted(outside))}")
    if listing.skipped_dirs:
        notes.append(f"skipped hidden/system folder(s): {', '.join(listing.skipped_dirs[:5])}"
                     f"{' ...' if len(listing.skipped_dirs) > 5 else ''}")
    if nested:
        notes.append("nested folders: each image's class is its first-level folder under the split "
                     "root (cats/indoor/a.jpg is `cats`)")
    if not rows:
        n_images = len(loose)
        raise VramfitError(
            f"--data {root}: no images in class folders"
            + (f" ({n_images} image(s) directly in the folder)" if n_images else "")
            + (f"; ignored {sum(ignored.values())} file(s) that are not images "
               f"({', '.join(f'{k} {n}' for k, n in ignored.most_common(5))})" if ignored else "") + ".",
            hint="put images in one sub-folder per class (e.g. cats/, dogs/), optionally under "
                 "train/ and val/; image files end in .jpg .jpeg .png .webp .bmp .tif ...")
    class_names = sorted({c for split_rows in rows.values() for _, c in split_rows})
    if "train" in rows:
        missing = sorted(set(class_names) - {c for _, c in rows["train"]})
        if missing:
            notes.append(f"class(es) with no training images: {', '.join(missing[:10])}")
    index = {c: i for i, c in enumerate(class_names)}
    features = datasets.Features({"image": datasets.Image(decode=False),
                                  "label": datasets.ClassLabel(names=class_names)})
    order = [s for s in ("train",) + VAL_SPLITS if s in rows]
    dd = datasets.DatasetDict({
        s: datasets.Dataset.from_dict({"image": [p for p, _ in rows[s]],
                                       "label": [index[c] for _, c in rows[s]]}, features=features)
        for s in order})
    return dd, notes


# ---- columns and labels ----


def _is_image_feature(feat) -> bool:
    import datasets

    if isinstance(feat, datasets.Image):
        return True
    # {"bytes", "path"} structs: parquet written without the HF features metadata.
    return isinstance(feat, dict) and "bytes" in feat


def _by_priority(candidates: list[str], wanted: tuple[str, ...]) -> str | None:
    for w in wanted:
        for n in candidates:
            if n.lower() == w:
                return n
    return candidates[0] if candidates else None


def _pick_image_column(ds, override: str | None) -> str:
    import datasets

    names, feats = ds.column_names, ds.features
    if override:
        if override not in names:
            raise VramfitError(f"data.image_column `{override}` is not a column of this dataset.",
                               hint=f"columns: {', '.join(names)}")
        return override
    typed = [n for n in names if _is_image_feature(feats[n])]
    pick = _by_priority(typed, IMAGE_COLUMNS)
    if pick:
        return pick
    # Encoded bytes or file paths under a conventional name.
    raw = [n for n in names if isinstance(feats[n], datasets.Value)
           and feats[n].dtype in ("binary", "large_binary", "string", "large_string")
           and n.lower() in IMAGE_COLUMNS]
    pick = _by_priority(raw, IMAGE_COLUMNS)
    if pick:
        return pick
    raise VramfitError(f"Could not find the image column among {_describe_columns(ds)}.",
                       hint="name it with --set data.image_column=COLUMN")


def _pick_label_column(ds, image_col: str, override: str | None) -> str:
    import datasets

    names = [n for n in ds.column_names if n != image_col]
    feats = ds.features
    if override:
        if override not in ds.column_names:
            raise VramfitError(f"data.label_column `{override}` is not a column of this dataset.",
                               hint=f"columns: {', '.join(ds.column_names)}")
        return override
    typed = [n for n in names if isinstance(feats[n], datasets.ClassLabel)]
    pick = _by_priority(typed, LABEL_COLUMNS)
    if pick:
        return pick
    plain = [n for n in names if isinstance(feats[n], datasets.Value) and n.lower() in LABEL_COLUMNS
             and (feats[n].dtype.startswith(("int", "uint")) or feats[n].dtype in ("string", "large_string"))]
    pick = _by_priority(plain, LABEL_COLUMNS)
    if pick:
        return pick
    raise VramfitError(f"Could not find the label column among {_describe_columns(ds)}.",
                       hint="name it with --set data.label_column=COLUMN")


def _describe_columns(ds) -> str:
    return ", ".join(f"{n} ({type(f).__name__ if not hasattr(f, 'dtype') else f.dtype})"
                     for n, f in ds.features.items())


def _column(ds, name: str) -> list:
    """A column as a Python list, fast (Arrow, not row by row) and honouring any index mapping."""
    return ds.select_columns([name]).with_format("arrow")[:][name].to_pylist()


def _encode_labels(parts: dict, label_col: str, desc: str):
    """Labels as a ClassLabel column, the same class list in every split."""
    import datasets

    feat = parts["train"].features[label_col]
    if isinstance(feat, datasets.ClassLabel):
        names = list(feat.names)
        for k, ds in parts.items():
            f = ds.features[label_col]
            if isinstance(f, datasets.ClassLabel) and list(f.names) != names:
                raise VramfitError(f"{desc}: split `{k}` names its classes differently from train.",
                                   hint="use splits that share one ClassLabel feature")
        values = {k: _column(ds, label_col) for k, ds in parts.items()}
        _check_labels(values, len(names), desc, label_col)
        out = {k: ds if isinstance(ds.features[label_col], datasets.ClassLabel)
               else _set_labels(ds, label_col, values[k], names) for k, ds in parts.items()}
        return out, names
    values = {k: _column(ds, label_col) for k, ds in parts.items()}
    missing = sum(v is None for vals in values.values() for v in vals)
    if missing:
        raise VramfitError(f"{desc}: {missing} row(s) have no `{label_col}` value.",
                           hint="drop unlabelled rows, or pick another column with --set data.label_column=...")
    distinct = {v for vals in values.values() for v in vals}
    if all(isinstance(v, (int, np.integer)) for v in distinct):
        ordered = sorted(distinct)  # numeric order: 2 before 10
        if ordered == list(range(len(ordered))):
            names = [str(v) for v in ordered]
            index = {v: v for v in ordered}
        else:  # sparse ids (e.g. 3, 7, 12): mapped onto 0..K-1, named by the id
            names = [str(v) for v in ordered]
            index = {v: i for i, v in enumerate(ordered)}
    else:  # strings map onto a sorted class list, the same for every split
        ordered = sorted(distinct, key=str)
        names = [str(v) for v in ordered]
        index = {v: i for i, v in enumerate(ordered)}
    return {k: _set_labels(ds, label_col, [index[v] for v in values[k]], names)
            for k, ds in parts.items()}, names


def _set_labels(ds, label_col: str, ints: list[int], names: list[str]):
    import datasets

    # Replacing one column leaves the (possibly large) image column untouched; a cast or map
    # would rewrite the whole table into the cache.
    return ds.remove_columns([label_col]).add_column(label_col, ints,
                                                     feature=datasets.ClassLabel(names=names))


def _check_labels(values: dict, n_classes: int, desc: str, label_col: str) -> None:
    for k, vals in values.items():
        bad = sum(v is None or v < 0 or v >= n_classes for v in vals)
        if bad:
            raise VramfitError(
                f"{desc}: {bad} of {len(vals)} rows of split `{k}` have no valid `{label_col}` "
                f"(unlabelled, e.g. -1).",
                hint="Hub test splits are often unlabelled: pick another with --set data.val_split=..., "
                     "or drop it so a validation split is held out of train")


# ---- holdout ----


def _holdout(ds, label_col: str, fraction: float, seed: int):
    """Seeded, stratified train/validation split of one split."""
    try:
        # The library's stratified split (sklearn's StratifiedShuffleSplit semantics) whenever it
        # applies, so results match other tools given the same seed.
        parts = ds.train_test_split(test_size=fraction, seed=seed, stratify_by_column=label_col)
        return parts["train"], parts["test"]
    except ValueError:
        pass  # a class with 1 image, or fewer held-out images than classes: split by hand below
    labels = np.asarray(_column(ds, label_col))
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
    function of (seed, epoch, index), whatever the worker count, and the caller's RNGs are untouched.

    Only the CPU torch generator is seeded (torch.manual_seed would also reseed CUDA's and costs
    0.13 ms). Inside a loader worker nothing else draws from these RNGs, so nothing is saved or
    restored there: numpy's get/set_state alone costs ~0.1 ms, a tenth of decoding a 500x375 JPEG.
    """

    def __init__(self, seed: int):
        self.seed = seed

    def __enter__(self):
        self._restore = torch.utils.data.get_worker_info() is None
        if self._restore:
            self._py, self._np = random.getstate(), np.random.get_state()
            self._t = torch.default_generator.get_state()
        random.seed(self.seed)
        np.random.seed(self.seed % 2**32)
        torch.default_generator.manual_seed(self.seed)

    def __exit__(self, *exc):
        if self._restore:
            random.setstate(self._py)
            np.random.set_state(self._np)
            torch.default_generator.set_state(self._t)


# ---------------------------------------------------------------------------------------------
# Datasets and loaders


def build_transforms(cfg: DataConfig, data_cfg: dict):
    from timm.data import create_transform

    common = dict(input_size=data_cfg["input_size"], interpolation=data_cfg.get("interpolation", "bilinear"),
                  mean=data_cfg["mean"], std=data_cfg["std"], use_prefetcher=True)
    # Random erasing is not done here (re_prob=0) but on the device, on normalised batches
    # (vramfit.augment), as timm's own prefetcher does.
    train = create_transform(is_training=True, scale=tuple(cfg.scale), ratio=tuple(cfg.ratio),
                             hflip=cfg.hflip, auto_augment=cfg.auto_augment, re_prob=0.0,
                             color_jitter=cfg.color_jitter or None, **common)
    val = create_transform(is_training=False, crop_pct=data_cfg.get("crop_pct", 0.875), **common)
    return train, val


def draft_size(transform, image_size: int) -> int:
    """The shorter side a JPEG must keep when decoded at reduced size (`decode_image` target), read
    off the transform that will consume the image, so the draft always follows the crop settings.

    - RandomResizedCrop (train): the crop side is ~sqrt(scale) of the image's, so full detail for
      every crop would need size / sqrt(scale_min) (792 px at 224 and 0.08); capped at
      TRAIN_DRAFT_FACTOR x size (336 px at 224).
    - Resize (eval): exactly the size it resizes to (256 px at 224 and crop_pct 0.875): nothing is
      lost, the resize only starts from fewer pixels.
    """
    for t in getattr(transform, "transforms", [transform]):
        size, scale = getattr(t, "size", None), getattr(t, "scale", None)
        if size is None:
            continue
        side = max(size) if isinstance(size, (tuple, list)) else int(size)
        if isinstance(scale, (tuple, list)) and len(scale) == 2:
            factor = min(1.0 / math.sqrt(max(float(scale[0]), 1e-4)), TRAIN_DRAFT_FACTOR)
            return math.ceil(side * max(1.0, factor))
        if "Resize" in type(t).__name__:
            return side
    return math.ceil(image_size * 1.15)


class ImageDataset(torch.utils.data.Dataset):
    """Decodes in the loader worker through our guarded decoder; a bad file is replaced by a
    deterministic other sample (train) or masked out (eval), and reported by name."""

    def __init__(self, hf, image_col, label_col, transform, image_size, seed, train: bool):
        self.hf, self.image_col, self.label_col = hf, image_col, label_col
        self.transform, self.image_size, self.seed, self.train = transform, image_size, seed, train
        self.draft = draft_size(transform, image_size)

    def __len__(self):
        return len(self.hf)

    def _load(self, i):
        row = self.hf[int(i)]
        return decode_image(row[self.image_col], self.draft), int(row[self.label_col])

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
    # Its own generator: creating an iterator each epoch must not draw from the global RNG, or a
    # resumed run's dropout stream would be shifted by one draw.
    kw = dict(num_workers=workers, pin_memory=pin, collate_fn=collate,
              generator=torch.Generator().manual_seed(seed))
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
        # One float copy, normalised in place (a uint8 -> float batch at 224 px is 600 KB a sample).
        out = x.to(device, non_blocking=True).to(torch.float32, memory_format=fmt)
        return out.sub_(mean).div_(std)

    return norm


def check_batch_shape(images: torch.Tensor, image_size: int) -> None:
    """The 'resize written but never applied' guard: stop at step 1, not at an OOM later."""
    if images.dim() != 4 or tuple(images.shape[1:]) != (3, image_size, image_size):
        raise VramfitError(
            f"Training batches have shape {tuple(images.shape)}, expected (N, 3, {image_size}, "
            f"{image_size}): the resize/crop transform is not being applied to the images.",
            hint="check data.image_size and that the dataset goes through the train transform")


