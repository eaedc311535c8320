"""What vramfit's optimizer step costs over a plain training step, measured in the same process.

Baseline: the loop of Accelerate's examples (forward, `accelerator.backward(loss / accum)`,
`clip_grad_norm_`, `optimizer.step()`, `zero_grad()`, micro-batches under `no_sync`).
Ours: `train.step.TrainStep` on the same model, data and optimizer settings, which adds the per-step
safety: the out-of-memory / non-finite flag, the copy of BatchNorm statistics and RNG state an
interrupted or retried step is undone with, the gradient-norm check and the loss bookkeeping.
Both run the same number of steps, interleaved, best of `--repeats`; the ratio is ours / baseline
time per step (1.00 = no overhead).

    python bench/step_overhead.py                     # resnet18 at 64 px, batch 32, CPU
    python bench/step_overhead.py --model resnet50 --image-size 224 --batch 64   # on a GPU
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.nn.functional as F


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--image-size", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32, help="per-process batch of one optimizer step")
    ap.add_argument("--accum", type=int, nargs="+", default=[1, 4], help="micro-batches per step")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from accelerate import Accelerator

    from vramfit.config import ModelConfig, OptimConfig
    from vramfit.models.create import create_model
    from vramfit.runtime.collectives import broadcast_module
    from vramfit.train.optim import create_optimizer
    from vramfit.train.step import TrainStep

    acc = Accelerator(cpu=not torch.cuda.is_available())
    torch.manual_seed(0)
    base_model = create_model(ModelConfig(name=args.model), num_classes=10, load_weights=False)
    ocfg = OptimConfig(name="adamw", lr=1e-3)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, 3, args.image_size, args.image_size, generator=g).to(acc.device)
    y = torch.randint(0, 10, (args.batch,), generator=g).to(acc.device)

    def setup():
        """The plain loop: Accelerate's DDP-wrapped model."""
        model = copy.deepcopy(base_model)
        opt = create_optimizer(model, ocfg)
        return acc.prepare(model, opt)

    def setup_ours():
        """As the trainer builds it: no DDP wrapper, the weights broadcast once."""
        model = copy.deepcopy(base_model)
        opt = acc.prepare_optimizer(create_optimizer(model, ocfg))
        model = acc.prepare_model(model, evaluation_mode=True)
        broadcast_module(model)
        return model, opt

    def sync():
        if acc.device.type == "cuda":
            torch.cuda.synchronize()

    def plain(model, opt, accum):
        micro = args.batch // accum
        for i in range(accum):
            ctx = acc.no_sync(model) if i < accum - 1 else torch.enable_grad()
            with ctx:
                logits = model(x[i * micro:(i + 1) * micro])
                loss = F.cross_entropy(logits.float(), y[i * micro:(i + 1) * micro], label_smoothing=0.1)
                acc.backward(loss / accum)
        acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        float(loss.detach())  # the usual per-step logging sync

    def ours(step):
        step(x, y, args.batch * acc.num_processes)

    say = print if acc.is_main_process else (lambda *a, **k: None)
    say(f"{args.model} at {args.image_size} px, batch {args.batch}, {acc.device}, "
          f"{args.steps} steps, best of {args.repeats}, {acc.num_processes} process(es)")
    say(f"{'accumulation':>12}  {'baseline ms/step':>16}  {'vramfit ms/step':>15}  {'ratio':>6}")
    for accum in args.accum:
        if args.batch % accum:
            raise SystemExit(f"--batch {args.batch} is not divisible by accumulation {accum}")
        m1, o1 = setup()
        m2, o2 = setup_ours()
        step = TrainStep(acc, m2, o2, args.batch // accum, label_smoothing=0.1, clip_grad_norm=1.0)
        plain(m1, o1, accum), ours(step)  # warm-up: allocator, optimizer state
        best = {"plain": float("inf"), "ours": float("inf")}
        for _ in range(args.repeats):
            for name, fn in (("plain", lambda: plain(m1, o1, accum)), ("ours", lambda: ours(step))):
                sync()
                t = time.perf_counter()
                for _ in range(args.steps):
                    fn()
                sync()
                best[name] = min(best[name], (time.perf_counter() - t) / args.steps)
        say(f"{accum:>12}  {best['plain'] * 1e3:>16.1f}  {best['ours'] * 1e3:>15.1f}  "
              f"{best['ours'] / best['plain']:>5.2f}x")


if __name__ == "__main__":
    main()
