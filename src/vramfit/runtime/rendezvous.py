"""Several processes launched by hand (RANK, WORLD_SIZE, ... set by a script or `srun`, not by
torchrun): the variables are checked before Accelerate reads them (half set, it raises a ValueError
or waits in silence), and the wait for the other processes is said while it lasts and ends.

Under torchrun (TORCHELASTIC_RUN_ID) its agent has already gathered every process, and under
mpirun (PMI_SIZE, OMPI_COMM_WORLD_SIZE, ...) Accelerate reads MPI's variables: both are left alone.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

from ..errors import VramfitError

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
NUMBERS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT")
MPI_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
WAIT_VAR = "VRAMFIT_RENDEZVOUS_SECONDS"
WAIT_SECONDS = 600  # as long as torchrun's own rendezvous waits for a node to join
FIRST_WORD_S, SAY_EVERY_S = 2.0, 10.0  # a launch that works gathers in under a second: no word for it
ARRIVED = "vramfit/arrived"


def _hint(world: int) -> str:
    return (f"launch every process with a launcher, which sets them all: `torchrun --nproc_per_node {world} "
            f"train.py ...` (or `accelerate launch --num_processes {world} train.py ...`; several machines: "
            "docs/distributed.md); for one process, `unset RANK WORLD_SIZE LOCAL_RANK`")


def _wait_hint(world: int) -> str:
    return (f"start ranks 0 to {world - 1}, each with the same MASTER_ADDR and MASTER_PORT, reachable from "
            f"every machine (or let `torchrun --nproc_per_node {world} train.py ...` start them); {WAIT_VAR} "
            "sets how long to wait")


def check_env() -> None:
    """The launch variables are all set (a run on several processes, or LOCAL_RANK, which makes
    Accelerate start one) or none is; numbers are numbers, each rank in its world."""
    env = os.environ
    if any(v in env for v in MPI_VARS):
        return
    bad = [f"{v}={env[v]!r}" for v in NUMBERS if v in env and not env[v].strip().isdigit()]
    if bad:
        raise VramfitError(f"Launch variable{'s' if len(bad) > 1 else ''} {', '.join(bad)}: not a whole number.",
                           hint=_hint(2))
    world = int(env.get("WORLD_SIZE", "1"))
    if world > 1 or "LOCAL_RANK" in env or ("RANK" in env and "WORLD_SIZE" not in env):
        given = [v for v in LAUNCH_VARS if v in env]
        missing = [v for v in LAUNCH_VARS if v not in env]
        if missing:
            raise VramfitError(
                f"The launch variables are half set: {', '.join(f'{v}={env[v]}' for v in given)}, but not "
                f"{', '.join(missing)}. A run on several processes needs all of {', '.join(LAUNCH_VARS)} in "
                "every process, as a launcher sets them.", hint=_hint(max(world, 2)))
    for rank, size in (("RANK", "WORLD_SIZE"), ("LOCAL_RANK", "LOCAL_WORLD_SIZE")):
        if rank in env and size in env and int(env[rank]) >= int(env[size]):
            raise VramfitError(f"{rank}={env[rank]} is not below {size}={env[size]}: ranks count from 0.",
                               hint=_hint(max(world, 2)))


def wait_seconds() -> float:
    raw = os.environ.get(WAIT_VAR, str(WAIT_SECONDS))
    try:
        return max(1.0, float(raw))
    except ValueError:
        raise VramfitError(f"{WAIT_VAR}={raw!r} is not a number of seconds.",
                           hint=f"e.g. {WAIT_VAR}=600, or unset it") from None


def gather(device_type: str) -> None:
    """A launch by hand on several processes: make the process group here, after every process has
    arrived at MASTER_ADDR:MASTER_PORT, saying who is awaited (every SAY_EVERY_S) and ending with
    exit 2 after `wait_seconds()`; Accelerate takes the initialised group as it is. torch's own
    rendezvous (env://) would wait 30 minutes in silence."""
    import torch.distributed as dist

    env = os.environ
    world = int(env.get("WORLD_SIZE", "1"))
    if (world < 2 or "TORCHELASTIC_RUN_ID" in env or any(v in env for v in MPI_VARS)
            or not dist.is_available() or dist.is_initialized()):
        return
    rank, addr, port = int(env["RANK"]), env["MASTER_ADDR"], int(env["MASTER_PORT"])
    where = f"{addr}:{port}"
    clock = _Clock(wait_seconds())
    store = _connect(addr, port, rank, world, clock)
    store.add(ARRIVED, 1)
    while (arrived := store.add(ARRIVED, 0)) < world:
        clock.say(f"waiting for {world - arrived} of {world} processes at {where} (rank {rank} here)")
        if clock.over():
            raise VramfitError(
                f"Only {arrived} of {world} processes reached {where} in {clock.limit:.0f} s (rank {rank} "
                "here): the others were not started, or cannot reach this address.",
                hint=_wait_hint(world))
        time.sleep(0.2)
    store.set_timeout(timedelta(minutes=30))  # torch's default for what the group waits on later
    # gloo for what is on the CPU; on GPUs NCCL for CUDA tensors, as Accelerate would pick.
    backend = "gloo" if device_type == "cpu" else "cuda:nccl,cpu:gloo"
    dist.init_process_group(backend, store=dist.PrefixStore("vramfit/group", store), rank=rank,
                            world_size=world)


class _Clock:
    def __init__(self, limit: float):
        self.limit, self.start, self.said = limit, time.monotonic(), None

    def over(self) -> bool:
        return time.monotonic() - self.start >= self.limit

    def say(self, what: str) -> None:
        now = time.monotonic() - self.start
        due = FIRST_WORD_S if self.said is None else self.said + SAY_EVERY_S
        if now >= min(due, self.limit):
            print(f"vramfit: {what}... (waited {now:.0f} s, at most {self.limit:.0f})", file=sys.stderr, flush=True)
            self.said = now


def _connect(addr: str, port: int, rank: int, world: int, clock: _Clock):
    """Rank 0 serves the store; the others connect to it, retrying until rank 0 is up."""
    import torch.distributed as dist

    while True:
        try:
            return dist.TCPStore(addr, port, world, rank == 0, timeout=timedelta(seconds=1),
                                 wait_for_workers=False)
        except (RuntimeError, OSError) as e:  # DistNetworkError: a RuntimeError
            if rank == 0:
                raise VramfitError(f"Rank 0 cannot listen at {addr}:{port}: {str(e).splitlines()[0][:200]}.",
                                   hint="pick a free MASTER_PORT (the same in every process), and a "
                                        "MASTER_ADDR of this machine") from None
            clock.say(f"waiting for rank 0 at {addr}:{port} (rank {rank} here)")
            if clock.over():
                raise VramfitError(f"Rank 0 did not come up at {addr}:{port} in {clock.limit:.0f} s "
                                   f"(rank {rank} here).",
                                   hint=_wait_hint(world)) from None
