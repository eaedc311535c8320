"""`vramfit predict --run DIR IMAGE_OR_FOLDER...`: top-k labels with probabilities for images on
disk, as a table, JSON or CSV. Unreadable files are reported and skipped, never fatal to the rest."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import torch

from ..errors import VramfitError
from .trained import TrainedModel

FORMATS = ("table", "json", "csv")


def collect_images(inputs: list[str]) -> list[str]:
    """Files as given (a missing one is reported later as unreadable, in its place), folders
    searched recursively for image files, in sorted order."""
    from ..data import is_image_file

    files = []
    for name in inputs:
        p = Path(name)
        if p.is_dir():
            found = sorted(str(f) for f in p.rglob("*") if f.is_file() and is_image_file(f))
            if not found:
                raise VramfitError(f"{p} holds no image files.",
                                   hint="pass image files, or folders that contain some")
            files += found
        else:
            files.append(str(p))
    if not files:
        raise VramfitError("No images given.", hint="vramfit predict --run DIR IMAGE_OR_FOLDER...")
    return files


def top_k(logits: torch.Tensor, class_names: list[str], k: int) -> list[list[dict]]:
    probs = logits.float().softmax(dim=1)
    values, indices = probs.topk(min(k, probs.shape[1]), dim=1)
    return [[{"label": class_names[i], "probability": float(p)} for p, i in zip(pv.tolist(), iv.tolist())]
            for pv, iv in zip(values, indices)]


def predict(run_dir: str | Path, inputs: list[str], k: int = 5, fmt: str = "table", batch_size: int = 64,
            out=None, err=None) -> list[dict]:
    """Predictions in input order: `{"file", "predictions": [{"label", "probability"}, ...]}`."""
    if fmt not in FORMATS:
        raise VramfitError(f"Unknown output format `{fmt}`.", hint=f"one of: {', '.join(FORMATS)}")
    out, err = out or sys.stdout, err or sys.stderr
    files = collect_images(inputs)
    tm = TrainedModel(run_dir)
    scores = tm.scores(files, batch_size=batch_size)
    rows = [{"file": files[pos], "predictions": preds}
            for pos, preds in zip(scores.positions, top_k(scores.logits, tm.class_names, k))]
    write(rows, fmt, out)
    if scores.unreadable:
        for _, why in scores.unreadable:
            err.write(f"vramfit: skipped unreadable image {why}\n")
        raise VramfitError(f"{len(scores.unreadable)} of {len(files)} image(s) could not be read "
                           f"(listed above){'' if rows else '; nothing was predicted'}.",
                           hint="check those files (`vramfit scan-data --data FOLDER` lists every broken "
                                "file of a folder)")
    return rows


def write(rows: list[dict], fmt: str, out) -> None:
    if fmt == "json":
        out.write(json.dumps(rows, indent=1) + "\n")
    elif fmt == "csv":
        w = csv.writer(out, lineterminator="\n")
        w.writerow(["file", "rank", "label", "probability"])
        for r in rows:
            for rank, p in enumerate(r["predictions"], 1):
                w.writerow([r["file"], rank, p["label"], f"{p['probability']:.6f}"])
    elif rows:
        from .tables import text_table

        k = max(len(r["predictions"]) for r in rows)
        table = [["file", *(f"top-{i + 1}" for i in range(k))]]
        table += [[r["file"], *(f"{p['label']} {p['probability']:.3f}" for p in r["predictions"])]
                  for r in rows]
        out.write(text_table(table) + "\n")
