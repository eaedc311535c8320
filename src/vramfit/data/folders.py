"""Image folders: the class of an image is the first-level folder under its split root.

Not the `imagefolder` builder of `datasets`: it labels an image by its immediate parent folder, which
splits nested classes apart, and it says nothing about what it skipped.

Rules (docs/data.md):
- wrapper folders are skipped: while a folder holds exactly one sub-folder and no images (an
  unpacked archive's top folder), its sub-folder is the root;
- if the root has a `train/` (or `training/`) folder, its first-level folders named train,
  validation, val, valid, test, eval are splits; otherwise the whole root is `train`;
- the class of an image is the first-level folder under its split root, whatever the depth below it
  (cats/indoor/a.jpg is a `cats` image);
- files that are not images are ignored and counted; a class folder without images is named.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import VramfitError
from ..store.runfolder import is_run_folder
from .schema import SPLIT_NAMES, TRAIN_SPLITS

# Files an image folder may hold as samples (case-insensitive). Everything else (.txt, .DS_Store,
# Thumbs.db, .json sidecars ...) is ignored and counted in the notes.
IMAGE_EXTENSIONS = frozenset({
    ".jpg", ".jpeg", ".jpe", ".jfif", ".png", ".webp", ".bmp", ".dib", ".gif", ".tif", ".tiff",
    ".ppm", ".pgm", ".pbm", ".pnm", ".tga", ".ico"})
# Phone formats PIL cannot open without a plugin: named in the notes so a user knows why.
_NEEDS_PLUGIN = frozenset({".heic", ".heif", ".avif"})
# Folder names that never hold classes (archive and editor debris).
_SKIP_DIRS = frozenset({"__macosx", "@eadir", ".ipynb_checkpoints"})

_LAYOUT_HINT = ("put images in one sub-folder per class (e.g. cats/, dogs/), optionally under "
                "train/ and val/")


@dataclass
class Listing:
    files: list[Path]  # every file under the root, sorted
    skipped_dirs: list[str]  # hidden / system folders not descended into
    dirs: list[Path] = field(default_factory=list)  # every folder descended into, relative to the root


@dataclass
class ImageFolder:
    """An image folder's samples: (absolute path, class folder) rows per split, and what was left out."""

    rows: dict[str, list[tuple[str, str]]]
    notes: list[str]
    empty_classes: list[str]  # class folders without a single image, as `split/name` or `name`


def walk(root: Path, skip: Path | None = None) -> Listing:
    """Every file under root, sorted, following folder links once (a link cycle cannot loop). Never
    data: hidden and system folders, vramfit's own run folders (a run whose --output is the data
    folder or inside it), and `skip` (however it is spelt: relative, absolute, through a link)."""
    out, skipped, dirs, seen = [], [], [], set()
    skip_at = os.path.realpath(skip) if skip is not None else None
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        real = os.path.realpath(dirpath)
        if real in seen:
            dirnames[:] = []
            continue
        seen.add(real)
        keep = []
        for d in sorted(dirnames):
            path = os.path.join(dirpath, d)
            rel = os.path.relpath(path, root)
            if (d.startswith(".") or d.lower() in _SKIP_DIRS or is_run_folder(Path(path))
                    or os.path.realpath(path) == skip_at):
                skipped.append(rel)
            else:
                keep.append(d)
                dirs.append(Path(rel))
        dirnames[:] = keep
        out.extend(Path(dirpath) / f for f in filenames)
    out.sort()
    return Listing(out, skipped, sorted(dirs))


def is_image_file(p: Path) -> bool:
    # Hidden files are never samples: macOS `._x.jpg` AppleDouble files carry an image extension.
    return p.suffix.lower() in IMAGE_EXTENSIONS and not p.name.startswith(".")


def _kind_of(p: Path) -> str:
    name = p.name
    if name.startswith("._"):
        return "._* (macOS)"
    if name.startswith(".") or name.lower() in ("thumbs.db", "desktop.ini"):
        return name
    return p.suffix.lower() or "(no extension)"


