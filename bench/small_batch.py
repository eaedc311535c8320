"""What a small micro-batch costs a fine-tuning run in accuracy, by BatchNorm setting, offline.

The transfer task: resnet18 at 32 px is pretrained on the built-in digits 0-4, then fine-tuned
from that weight file (`model.pretrained_path`) on the digits 5-9, with the same global batch (32),
epochs and LR in every variant, over three seeds:

- micro 32 x 1 (the reference: what fits on a large card)
- micro 8 x 4, bn: train (accumulation; BatchNorm normalises groups of 8), with the running
  statistics' momentum per forward (torch's) and per step (vramfit's default, model.bn_momentum_per)
- micro 8 x 4, bn: freeze (the pretrained statistics and affine fixed)
- batch 8 with batch 32's LR (what the forum user did: no accumulation)
- staged: freeze_epochs 1, with and without layer_decay 0.75, at micro 32 x 1

Prints a markdown table: final validation accuracy (mean and each seed) and wall seconds.

    python bench/small_batch.py                 # CPU, ~8 minutes on 2 cores
    python bench/small_batch.py --seeds 0 --epochs 2    # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from vramfit.builtin_data import ensure_digits

COMMON = ["--model", "resnet18", "--image-size", "32", "--set", "data.hflip=0", "--set", "data.scale=[0.5,1.0]",
          "--set", "data.val_fraction=0.3", "--set", "data.color_jitter=0", "--set", "train.log_every_steps=1000"]

VARIANTS = {
    "micro 32 x 1, bn train": ["--global-batch", "32", "--micro-batch", "32"],
    "micro 8 x 4, bn train, momentum per forward": ["--global-batch", "32", "--micro-batch", "8",
                                                    "--set", "model.bn_momentum_per=micro_batch"],
    "micro 8 x 4, bn train, momentum per step": ["--global-batch", "32", "--micro-batch", "8"],
    "micro 8 x 4, bn freeze": ["--global-batch", "32", "--micro-batch", "8", "--set", "model.bn=freeze"],
    "batch 8, batch 32's LR": ["--global-batch", "8", "--micro-batch", "8"],
    "staged + layer decay 0.75, micro 32 x 1": ["--global-batch", "32", "--micro-batch", "32",
                                                "--set", "train.freeze_epochs=1", "--set", "optim.layer_decay=0.75"],
    "staged, micro 32 x 1": ["--global-batch", "32", "--micro-batch", "32", "--set", "train.freeze_epochs=1"],
}


def split_digits(root: Path) -> tuple[Path, Path]:
    """Two class-folder trees of the built-in digits: 0-4 (pretraining) and 5-9 (fine-tuning)."""
    digits = ensure_digits()
    parts = []
    for name, classes in (("digits_0_4", range(5)), ("digits_5_9", range(5, 10))):
        part = root / name
        part.mkdir(parents=True, exist_ok=True)
        for c in classes:
            link = part / str(c)
            if not link.exists():
                link.symlink_to(digits / str(c), target_is_directory=True)
        parts.append(part)
    return parts[0], parts[1]


def train(out: Path, name: str, data: Path, args: list[str]) -> dict:
    """One `vramfit train` in its own process; its summary.json and wall seconds."""
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "vramfit", "train", "--data", str(data), "--output", str(out), "--run-name", name,
           *COMMON, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if proc.returncode:
        sys.exit(f"{name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    summary = json.loads((out / name / "summary.json").read_text())
    return {"accuracy": summary["final_accuracy"], "wall": time.perf_counter() - t0}


def pretrain(out: Path, data: Path) -> Path:
    """The digits 0-4 checkpoint the variants start from (kept in --out and reused by a rerun)."""
    weights = out / "pretrain" / "model" / "model.safetensors"
    if not weights.exists():
        pre = train(out, "pretrain", data, ["--global-batch", "32", "--epochs", "8", "--set", "train.seed=100"])
        print(f"pretrained on digits 0-4: val accuracy {pre['accuracy']:.4f} ({pre['wall']:.0f} s)", file=sys.stderr)
    return weights


def claims(means: dict[str, float]) -> list[tuple[str, bool]]:
    """The two claims docs/faq.md makes from the table, each with whether this run bears it out."""
    ref = means["micro 32 x 1, bn train"]
    best_bn = max(v for k, v in means.items() if k.startswith("micro 8 x 4"))
    staged = [(k, "micro 32 x 1, bn train") for k in means if k.startswith("staged")]
    return [(f"micro 8 x 4 with the better BatchNorm setting within 0.5 pt of micro 32 x 1 "
             f"({100 * (best_bn - ref):+.2f} pt)", best_bn >= ref - 0.005),
            *((f"{a} at least as accurate as {b} ({100 * (means[a] - means[b]):+.2f} pt)", means[a] >= means[b])
              for a, b in staged)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--epochs", type=int, default=4, help="fine-tuning epochs (pretraining: 8)")
    ap.add_argument("--out", type=Path, default=None, help="keep the runs here (default: a temporary folder)")
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="vramfit-small-batch-"))
    first, second = split_digits(out / "data")
    weights = pretrain(out, first)
    rows = []
    for label, extra in VARIANTS.items():
        runs = [train(out, f"{''.join(c for c in label if c.isalnum())}-s{seed}", second,
                      [*extra, "--epochs", str(args.epochs), "--set", f"train.seed={seed}",
                       "--set", f"model.pretrained_path={weights}"]) for seed in args.seeds]
        accs = [r["accuracy"] for r in runs]
        rows.append((label, statistics.mean(accs), accs, statistics.median(r["wall"] for r in runs)))
        print(f"{label}: {statistics.mean(accs):.4f}", file=sys.stderr)
    ref = rows[0][1]
    print(f"\nresnet18 32 px, digits 5-9 fine-tuned from digits 0-4, {args.epochs} epochs, seeds {args.seeds}\n")
    print("| setting | val accuracy (mean) | vs micro 32 x 1 | per seed | wall s (median) |")
    print("|---|---|---|---|---|")
    for label, mean, accs, wall in rows:
        print(f"| {label} | {mean:.4f} | {100 * (mean - ref):+.2f} pt | {' '.join(f'{a:.4f}' for a in accs)} | {wall:.0f} |")
    results = claims({label: mean for label, mean, _, _ in rows})
    print()
    for text, holds in results:
        print(f"- {'holds' if holds else 'DOES NOT HOLD'}: {text}")
    sys.exit(0 if all(holds for _, holds in results) else 1)


if __name__ == "__main__":
    main()
