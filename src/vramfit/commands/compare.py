"""`vramfit compare RUN_DIR...`: several runs side by side, as a table, a CSV and a picture."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import yaml

from ..errors import VramfitError, damaged_file
from ..runtime.storage import atomic_path, named_output
from ..store.runfolder import RunPaths, data_short_name
from ..store.tracking import read_metrics

# (header, summary.json key or a derived field); derived fields are filled in by `load_run`.
COLUMNS = [("run", None), ("data", None), ("model", None), ("size", None), ("precision", "precision"),
           ("batch g=m×a×p", None), ("accum", "grad_accum_steps"), ("ckpt", None),
           ("best acc", "best_accuracy"), ("final acc", "final_accuracy"), ("epochs", "epochs"),
           ("to best s", "seconds_to_best"), ("img/s", "images_per_second"),
           ("peak GiB", "peak_memory_bytes"), ("planned GiB", "predicted_peak_memory_bytes"),
           ("OOM retries", "oom_retries"), ("skipped", "skipped_samples"), ("wall s", "wall_seconds")]
# What the default table shows, to fit TABLE_WIDTH columns (`--wide`: every column of COLUMNS).
NARROW = ("run", "data", "model", "size", "precision", "batch g=m×a×p", "best acc", "img/s", "peak GiB",
          "planned GiB", "wall s")
TABLE_WIDTH = 120
CSV_FIELDS = ["run", "path", "data", "model", "image_size", "precision", "global_batch", "micro_batch",
              "grad_accum_steps", "num_processes", "grad_checkpointing", "best_accuracy", "final_accuracy",
              "epochs", "seconds_to_best", "images_per_second", "peak_memory_bytes",
              "predicted_peak_memory_bytes", "oom_retries", "skipped_samples", "wall_seconds"]
GIB = 2**30


def load_run(path: Path) -> dict:
    files = RunPaths.at(path)
    summary_file = files.summary
    if not summary_file.is_file():
        raise VramfitError(f"{path} has no summary.json: it is not a run folder, or the run has not "
                           "ended yet.", hint="pass folders such as runs/<run_name>")
    try:
        s = json.loads(summary_file.read_text())
        cfg = yaml.safe_load(files.config.read_text()) if files.config.is_file() else {}
        if not isinstance(s, dict):
            raise ValueError("not a JSON object")
        if not isinstance(cfg, (dict, type(None))):  # config.yaml edited into a list or a word
            raise ValueError(f"{files.config.name} is not a mapping of sections")
    except (OSError, ValueError, yaml.YAMLError) as e:
        raise damaged_file(path, e) from None
    evals = eval_history(files.metrics)
    best = max(evals, key=lambda e: e["accuracy"], default=None)  # max keeps the first of equals
    s = {**s, "seconds_to_best": best["time"] if best else None}
    return {"path": path, "summary": s, "config": cfg or {}, "evals": evals}


def eval_history(metrics_file: Path) -> list[dict]:
    """The evaluation records of metrics.jsonl, `time` made cumulative over resumed segments.

    A resumed run appends to the same file, and its clock starts again at 0 (and may repeat steps
    after the checkpoint it went back to): each segment continues from where the last one ended, so
    the time axis is the wall time the run has cost."""
    evals, offset, last = [], 0.0, 0.0
    for rec in read_metrics(metrics_file):
        t = rec.get("time")
        if not isinstance(t, (int, float)):
            continue
        if t + offset < last:
            offset = last
        last = t + offset
        if rec.get("kind") == "eval" and "val/accuracy" in rec:
            evals.append({"time": last, "step": rec.get("step"), "accuracy": rec["val/accuracy"]})
    return evals


def _cell(run: dict, name: str, key: str | None) -> str:
    s, c = run["summary"], run["config"]
    if name == "run":
        return run["label"]
    if name == "data":
        source = c.get("data", {}).get("source")
        return data_short_name(source) if source else "?"
    if name == "model":
        return str(c.get("model", {}).get("name", "?"))
    if name == "size":
        return str(c.get("data", {}).get("image_size", "?"))
    if name == "ckpt":
        gc = c.get("model", {}).get("grad_checkpointing")
        return "?" if gc is None else "yes" if gc else "no"
    if name.startswith("batch"):
        return f"{s.get('global_batch')}={s.get('micro_batch')}×{s.get('grad_accum_steps')}×{s.get('num_processes')}"
    v = s.get(key)
    if v is None:
        return "-"
    if key in ("peak_memory_bytes", "predicted_peak_memory_bytes"):
        return f"{v / GIB:.2f}"
    if isinstance(v, float):
        return f"{v:.4f}" if "accuracy" in key else f"{v:.1f}"
    return str(v)


def _fit(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(1, width - 1)] + "…"


def table(runs: list[dict], wide: bool = False) -> str:
    """The runs as a text table: every column with `wide`; else the NARROW ones, labels and data
    names shortened (the parts every run name shares left out, then cut) to fit TABLE_WIDTH."""
    from .tables import text_table

    if wide:
        return text_table([[name for name, _ in COLUMNS]] + [[_cell(r, n, k) for n, k in COLUMNS] for r in runs])
    cols = [(n, k) for n, k in COLUMNS if n in NARROW]
    rows = [[_cell({**r, "label": r["short"]}, n, k) for n, k in cols] for r in runs]
    data_col = [n for n, _ in cols].index("data")
    for row in rows:
        row[data_col] = _fit(row[data_col], 16)
    text = text_table([[n for n, _ in cols]] + rows)
    over = max(map(len, text.splitlines())) - TABLE_WIDTH
    if over > 0:  # the run column gives up what is too much, down to 12 characters
        keep = max(12, max(len(row[0]) for row in rows) - over)
        text = text_table([[n for n, _ in cols]] + [[_fit(row[0], keep), *row[1:]] for row in rows])
    return text


def csv_row(run: dict) -> dict:
    s, c = run["summary"], run["config"]
    row = {k: s.get(k) for k in CSV_FIELDS}
    row.update(run=run["label"], path=str(run["path"]), data=c.get("data", {}).get("source"),
               model=c.get("model", {}).get("name"),
               image_size=c.get("data", {}).get("image_size"),
               grad_checkpointing=c.get("model", {}).get("grad_checkpointing"))
    return row


def write_csv(runs: list[dict], path: Path) -> Path:
    """Into `path` (a folder: runs.csv in it); returns the path written."""
    path = named_output(path, "runs.csv")
    with atomic_path(path, "the table") as tmp, open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for r in runs:
            w.writerow(csv_row(r))
    return path


def plot(runs: list[dict], path: Path) -> Path:
    from ..store.figures import compare_figure, save_png

    def gib(v):
        return v / GIB if isinstance(v, (int, float)) else None

    series = [{"label": r["short"], "times": [e["time"] for e in r["evals"]],
               "accuracies": [e["accuracy"] for e in r["evals"]],
               "peak_gib": gib(r["summary"].get("peak_memory_bytes")),
               "planned_gib": gib(r["summary"].get("predicted_peak_memory_bytes")),
               "images_per_second": r["summary"].get("images_per_second")} for r in runs]
    return save_png(compare_figure(series), path, default_name="compare.png")


def short_labels(names: list[str]) -> list[str]:
    """Run names without the parts every one of them shares (`quickstart-resnet18-32px-gb64-...`
    -> `resnet18`), so a picture's legend says what differs; the full name where nothing is left."""
    parts = [n.split("-") for n in names]
    common = set(parts[0]).intersection(*parts[1:]) if len(parts) > 1 else set()
    short = ["-".join(p for p in ps if p not in common) or n for ps, n in zip(parts, names)]
    return short if len(set(short)) == len(short) else names


