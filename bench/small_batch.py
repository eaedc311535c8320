"""What a small micro-batch costs a fine-tuning run in accuracy, by BatchNorm setting, offline.

resnet18 at 32 px is pretrained on part of the built-in digits, then fine-tuned from that weight
file (`model.pretrained_path`, a fresh head) on the rest, with the same global batch (32), epochs
and LR in every variant, over three seeds. Two transfer tasks (`--task`):

- `suited` (default): pretrained 10-way on half the images of every digit, fine-tuned on the other
  half to tell pairs of digits apart (0-1, 2-3, ...): the features suit the target, as ImageNet
  features suit a user's photos
- `distant`: pretrained on the digits 0-4, fine-tuned on the digits 5-9: the features must change

The variants:

- micro 32 x 1 (the reference: what fits on a large card)
- micro 8 x 4, bn: train (accumulation; BatchNorm normalises groups of 8), with the running
  statistics' momentum per forward (torch's) and per step (vramfit's default, model.bn_momentum_per)
- micro 8 x 4, bn: freeze (the pretrained statistics and affine fixed)
- batch 8 with batch 32's LR (what the forum user did: no accumulation)
- micro 8 x 4, bn train, precise BN (model.precise_bn: the statistics recomputed at the end of
  every epoch over 1024 train images at batch 32)
- staged: freeze_epochs 1, with and without layer_decay 0.75, at micro 32 x 1

A run whose summary.json is already in --out is read, not trained again.

Prints a markdown table: final validation accuracy (mean and each seed) and wall seconds.

    python bench/small_batch.py                 # CPU, ~25 minutes on 2 idle cores
    python bench/small_batch.py --task distant
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

from vramfit.data.builtin import ensure_digits

COMMON = ["--model", "resnet18", "--image-size", "32", "--set", "data.hflip=0", "--set", "data.scale=[0.5,1.0]",
          "--set", "data.val_fraction=0.3", "--set", "data.color_jitter=0", "--set", "train.log_every_steps=1000"]

VARIANTS = {
    "micro 32 x 1, bn train": ["--global-batch", "32", "--micro-batch", "32"],
    "micro 8 x 4, bn train, momentum per forward": ["--global-batch", "32", "--micro-batch", "8",
                                                    "--set", "model.bn_momentum_per=micro_batch"],
    "micro 8 x 4, bn train, momentum per step": ["--global-batch", "32", "--micro-batch", "8"],
    "micro 8 x 4, bn train, precise BN": ["--global-batch", "32", "--micro-batch", "8",
                                          "--set", "model.precise_bn=1024"],
    "micro 8 x 4, bn freeze": ["--global-batch", "32", "--micro-batch", "8", "--set", "model.bn=freeze"],
    "batch 8, batch 32's LR": ["--global-batch", "8", "--micro-batch", "8"],
    "staged + layer decay 0.75, micro 32 x 1": ["--global-batch", "32", "--micro-batch", "32",
                                                "--set", "train.freeze_epochs=1", "--set", "optim.layer_decay=0.75"],
    "staged, micro 32 x 1": ["--global-batch", "32", "--micro-batch", "32", "--set", "train.freeze_epochs=1"],
}


def split_digits(root: Path, task: str) -> tuple[Path, Path]:
    """Two class-folder trees of the built-in digits (symlinks): the pretraining and the
    fine-tuning data of `task`."""
    digits = ensure_digits()
    if task == "distant":
        trees = {"digits_0_4": {str(c): sorted((digits / str(c)).iterdir()) for c in range(5)},
                 "digits_5_9": {str(c): sorted((digits / str(c)).iterdir()) for c in range(5, 10)}}
    else:
        files = {c: sorted((digits / str(c)).iterdir()) for c in range(10)}
        trees = {"digits_even_images": {str(c): f[0::2] for c, f in files.items()},
                 "digit_pairs_odd_images": {f"{2 * p}or{2 * p + 1}": files[2 * p][1::2] + files[2 * p + 1][1::2]
                                            for p in range(5)}}
    parts = []
    for name, classes in trees.items():
        for label, members in classes.items():
            folder = root / name / label
            folder.mkdir(parents=True, exist_ok=True)
            for f in members:
                link = folder / f"{f.parent.name}_{f.name}"
                if not link.exists():
                    link.symlink_to(f)
        parts.append(root / name)
    return parts[0], parts[1]


def train(out: Path, name: str, data: Path, args: list[str]) -> dict:
    """One `vramfit train` in its own process; its summary.json and wall seconds (a run already
    in `out` is read, with the wall it recorded)."""
    done, wall = out / name / "summary.json", out / name / "bench_wall_seconds"
    if done.exists() and wall.exists():
        return {"accuracy": json.loads(done.read_text())["final_accuracy"], "wall": float(wall.read_text())}
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "vramfit", "train", "--data", str(data), "--output", str(out), "--run-name", name,
           *COMMON, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if proc.returncode:
        sys.exit(f"{name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    summary = json.loads(done.read_text())
    wall.write_text(f"{time.perf_counter() - t0:.2f}")
    return {"accuracy": summary["final_accuracy"], "wall": float(wall.read_text())}


def pretrain(out: Path, data: Path) -> Path:
    """The checkpoint the variants start from (kept in --out and reused by a rerun)."""
    weights = out / "pretrain" / "model" / "model.safetensors"
    if not weights.exists():
        pre = train(out, "pretrain", data, ["--global-batch", "32", "--epochs", "8", "--set", "train.seed=100"])
        print(f"pretrained on {data.name}: val accuracy {pre['accuracy']:.4f} ({pre['wall']:.0f} s)", file=sys.stderr)
    return weights


def claims(means: dict[str, float]) -> list[tuple[str, bool]]:
    """The claims docs/faq.md makes from the table (micro 8 x 4 near micro 32 x 1; each staged row at
    least as accurate as micro 32 x 1), each with whether this run bears it out."""
    ref = means["micro 32 x 1, bn train"]
    best_bn = max(v for k, v in means.items() if k.startswith("micro 8 x 4"))
    staged = [(k, "micro 32 x 1, bn train") for k in means if k.startswith("staged")]
    return [(f"micro 8 x 4 with the better BatchNorm setting within 0.5 pt of micro 32 x 1 "
             f"({100 * (best_bn - ref):+.2f} pt)", best_bn >= ref - 0.005),
            *((f"{a} at least as accurate as {b} ({100 * (means[a] - means[b]):+.2f} pt)", means[a] >= means[b])
              for a, b in staged)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", choices=["suited", "distant"], default="suited")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--epochs", type=int, default=4, help="fine-tuning epochs (pretraining: 8)")
    ap.add_argument("--skip", nargs="*", default=[], help="leave out the settings whose label holds one of these")
    ap.add_argument("--out", type=Path, default=None, help="keep the runs here (default: a temporary folder)")
    args = ap.parse_args()
    out = (args.out or Path(tempfile.mkdtemp(prefix="vramfit-small-batch-"))) / args.task
    first, second = split_digits(out / "data", args.task)
    weights = pretrain(out, first)
    rows = []
    for label, extra in VARIANTS.items():
        if any(word in label for word in args.skip):
            continue
        runs = [train(out, f"{''.join(c for c in label if c.isalnum())}-s{seed}", second,
                      [*extra, "--epochs", str(args.epochs), "--set", f"train.seed={seed}",
                       "--set", f"model.pretrained_path={weights}"]) for seed in args.seeds]
        accs = [r["accuracy"] for r in runs]
        rows.append((label, statistics.mean(accs), accs, statistics.median(r["wall"] for r in runs)))
        print(f"{label}: {statistics.mean(accs):.4f}", file=sys.stderr)
    ref = rows[0][1]
    print(f"\nresnet18 32 px, {second.name} fine-tuned from {first.name}, {args.epochs} epochs, seeds {args.seeds}\n")
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
