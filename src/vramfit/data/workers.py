"""Loader worker processes: how many, how they treat signals, and that they end with the run.

Workers ignore the stop signals (collectives.STOP_SIGNALS): one sent to the whole process group
(Ctrl-C, a closed terminal's SIGHUP, a scheduler's SIGTERM) must not kill them before the main
process has saved its checkpoint. The price is that they also ignore the SIGTERM multiprocessing
sends them when the main process exits, and its exit then waits on them forever (an error raised
mid-epoch leaves the loader's workers running); so the main process ends them itself, at exit, with
a signal they cannot ignore.

Ctrl-Z and `fg`/`bg` act on workers through the kernel's defaults (runtime/terminal.py stops and continues
the trainer's whole job): a forked worker inherits the trainer's Python handlers for SIGTSTP and
SIGCONT, and a Python handler runs only when the worker's main thread next runs Python code. A
worker busy in a long C call when it was stopped would run the Ctrl-Z handler after being continued
and stop itself for good, and the trainer would wait on its batches forever (a Ctrl-C then says
"saving" and never saves). The default action happens at once, and SIGCONT discards a stop still
pending.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.util  # noqa: F401 - registers its exit handler first, so ours runs before it
import os
import signal
from typing import Callable

import torch

from ..config import DataConfig
from ..runtime.collectives import STOP_SIGNALS

_REGISTERED = False


# A worker is added only when the cost model predicts it saves this much of a sample's time: each
# one is a process with its own memory and start-up, and the model is rough.
WORKER_GAIN = 0.05
MOST_WORKERS = 8


def predicted_seconds(workers: int, sample_seconds: float, compute_seconds: float, cpus: int) -> float:
    """Seconds per training sample on `cpus` cores: without workers the process loads and computes
    in turn; with w workers loading overlaps computing, which keeps the cores the workers leave it
    (its kernels use every core, so they slow by cpus / (cpus - w))."""
    if workers == 0:
        return sample_seconds + compute_seconds
    return max(compute_seconds * cpus / max(1, cpus - workers), sample_seconds / workers)


def pick_cpu_workers(sample_seconds: float, compute_seconds: float, cpus: int) -> int:
    """Loader workers for a CPU run, from what loading one sample and computing one sample took."""
    best, best_time = 0, predicted_seconds(0, sample_seconds, compute_seconds, cpus)
    for w in range(1, min(MOST_WORKERS, cpus - 1) + 1):
        t = predicted_seconds(w, sample_seconds, compute_seconds, cpus)
        if t < best_time * (1 - WORKER_GAIN):
            best, best_time = w, t
    return best


def local_processes(default: int) -> int:
    """Processes of this machine, which share its CPUs (torchrun / accelerate launch export it)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", default))


def cpus_per_process(local: int) -> int:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cpus // max(1, local))


def measures_workers(cfg: DataConfig, device_type: str, local: int) -> bool:
    """Whether `num_workers: auto` is measured: a CPU run with a core to spare for a worker."""
    return cfg.num_workers == "auto" and device_type == "cpu" and cpus_per_process(local) >= 2


def resolve_workers(cfg: DataConfig, device_type: str, local: int,
                    measure: Callable[[], tuple[float, float]] | None = None) -> tuple[int, str]:
    """(loader workers per process, how they were chosen): `data.num_workers`; or for `auto` on an
    accelerator the CPUs this process may use less one (at most 8); on the CPU, from `measure()`
    (seconds to load one sample, seconds to compute one) through `pick_cpu_workers`, none when
    there is no measurement or no core to spare."""
    if cfg.num_workers != "auto":
        return int(cfg.num_workers), "data.num_workers"
    per_proc = cpus_per_process(local)
    if device_type != "cpu":
        return max(0, min(MOST_WORKERS, per_proc - 1)), f"auto: {per_proc} CPUs for this process"
    if measure is None or not measures_workers(cfg, device_type, local):
        return 0, f"auto: {per_proc} CPU(s) for this process, all computing"
    sample_s, compute_s = measure()
    return pick_cpu_workers(sample_s, compute_s, per_proc), (
        f"auto, measured: loading {sample_s * 1e3:.2f} ms and computing {compute_s * 1e3:.2f} ms a sample "
        f"on {per_proc} CPUs")


def init_worker(_worker_id: int) -> None:
    """`worker_init_fn` of every loader with workers (see the module docstring)."""
    for name in STOP_SIGNALS:  # a terminal's hangup reaches the workers too: they must outlive the save
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_IGN)
    for s in (getattr(signal, "SIGTSTP", None), getattr(signal, "SIGCONT", None)):
        if s is not None:
            signal.signal(s, signal.SIG_DFL)
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
