"""Debug fault injection (`debug.*` keys), gathered here so the run loop stays free of it.

Each fault behaves as the real event would at that point, so the tests exercise the real recovery
paths on a CPU: an out-of-memory error in a forward (and a second one inside the recovery), a NaN
loss, a SIGTERM between steps, inside a step or inside an evaluation. With `debug.fault_rank` only
that process injects them, and the processes must still agree.
"""

from __future__ import annotations

import os
import signal
from typing import Callable

import torch

from ..config import DebugConfig
from ..runtime.signals import SignalFlag
from .step import cross_entropy_sum


class Faults:
    def __init__(self, cfg: DebugConfig, rank: int):
        self.cfg = cfg
        self.here = cfg.fault_rank is None or cfg.fault_rank == rank
        self._recovery_due = False

    def install(self, model: torch.nn.Module, step) -> None:
        """Simulated OOMs: in any forward larger than `simulate_oom_above`, and (with
        `simulate_oom_in_recovery`) once more while the failed step's gradient sums go out."""
        limit = self.cfg.simulate_oom_above
        if limit is None or not self.here:
            return

        def forward_oom(_module, args):
            x = args[0]
            if x.shape[0] > limit:
                self._recovery_due = bool(self.cfg.simulate_oom_in_recovery)
                raise torch.OutOfMemoryError(
                    f"simulated out of memory: forward with {x.shape[0]} > debug.simulate_oom_above={limit}")

        model.register_forward_pre_hook(forward_oom)
        if step.reducer is not None:
            step.reducer.fault = self._recovery_oom

    def _recovery_oom(self) -> None:
        if self._recovery_due:
            self._recovery_due = False
            raise torch.OutOfMemoryError("simulated out of memory inside the recovery")

    def loss_fn(self, step_number: int) -> Callable | None:
        """`nan_at_step`: that step's loss is NaN (the update must be refused before it happens)."""
        if self.cfg.nan_at_step != step_number or not self.here:
            return None
        return lambda logits, y, smoothing: cross_entropy_sum(logits, y, smoothing) * float("nan")

    def stop_check(self, flag: SignalFlag, inject: bool) -> Callable[[], int]:
        """Asked before each micro-batch of a step (or batch of an evaluation); returns the signal.
        `inject` (signal_in_step / signal_in_eval) raises the flag before the second ask, as a
        SIGTERM arriving in the middle would."""
        asked = [0]

        def check() -> int:
            asked[0] += 1
            if inject and asked[0] == 2:
                flag.raise_flag()
            return flag.signum
        return check

    def in_step(self, flag: SignalFlag, step_number: int) -> Callable[[], int]:
        return self.stop_check(flag, self.cfg.signal_in_step == step_number)

    def in_eval(self, flag: SignalFlag, epoch_number: int) -> Callable[[], int]:
        return self.stop_check(flag, self.cfg.signal_in_eval == epoch_number)

    def after_step(self, flag: SignalFlag, step_number: int) -> None:
        """`signal_at_step`: as if SIGTERM arrived right after that step. `kill_at_step`: SIGKILL
        (on the fault rank, in a torchrun job's first attempt only)."""
        if self.cfg.signal_at_step == step_number:
            flag.raise_flag()
        if (self.cfg.kill_at_step == step_number and self.here
                and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
            os.kill(os.getpid(), signal.SIGKILL)
