"""What every run records: the run folder files, metrics.jsonl, and the trackers (W&B, TensorBoard)
through Accelerate: how a run is named, grouped and tagged there, and the per-evaluation views
(per-class accuracy, confusion matrix, the misclassified images).

The training loop calls, in order (main process only where noted by the functions themselves):
  Accelerator(log_with=log_with(cfg, run_dir), ...)
  run_id = wandb_run_id(resumed_state.wandb_run_id)  # kept in the checkpointed trainer state
  start_trackers(acc, cfg, run_dir, run_name, run_id=run_id, precision=name, env=env, plan=plan)
  RunLog(acc, run_dir, use_trackers=bool(tracker_names(cfg.tracking.tracker))).log(...)  # each step / eval
  log_evaluation(acc, logits, labels, class_names, step, indices=..., load_image=...)   # each eval
  RunLog.summary(summary); acc.end_training()
"""

from __future__ import annotations

import json
import os
import platform
import secrets
import subprocess
import time
from pathlib import Path

import numpy as np
import torch

from ..errors import VramfitError
from ..runtime import storage

SECRET_ENV = ("WANDB_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")


def environment(accelerator) -> dict:
    import accelerate
    import datasets
    import timm

    env = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": str(torch.__version__),  # a str subclass, which YAML (TensorBoard's hparams) would dump as an object
        "torchvision": _version("torchvision"),
        "timm": timm.__version__,
        "accelerate": accelerate.__version__,
        "datasets": datasets.__version__,
        "evaluate": _version("evaluate"),
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "git_commit": _git_commit(),
        "num_processes": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type),
        "device": str(accelerator.device),
        "device_names": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available() else [platform.processor() or "cpu"],
        "cpu_count": os.cpu_count(),
    }
    return env


def _version(name: str):
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:  # noqa: BLE001
        return None


