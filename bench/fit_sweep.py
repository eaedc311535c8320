"""Is `train.fit: fastest` right, and is its probe cheap? Every candidate trained for the same
steps, beside the chooser's pick and what its probe cost.

1. Each candidate (micro-batch: the whole share and two halvings; channels_last off/on; gradient
   checkpointing at the whole share; with --precisions, each of them in each precision) trains the
   same epochs with its settings given directly (`train.fit: largest`), in three interleaved
   rounds; its images/s is the median of summary.json's (training time, data waits included).
2. The chooser: the same recipe for its full epochs with `train.fit: fastest` and an empty fit
   cache (with --precisions, `train.precision: auto`, which runs bf16 on a card with bf16 without
   measuring fp16: the sweep says what that rule costs); its pick (with the precision it ran) and
   `probe_seconds` from summary.json `fit`, against that run's wall time.

Must hold: the pick's swept images/s within 5% of the best candidate's, and the probe at most 3%
of the chooser run's wall time. Exit 1 when either does not.

    python bench/fit_sweep.py                       # the quickstart on this CPU (~3 minutes on 2 cores)
    python bench/fit_sweep.py --recipe rtx3060 --model resnet50 --image-size 224 --train-samples 1024
                                                    # a GPU, the allocator capped at the recipe's card
    python bench/fit_sweep.py --recipe rtx3060 --model resnet50 --image-size 224 --train-samples 1024 \
        --precisions bf16,fp16                      # the precision too (bf16 against fp16)
"""

from __future__ import annotations

import argparse
import json
import os
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
    ap.add_argument("--sweep-epochs", type=int, default=1, help="epochs each candidate trains per round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds over the candidates (median)")
    ap.add_argument("--chooser-epochs", type=int, default=None,
                    help="epochs of the chooser's run (default: the recipe's; its probe is a larger share of a shorter run)")
    ap.add_argument("--train-samples", type=int, default=None, help="data.limit_train_samples")
    ap.add_argument("--precisions", default=None,
                    help="bf16,fp16: sweep each candidate in each; the chooser runs `auto` (bf16 where the "
                         "card has it)")
    ap.add_argument("--out", default=None, help="folder for the runs (default: a temporary one)")
    ap.add_argument("--json", default=None, help="write the figures here too")
    return ap.parse_args(argv)


def base_args(args, output: Path) -> list[str]:
    out = ["train", "--recipe", args.recipe, "--data", "digits", "--output", str(output),
           "--set", "model.pretrained=false", "--set", "train.log_every_steps=1000",
           # The whole network trains in every step (a staged recipe's head-only epoch is another
           # fit: the probe runs in the phase the run starts in)
           "--set", "train.freeze_epochs=0"]
    if args.model:
        out += ["--model", args.model]
    if args.image_size:
        out += ["--image-size", str(args.image_size)]
    if args.train_samples:
        out += ["--set", f"data.limit_train_samples={args.train_samples}", "--set", "data.limit_val_samples=256"]
    return out


