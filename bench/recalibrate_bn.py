"""Is it the running statistics? A finished run's BatchNorm statistics recomputed, then evaluated.

A micro-batch of 8 can cost accuracy two ways: the running statistics that evaluation uses follow
noisy 8-image means, or training itself normalises by 8 images. This recomputes every BatchNorm's
running statistics of a run's best weights (model/) from scratch, as an equal-weight average over
the train split in a fixed order at `--batch` images (train-mode forwards without gradients, the
validation transform: what torch.optim.swa_utils.update_bn and "precise BN" do), and prints the
validation accuracy before and after. If the small micro-batch's gap closes, the statistics were to
blame; if it stays, the training was.

    python bench/small_batch.py --out /tmp/sb        # the runs, under /tmp/sb/suited
    python bench/recalibrate_bn.py /tmp/sb/suited/micro32x1bntrain-s* /tmp/sb/suited/micro8x4bntrainmomentumperstep-s*
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

from vramfit.commands.eval import run_data_config
from vramfit.commands.trained import ColumnItems, TrainedModel
from vramfit.data import load_splits


def accuracy(tm: TrainedModel, ds, column: str, labels: torch.Tensor) -> float:
    s = tm.scores(ColumnItems(ds, column), batch_size=64, workers=0)
    return (s.logits.argmax(1) == labels[s.positions]).float().mean().item()


def recalibrate(run: str, batch: int) -> tuple[float, float]:
    tm = TrainedModel(run, device="cpu")
    sp = load_splits(run_data_config(tm))
    labels = torch.tensor(sp.val[sp.label_column])
    before = accuracy(tm, sp.val, sp.image_column, labels)
    # Hand-written rather than swa_utils.update_bn: that one takes a loader of tensors, and this
    # reuses TrainedModel's own preprocessing; the statistics are the same equal-weight average.
    norms = [m for m in tm.model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # cumulative: each batch weighs the same
        m.train()
    order = torch.randperm(len(sp.train), generator=torch.Generator().manual_seed(0)).tolist()
    tm.scores(ColumnItems(sp.train.select(order), sp.image_column), batch_size=batch, workers=0)
    for m in norms:
        m.eval()
    return before, accuracy(tm, sp.val, sp.image_column, labels)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    groups: dict[str, list[tuple[float, float]]] = {}
    for run in args.runs:
        groups.setdefault(os.path.basename(run.rstrip("/")).rsplit("-s", 1)[0], []).append(recalibrate(run, args.batch))
    print(f"| run | best weights (model/), as trained (mean) | recomputed at batch {args.batch} (mean) | change | runs |")
    print("|---|---|---|---|---|")
    for name, pairs in groups.items():
        b, a = statistics.mean(p[0] for p in pairs), statistics.mean(p[1] for p in pairs)
        print(f"| {name} | {b:.4f} | {a:.4f} | {100 * (a - b):+.2f} pt | {len(pairs)} |")


if __name__ == "__main__":
    main()
