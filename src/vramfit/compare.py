"""`vramfit compare RUN_DIR...`: the summaries of several runs side by side."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

from .errors import VramfitError

COLUMNS = [("run", None), ("model", None), ("size", None), ("precision", "precision"),
           ("batch g=m×a×p", None), ("best acc", "best_accuracy"), ("final acc", "final_accuracy"),
           ("epochs", "epochs"), ("img/s", "images_per_second"), ("peak GiB", "peak_memory_bytes"),
           ("planned GiB", "predicted_peak_memory_bytes"),
           ("OOM retries", "oom_retries"), ("skipped", "skipped_samples"), ("wall s", "wall_seconds")]


def load_run(path: Path) -> dict:
    summary_file = path / "summary.json"
    if not summary_file.is_file():
        raise VramfitError(f"{path} has no summary.json: it is not a run folder, or the run has not "
                           "ended yet.", hint="pass folders such as runs/<run_name>")
    s = json.loads(summary_file.read_text())
    cfg = yaml.safe_load((path / "config.yaml").read_text()) if (path / "config.yaml").is_file() else {}
    return {"path": path, "summary": s, "config": cfg or {}}


def _cell(run: dict, name: str, key: str | None) -> str:
    s, c = run["summary"], run["config"]
    if name == "run":
        return run["label"]
    if name == "model":
        return str(c.get("model", {}).get("name", "?"))
    if name == "size":
        return str(c.get("data", {}).get("image_size", "?"))
    if name.startswith("batch"):
        return f"{s.get('global_batch')}={s.get('micro_batch')}×{s.get('grad_accum_steps')}×{s.get('num_processes')}"
    v = s.get(key)
    if v is None:
        return "-"
    if key in ("peak_memory_bytes", "predicted_peak_memory_bytes"):
        return f"{v / 2**30:.2f}"
    if isinstance(v, float):
        return f"{v:.4f}" if "accuracy" in key else f"{v:.1f}"
    return str(v)


def table(runs: list[dict]) -> str:
    rows = [[name for name, _ in COLUMNS]] + [[_cell(r, n, k) for n, k in COLUMNS] for r in runs]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def compare(paths: list[str], sort: str = "best_accuracy", as_json: bool = False, out=None) -> list[dict]:
    out = out or sys.stdout
    runs = []
    for p in paths:
        path = Path(p)
        if path.is_dir() and not (path / "summary.json").exists():
            # An output folder holding several runs.
            runs += [load_run(q) for q in sorted(path.iterdir()) if (q / "summary.json").is_file()]
        else:
            runs.append(load_run(path))
    if not runs:
        raise VramfitError("No finished runs found.", hint="pass run folders or an output folder (runs/)")
    runs.sort(key=lambda r: (r["summary"].get(sort) is None, -(r["summary"].get(sort) or 0)))
    names = [r["path"].name for r in runs]
    for r in runs:  # the same run name under two output folders: say which is which
        r["label"] = (f"{r['path'].parent.name}/{r['path'].name}" if names.count(r["path"].name) > 1
                      else r["path"].name)
    if as_json:
        out.write(json.dumps([{"run": str(r["path"]), **r["summary"]} for r in runs], indent=1) + "\n")
    else:
        out.write(table(runs) + "\n")
    return runs