def _git_commit() -> str | None:
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True,
                             timeout=5)
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def scrub(obj):
    """Drop any value equal to a secret from the environment (defence in depth for config/logs)."""
    secrets = {os.environ[k] for k in SECRET_ENV if os.environ.get(k)}
    if not secrets:
        return obj
    if isinstance(obj, dict):
        return {k: scrub(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [scrub(v) for v in obj]
    if isinstance(obj, str) and any(s in obj for s in secrets):
        return "<redacted>"
    return obj


class RunLog:
    """metrics.jsonl on the main process, mirrored to the configured Accelerate trackers."""

    def __init__(self, accelerator, run_dir: Path, use_trackers: bool, resumed_step: int | None = None):
        """`resumed_step`: the checkpoint's global step the run continues from (None: a fresh
        start). The record is made to match the checkpoint first (see `continue_record`)."""
        from .runfolder import RunPaths

        self.acc, self.path, self.use_trackers = accelerator, RunPaths.at(run_dir).metrics, use_trackers
        if accelerator.is_main_process:
            continue_record(self.path, resumed_step)
        # A resumed run appends to the same file: its clock continues where the file ends, so `time`
        # is the wall time the whole run has cost (what `compare` plots accuracy against).
        self.t0 = time.time() - _last_time(self.path)

    def log(self, record: dict, step: int) -> None:
        if not self.acc.is_main_process:
            return
        figures = figure_names(record)
        rec = scrub({"step": step, "time": round(time.time() - self.t0, 3), "kind": record.get("kind"), **figures})
        storage.append_line(self.path, json.dumps(rec), "the metrics record")
        if self.use_trackers:
            self.acc.log(figures, step=step)  # numbers only: nothing to scrub

    def summary(self, summary: dict) -> None:
        """The run's final figures as the tracker's run summary (W&B's last-value default would show
        the final, not the best, accuracy when runs are compared)."""
        if not (self.acc.is_main_process and self.use_trackers):
            return
        figures = {k: v for k, v in scrub(summary).items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        for tracker in self.acc.trackers:
            if tracker.name == "wandb":
                tracker.tracker.summary.update(figures)
            elif tracker.name == "tensorboard":  # no run summary there: the figures at the last step
                for k, v in figures.items():
                    tracker.tracker.add_scalar(f"summary/{k}", v, summary.get("global_step"))
                tracker.tracker.flush()


# The groups every logged figure is named under (`group/name`): what docs, sweeps and compare may
# name, checked against a real run's W&B history by tests/test_tracking.py.
FIGURE_GROUPS = ("train", "val", "epoch", "memory")
# Keys that keep their name (the x axes, not figures).
AXES = ("epoch",)
# The memory a step measured, one group whatever the record's kind.
MEMORY_NAMES = {"host_rss_bytes": "memory/host_rss_bytes", "mem_allocated_bytes": "memory/allocated_bytes",
                "mem_reserved_bytes": "memory/reserved_bytes", "mem_peak_bytes": "memory/peak_bytes"}
POSITION = ("step", "time", "kind")  # where a metrics.jsonl row sits, not figures


def figure_names(record: dict) -> dict:
    """A record's figures under the names metrics.jsonl and the trackers both use, grouped by what
    they measure: a training step's `loss` as `train/loss`, an evaluation's `val_accuracy` as
    `val/accuracy`, the epoch it closes as `epoch/seconds`, memory as `memory/...` (W&B and
    TensorBoard group panels by the part before the slash). Numbers only. Names already grouped
    pass through, so a row written this way maps to itself."""
    kind = record.get("kind")
    out = {}
    for k, v in record.items():
        if k in POSITION or not isinstance(v, (int, float)) or isinstance(v, bool):
            continue
        if k in AXES or "/" in k:
            out[k] = v
        elif k in MEMORY_NAMES:
            out[MEMORY_NAMES[k]] = v
        elif kind == "eval":  # the evaluation's own figures, and the epoch's it closes
            out[f"val/{k.removeprefix('val_')}" if k.startswith("val_") else f"epoch/{k.removeprefix('epoch_')}"] = v
        else:
            out[f"{kind or 'train'}/{k}"] = v
    return out


def read_metrics(metrics_file: Path) -> list[dict]:
    """metrics.jsonl's rows (`step`, `time`, `kind` and the figures by their grouped names). Lines
    cut short by a crash are skipped; rows of run folders written before the figures were grouped
    (`loss`, `val_accuracy`, ...) read under today's names."""
    return [{**{k: row[k] for k in POSITION if k in row}, **figure_names(row)} for _, row in _rows(metrics_file)]


def _rows(metrics_file: Path) -> list[tuple[str, dict]]:
    """Each whole line of metrics.jsonl with its object; lines cut short by a crash are left out."""
    if not metrics_file.is_file():
        return []
    out = []
    for line in metrics_file.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            out.append((line, row))
    return out


def continue_record(metrics_file: Path, resumed_step: int | None) -> None:
    """metrics.jsonl as an uninterrupted run would have it at the resume point: lines logged after
    the checkpoint's step (by a run that crashed or was killed before its next save) are dropped,
    since the resumed run logs those steps again. A fresh start into a folder that holds a record
    (every checkpoint was damaged) keeps the old record aside as metrics.jsonl.before-<time>."""
    if not metrics_file.is_file():
        return
    if resumed_step is None:
        os.replace(metrics_file, metrics_file.with_name(f"{metrics_file.name}.before-{int(time.time())}"))
        return
    kept = [line + "\n" for line, row in _rows(metrics_file)
            if isinstance(row.get("step"), int) and row["step"] <= resumed_step]
    storage.write_text(metrics_file, "".join(kept), "the metrics record")


def _last_time(metrics_file: Path) -> float:
    for _, row in reversed(_rows(metrics_file)):
        if isinstance(row.get("time"), (int, float)):
            return float(row["time"])
    return 0.0


# -------------------------------------------------------------------------------------------------
# Trackers: which, where, and how a run is named, grouped and tagged

TRACKERS = ("wandb", "tensorboard")
TENSORBOARD_DIR = "tensorboard"  # under the run folder: `tensorboard --logdir runs/` shows every run
WANDB_TAG_MAX = 64  # W&B refuses longer tags
# Above this many classes W&B's interactive confusion matrix (a table of C x C rows) is too large to
# be useful; the matrix is logged as a picture instead.
WANDB_MATRIX_MAX_CLASSES = 50
TENSORBOARD_CLASS_SCALARS_MAX = 100


def tracker_names(setting: str | None) -> list[str]:
    """`none` / `wandb` / `tensorboard` / `wandb,tensorboard` -> the tracker names, checked."""
    names = [t.strip() for t in str(setting or "none").split(",") if t.strip() not in ("", "none")]
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise VramfitError(f"Unknown tracker `{unknown[0]}` in tracking.tracker={setting}.",
                           hint=f"use none, {', '.join(TRACKERS)}, or both comma-separated: wandb,tensorboard")
    return list(dict.fromkeys(names))


def log_with(cfg, run_dir: Path) -> list | None:
    """`Accelerator(log_with=...)`: W&B by name; TensorBoard as a tracker writing into the run folder
    (`<run>/tensorboard/`), so it needs no Accelerator project_dir and stays with the run."""
    from accelerate.tracking import TensorBoardTracker

    trackers = [TensorBoardTracker(TENSORBOARD_DIR, str(run_dir)) if n == "tensorboard" else n
                for n in tracker_names(cfg.tracking.tracker)]
    return trackers or None


def wandb_run_id(kept: str | None = None) -> str:
    """The W&B run id: the checkpoint's (`kept`: a resumed run appends to the same W&B run), else
    the one a sweep agent or the user set (WANDB_RUN_ID), else a new one. Store it in the
    checkpointed trainer state as `wandb_run_id`."""
    if kept:
        return str(kept)
    if os.environ.get("WANDB_RUN_ID"):
        return os.environ["WANDB_RUN_ID"]
    # Random, not derived from the run folder: a new run in a reused or moved folder is a new W&B run.
    # (wandb has no public id generator; its ids are short lowercase alphanumerics like this one.)
    return secrets.token_hex(6)


def dataset_group(source: str) -> str:
    """W&B group: the dataset's name (a folder's or file's own name, a Hub id as is), so runs on
    one dataset are listed and charted together."""
    p = Path(str(source)).expanduser()
    if p.exists():
        return (p.stem if p.is_file() else p.resolve().name) or str(source)
    return str(source)


def run_tags(cfg, env: dict | None, precision: str) -> list[str]:
    """`precision`: what ran (precision.resolve's name: fp32 | bf16 | fp16), not `auto`."""
    env = env or {}
    device = "cpu"
    if str(env.get("device", "")).startswith("cuda") and env.get("device_names"):
        n = int(env.get("num_processes") or 1)
        device = f"{n}x {env['device_names'][0]}" if n > 1 else str(env["device_names"][0])
    recipe = Path(cfg.recipe).stem if cfg.recipe else "custom"
    tags = [f"recipe:{recipe}", f"model:{cfg.model.name}", f"device:{device}",
            f"precision:{precision}"]
    return [t[:WANDB_TAG_MAX] for t in tags]


def run_config(cfg, precision: str, env: dict | None = None, plan: dict | None = None) -> dict:
    """The resolved config with the memory plan and the environment, as the trackers store it:
    `train.precision` is what ran (`train.requested_precision` what was asked, e.g. `auto`)."""
    tree = cfg.model_dump(mode="json")
    tree["train"] = {**tree["train"], "precision": precision, "requested_precision": cfg.train.precision}
    return scrub({**tree, "plan": plan or {}, "env": env or {}})


def wandb_init_kwargs(cfg, run_name: str, run_dir: Path, run_id: str, precision: str,
                      env: dict | None = None) -> dict:
    kwargs = {"name": run_name, "id": run_id, "resume": "allow", "dir": str(Path(run_dir).resolve()),
              "group": dataset_group(cfg.data.source), "tags": run_tags(cfg, env, precision),
              "job_type": "train"}
    if cfg.tracking.entity:
        kwargs["entity"] = cfg.tracking.entity
    return kwargs


def start_trackers(acc, cfg, run_dir: Path, run_name: str, *, run_id: str, precision: str,
                   env: dict | None = None, plan: dict | None = None) -> None:
    """Start every configured tracker and store the run's config (+ plan and environment) in it.
    Call on every process once the run folder exists, after `Accelerator(log_with=log_with(cfg, run_dir))`."""
    storage.make_folder(Path(run_dir))
    storage.quiet_writer_threads()
    acc.init_trackers(cfg.tracking.project,
                      init_kwargs={"wandb": wandb_init_kwargs(cfg, run_name, run_dir, run_id, precision, env)})
    if not acc.is_main_process:
        return
    config = run_config(cfg, precision, env, plan)
    for tracker in acc.trackers:
        if tracker.name == "wandb":  # the run's headline in W&B's table: its best validation accuracy
            tracker.tracker.define_metric("val/accuracy", summary="max")
        # TensorBoard's hparams take only flat scalars; W&B keeps the nesting (filterable in its UI).
        tracker.store_init_configuration(config if tracker.name == "wandb" else flat_config(config))


def flat_config(tree: dict, prefix: str = "") -> dict:
    """`{"model": {"name": x}}` -> `{"model/name": x}`; lists and None as text."""
    out = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flat_config(v, key + "/"))
        else:
            out[key] = v if isinstance(v, (int, float, str, bool)) else json.dumps(v, default=str)
    return out


# -------------------------------------------------------------------------------------------------
# Per evaluation: per-class accuracy, confusion matrix, the misclassified images

MISCLASSIFIED_SHOWN = 24
THUMBNAIL_PX = 96


def log_evaluation(acc, logits: torch.Tensor, labels: torch.Tensor, class_names: list[str], step: int, *,
                   indices: torch.Tensor | None = None, load_image=None,
                   max_images: int = MISCLASSIFIED_SHOWN) -> dict | None:
    """Log one evaluation's per-class accuracy table, confusion matrix and the most confident
    mistakes (images when `indices` and `load_image` are given) to every tracker, at `step` (the
    step of the eval record RunLog wrote). Returns the report (store.accuracy.classification_report).

    `logits` [N, C] float and `labels` [N] are the gathered validation outputs (CPU); `indices` [N]
    the dataset index of each row and `load_image(index)` the image (PIL / uint8 array, or None if
    unreadable), e.g. `dataset_images(splits.val, splits.image_column)`. Main process only."""
    from .accuracy import classification_report, misclassified

    if not acc.is_main_process or not acc.trackers:
        return None
    logits, labels = logits.detach().float().cpu(), labels.detach().cpu()
    report = classification_report(logits, labels, class_names)
    mistakes = misclassified(logits, labels, max_images) if indices is not None and load_image else []
    shown = _mistake_images(mistakes, indices, load_image, class_names)
    for tracker in acc.trackers:
        if tracker.name == "wandb":
            _wandb_evaluation(tracker.tracker, report, logits, labels, shown, step)
        elif tracker.name == "tensorboard":
            _tensorboard_evaluation(tracker.tracker, report, shown, step)
    return report


def dataset_images(ds, image_column: str):
    """`load_image` for `log_evaluation`: row `index` of a datasets split, decoded, or None."""
    from ..data.decode import BadImage, decode_image

    def load(index: int):
        try:
            return decode_image(ds[int(index)][image_column])
        except BadImage:
            return None

    return load


def _mistake_images(mistakes: list[dict], indices, load_image, class_names: list[str]) -> list[tuple]:
    """(thumbnail, caption) of each mistake whose image can be read."""
    from PIL import Image

    shown = []
    for m in mistakes:
        img = load_image(int(indices[m["row"]]))
        if img is None:
            continue
        img = img if isinstance(img, Image.Image) else Image.fromarray(np.asarray(img))
        # Tiny images (digits are 8 px) are scaled up without smoothing, large ones down.
        scale = THUMBNAIL_PX / max(img.size)
        img = img.convert("RGB").resize((max(1, round(img.width * scale)), max(1, round(img.height * scale))),
                                        Image.NEAREST if scale > 1 else Image.BICUBIC)
        shown.append((img, f"{class_names[m['label']]} → {class_names[m['predicted']]} ({m['probability']:.2f})"))
    return shown


def _wandb_evaluation(run, report: dict, logits, labels, shown: list[tuple], step: int) -> None:
    import wandb

    names = report["class_names"]
    table = wandb.Table(columns=["class", "accuracy", "samples"],
                        data=[[c["class"], c["accuracy"], c["samples"]] for c in report["per_class"]])
    values = {"val/per_class_accuracy": table, "val/mean_class_accuracy": report["mean_class_accuracy"]}
    if len(names) <= WANDB_MATRIX_MAX_CLASSES:
        values["val/confusion_matrix"] = wandb.plot.confusion_matrix(
            y_true=labels.tolist(), preds=logits.argmax(1).tolist(), class_names=names,
            title=f"confusion matrix, step {step}")
    else:
        values["val/confusion_matrix"] = wandb.Image(_confusion_pixels(report, step))
    if shown:
        values["val/misclassified"] = [wandb.Image(img, caption=cap) for img, cap in shown]
    run.log(values, step=step)


def _tensorboard_evaluation(writer, report: dict, shown: list[tuple], step: int) -> None:
    from .figures import image_grid_figure, to_array

    if len(report["per_class"]) <= TENSORBOARD_CLASS_SCALARS_MAX:
        for c in report["per_class"]:
            if c["accuracy"] is not None:
                writer.add_scalar(f"val/class_accuracy/{c['class']}", c["accuracy"], step)
    writer.add_scalar("val/mean_class_accuracy", report["mean_class_accuracy"], step)
    writer.add_image("val/confusion_matrix", _confusion_pixels(report, step), step, dataformats="HWC")
    if shown:
        grid = image_grid_figure([img for img, _ in shown], [cap for _, cap in shown], columns=8,
                                 title="misclassified: true → predicted (probability)")
        writer.add_image("val/misclassified", to_array(grid), step, dataformats="HWC")
    writer.flush()


def _confusion_pixels(report: dict, step: int) -> np.ndarray:
    from .figures import confusion_figure, to_array

    return to_array(confusion_figure(report["confusion_matrix"], report["class_names"],
                                     f"step {step}: top-1 {report['top1']:.4f}"))
