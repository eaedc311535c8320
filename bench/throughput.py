"""Images/second of vramfit's training step against a plain Accelerate + timm loop, same process.

Ours:     the step as `vramfit train` builds it: launch.start (Accelerate, precision, TF32, cuDNN
          benchmark), then train.build.build_training, the same assembly `vramfit train` runs
          (vramfit.models.create.create_model with channels_last when asked, vramfit.train.optim,
          `prepare_model(
          evaluation_mode=True)` + `prepare_optimizer`, the micro-batch plan, torch.compile when
          asked, train.step.TrainStep) without the data.
Baseline: timm.create_model + timm's AdamW, `accelerator.prepare(model, optimizer)`, then per step
          forward, cross-entropy, `accelerator.backward`, clip (as Accelerate's examples do when they
          clip; both loops clip at the trainer's default unless --clip-grad-norm 0), step, zero_grad.
Same model, precision, memory format, batch (one micro-batch) and synthetic data, already
normalised on the device: the step alone is timed, not the loader. Each loop runs its warm-up
steps, then --repeats timed blocks of --steps steps, the two loops interleaved (the order swaps
every repeat); images/s is the best block. ratio = vramfit / plain.

One process per precision (Accelerate fixes the precision once per process); several precisions
run as child processes of this script.

    python bench/throughput.py                       # GPU: ~3 min on one H200; CPU: ~1 min on 2 cores
    python bench/throughput.py --quick               # test_resnet at 32 px, seconds on a CPU
    python bench/throughput.py --models resnet50 --precision bf16 --batch 256 --channels-last
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
TARGET_RATIO = 0.98
# Defaults per device: a GPU run of both models and precisions in under 5 minutes; on a CPU a
# smaller image and batch, so the same comparison takes about a minute on 2 idle cores.
DEFAULTS = {
    "cuda": dict(models="resnet50,efficientnet_b0", image_size=224, precision="fp32,bf16", batch=256,
                 steps=30, warmup=10, repeats=3),
    "cpu": dict(models="resnet50,efficientnet_b0", image_size=64, precision="fp32", batch=16,
                steps=8, warmup=2, repeats=5),
    "quick": dict(models="test_resnet", image_size=32, precision="fp32", batch=8, steps=3, warmup=1,
                  repeats=2),
}
COLUMNS = f"{'model':<20}{'precision':<11}{'plain img/s':>12}{'vramfit img/s':>15}{'ratio':>8}"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", help="comma-separated timm names (default: resnet50,efficientnet_b0)")
    ap.add_argument("--image-size", type=int)
    ap.add_argument("--precision", help="comma-separated: fp32, bf16, fp16 (default GPU: fp32,bf16)")
    ap.add_argument("--batch", type=int, help="samples per step, one micro-batch")
    ap.add_argument("--steps", type=int, help="steps per timed block")
    ap.add_argument("--warmup", type=int, help="untimed steps of each loop first")
    ap.add_argument("--repeats", type=int, help="timed blocks per loop; the best counts")
    ap.add_argument("--channels-last", action="store_true")
    ap.add_argument("--compile", action="store_true", help="torch.compile both models")
    ap.add_argument("--num-classes", type=int, default=1000)
    ap.add_argument("--clip-grad-norm", type=float, default=1.0, help="both loops; 0: no clipping")
    ap.add_argument("--threads", type=int, help="CPU: torch threads (default: as `vramfit train` sets them)")
    ap.add_argument("--quick", action="store_true", help="test_resnet at 32 px, a few steps (CPU check)")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    import torch

    defaults = DEFAULTS["quick" if args.quick else "cuda" if torch.cuda.is_available() else "cpu"]
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def build_ours(args, model_name: str, precision: str):
    """The launch, model, optimizer and step exactly as `vramfit.train.run.train` builds them."""
    import torch

    from vramfit.config import Config
    from vramfit.runtime import launch
    from vramfit.train import build

    cfg = Config.model_validate({
        "model": {"name": model_name, "channels_last": args.channels_last},
        "data": {"image_size": args.image_size},
        "train": {"precision": precision, "global_batch": args.batch, "micro_batch": args.batch,
                  "compile": args.compile, "clip_grad_norm": args.clip_grad_norm or None}})
    L = launch.start(cfg)
    if args.threads:
        torch.set_num_threads(args.threads)
    classes = [str(i) for i in range(args.num_classes)]
    training = build.build_training(cfg, L, classes, steps_per_epoch=args.steps)
    return L, cfg, lambda x, y: training.step(x, y, args.batch)


def build_plain(args, acc, model_name: str, label_smoothing: float):
    """The loop of Accelerate's examples on a timm model, nothing of vramfit."""
    import timm
    import torch
    import torch.nn.functional as F
    from timm.optim import create_optimizer_v2

    model = timm.create_model(model_name, num_classes=args.num_classes)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = create_optimizer_v2(model, opt="adamw", lr=1e-3, weight_decay=0.05)
    model, optimizer = acc.prepare(model, optimizer)
    if args.compile:
        model.compile()
    model.train()

    def step(x, y):
        loss = F.cross_entropy(model(x), y, label_smoothing=label_smoothing)
        acc.backward(loss)
        if args.clip_grad_norm:
            acc.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def measure(args, precision: str) -> list[dict]:
    """Both loops for every model at one precision, in this process."""
    import torch

    results = []
    for model_name in args.models.split(","):
        L, cfg, ours = build_ours(args, model_name, precision)
        plain = build_plain(args, L.acc, model_name, cfg.train.label_smoothing)
        g = torch.Generator().manual_seed(0)
        fmt = torch.channels_last if args.channels_last else torch.contiguous_format
        x = torch.randn(args.batch, 3, args.image_size, args.image_size, generator=g).to(
            L.acc.device, memory_format=fmt)
        y = torch.randint(0, args.num_classes, (args.batch,), generator=g).to(L.acc.device)
        loops = {"plain": plain, "vramfit": ours}
        best = {name: 0.0 for name in loops}
        for fn in loops.values():
            run_steps(fn, x, y, args.warmup, L.acc.device)
        for rep in range(args.repeats):
            # Swapping the order each repeat spreads a burst of other load, or a clock that ramps,
            # over both loops.
            for name in (("plain", "vramfit") if rep % 2 == 0 else ("vramfit", "plain")):
                seconds = run_steps(loops[name], x, y, args.steps, L.acc.device)
                best[name] = max(best[name], args.batch * args.steps / seconds)
        results.append({"model": model_name, "precision": L.precision.name,
                        "plain": best["plain"], "vramfit": best["vramfit"],
                        "ratio": best["vramfit"] / best["plain"], "device": device_name(L.acc.device),
                        "threads": torch.get_num_threads()})
        del loops, plain, ours
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return results


