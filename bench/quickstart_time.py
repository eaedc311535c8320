"""Wall time and accuracy of the quickstart, by command, seed by seed, the commands interleaved.

Commands (each a fresh process, as a user types it, from the repository root):
  accelerate  `accelerate launch train.py --recipe quickstart`
  vramfit     `vramfit train --recipe quickstart`
  baseline    `vramfit train --recipe FILE`, FILE the quickstart recipe of another revision
              (--baseline-rev, e.g. the one before a recipe change) or any recipe file
              (--baseline-recipe)
For every seed all commands run once, in an order that rotates from seed to seed (a burst of other
load then hits a different command each time). Wall time is the whole command, start-up and
evaluation included; accuracy is the run's validation accuracy (best epoch, and the last).
The ratio is the median wall time of each command over the baseline's.

    python bench/quickstart_time.py --baseline-rev HEAD~1            # ~5 minutes on 2 idle cores
    python bench/quickstart_time.py --commands accelerate,vramfit --seeds 0,1,2
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = "src/vramfit/recipes/quickstart.yaml"


def command(name: str, baseline_recipe: str | None) -> list[str]:
    if name == "accelerate":
        return [sys.executable, "-m", "accelerate.commands.launch", "train.py", "--recipe", "quickstart"]
    if name == "vramfit":
        return [sys.executable, "-m", "vramfit.cli", "train", "--recipe", "quickstart"]
    if name == "baseline":
        if not baseline_recipe:
            raise SystemExit("the baseline command needs --baseline-rev or --baseline-recipe")
        return [sys.executable, "-m", "vramfit.cli", "train", "--recipe", baseline_recipe]
    raise SystemExit(f"unknown command {name!r}: accelerate, vramfit or baseline")


def run_once(name: str, cmd: list[str], seed: int, out: Path) -> dict:
    run_name = f"{name}-s{seed}"
    t0 = time.perf_counter()
    proc = subprocess.run([*cmd, "--seed", str(seed), "--output", str(out), "--run-name", run_name],
                          cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{name} seed {seed} failed:\n{proc.stderr[-3000:]}")
    summary = json.loads((out / run_name / "summary.json").read_text())
    threads = re.search(r"(\d+) torch threads", proc.stderr)
    workers = re.search(r"(\d+) workers", proc.stderr)
    return {"command": name, "seed": seed, "wall": wall, "best": summary["best_accuracy"],
            "final": summary["final_accuracy"], "epochs": summary["epochs"],
            "threads": int(threads.group(1)) if threads else None,
            "workers": int(workers.group(1)) if workers else None}


def baseline_file(args, tmp: Path) -> str | None:
    if args.baseline_recipe:
        return str(Path(args.baseline_recipe).resolve())
    if args.baseline_rev:
        text = subprocess.run(["git", "show", f"{args.baseline_rev}:{RECIPE}"], cwd=REPO, check=True,
                              capture_output=True, text=True).stdout
        path = tmp / "quickstart.yaml"  # same name, so the run names match the shipped recipe's
        path.write_text(text)
        return str(path)
    return None


def report(rows: list[dict], names: list[str]) -> None:
    print(f"\n{'command':<12}{'seed':>5}{'wall s':>9}{'best':>8}{'final':>8}{'epochs':>8}{'threads':>9}{'workers':>9}")
    for r in rows:
        print(f"{r['command']:<12}{r['seed']:>5}{r['wall']:>9.1f}{r['best'] * 100:>7.2f}%{r['final'] * 100:>7.2f}%"
              f"{r['epochs']:>8}{r['threads'] or '?':>9}{r['workers'] if r['workers'] is not None else '?':>9}")
    med = {n: {k: statistics.median(r[k] for r in rows if r["command"] == n) for k in ("wall", "best", "final")}
           for n in names}
    ref = med.get("baseline") or med[names[0]]
    print(f"\n{'median':<12}{'wall s':>9}{'best':>8}{'final':>8}{'wall ratio':>12}")
    for n in names:
        m = med[n]
        print(f"{n:<12}{m['wall']:>9.1f}{m['best'] * 100:>7.2f}%{m['final'] * 100:>7.2f}%{m['wall'] / ref['wall']:>11.2f}x")
    print(f"wall ratio = median wall / median wall of {'baseline' if 'baseline' in med else names[0]}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--commands", default=None, help="comma-separated: accelerate, vramfit, baseline "
                                                     "(default: all three with a baseline, else the first two)")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--baseline-rev", help="git revision whose quickstart recipe is the baseline")
    ap.add_argument("--baseline-recipe", help="recipe file for the baseline command")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    tmp = Path(tempfile.mkdtemp(prefix="vramfit-quickstart-"))
    try:
        base = baseline_file(args, tmp)
        names = (args.commands or ("baseline,accelerate,vramfit" if base else "accelerate,vramfit")).split(",")
        cmds = {n: command(n, base) for n in names}
        print("OMP_NUM_THREADS:", os.environ.get("OMP_NUM_THREADS", "unset"), "| baseline recipe:",
              f"{args.baseline_rev or ''}:{RECIPE}" if args.baseline_rev else base or "none", flush=True)
        rows = []
        for k, seed in enumerate(int(s) for s in args.seeds.split(",")):
            for name in names[k % len(names):] + names[:k % len(names)]:
                rows.append(run_once(name, cmds[name], seed, tmp / "runs"))
                r = rows[-1]
                print(f"  {name} seed {seed}: {r['wall']:.1f} s, best {r['best']:.4f}, final {r['final']:.4f}",
                      flush=True)
        report(rows, names)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