def candidates(share: int, precisions: list[str] | None = None) -> list[tuple[str, list[str]]]:
    out = []
    for micro in (share, share // 2, share // 4):
        for cl in (False, True):
            label = f"micro {micro}" + (", channels_last" if cl else "")
            out.append((label, ["--micro-batch", str(micro), "--set", f"model.channels_last={str(cl).lower()}"]))
    out.append((f"micro {share}, checkpointing", ["--micro-batch", str(share), "--set", "model.channels_last=false",
                                                  "--grad-checkpointing"]))
    if not precisions:  # the recipe's precision
        return out
    return [(f"{label}, {p}", [*extra, "--precision", p]) for label, extra in out for p in precisions]


def chooser_args(precisions: list[str] | None) -> list[str]:
    return ["--set", "train.fit=fastest", *(["--precision", "auto"] if precisions else [])]


def summary_of(output: Path, name: str) -> dict:
    return json.loads((output / name / "summary.json").read_text())


def settings_label(s: dict, precision: str | None = None) -> str:
    """A candidate's label, as `candidates` writes it (`precision`: what ran, with --precisions)."""
    return (f"micro {s['micro_batch']}" + (", channels_last" if s["channels_last"] else "")
            + (", checkpointing" if s["grad_checkpointing"] else "") + (f", {precision}" if precision else ""))


def main(argv=None) -> int:
    args = parse_args(argv)
    cap_allocator(args.recipe)
    root = Path(args.out or tempfile.mkdtemp(prefix="vramfit-fit-sweep-"))
    os.environ["VRAMFIT_CACHE"] = str(root / "cache")  # the chooser starts with an empty fit cache
    from vramfit.config import build_config

    cfg = build_config(args.recipe)
    share = cfg.train.global_batch  # one process
    common = base_args(args, root)
    precisions = args.precisions.split(",") if args.precisions else None
    # Rounds interleave the candidates, so that a slow stretch of a shared machine falls on all of
    # them; each candidate's figure is its median over the rounds.
    runs: dict[str, list[float]] = {label: [] for label, _ in candidates(share, precisions)}
    for r in range(args.rounds):
        for i, (label, extra) in enumerate(candidates(share, precisions)):
            name = f"cand{i}-r{r}"
            code = vramfit([*common, "--run-name", name, "--epochs", str(args.sweep_epochs),
                            "--set", "train.fit=largest", *extra])
            if code == 0:
                runs[label].append(summary_of(root, name)["images_per_second"])
            print(f"  round {r + 1}: {label:<36} {runs[label][-1] if code == 0 else 0:8.0f} img/s"
                  + ("" if code == 0 else f" (exit {code})"), file=sys.stderr)
    swept = {label: statistics.median(v) if v else None for label, v in runs.items()}
    epochs = ["--epochs", str(args.chooser_epochs)] if args.chooser_epochs else []
    code = vramfit([*common, "--run-name", "chooser", *epochs, *chooser_args(precisions)])
    if code:
        print(f"the chooser's run failed (exit {code})")
        return 1
    chooser = summary_of(root, "chooser")
    fit, wall = chooser["fit"], chooser["wall_seconds"]
    pick = settings_label(fit["chosen"], chooser["precision"] if precisions else None)
    best_label = max((k for k in swept if swept[k]), key=lambda k: swept[k])
    best, got = swept[best_label], swept.get(pick)
    print(f"fit sweep: {args.recipe}" + (f", {args.model}" if args.model else "") + f" on {device_name() or 'CPU'}, "
          f"global batch {share}, {args.sweep_epochs} epoch(s) per candidate x {args.rounds} rounds")
    print("| candidate | images/s (median) | rounds | vs best |\n|---|---:|---|---:|")
    for label, ips in swept.items():
        mark = " (chosen)" if label == pick else ""
        each = ", ".join(f"{v:.0f}" for v in runs[label])
        print(f"| {label}{mark} | {ips or 0:.0f} | {each} | {(ips or 0) / best:.3f}x |")
    probed = sum(1 for c in fit["candidates"] if c["outcome"] == "measured")
    share_of_wall = fit["probe_seconds"] / wall
    print(f"chooser: {pick} after probing {probed} of {len(fit['candidates'])} candidates in "
          f"{fit['probe_seconds']:.2f} s = {100 * share_of_wall:.1f}% of its {wall:.0f} s run")
    within = got is not None and got >= 0.95 * best
    cheap = share_of_wall <= 0.03
    print(f"pick within 5% of the best ({best_label}): {'holds' if within else 'DOES NOT HOLD'} "
          f"({(got or 0) / best:.3f}x); probe <= 3% of the run: {'holds' if cheap else 'DOES NOT HOLD'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"swept": swept, "rounds": runs, "fit": fit, "wall_seconds": wall,
                                               "device": device_name()}, indent=1))
    return 0 if within and cheap else 1


if __name__ == "__main__":
    sys.exit(main())
