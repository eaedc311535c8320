"""What a dataset's parts are called: split names, the image and label columns, and the labels as
one `ClassLabel` shared by every split (strings and sparse ids mapped onto 0..K-1)."""

from __future__ import annotations

import re
from pathlib import PurePath

import numpy as np

from ..errors import VramfitError

IMAGE_COLUMNS = ("image", "img", "images", "pixel_values", "picture", "photo", "jpg", "jpeg", "png",
                 "webp", "image_bytes", "file", "path", "image_path", "filepath")
LABEL_COLUMNS = ("label", "labels", "fine_label", "target", "targets", "class", "category",
                 "label_id", "class_id", "coarse_label", "cls", "y")
TRAIN_SPLITS = ("train", "training")
# Picked as the validation split when present, in this order. `test` never is: selecting the best
# epoch on it would be selection on the test set (`data.val_split=test` still picks it on request).
VAL_SPLITS = ("validation", "val", "valid")
# Splits kept aside for a final evaluation; named as splits (folders, file names) but not picked.
HELD_OUT_SPLITS = ("test", "eval")
SPLIT_NAMES = TRAIN_SPLITS + VAL_SPLITS + HELD_OUT_SPLITS


def split_of(rel: PurePath) -> str:
    """Split of a parquet/arrow file from its path: `train-00000-of-00002.parquet`,
    `data/validation/x.arrow`, `cifar10-test.arrow`; the file name wins over its folders."""
    for part in reversed((*rel.parent.parts, rel.stem)):
        tokens = re.split(r"[-_.\s]+", part.lower())
        hit = next((s for s in SPLIT_NAMES if s in tokens), None)
        if hit:
            return "train" if hit in TRAIN_SPLITS else hit
    return "train"


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


def pick_image_column(ds, override: str | None) -> str:
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


def pick_label_column(ds, image_col: str, override: str | None) -> str:
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


def column(ds, name: str) -> list:
    """A column as a Python list, fast (Arrow, not row by row) and honouring any index mapping."""
    return ds.select_columns([name]).with_format("arrow")[:][name].to_pylist()


def encode_labels(parts: dict, label_col: str, desc: str):
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
        values = {k: column(ds, label_col) for k, ds in parts.items()}
        _check_labels(values, len(names), desc, label_col)
        out = {k: ds if isinstance(ds.features[label_col], datasets.ClassLabel)
               else _set_labels(ds, label_col, values[k], names) for k, ds in parts.items()}
        return out, names
    values = {k: column(ds, label_col) for k, ds in parts.items()}
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


