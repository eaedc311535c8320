"""The process a run lives in: Accelerate, precision, threads and logging, set up once."""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .signals import under_launcher

if TYPE_CHECKING:
    from pathlib import Path

    from accelerate import Accelerator

    from .precision import Precision

log = logging.getLogger("vramfit")


@dataclass
class Launch:
    acc: Accelerator
    device_type: str  # cuda | cpu
    precision: Precision  # what runs (precision.resolve)
    world: int
    rank: int
    main: bool
    notes: list[str]  # said once at start


def forget() -> None:
    """Forget this process's Accelerate state, so that the next run in the same process (a test,
    a bench running several commands) builds its own Accelerator, precision and device, as a new
    process would. Accelerate keeps them in process-wide singletons that only these reset."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


def _scale_fp16_on_cpu(acc: Accelerator) -> None:
    """Accelerate keeps fp16 for accelerators: on a CPU it leaves autocast and loss scaling off. Give
    it what it gives a GPU (its `native_amp` autocast wrapping and torch's GradScaler for the
    device), before anything is prepared, so that `prepare`, `backward`, `clip_grad_norm_`, the
    optimizer's skipped steps and `save_state` run as on a GPU."""
    acc.native_amp = True
    acc.scaler = torch.amp.GradScaler("cpu")


def _launcher_set_threads() -> bool:
    """True when OMP_NUM_THREADS came from a launcher (`accelerate launch` and `torchrun` set it to
    1 when the user did not), not from the user: the launcher's own starting environment, which is
    the user's, does not hold it."""
    if "OMP_NUM_THREADS" not in os.environ or not under_launcher():
        return False
    try:
        with open(f"/proc/{os.getppid()}/environ", "rb") as f:
            parent = f.read().split(b"\0")
    except OSError:  # not Linux, or not allowed: leave the setting alone
        return False
    return not any(item.startswith(b"OMP_NUM_THREADS=") for item in parent)


def set_threads(local_processes: int) -> str:
    """Torch threads for this process: its share of the cores when a launcher chose 1 for it."""
    if _launcher_set_threads():
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        torch.set_num_threads(max(1, cpus // max(1, local_processes)))
        return f"{torch.get_num_threads()} torch threads (this process's share of {cpus} cores)"
    return f"{torch.get_num_threads()} torch threads"


def _join_elastic_round(device_type: str) -> None:
    """Under torchrun on CPU, the process group is made here, on a key space of this round's own.
    torchrun's agent keeps one TCPStore for the whole job, and torch's env:// rendezvous hands the
    workers of every round a plain client of it (torch 2.x's `_create_c10d_store`: "a new TCPStore
    for every retry, so no prefix"), so the workers of a round restarted after a worker died can
    read the dead round's gloo addresses, whichever process asks first (connectFullMesh: connection
    refused, or a hang). A PrefixStore named by TORCHELASTIC_RESTART_COUNT keeps the rounds apart.
    Accelerate takes an initialised group as it is."""
    import torch.distributed as dist

    if (device_type != "cpu" or not os.environ.get("TORCHELASTIC_RUN_ID") or int(os.environ.get("WORLD_SIZE", "1")) < 2
            or not dist.is_available() or dist.is_initialized()):
        return
    store, rank, world = next(dist.rendezvous("env://"))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group("gloo", store=dist.PrefixStore(f"vramfit/round_{attempt}", store), rank=rank,
                            world_size=world)


def start(cfg, run_dir: Path | None = None, precision: Precision | None = None) -> Launch:
    """The process's Accelerator, in `precision` (default: what `precision.here(cfg)` resolves);
    with the run's trackers when `run_dir` is given (TensorBoard writes into it), none without
    (lr-find, benches). Once more after `forget()` (another run in the same process) it makes a new
    Accelerator on the process group it has."""
    from . import rendezvous

    rendezvous.check_env()  # before anything reads them: half-set launch variables are named
    # Must be set before CUDA initialises; expandable segments cut fragmentation-driven OOMs.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    from accelerate import Accelerator

    from ..store.tracking import log_with
    from . import openmp
    from . import precision as precisions

    from .gpucheck import check_gpu_recipe
    from .signals import end_with_parent
    from .terminal import hold_foreground

    end_with_parent()
    # Ctrl-C in a terminal reaches the trainer, not `accelerate launch` (runtime/terminal.py)
    hold_foreground()
    check_gpu_recipe(cfg, torch.cuda.is_available())
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    precision = precision or precisions.here(cfg)
    _join_elastic_round(device_type)
    rendezvous.gather(device_type)  # a launch by hand: every process arrived, or exit 2 saying who not
    acc = Accelerator(mixed_precision=precision.accelerate,
                      cpu=device_type == "cpu",  # without it Accelerate ignores a torchrun world on CPU
                      log_with=log_with(cfg, run_dir) if run_dir is not None else None,
                      step_scheduler_with_optimizer=False)
    if device_type == "cpu" and precision.scales_loss:
        _scale_fp16_on_cpu(acc)
    main = acc.is_main_process
    logging.basicConfig(level=logging.INFO if main else logging.WARNING, format="%(message)s", stream=sys.stderr)
    for noisy in ("accelerate", "datasets", "timm"):  # their per-save INFO lines drown the run's own
        logging.getLogger(noisy).setLevel(logging.WARNING)
    notes = [f"precision: {precision.note}"] if precision.note else []
    notes.append(set_threads(int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    if device_type == "cpu":  # on a GPU the CPU's OpenMP barely runs: no word for it
        notes.append(openmp.in_effect())
    if device_type == "cuda":
        torch.backends.cudnn.benchmark = cfg.train.cudnn_benchmark
        # TF32 matmuls on Ampere and newer (as timm and NVIDIA's references train); convolutions
        # already use TF32 by default in PyTorch.
        torch.backends.cuda.matmul.allow_tf32 = True
        if torch.cuda.get_device_capability(acc.device)[0] >= 8:
            notes.append("TF32 matmuls on")
    if device_type == "cpu" and os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true"):
        notes.append(f"distributed: the launch config asks for FSDP, which needs CUDA GPUs; on CPU the "
                     f"{acc.num_processes} process(es) run plain data parallel (every process holds the "
                     "whole model)")
    return Launch(acc, device_type, precision, acc.num_processes, acc.process_index, main, notes)