def find_runs(paths: list[str]) -> list[dict]:
    runs = []
    for p in paths:
        path = Path(p)
        if path.is_dir() and not RunPaths.at(path).summary.exists():
            # An output folder holding several runs: a damaged one is named and left out.
            for q in sorted(path.iterdir()):
                if RunPaths.at(q).summary.is_file():
                    try:
                        runs.append(load_run(q))
                    except VramfitError as e:
                        print(f"vramfit: skipping {q}: {e.message}", file=sys.stderr)
        else:
            runs.append(load_run(path))
    if not runs:
        raise VramfitError("No finished runs found.", hint="pass run folders or an output folder (runs/)")
    names = [r["path"].name for r in runs]
    for r in runs:  # the same run name under two output folders: say which is which
        r["label"] = (f"{r['path'].parent.name}/{r['path'].name}" if names.count(r["path"].name) > 1
                      else r["path"].name)
    for r, short in zip(runs, short_labels([r["label"] for r in runs])):
        r["short"] = short
    return runs


def compare(paths: list[str], sort: str = "best_accuracy", as_json: bool = False, out=None,
            plot_path: str | None = None, csv_path: str | None = None, wide: bool = False) -> list[dict]:
    out = out or sys.stdout
    runs = find_runs(paths)
    known = set().union(*(r["summary"] for r in runs))
    if sort not in known:
        raise VramfitError(f"--sort {sort}: no run's summary has that key.",
                           hint=f"numeric keys: {', '.join(sorted(k for k in known if _numeric(runs, k)))}")
    runs.sort(key=lambda r: (not _is_number(r["summary"].get(sort)),
                             -(r["summary"].get(sort) if _is_number(r["summary"].get(sort)) else 0)))
    if as_json:
        out.write(json.dumps([{"run": str(r["path"]), **r["summary"]} for r in runs], indent=1) + "\n")
    else:
        out.write(table(runs, wide) + "\n")
    if csv_path:
        csv_path = write_csv(runs, Path(csv_path))
    if plot_path:
        plot_path = plot(runs, Path(plot_path))
    for what, where in (("table", csv_path), ("plot", plot_path)):
        if where and not as_json:
            out.write(f"{what} written to {where}\n")
    return runs


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _numeric(runs: list[dict], key: str) -> bool:
    return any(_is_number(r["summary"].get(key)) for r in runs)
