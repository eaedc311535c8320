"""Stop signals: the handler only records the signal; the run agrees and saves at a safe point."""

from __future__ import annotations

import os
import signal
import sys

from .collectives import STOP_SIGNALS

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def under_launcher() -> bool:
    """Started by `accelerate launch` or torchrun (they set LOCAL_RANK or ACCELERATE_* variables)."""
    return "LOCAL_RANK" in os.environ or any(k.startswith("ACCELERATE_") for k in os.environ)


def end_with_parent() -> bool:
    """Under a launcher, have Linux send this process SIGTERM when the launcher dies. `kill PID`,
    `docker stop` and a preemption signal the launcher (often PID 1), and `accelerate launch` dies
    of it without passing it on: with this the trainer still hears it, saves the last completed step
    and exits 143, instead of training on (or being orphaned) with no one watching. Returns whether
    it was set. The prctl call is Linux's; torch and the standard library have no wrapper for it."""
    if not sys.platform.startswith("linux") or not under_launcher():
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() == 1:  # the launcher died before the request was made
        os.kill(os.getpid(), signal.SIGTERM)
    return True


class SignalFlag:
    def __init__(self):
        self.signum = 0
        self._old: dict = {}

    def install(self) -> "SignalFlag":
        for name in STOP_SIGNALS:
            s = getattr(signal, name, None)
            if s is not None:
                self._old[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum, _frame) -> None:
        if not self.signum and os.environ.get("LOCAL_RANK", "0") == "0":
            # Said at once (a step can take half a minute); os.write is safe inside a handler.
            os.write(2, f"\nvramfit: signal {signum} received: saving the last completed step, then "
                        "stopping\n".encode())
        self.signum = signum

    def raise_flag(self, signum: int = signal.SIGTERM) -> None:
        """As if `signum` had arrived (keeps the first one)."""
        self.signum = self.signum or int(signum)

    def restore(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old = {}
