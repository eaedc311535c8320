"""Planner vs a real GPU: predicted peak memory against measured, and the planner's pick under a cap.

    python bench/memory_check.py              # full check, one GPU, < 8 min on an H200
    python bench/memory_check.py --quick      # subset (~2 min)
    python bench/memory_check.py --dry-run    # no GPU needed: the planner's predictions only
    python bench/memory_check.py --published  # no GPU needed: every public fit / OOM pair (--fit: refit)
    python bench/memory_check.py --empty-cache  # what empty_cache() after every step costs (~1 min)
    python bench/memory_check.py --models resnet50,efficientnet_b0 --precisions no,bf16 --micros 32,64 \
        --picks                               # a chosen grid, each of its model/precision picked too

Part 1 (accuracy): ResNet50, EfficientNet-B0, ResNet18 x {fp32, bf16, fp16} x grad checkpointing
{off, on} x micro-batch {32, 64, 128} at 224 px, AdamW, clip 1.0, label smoothing 0.1 -- the step
`train.step.TrainStep` runs (autocast forward, fp32 logits, summed cross-entropy, backward, clip,
optimizer step, zero_grad), on synthetic data, micro-batch = per-process batch. Two warm steps, then
one measured: measured peak = torch.cuda.max_memory_reserved + the CUDA context (device memory in
use per `torch.cuda.mem_get_info` minus what the caching allocator holds, minus what other
processes used before we started). Error = (predicted - measured) / measured.
Targets: median |error| <= 5 %, worst <= 10 %.

Part 2 (picks): under a 12 GiB card (allocator capped with set_per_process_memory_fraction at
12 GiB minus the measured context), for each model/precision the largest micro-batch that really
fits (real steps, OOM caught, bisection to 2 %) vs the planner's largest micro-batch whose predicted
peak fits 12 GiB x (1 - margin). Targets: the pick always fits, and is >= 90 % of the true
maximum. Picks are reported for margins 0, the default 0.05 and 0.1 (with a 10 % margin the pick is
~89 % of the maximum by construction: the margin is 10 % of the card, the activations less than
all of it).

Also printed: measured max_memory_allocated vs the trace's allocated peak (the trace's own error,
without the constants), and fitted values for the planner's named constants.
Writes $OUT/memory_check.json and $OUT/memory_check.md ($OUT defaults to ./bench_out).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from vramfit import planner as P  # noqa: E402
from vramfit.config import Config  # noqa: E402

GiB, MiB = 2**30, 2**20
MODELS = ["resnet50", "efficientnet_b0", "resnet18"]
PRECISIONS = ["no", "bf16", "fp16"]
MICROS = [32, 64, 128]
IMAGE = 224
CLASSES = 1000
DEVICE = "cuda"


def config(model: str, precision: str, ckpt: bool, micro: int, optim: str = "adamw") -> Config:
    return Config.model_validate({
        "model": {"name": model, "grad_checkpointing": ckpt},
        "data": {"image_size": IMAGE},
        "train": {"global_batch": micro, "micro_batch": micro, "precision": precision},
        "optim": {"name": optim},
    })


def predict(model: str, precision: str, ckpt: bool, micro: int, optim: str = "adamw") -> P.MemoryEstimate:
    return P.estimate(config(model, precision, ckpt, micro, optim), CLASSES, micro, per_process_batch=micro)


def planner_max(model: str, precision: str, budget: int, optim: str = "adamw") -> int:
    """Largest micro-batch (any integer) whose predicted peak fits `budget`, run whole."""
    from vramfit.planner.lineup import largest_whole_batch

    return largest_whole_batch(config(model, precision, False, 1, optim), CLASSES, budget)


# ---------------------------------------------------------------------------------------------
# GPU side


def others_used_bytes() -> int:
    """Device memory used by other processes before we create a CUDA context (nvidia-smi)."""
    if not shutil.which("nvidia-smi"):
        return 0
    try:
        dev = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                              "-i", dev], capture_output=True, text=True, timeout=20).stdout
        return int(float(out.strip().splitlines()[0]) * MiB)
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return 0


def context_bytes(others: int) -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free - torch.cuda.memory_reserved() - others


def clean() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def steps(model_name: str, precision: str, ckpt: bool, micro: int, n: int = 3, empty_cache: bool = False) -> dict:
    """`n` training steps exactly as planned; returns the peaks of the last one and the time of a
    step after the first. `empty_cache`: torch.cuda.empty_cache() after every step (the forum's
    advice), to see what it costs."""
    from vramfit.models.create import create_model
    from vramfit.train.optim import create_optimizer

    cfg = config(model_name, precision, ckpt, micro)
    dev = torch.device(DEVICE)
    model = create_model(cfg.model, CLASSES, load_weights=False, image_size=cfg.data.image_size).to(dev).train()
    opt = create_optimizer(model, cfg.optim)
    params = [p for p in model.parameters() if p.requires_grad]
    fmt = torch.channels_last if cfg.model.channels_last else torch.contiguous_format
    images = torch.randn(micro, 3, IMAGE, IMAGE, device=dev).contiguous(memory_format=fmt)
    labels = torch.randint(0, CLASSES, (micro,), device=dev)
    lp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    scaler = torch.amp.GradScaler(DEVICE) if precision == "fp16" else None
    t0 = None
    for i in range(n):
        if i == 1:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        if i == n - 1:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        with torch.autocast(DEVICE, dtype=lp) if lp is not None else contextlib.nullcontext():
            logits = model(images)
        logits = logits.float()
        loss = torch.nn.functional.cross_entropy(logits.float(), labels, reduction="sum",
                                                 label_smoothing=cfg.train.label_smoothing)
        scaled = loss / micro
        (scaler.scale(scaled) if scaler else scaled).backward()
        loss_sum = loss.detach()
        correct = (logits.detach().argmax(1) == labels).sum()
        del logits, loss, scaled, loss_sum, correct
        if scaler:
            scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(params, cfg.train.clip_grad_norm)
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
        if empty_cache:
            torch.cuda.empty_cache()
    torch.cuda.synchronize()
    return {"max_allocated": torch.cuda.max_memory_allocated(), "max_reserved": torch.cuda.max_memory_reserved(),
            "seconds_per_step": (time.perf_counter() - t0) / (n - 1) if t0 is not None else None}


def empty_cache_table(n: int = 20) -> str:
    """Step time and memory with and without torch.cuda.empty_cache() after every step."""
    lines = ["| model | precision | micro | empty_cache every step | ms / step | max reserved GiB | "
             "max allocated GiB |", "|---|---|---:|---|---:|---:|---:|"]
    for model, precision, micro in (("resnet50", "bf16", 64), ("efficientnet_b0", "bf16", 64)):
        for flag in (False, True):
            clean()
            r = steps(model, precision, False, micro, n=n, empty_cache=flag)
            lines.append(f"| {model} | {precision} | {micro} | {'yes' if flag else 'no'} | "
                         f"{r['seconds_per_step'] * 1e3:.1f} | {r['max_reserved'] / GiB:.2f} | "
                         f"{r['max_allocated'] / GiB:.2f} |")
    return "\n".join(lines)


def fits(model: str, precision: str, micro: int) -> bool:
    clean()
    try:
        steps(model, precision, False, micro)
        ok = True
    except torch.OutOfMemoryError:
        ok = False
    clean()
    return ok


def true_max(model: str, precision: str, guess: int, known: dict[int, bool]) -> int:
    """Largest micro-batch that really fits under the cap, to within 2 % (real steps, OOM caught).

    Starts at the planner's guess and walks out in 15 % steps to bracket it, then bisects."""
    def probe(m: int) -> bool:
        if m not in known:
            known[m] = fits(model, precision, m)
        return known[m]

    m = max(1, guess)
    if probe(m):
        lo = m
        while probe(hi := max(lo + 1, int(lo * 1.15))):
            lo = hi
    else:
        hi = m
        while True:
            lo = min(hi - 1, int(hi / 1.15))
            if lo < 1:
                return 0
            if probe(lo):
                break
            hi = lo
    while hi - lo > max(1, int(0.02 * lo)):
        mid = (lo + hi) // 2
        if probe(mid):
            lo = mid
        else:
            hi = mid
    return lo