def run_steps(fn, x, y, n: int, device) -> float:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(n):
        fn(x, y)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def device_name(device) -> str:
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def in_children(args, argv: list[str]) -> list[dict]:
    """One child process per precision, each printing its results as JSON lines."""
    results = []
    for precision in args.precision.split(","):
        cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--precision", precision, "--child"]
        out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True).stdout
        done = [json.loads(line[len("RESULT "):]) for line in out.splitlines() if line.startswith("RESULT ")]
        for r in done:  # as each precision finishes: a run cut short keeps what it measured
            print(f"  {r['model']} {r['precision']}: plain {r['plain']:.1f}, vramfit {r['vramfit']:.1f} images/s "
                  f"({r['ratio']:.2f}x)", file=sys.stderr, flush=True)
        results += done
    return results


def print_table(args, results: list[dict]) -> bool:
    import accelerate
    import timm
    import torch

    device = results[0]["device"] if results else "?"
    threads = f", {results[0]['threads']} torch threads" if results and device == "cpu" else ""
    print(f"\nvramfit step vs plain Accelerate + timm loop, synthetic data | {device}{threads} | "
          f"torch {torch.__version__}, timm {timm.__version__}, accelerate {accelerate.__version__}")
    print(f"batch {args.batch}, {args.image_size} px, {args.num_classes} classes, channels_last "
          f"{'on' if args.channels_last else 'off'}, compile {'on' if args.compile else 'off'}, clip "
          f"{args.clip_grad_norm or 'off'} | {args.warmup} warm-up + best of {args.repeats} x "
          f"{args.steps} steps, interleaved")
    print(COLUMNS)
    ok = True
    for r in results:
        ok &= r["ratio"] >= TARGET_RATIO
        print(f"{r['model']:<20}{r['precision']:<11}{r['plain']:>12.1f}{r['vramfit']:>15.1f}{r['ratio']:>7.2f}x")
    print(f"ratio = vramfit / plain (target >= {TARGET_RATIO:.2f}x): {'ok' if ok else 'MISSED'}")
    return ok


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    t0 = time.time()
    if args.child or "," not in args.precision:
        results = measure(args, args.precision)
        if args.child:
            for r in results:
                print("RESULT " + json.dumps(r), flush=True)
            return 0
    else:
        # The children take the same arguments, each with one precision (argparse keeps the last).
        results = in_children(args, argv)
    ok = print_table(args, results)
    print(f"total {time.time() - t0:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
