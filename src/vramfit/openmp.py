"""OpenMP's wait between parallel regions, chosen before torch loads its OpenMP runtime.

libgomp (torch's OpenMP on Linux pip wheels) lets a thread that finished its share of a parallel
region spin 300000 times before it sleeps. On a CPU that other jobs share, a spinning thread holds
a core that its descheduled partner needs, and every op waits for the slowest thread.
`bench/shared_cpu.py` measured the quickstart on 2 cores (docs/benchmarks.md, "Shared CPU"):
GOMP_SPINCOUNT=10000 took 0.61x to 0.67x the wall time of the default under 4 competing processes and
0.92x under 2, and 0.92x to 1.06x (noise) on an idle machine; OMP_WAIT_POLICY=PASSIVE was as good
under load but up to 1.16x idle, and one thread 1.32x to 1.41x idle. So the short spin is the
default; a user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT is kept.

libgomp reads these variables once, when it loads: this runs from `vramfit/__init__.py`, before any
vramfit module imports torch. Where torch was imported first (a user's script), it says so rather
than claim a setting that did not take."""

from __future__ import annotations

import os
import sys

SPIN_COUNT = "10000"
USER_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def shorten_spin() -> str:
    """Set GOMP_SPINCOUNT unless the user chose a wait policy; the words for the start line."""
    if any(k in os.environ for k in USER_KEYS):
        chosen = ", ".join(f"{k}={os.environ[k]}" for k in USER_KEYS if k in os.environ)
        return f"OpenMP wait as set ({chosen})"
    if "torch" in sys.modules:
        return "OpenMP wait: libgomp's default (torch was imported before vramfit)"
    os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
    return f"OpenMP spins {SPIN_COUNT} before it sleeps (GOMP_SPINCOUNT; set yours to override)"


WAIT = shorten_spin()
