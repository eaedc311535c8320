"""OpenMP's wait between parallel regions, chosen by the command-line entry before torch loads its
OpenMP runtime.

libgomp (torch's OpenMP on Linux pip wheels) lets a thread that finished its share of a parallel
region spin 300000 times before it sleeps. On a CPU that other jobs share, a spinning thread holds
a core that its descheduled partner needs, and every op waits for the slowest thread.
`bench/shared_cpu.py` measured the quickstart on 2 cores (docs/benchmarks.md, "Shared CPU"):
GOMP_SPINCOUNT=10000 took 0.61x to 0.67x the wall time of the default under 4 competing processes and
0.92x under 2, and 0.92x to 1.06x (noise) on an idle machine; OMP_WAIT_POLICY=PASSIVE was as good
under load but up to 1.16x idle, and one thread 1.32x to 1.41x idle. So the short spin is the
default; a user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT is kept.

libgomp reads these variables once, when it loads, so only a process's entry can choose them:
`cli.main` (`vramfit`, `python -m vramfit`, train.py) and the benches call `shorten_spin` before
anything imports torch. Importing vramfit sets nothing: a user's script keeps its own environment."""

from __future__ import annotations

import os
import sys

SPIN_COUNT = "10000"
USER_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def shorten_spin() -> str:
    """Set GOMP_SPINCOUNT unless a wait is already chosen or torch has loaded libgomp; the words
    for what applies."""
    if not any(k in os.environ for k in USER_KEYS):
        if "torch" in sys.modules:
            return "OpenMP wait: libgomp's default (torch was imported before vramfit)"
        os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
    return in_effect()


def in_effect() -> str:
    """The CPU start line's words for the wait this process's environment asks libgomp for."""
    chosen = {k: os.environ[k] for k in USER_KEYS if k in os.environ}
    if chosen == {"GOMP_SPINCOUNT": SPIN_COUNT}:
        return f"OpenMP spins {SPIN_COUNT} before it sleeps (GOMP_SPINCOUNT; set yours to override)"
    if chosen:
        return "OpenMP wait as set (" + ", ".join(f"{k}={v}" for k, v in chosen.items()) + ")"
    return "OpenMP wait: libgomp's default (GOMP_SPINCOUNT unset)"
