"""Two tiny real runs on the built-in digits, trained once per test process and shared by the tests of
what comes after training (eval, predict, export, compare).

If training itself fails, a stand-in run folder is written by hand (config.yaml, summary.json,
metrics.jsonl and model/ through `vramfit.models.create.export`), so these tests keep checking their own
commands; `Run.real` says which one a test got.
"""

from __future__ import annotations

import functools
import json
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

from helpers import tiny_args
from vramfit.runtime.launch import forget


@dataclass
class Run:
    path: Path
    real: bool  # trained by `vramfit train` (not a stand-in)


VARIANTS = {
    # name: extra train flags. `b` differs in what compare shows: accumulation, checkpointing, epochs.
    "a": [],
    "b": ["--micro-batch", "8", "--grad-checkpointing", "--set", "data.limit_train_samples=32"],
}


@functools.lru_cache(maxsize=None)
def _root() -> Path:
    return Path(tempfile.mkdtemp(prefix="vramfit-trained-"))


@functools.lru_cache(maxsize=None)
def trained_run(name: str = "a") -> Run:
    from vramfit.cli import run

    out = _root() / "runs"
    try:
        code = run(["train", *tiny_args(*VARIANTS[name]), "--output", str(out), "--run-name", name])
        if code == 0 and (out / name / "model" / "model.safetensors").is_file():
            return Run(out / name, True)
        reason = f"exit code {code}"
    except (Exception, SystemExit) as e:  # noqa: BLE001 - any trainer failure: fall back, say so
        reason = f"{type(e).__name__}: {e}"
    finally:
        forget()
    warnings.warn(f"training the tiny run `{name}` failed ({reason}); using a stand-in run folder")
    return Run(stand_in(out / name, name), False)


def stand_in(run_dir: Path, name: str) -> Path:
    """A run folder as the trainer writes it, with an untrained test_resnet."""
    import timm
    import torch

    from vramfit.config import build_config
    from vramfit.models.create import data_config, export

    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    cfg = build_config(None, ["data.val_fraction=0.2", "data.limit_train_samples=480",
                              "data.limit_val_samples=120", "data.num_workers=0"],
                       {"model.name": "test_resnet", "data.image_size": 32, "train.global_batch": 16,
                        "train.epochs": 1, "run_name": name})
    (run_dir / "config.yaml").write_text(cfg.to_yaml())
    torch.manual_seed(0)
    model = timm.create_model("test_resnet", num_classes=10)
    export(model, run_dir / "model", [str(i) for i in range(10)], data_config(model, 32))
    summary = {"run_name": name, "best_accuracy": 0.1, "final_accuracy": 0.1, "epochs": 1, "global_step": 30,
               "global_batch": 16, "micro_batch": 16, "grad_accum_steps": 1, "num_processes": 1,
               "precision": "no", "images_per_second": 50.0, "peak_memory_bytes": None,
               "predicted_peak_memory_bytes": 10 * 2**20, "skipped_samples": 0, "oom_retries": 0,
               "wall_seconds": 12.0}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    records = [{"step": 10, "time": 4.0, "kind": "train", "loss": 2.3},
               {"step": 30, "time": 11.0, "kind": "eval", "epoch": 1, "val_accuracy": 0.1, "val_top5": 0.5}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run_dir


