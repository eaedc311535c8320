"""Loader worker processes: how many, how they treat signals, and that they end with the run.

Workers ignore SIGTERM/SIGINT: a signal sent to the whole process group (Ctrl-C, a scheduler's
SIGTERM) must not kill them before the main process has saved its checkpoint. The price is that
they also ignore the SIGTERM multiprocessing sends them when the main process exits, and its exit
then waits on them forever (an error raised mid-epoch leaves the loader's workers running); so the
main process ends them itself, at exit, with a signal they cannot ignore.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.util  # noqa: F401 - registers its exit handler first, so ours runs before it
import os
import signal

import torch

from ..config import DataConfig

_REGISTERED = False


def resolve_workers(cfg: DataConfig, device_type: str, local_processes: int) -> int:
    """Loader workers per process: `data.num_workers`, or for `auto` the CPUs this process may use
    less one (at most 8), none on a CPU run that has no core to spare."""
    if cfg.num_workers != "auto":
        return int(cfg.num_workers)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    per_proc = cpus // max(1, local_processes)
    if device_type == "cpu" and per_proc <= 2:
        return 0  # compute already uses every core; worker processes would only contend
    return max(0, min(8, per_proc - 1))


def init_worker(_worker_id: int) -> None:
    """`worker_init_fn` of every loader with workers (see the module docstring)."""
    for s in (signal.SIGTERM, signal.SIGINT, getattr(signal, "SIGUSR1", None)):
        if s is not None:
            signal.signal(s, signal.SIG_IGN)
    torch.set_num_threads(1)


def end_workers_at_exit() -> None:
    """Make sure this process's loader workers end when it exits (once per process)."""
    global _REGISTERED
    if not _REGISTERED:
        atexit.register(_end_workers)  # exit handlers run last-registered first
        _REGISTERED = True


def _end_workers() -> None:
    # The daemonic children are the ones multiprocessing's own exit handler would terminate next;
    # here they get SIGKILL instead of the SIGTERM they ignore. Nothing in them needs saving.
    children = [p for p in multiprocessing.active_children() if p.daemon]
    if not children:
        return
    if hasattr(signal, "SIGCHLD"):
        # torch's SIGCHLD handler would report the workers ended here as crashed.
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for p in children:
        p.kill()
    for p in children:
        p.join(timeout=5)