def read_image_folder(root: Path, listing: Listing | None = None) -> ImageFolder:
    """The samples of an image folder (see the module docstring for the rules)."""
    listing = listing or walk(root)
    if not listing.files:
        raise VramfitError(f"--data {root} is an empty folder.", hint=_LAYOUT_HINT)
    rels = [f.relative_to(root) for f in listing.files]
    notes: list[str] = []
    prefix = _wrapper_prefix(rels)
    if prefix:
        notes.append(f"used {Path(*prefix)}/ inside {root} as the dataset root (the only folder there)")
    depth = len(prefix)
    top = {r.parts[depth] for r in rels if r.parts[:depth] == prefix and len(r.parts) > depth + 1}
    split_dirs = {d: ("train" if d.lower() in TRAIN_SPLITS else d.lower()) for d in top
                  if d.lower() in SPLIT_NAMES}
    if not any(s == "train" for s in split_dirs.values()):
        split_dirs = {}
    rows, left_out = _assign(listing.files, rels, prefix, split_dirs)
    notes += _left_out_notes(left_out, listing.skipped_dirs)
    if not rows:
        n_images, ignored = len(left_out["loose"]), left_out["ignored"]
        raise VramfitError(
            f"--data {root}: no images in class folders"
            + (f" ({n_images} image(s) directly in the folder)" if n_images else "")
            + (f"; ignored {sum(ignored.values())} file(s) that are not images "
               f"({', '.join(f'{k} {n}' for k, n in ignored.most_common(5))})" if ignored else "") + ".",
            hint=_LAYOUT_HINT + "; image files end in .jpg .jpeg .png .webp .bmp .tif ...")
    class_names = sorted({c for split_rows in rows.values() for _, c in split_rows})
    empty = _empty_class_folders(listing.dirs, prefix, split_dirs, set(class_names))
    if empty:
        notes.append(f"class folder(s) without images left out: {', '.join(empty[:10])}"
                     f"{' ...' if len(empty) > 10 else ''} (the model has {len(class_names)} classes: "
                     f"{', '.join(class_names[:10])}{' ...' if len(class_names) > 10 else ''})")
    if "train" in rows:
        missing = sorted(set(class_names) - {c for _, c in rows["train"]})
        if missing:
            notes.append(f"class(es) with no training images: {', '.join(missing[:10])}")
    return ImageFolder(rows, notes, empty)


def _wrapper_prefix(rels: list[Path]) -> tuple[str, ...]:
    """Wrapper folders: descend while everything lives under one single folder."""
    prefix: tuple[str, ...] = ()
    while True:
        depth = len(prefix)
        under = [r for r in rels if r.parts[:depth] == prefix]
        top_dirs = {r.parts[depth] for r in under if len(r.parts) > depth + 1}
        top_images = [r for r in under if len(r.parts) == depth + 1 and is_image_file(r)]
        if len(top_dirs) != 1 or top_images:
            return prefix
        (only,) = top_dirs
        if only.lower() in SPLIT_NAMES:
            return prefix
        sub_dirs = {r.parts[depth + 1] for r in under if r.parts[depth] == only and len(r.parts) > depth + 2}
        if not sub_dirs:  # `only` itself holds the images: it is a (single) class, not a wrapper
            return prefix
        prefix = prefix + (only,)


def _assign(files: list[Path], rels: list[Path], prefix: tuple[str, ...], split_dirs: dict[str, str]):
    """(rows per split, what was left out) for every file of the listing."""
    depth = len(prefix)
    left_out = {"ignored": Counter(), "loose": [], "outside": set(), "nested": False}
    rows: dict[str, list[tuple[str, str]]] = {}
    for f, r in zip(files, rels):
        parts = r.parts
        if not is_image_file(r):
            left_out["ignored"][_kind_of(r)] += 1
            continue
        if parts[:depth] != prefix:
            left_out["loose"].append(r)
            continue
        parts = parts[depth:]
        split = "train"
        if split_dirs:
            if len(parts) < 2 or parts[0] not in split_dirs:
                (left_out["outside"].add(parts[0]) if len(parts) > 1 else left_out["loose"].append(r))
                continue
            split, parts = split_dirs[parts[0]], parts[1:]
        if len(parts) < 2:  # an image directly in the split root has no class folder
            left_out["loose"].append(r)
            continue
        left_out["nested"] |= len(parts) > 2
        rows.setdefault(split, []).append((os.path.abspath(f), parts[0]))
    return rows, left_out


def _left_out_notes(left_out: dict, skipped_dirs: list[str]) -> list[str]:
    notes = []
    ignored, loose = left_out["ignored"], left_out["loose"]
    if ignored:
        kinds = ", ".join(f"{k} {n}" for k, n in ignored.most_common(8))
        notes.append(f"ignored {sum(ignored.values())} file(s) that are not images ({kinds})")
        plugin = sorted(k for k in ignored if k in _NEEDS_PLUGIN)
        if plugin:
            notes.append(f"{', '.join(plugin)} files need a PIL plugin (e.g. pillow-heif) and were "
                         f"skipped: convert them to JPEG to train on them")
    if loose:
        notes.append(f"ignored {len(loose)} image(s) outside any class folder (e.g. {loose[0]})")
    if left_out["outside"]:
        notes.append(f"ignored folder(s) next to the split folders: {', '.join(sorted(left_out['outside']))}")
    if skipped_dirs:
        notes.append(f"skipped hidden/system folder(s): {', '.join(skipped_dirs[:5])}"
                     f"{' ...' if len(skipped_dirs) > 5 else ''}")
    if left_out["nested"]:
        notes.append("nested folders: each image's class is its first-level folder under the split "
                     "root (cats/indoor/a.jpg is `cats`)")
    return notes


def _empty_class_folders(dirs: list[Path], prefix: tuple[str, ...], split_dirs: dict[str, str],
                         classes: set[str]) -> list[str]:
    """Class-level folders that hold no image and name no class of any split, as written on disk."""
    depth = len(prefix) + (1 if split_dirs else 0)
    out = []
    for d in dirs:
        parts = d.parts
        if len(parts) != depth + 1 or parts[:len(prefix)] != prefix:
            continue
        if split_dirs and parts[len(prefix)] not in split_dirs:
            continue
        if parts[-1] not in classes:
            out.append("/".join(parts[len(prefix):]))
    return out
