"""The quickstart on a CPU that other jobs share: torch's thread count and OpenMP's wait.

A competing load of `--load` busy processes (pure-Python loops: CPU time, no memory traffic)
runs for the whole bench. Under it, and once idle for reference, `vramfit train --recipe
quickstart --epochs E` runs as a fresh process per setting:
  default     torch's threads (one per core) with libgomp's own wait (GOMP_SPINCOUNT=300000: a
              thread that finished its share spins that many times before it sleeps)
  rule        vramfit's rule (src/vramfit/runtime/openmp.py): the same threads, GOMP_SPINCOUNT=10000
  1 thread    OMP_NUM_THREADS=1 (vramfit keeps a count the user set)
  passive     torch's threads with OMP_WAIT_POLICY=PASSIVE (a waiting thread sleeps at once)
Every setting runs idle and loaded. The settings interleave over `--rounds` rounds; each figure is
the median wall time. The ratio is against the default under the same load.

    python bench/shared_cpu.py                  # ~8 minutes on 2 cores
    python bench/shared_cpu.py --load 4 --epochs 1 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from vramfit.runtime.openmp import USER_KEYS

REPO = Path(__file__).resolve().parents[1]
SETTINGS = {"default": {"GOMP_SPINCOUNT": "300000"}, "rule": {}, "1 thread": {"OMP_NUM_THREADS": "1"},
            "passive": {"OMP_WAIT_POLICY": "PASSIVE"}}
SCRUBBED = ("OMP_NUM_THREADS", *USER_KEYS)  # every setting starts from none of them


def spin() -> None:  # a competing job
    while True:
        pass


def one(out: Path, name: str, epochs: int, extra_env: dict) -> float:
    env = {k: v for k, v in os.environ.items() if k not in SCRUBBED}
    env.update(extra_env)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "vramfit.cli", "train", "--recipe", "quickstart", "--epochs",
                           str(epochs), "--output", str(out), "--run-name", name, "--resume", "never"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise SystemExit(f"{name}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--load", type=int, default=os.cpu_count() or 2, help="busy processes (default: one per core)")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    out = Path(tempfile.mkdtemp(prefix="vramfit-shared-cpu-"))
    walls: dict[str, list[float]] = {f"{phase}: {k}": [] for phase in ("idle", "loaded") for k in SETTINGS}
    for r in range(args.rounds):
        for phase in ("idle", "loaded"):
            jobs = [mp.Process(target=spin, daemon=True) for _ in range(args.load if phase == "loaded" else 0)]
            for j in jobs:
                j.start()
            try:
                for name, env in SETTINGS.items():
                    label = f"{phase}: {name}"
                    walls[label].append(one(out, f"{phase}-{name.replace(' ', '')}-{r}", args.epochs, env))
                    print(f"  round {r + 1} {label:<18} {walls[label][-1]:6.1f} s", file=sys.stderr)
            finally:
                for j in jobs:
                    j.terminate()
    med = {k: statistics.median(v) for k, v in walls.items()}
    print(f"shared CPU: quickstart --epochs {args.epochs} on {os.cpu_count()} cores, {args.load} busy processes "
          f"competing, {args.rounds} rounds (median wall)")
    print("| setting | wall s (median) | rounds | vs the default, same load |\n|---|---:|---|---:|")
    for k, v in walls.items():
        base = med["idle: default"] if k.startswith("idle") else med["loaded: default"]
        print(f"| {k} | {med[k]:.1f} | {', '.join(f'{x:.1f}' for x in v)} | {med[k] / base:.2f}x |")
    if args.json:
        Path(args.json).write_text(json.dumps({"walls": walls, "median": med, "load": args.load}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
