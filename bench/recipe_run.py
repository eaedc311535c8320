"""A shipped GPU recipe as a user runs it, for one short epoch, on a card capped to the recipe's.

    python bench/recipe_run.py --recipe rtx3060            # GPU; ~1 min on an H200 (whole network)
    python bench/recipe_run.py --recipe rtx3060 --dry-run  # any machine: the command it would run
    python bench/recipe_run.py --recipe rtx3060 --staged   # + train.freeze_epochs=1 over 2 epochs
    python bench/recipe_run.py --cpu --model test_resnet --image-size 32 --train-samples 64 \
        --set train.global_batch=16                        # the same steps at a toy size on a CPU

The caching allocator is capped (torch.cuda.set_per_process_memory_fraction) at the recipe's card
(`hardware.memory_gib`, as the card reports it), so a pick that does not fit a 12 GB RTX 3060 runs
out of memory here too. The recipe trains on the built-in digits at its own image size (224 px),
random weights (no download), its own micro-batch pick, precision, channels_last and augmentation:
stopped after step 3 as SIGTERM would, resumed by the same command, then exported. Prints the
planner's predicted peak against the measured device peak (summary.json's peak_memory_bytes, max_memory_reserved) and their ratio;
writes $OUT/recipe_<name>.json ($OUT defaults to ./bench_out). With --staged the run trains the
head alone for its first epoch, then everything for a second (a micro-batch plan per phase), and
each phase's planned reserve is printed against its own measured peak (summary.json `phases`), and
`train.fit: fastest`'s choice for each phase (the whole network's measured as it begins).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default="rtx3060")
    ap.add_argument("--train-samples", type=int, default=1024, help="one short epoch of this many images")
    ap.add_argument("--dry-run", action="store_true", help="print the command, run nothing")
    ap.add_argument("--staged", action="store_true",
                    help="staged fine-tuning: head only for epoch 1, everything for epoch 2 (peaks per phase)")
    ap.add_argument("--model", help="another backbone (default: the recipe's)")
    ap.add_argument("--image-size", type=int, help="default: the recipe's")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="passed to vramfit train")
    ap.add_argument("--cpu", action="store_true",
                    help="run on a CPU (hardware.allow_cpu, no allocator cap): the steps, not the figures")
    return ap.parse_args(argv)


def overrides(args) -> list[str]:
    """What a run of this bench changes in the recipe besides the data (a toy size, a CPU)."""
    out = [*(["--model", args.model] if args.model else []),
           *(["--image-size", str(args.image_size)] if args.image_size else [])]
    return out + [a for kv in [*args.set, *(["hardware.allow_cpu=true"] if args.cpu else [])] for a in ("--set", kv)]


def train_args(recipe: str, samples: int, output: Path, staged: bool = False) -> list[str]:
    # One epoch trains the whole network (a recipe that stages would spend it on the head alone);
    # --staged gives the head-only epoch and the whole-network one, each against its own plan.
    staging = (["--epochs", "2", "--set", "train.freeze_epochs=1"] if staged
               else ["--epochs", "1", "--set", "train.freeze_epochs=0"])
    return ["train", "--recipe", recipe, "--data", "digits", *staging, "--output", str(output),
            "--run-name", recipe, "--set", "model.pretrained=false",
            "--set", f"data.limit_train_samples={samples}", "--set", "data.limit_val_samples=256"]


def weight_file(args: list[str], folder: Path) -> Path:
    """A seeded random init of the run's model as a weight file: the run loads it as pretrained
    weights (no network on the bench machines), so its first phase trains the head alone."""
    import timm
    import torch
    from safetensors.torch import save_file

    from vramfit.cli import train_config

    cfg = train_config(args)
    torch.manual_seed(0)
    model = timm.create_model(cfg.model.name, num_classes=10)  # the built-in digits
    path = folder / "init.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return path


def phase_lines(summary: dict) -> list[str]:
    """Each phase's planned allocator reserve against its measured peak (both without the context)."""
    gib = 2**30
    lines = []
    for p in summary.get("phases") or []:
        plan, seen = p.get("predicted_reserved_bytes"), p.get("measured_peak_bytes")
        ratio = f" ({plan / seen:.3f}x)" if plan and seen else ""
        lines.append(f"  phase {p['name']}: micro {p['micro_batch']}, {p['trainable_params']:,} trainable; planned "
                     f"{(plan or 0) / gib:.2f} GiB, measured {(seen or 0) / gib:.2f} GiB{ratio}")
    return lines


