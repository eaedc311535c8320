"""Does progressive resizing pay? Fixed size against `data.progressive_resize` on the same data,
epochs and seeds, side by side.

Each seed trains the recipe twice, the two runs back to back (a slow stretch of a shared machine
falls on both): once at its image size, once with progressive resizing (Composer's defaults unless
--resize-set says otherwise). Figures from summary.json: final validation accuracy (always at the
full size) and wall time; medians over the seeds.

Must hold: the progressive median accuracy at least the fixed one less 0.3 points, in at most
0.8x its median wall time. Exit 1 when either does not.

Beside them, what the schedule could save here at best: one training step (the run's own step:
forwards, backwards and update on random images of the global batch, no loading) timed at every
size the schedule trains at, and the schedule's steps priced by it against the fixed
run's (evaluation and start-up, which do not shrink, left out). Where that ceiling is above 0.8x,
the wall bound cannot hold on this device whatever the accuracy.

    python bench/progressive.py                     # the quickstart on this CPU (~4 minutes on 2 cores)
    python bench/progressive.py --recipe rtx3060 --model resnet50 --image-size 224 --train-samples 2048 --epochs 4
                                                    # a GPU, the allocator capped at the recipe's card
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from recipe_run import cap_allocator, device_name, vramfit


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="quickstart")
    ap.add_argument("--model", default=None, help="another backbone (default: the recipe's)")
    ap.add_argument("--image-size", type=int, default=None)
    ap.add_argument("--epochs", type=int, default=None, help="default: the recipe's")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--train-samples", type=int, default=None, help="data.limit_train_samples")
    ap.add_argument("--resize-set", action="append", default=[], metavar="KEY=VALUE",
                    help="a data.progressive_resize key (e.g. initial_scale=0.6); default: Composer's defaults")
    ap.add_argument("--out", default=None, help="folder for the runs (default: a temporary one)")
    ap.add_argument("--json", default=None, help="write the figures here too")
    return ap.parse_args(argv)


def run_config(run_dir: Path):
    """A run's resolved config, from its run folder's config.yaml."""
    import yaml

    from vramfit.config import Config

    return Config.model_validate(yaml.safe_load((run_dir / "config.yaml").read_text()))


def step_costs(cfg, micro: dict[int, int], rounds: int = 6) -> dict[int, float]:
    """Seconds of one training step at each size of `micro` (px -> the micro-batch the runs trained
    it at): the step a run trains with (train.build.build_training, as bench/throughput.py times it) on
    random images of the global batch, split into micro-batches of that size. The sizes take turns,
    round after round, so that a slow stretch of a shared machine falls on all of them; each size's
    figure is its fastest round after the first."""
    import time

    import torch

    from vramfit.runtime import launch
    from vramfit.train import build

    L = launch.start(cfg)
    try:
        training = build.build_training(cfg, L, [str(i) for i in range(10)], steps_per_epoch=1)
        batch, device = cfg.train.global_batch // L.world, L.acc.device
        fmt = torch.channels_last if cfg.model.channels_last else torch.contiguous_format
        times: dict[int, list[float]] = {size: [] for size in micro}
        for _ in range(rounds):
            for size, m in micro.items():
                training.step.state.micro_batch = m
                x = torch.randn(batch, 3, size, size).to(device, memory_format=fmt)
                y = torch.randint(0, 10, (batch,)).to(device)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                training.step(x, y, batch)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times[size].append(time.perf_counter() - t0)
    finally:
        launch.forget()  # the next run in this process builds its own Accelerator
    return {size: min(t[1:]) for size, t in times.items()}


def ceiling(cfg, fixed: dict, progressive: dict) -> tuple[list[tuple[int, int, float]], float]:
    """Per size the progressive run trained at (size, steps, its step's cost against the fixed
    run's step), and its training steps priced so against the fixed run's. `cfg`: the progressive
    run's config; `fixed`, `progressive`: the two runs' summary.json (the micro-batch of each size)."""
    full = cfg.data.image_size
    micro = {p["image_size"]: p["micro_batch"] for p in progressive["phases"] if p["image_size"] != full}
    cost = step_costs(cfg, {**micro, full: fixed["micro_batch"]})
    rows = [(p["image_size"], p["steps"], cost[p["image_size"]] / cost[full]) for p in progressive["phases"]]
    return rows, sum(steps * c for _, steps, c in rows) / sum(steps for _, steps, _ in rows)


def base_args(args, output: Path) -> list[str]:
    out = ["train", "--recipe", args.recipe, "--data", "digits", "--output", str(output),
           "--set", "model.pretrained=false", "--set", "train.log_every_steps=1000", "--resume", "never"]
    for flag, value in (("--model", args.model), ("--image-size", args.image_size), ("--epochs", args.epochs)):
        if value:
            out += [flag, str(value)]
    if args.train_samples:
        out += ["--set", f"data.limit_train_samples={args.train_samples}", "--set", "data.limit_val_samples=512"]
    return out


def resize_args(args) -> list[str]:
    if not args.resize_set:
        return ["--set", "data.progressive_resize=true"]
    return [a for kv in args.resize_set for a in ("--set", f"data.progressive_resize.{kv}")]


def one(root: Path, common: list[str], name: str, extra: list[str]) -> dict | None:
    code = vramfit([*common, "--run-name", name, *extra])
    if code:
        print(f"  {name}: exit {code}", file=sys.stderr)
        return None
    s = json.loads((root / name / "summary.json").read_text())
    print(f"  {name}: accuracy {s['final_accuracy']:.4f}, wall {s['wall_seconds']:.1f} s, "
          f"{s['images_per_second']:.0f} img/s", file=sys.stderr)
    return s


def main(argv=None) -> int:
    args = parse_args(argv)
    cap_allocator(args.recipe)
    root = Path(args.out or tempfile.mkdtemp(prefix="vramfit-progressive-"))
    common = base_args(args, root)
    rows: dict[str, list[dict]] = {"fixed": [], "progressive": []}
    for seed in (int(s) for s in args.seeds.split(",")):
        for kind, extra in (("fixed", []), ("progressive", resize_args(args))):
            s = one(root, common, f"{kind}-s{seed}", ["--seed", str(seed), *extra])
            if s is None:
                return 1
            rows[kind].append(s)
    med = {k: {"accuracy": statistics.median(r["final_accuracy"] for r in v),
               "wall_seconds": statistics.median(r["wall_seconds"] for r in v),
               "images_per_second": statistics.median(r["images_per_second"] for r in v)} for k, v in rows.items()}
    sizes = [p["image_size"] for p in rows["progressive"][0]["phases"]]
    print(f"progressive resizing: {args.recipe}" + (f", {args.model}" if args.model else "")
          + f" on {device_name() or 'CPU'}, seeds {args.seeds}; progressive sizes {sizes[0]}..{sizes[-1]} px "
          f"({' '.join(resize_args(args)[1::2])})")
    print("| run | final accuracy (median) | per seed | wall s (median) | per seed | images/s |")
    print("|---|---:|---|---:|---|---:|")
    for kind, v in rows.items():
        accs = ", ".join("%.4f" % r["final_accuracy"] for r in v)
        walls = ", ".join("%.1f" % r["wall_seconds"] for r in v)
        print(f"| {kind} | {med[kind]['accuracy']:.4f} | {accs} | {med[kind]['wall_seconds']:.1f} | {walls} | "
              f"{med[kind]['images_per_second']:.0f} |")
    gap = med["progressive"]["accuracy"] - med["fixed"]["accuracy"]
    ratio = med["progressive"]["wall_seconds"] / med["fixed"]["wall_seconds"]
    accurate, fast = gap >= -0.003, ratio <= 0.8
    seed = args.seeds.split(",")[0]
    per_size, best = ceiling(run_config(root / f"progressive-s{seed}"), rows["fixed"][0], rows["progressive"][0])
    print("step cost by size on this device (one step as the run trains it, against the full "
          "size's): " + ", ".join(f"{size} px {c:.2f}x ({steps} steps)" for size, steps, c in per_size))
    print(f"the schedule's training steps at best {best:.3f}x the fixed run's"
          + ("" if best <= 0.8 else ": above 0.80x, so the wall bound cannot hold on this device"))
    print(f"accuracy {100 * gap:+.2f} points (>= -0.30: {'holds' if accurate else 'DOES NOT HOLD'}); "
          f"wall {ratio:.3f}x (<= 0.80x: {'holds' if fast else 'DOES NOT HOLD'})")
    if args.json:
        Path(args.json).write_text(json.dumps({"median": med, "runs": {k: [{"final_accuracy": r["final_accuracy"],
                                   "wall_seconds": r["wall_seconds"], "phases": r["phases"]} for r in v]
                                   for k, v in rows.items()}, "device": device_name(),
                                   "step_cost_by_size": per_size, "step_ceiling": best}, indent=1))
    return 0 if accurate and fast else 1


if __name__ == "__main__":
    sys.exit(main())
