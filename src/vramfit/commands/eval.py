"""`vramfit eval --run DIR`: a trained run's model on a labelled split, with its own eval transform
and class names; top-1/top-5, per-class accuracy and a confusion matrix, written into the run folder
as `eval-<split>.json` and `confusion-<split>.png`."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..errors import VramfitError
from .trained import ColumnItems, TrainedModel

if TYPE_CHECKING:  # type names only; datasets is imported where it is used
    import datasets

DEFAULT_SPLIT = "val"  # the validation split the run itself was evaluated on
WORST_CLASSES_SHOWN = 5


def evaluate_run(run_dir: str | Path, data: str | None = None, split: str | None = None,
                 batch_size: int = 64, out=None) -> dict:
    from ..store.accuracy import classification_report
    from ..store.figures import confusion_figure, save_png
    from ..runtime.storage import write_json
    from ..store.tracking import scrub

    out = out or sys.stdout
    tm = TrainedModel(run_dir)
    ev = eval_split(tm, data, split)
    scores = tm.scores(ColumnItems(ev.ds, ev.image_column), batch_size=batch_size)
    labels = torch.as_tensor(_labels(ev.ds, ev.label_column), dtype=torch.long)[scores.positions]
    if not len(labels):
        raise VramfitError(f"None of the {len(ev.ds)} images of {ev.description} could be read.",
                           hint="run `vramfit scan-data --data SRC` to list the broken files")
    report = classification_report(scores.logits, labels, tm.class_names)
    name = ev.name
    report = {"run": str(tm.run_dir), "split": name, "data": ev.description, **report,
              "unreadable": [why for _, why in scores.unreadable]}
    json_path = tm.run_dir / f"eval-{name}.json"
    write_json(json_path, scrub(report), "the evaluation report")
    png_path = save_png(confusion_figure(report["confusion_matrix"], tm.class_names,
                                         f"{tm.run_dir.name} on {name}: top-1 {report['top1']:.4f}"),
                        tm.run_dir / f"confusion-{name}.png")
    out.write(summary_text(report) + f"\n  written: {json_path}, {png_path}\n")
    return report


@dataclass
class EvalData:
    ds: "datasets.Dataset"  # labels index the model's classes
    image_column: str
    label_column: str
    description: str
    name: str  # names the report files: eval-<name>.json, confusion-<name>.png


def eval_split(tm: TrainedModel, data: str | None, split: str | None) -> EvalData:
    """Default: the run's own validation split (its source, hold-out and sample limit), `val`.
    `split`: a named split of the source. `data`: another source, its validation split if it has
    one, else all of it (a source given for evaluation is not held out from); its reports are
    named after it, so they never overwrite the run's own."""
    from .. import data as D

    cfg = run_data_config(tm)
    prefix = ""
    if data is not None:
        cfg = cfg.model_copy(update={"source": data})
        prefix = re.sub(r"[^A-Za-z0-9_.]+", "_", Path(data).name or data).strip("_") + "-"
    if split is not None:
        ds = D.load_eval_split(cfg, split, tm.class_names)  # checks the classes itself
        return EvalData(ds, *_columns(ds), f"{cfg.source} split `{split}`", prefix + split)
    if data is not None:
        src = D.load_source(cfg)
        check_classes(src.class_names, tm.class_names, src.description)
        whole = src.val is None
        return EvalData(src.train if whole else src.val, src.image_column, src.label_column, src.description,
                        prefix + ("all" if whole else DEFAULT_SPLIT))
    splits = D.load_splits(cfg)
    check_classes(splits.class_names, tm.class_names, splits.description)
    return EvalData(splits.val, splits.image_column, splits.label_column, splits.description, DEFAULT_SPLIT)


def _columns(ds) -> tuple[str, str]:
    """(image column, label column) of a loaded split: its two columns, the label one a ClassLabel."""
    import datasets

    from ..data.shards import IndexedSamples

    if isinstance(ds, IndexedSamples):  # tar shards: rows {"image", "label"}
        return "image", "label"
    label = next(n for n, f in ds.features.items() if isinstance(f, datasets.ClassLabel))
    return next(n for n in ds.column_names if n != label), label


def run_data_config(tm: TrainedModel):
    """The `data` section of the run's resolved config.yaml."""
    from pydantic import ValidationError

    from ..config import Config

    tree = tm.run_file("config")
    if tree is None:
        raise VramfitError(f"{tm.run_dir} has no config.yaml, so its data source is unknown.",
                           hint="name the data with --data SRC")
    try:
        return Config.model_validate(tree).data
    except ValidationError as e:
        raise VramfitError(f"{tm.run_dir}/config.yaml is not a valid vramfit config: "
                           f"{str(e).splitlines()[0]}", hint="name the data with --data SRC") from None


def check_classes(data_classes: list[str], model_classes: list[str], desc: str) -> None:
    """The data's classes must be the model's, in the same order (label i is output i)."""
    if list(data_classes) == list(model_classes):
        return
    unknown = [c for c in data_classes if c not in model_classes]
    missing = [c for c in model_classes if c not in data_classes]
    parts = []
    if unknown:
        parts.append(f"{len(unknown)} the model does not know ({_names(unknown)})")
    if missing:
        parts.append(f"{len(missing)} of the model's are absent ({_names(missing)})")
    detail = "; ".join(parts) or (f"the same classes in another order (data: {_names(data_classes)}, "
                                  f"model: {_names(model_classes)})")
    raise VramfitError(f"The classes of {desc} differ from the model's: {detail}.",
                       hint="evaluate on data labelled with the classes the model was trained on "
                            "(same class folders or label names)")


def _names(names: list[str], most: int = 10) -> str:
    shown = ", ".join(names[:most])
    return shown + (f", ... ({len(names) - most} more)" if len(names) > most else "")


def _labels(ds, label_col: str) -> list[int]:
    from ..data.schema import column
    from ..data.shards import IndexedSamples, split_labels

    if isinstance(ds, IndexedSamples):  # read from the shards' label members, not with every image again
        return split_labels(ds.samples)
    return column(ds, label_col)


def summary_text(report: dict) -> str:
    per_class = [c for c in report["per_class"] if c["accuracy"] is not None]
    worst = sorted(per_class, key=lambda c: c["accuracy"])[:WORST_CLASSES_SHOWN]
    lines = [f"{report['split']}: top-1 {report['top1']:.4f}, top-5 {report['top5']:.4f}, mean per-class "
             f"{report['mean_class_accuracy']:.4f} on {report['samples']} images of {report['data']}"]
    if report["unreadable"]:
        lines.append(f"  {len(report['unreadable'])} unreadable image(s) left out, e.g. {report['unreadable'][0]}")
    lines.append("  weakest classes: " + ", ".join(f"{c['class']} {c['accuracy']:.3f} ({c['samples']})"
                                                   for c in worst))
    return "\n".join(lines)