def fit_lines(summary: dict) -> list[str]:
    """train.fit: fastest's choice for each phase (the first at the start, a later one as it began)."""
    fit = summary.get("fit") or {}
    if fit.get("mode") != "fastest":
        return []
    lines = []
    for r in (fit, *fit.get("later_phases", [])):
        measured = [c for c in r["candidates"] if c["outcome"] == "measured"]
        how = "cached" if r["cached"] else f"probed in {r['probe_seconds']:.1f} s"
        lines.append(f"  fit for phase {r.get('phase', 'all')}: micro {r['chosen']['micro_batch']}"
                     f"{', channels_last' if r['chosen']['channels_last'] else ''} ({how}; {len(measured)} of "
                     f"{len(r['candidates'])} candidates measured, "
                     f"{sum(c['outcome'] == 'out of memory' for c in r['candidates'])} out of memory)")
    return lines


def cap_allocator(recipe: str) -> int | None:
    """Cap this process's allocator at the recipe's card; returns the cap in bytes."""
    # OpenMP's wait before torch loads libgomp, so the runs of a bench on a CPU wait as
    # `vramfit train` does (vramfit.runtime.openmp).
    from vramfit.runtime.openmp import shorten_spin

    shorten_spin()
    from vramfit.config import build_config
    from vramfit.planner import reported_total_bytes

    import torch

    gib = build_config(recipe).hardware.memory_gib
    if gib is None or not torch.cuda.is_available():
        return None
    cap = reported_total_bytes(gib)
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), 0)
    return cap


def device_name() -> str | None:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def vramfit(argv: list[str]) -> int:
    """One vramfit command in this process (so the allocator cap holds), as its exit code."""
    from vramfit.cli import main
    from vramfit.runtime.launch import forget

    try:
        main(argv)
    except SystemExit as e:
        return int(e.code or 0)
    finally:  # the next command builds its own Accelerator, as a new process would
        forget()
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    out_dir = Path(os.environ.get("OUT", "bench_out"))
    runs = Path(tempfile.mkdtemp(prefix="vramfit-recipe-"))
    argv_train = [*train_args(args.recipe, args.train_samples, runs, args.staged), *overrides(args)]
    if args.staged and not args.dry_run:  # staging runs on trained weights only: start from a file
        argv_train += ["--set", f"model.pretrained_path={weight_file(argv_train[1:], runs)}"]
    if args.dry_run:
        print("vramfit " + " ".join(argv_train))
        return 0
    if not args.cpu and device_name() is None:
        print("recipe_run: needs a CUDA GPU (use --dry-run to see the command)", file=sys.stderr)
        return 2
    cap = None if args.cpu else cap_allocator(args.recipe)
    stopped = vramfit([*argv_train, "--set", "debug.signal_at_step=3"])
    code = vramfit(argv_train) if stopped == 143 else stopped  # the same command resumes
    run_dir = runs / args.recipe
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
    exported = vramfit(["export", "--run", str(run_dir), "--format", "torchscript"]) if code == 0 else None
    peak, predicted = summary.get("peak_memory_bytes"), summary.get("predicted_peak_memory_bytes")
    result = {"recipe": args.recipe, "device": device_name(), "cap_bytes": cap,
              "stop_exit_code": stopped, "exit_code": code, "export_exit_code": exported,
              **{k: summary.get(k) for k in ("micro_batch", "grad_accum_steps", "precision", "oom_retries",
                                             "images_per_second", "best_accuracy")},
              "predicted_peak_bytes": predicted, "measured_peak_bytes": peak,
              "predicted_over_measured": predicted / peak if peak and predicted else None,
              "phases": summary.get("phases"), "fit": summary.get("fit")}
    out_dir.mkdir(parents=True, exist_ok=True)
    name = f"recipe_{args.recipe}{'_staged' if args.staged else ''}"
    (out_dir / f"{name}.json").write_text(json.dumps(result, indent=1))
    gib = 2**30
    print(f"{args.recipe} on {result['device']} capped at {cap / gib if cap else float('nan'):.2f} GiB: exit {code}, "
          f"micro {result['micro_batch']} x accum {result['grad_accum_steps']}, {result['precision']}, "
          f"{result['oom_retries']} OOM retries, {result['images_per_second'] or 0:.0f} img/s; predicted peak "
          f"{(predicted or 0) / gib:.2f} GiB, measured {(peak or 0) / gib:.2f} GiB"
          + (f" ({result['predicted_over_measured']:.3f}x)" if result["predicted_over_measured"] else ""))
    if args.staged:
        print("\n".join(phase_lines(summary) + fit_lines(summary)))
    return 0 if stopped == 143 and code == 0 and exported == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