# ---------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    global IMAGE
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="ResNet50 + EfficientNet-B0, fp32/bf16, no checkpointing, "
                                                         "micro 32/64; picks for ResNet50 bf16 only")
    ap.add_argument("--dry-run", action="store_true", help="print the planner's predictions only (no GPU)")
    ap.add_argument("--published", action="store_true",
                    help="the planner against every public fit / OOM pair in bench/published_memory.csv "
                         "(no GPU; bench/published.py)")
    ap.add_argument("--fit", action="store_true", help="with --published: also fit the constants and the margin")
    ap.add_argument("--with", dest="measured", action="append", default=[], metavar="JSON",
                    help="with --published: add the rows of a memory_check.json measured on a card")
    ap.add_argument("--empty-cache", action="store_true",
                    help="only time steps with and without torch.cuda.empty_cache() after each (~1 min)")
    ap.add_argument("--models", help="comma-separated timm names (default: resnet50,efficientnet_b0,resnet18)")
    ap.add_argument("--precisions", help="comma-separated: no, bf16, fp16 (default: all three)")
    ap.add_argument("--micros", help="comma-separated micro-batches (default: 32,64,128)")
    ap.add_argument("--picks", action="store_true", help="check the pick of every model/precision of the grid")
    ap.add_argument("--image-size", type=int, default=IMAGE, help="square images of this side (default 224)")
    ap.add_argument("--cap-gib", type=float, default=12.0, help="card size for the pick check (default 12)")
    ap.add_argument("--time-limit", type=float, default=450.0, help="stop starting new work after this many s")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    IMAGE = args.image_size  # config() and steps() read it
    if args.published:
        from published import report

        print(report(fit_constants=args.fit, measured=[Path(m) for m in args.measured])[0])
        return 0

    models, precs, ckpts, micros = MODELS, PRECISIONS, [False, True], MICROS
    pick_cases = [(m, p) for m in MODELS for p in PRECISIONS]
    if args.quick:
        models, precs, ckpts, micros = ["resnet50", "efficientnet_b0"], ["no", "bf16"], [False], [32, 64]
        pick_cases = [("resnet50", "bf16")]
    models = args.models.split(",") if args.models else models
    precs = args.precisions.split(",") if args.precisions else precs
    micros = [int(b) for b in args.micros.split(",")] if args.micros else micros
    if args.models or args.precisions or args.micros:
        ckpts = [False] if args.quick else ckpts
        pick_cases = [pc for pc in pick_cases if pc[0] in models and pc[1] in precs]
    if args.picks:
        pick_cases = [(m, p) for m in models for p in precs]
    grid = [(m, p, c, b) for m in models for p in precs for c in ckpts for b in micros]

    if not args.dry_run and not torch.cuda.is_available():
        print("memory_check: no CUDA device here. This benchmark measures real GPU memory; run it on a "
              "machine with an NVIDIA GPU, or use --dry-run to print the planner's predictions only.",
              file=sys.stderr)
        return 2

    if args.empty_cache:
        print(empty_cache_table())
        return 0

    # Planner first (CPU): one profile per model/precision/checkpointing serves every micro-batch.
    t = time.perf_counter()
    preds = {k: predict(*k) for k in grid}
    plan_seconds = time.perf_counter() - t
    cap = int(args.cap_gib * GiB)
    margin = Config().hardware.safety_margin  # the default, 0.05
    margins = sorted({0.0, 0.05, 0.1, margin})
    picks = {(m, p): {f"margin_{g:g}": planner_max(m, p, int(cap * (1 - g))) for g in margins}
             for m, p in pick_cases}
    print(f"planner: {len(grid)} predictions + {len(pick_cases)} picks in {time.perf_counter() - t:.1f} s "
          f"(profiles: {plan_seconds:.1f} s)")

    if args.dry_run:
        print(f"{'model':<16}{'prec':<6}{'ckpt':<6}{'micro':>6}{'pred GiB':>10}{'alloc GiB':>11}  phase")
        for (m, p, c, b), e in preds.items():
            print(f"{m:<16}{p:<6}{str(c):<6}{b:>6}{e.peak_bytes / GiB:>10.2f}{e.allocated_bytes / GiB:>11.2f}  {e.peak_phase}")
        for (m, p), pk in picks.items():
            print(f"pick under {args.cap_gib:g} GiB: {m} {p}: {pk}")
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "memory_check.json").write_text(json.dumps({
            "summary": {"dry_run": True, "image_size": IMAGE, "cap_bytes": cap},
            "predictions": [{"model": m, "precision": p, "grad_checkpointing": c, "micro_batch": b,
                             "predicted_peak": e.peak_bytes, "predicted_allocated": e.allocated_bytes}
                            for (m, p, c, b), e in preds.items()],
            "picks": [{"model": m, "precision": p, **pk} for (m, p), pk in picks.items()]}, indent=1))
        return 0

    # ----------------------------------------------------------------------- GPU
    others = others_used_bytes()
    torch.cuda.init()
    dev_name = torch.cuda.get_device_name()
    # Load cuDNN / cuBLAS kernels for every precision before measuring the context.
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.randn(8, 3, 32, 32, device="cuda", dtype=dt, requires_grad=True)
        w = torch.randn(8, 3, 3, 3, device="cuda", dtype=dt, requires_grad=True)
        (torch.nn.functional.conv2d(x, w).sum() + (x.flatten(1) @ x.flatten(1).T).sum()).backward()
    del x, w
    clean()
    ctx0 = context_bytes(others)
    print(f"{dev_name}: context after init {ctx0 / MiB:.0f} MiB (others used {others / MiB:.0f} MiB before)")

    rows = []
    for (m, p, c, b) in grid:
        if time.perf_counter() - t_start > args.time_limit:
            print("time limit reached: skipping the rest of the grid")
            break
        clean()
        try:
            meas = steps(m, p, c, b)
        except torch.OutOfMemoryError:
            clean()
            continue
        ctx = context_bytes(others)
        e = preds[(m, p, c, b)]
        measured = meas["max_reserved"] + ctx
        row = {"model": m, "precision": p, "grad_checkpointing": c, "micro_batch": b,
               "predicted_peak": e.peak_bytes, "measured_peak": measured,
               "error_pct": round(100 * (e.peak_bytes - measured) / measured, 2),
               "predicted_allocated": e.allocated_bytes, "measured_max_allocated": meas["max_allocated"],
               "allocated_error_pct": round(100 * (e.allocated_bytes - meas["max_allocated"]) / meas["max_allocated"], 2),
               "measured_max_reserved": meas["max_reserved"], "context": ctx,
               "reserved_over_allocated": round(meas["max_reserved"] / meas["max_allocated"], 4),
               "predicted": e.as_dict()}
        rows.append(row)
        print(f"{m:<16}{p:<6}{'ckpt' if c else '':<6}{b:>5}  pred {e.peak_bytes / GiB:6.2f}  meas "
              f"{measured / GiB:6.2f} GiB  err {row['error_pct']:+6.1f}%   alloc pred {e.allocated_bytes / GiB:6.2f} "
              f"meas {meas['max_allocated'] / GiB:6.2f} ({row['allocated_error_pct']:+.1f}%)  ctx {ctx / MiB:.0f} MiB")
        clean()

    errs = [abs(r["error_pct"]) for r in rows]
    summary = {
        "device": dev_name, "torch": torch.__version__, "cuda": torch.version.cuda,
        "device_total_bytes": torch.cuda.get_device_properties(0).total_memory, "cap_bytes": cap,
        "cudnn": torch.backends.cudnn.version(), "n": len(rows),
        "median_abs_error_pct": round(statistics.median(errs), 2) if errs else None,
        "worst_abs_error_pct": round(max(errs), 2) if errs else None,
        "median_abs_allocated_error_pct": round(statistics.median(abs(r["allocated_error_pct"]) for r in rows), 2)
        if rows else None,
        "constants_used": {"CUDA_CONTEXT_BYTES": P.CUDA_CONTEXT_BYTES, "CUDA_WORKSPACE_BYTES": P.CUDA_WORKSPACE_BYTES,
                           "ALLOCATOR_OVERHEAD_FRACTION": P.ALLOCATOR_OVERHEAD_FRACTION},
    }
    if rows:
        # What the named constants would be if fitted to this run (see docs/memory.md).
        ctx_fit = statistics.median(r["context"] for r in rows)
        ws_fit = statistics.median(r["measured_max_allocated"] - r["predicted_allocated"] for r in rows)
        frac_fit = statistics.median(r["measured_max_reserved"] / r["measured_max_allocated"] - 1 for r in rows)
        summary["fitted"] = {"CUDA_CONTEXT_BYTES": int(ctx_fit), "CUDA_WORKSPACE_BYTES": int(max(0, ws_fit)),
                             "ALLOCATOR_OVERHEAD_FRACTION": round(frac_fit, 4)}
    print(f"peak error: median |{summary['median_abs_error_pct']}|%, worst |{summary['worst_abs_error_pct']}|% "
          f"(targets 5 / 10); allocated (trace only): median |{summary['median_abs_allocated_error_pct']}|%")
    if rows:
        print(f"fitted constants: {summary['fitted']}")

    # ----------------------------------------------------------------------- picks under a cap
    pick_rows = []
    ctx = context_bytes(others)
    total = torch.cuda.get_device_properties(0).total_memory
    frac = max(0.01, min(1.0, (cap - ctx) / total))
    torch.cuda.set_per_process_memory_fraction(frac)
    print(f"cap: {args.cap_gib:g} GiB card = allocator limited to {(cap - ctx) / GiB:.2f} GiB (context {ctx / MiB:.0f} MiB)")
    for m, p in pick_cases:
        if time.perf_counter() - t_start > args.time_limit:
            print("time limit reached: skipping the remaining pick checks")
            break
        known: dict[int, bool] = {}
        pk = picks[(m, p)]
        best = true_max(m, p, pk["margin_0"], known)
        row = {"model": m, "precision": p, "true_max": best, "probes": len(known),
               "outcomes": {str(k): bool(v) for k, v in sorted(known.items())}}  # bench/published.py reads them
        for name, pick in pk.items():
            ok = known.get(pick) if pick in known else (pick <= best or fits(m, p, pick))
            row[name] = {"pick": pick, "fits": bool(ok), "ratio_to_true_max": round(pick / best, 3) if best else None}
        pick_rows.append(row)
        print(f"{m:<16}{p:<6} true max {best:>5}  " + "  ".join(
            f"{k}: {v['pick']} ({'fits' if v['fits'] else 'OOM'}, {v['ratio_to_true_max']})" for k, v in row.items()
            if isinstance(v, dict)))
    torch.cuda.set_per_process_memory_fraction(1.0)
    for g in margins:
        k = f"margin_{g:g}"
        summary[f"picks_all_fit_{k}"] = all(r[k]["fits"] for r in pick_rows) if pick_rows else None
        summary[f"picks_min_ratio_{k}"] = min((r[k]["ratio_to_true_max"] or 0) for r in pick_rows) if pick_rows else None
    summary["seconds"] = round(time.perf_counter() - t_start, 1)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "memory_check.json").write_text(json.dumps({"summary": summary, "rows": rows, "picks": pick_rows}, indent=1))
    md = ["| model | precision | ckpt | micro | predicted GiB | measured GiB | error % | alloc pred GiB | alloc meas GiB |",
          "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    md += [f"| {r['model']} | {r['precision']} | {'on' if r['grad_checkpointing'] else 'off'} | {r['micro_batch']} | "
           f"{r['predicted_peak'] / GiB:.2f} | {r['measured_peak'] / GiB:.2f} | {r['error_pct']:+.1f} | "
           f"{r['predicted_allocated'] / GiB:.2f} | {r['measured_max_allocated'] / GiB:.2f} |" for r in rows]
    md += ["", f"median |error| {summary['median_abs_error_pct']} %, worst {summary['worst_abs_error_pct']} % "
               f"on {summary['device']} (torch {summary['torch']})", "",
           f"| model | precision | true max @ {args.cap_gib:g} GiB | "
           + " | ".join(f"pick (margin {g:g})" for g in margins) + " |",
           "|---|---|---:|" + "---:|" * len(margins)]
    md += [f"| {r['model']} | {r['precision']} | {r['true_max']} | " + " | ".join(
        f"{r[f'margin_{g:g}']['pick']} ({'fits' if r[f'margin_{g:g}']['fits'] else 'OOM'}, "
        f"{r[f'margin_{g:g}']['ratio_to_true_max']})" for g in margins) + " |" for r in pick_rows]
    (out / "memory_check.md").write_text("\n".join(md) + "\n")
    print(f"wrote {out / 'memory_check.json'} and {out / 'memory_check.md'} in {summary['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
