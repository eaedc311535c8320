"""Stop signals: the handler only records the signal; the run agrees and saves at a safe point."""

from __future__ import annotations

import contextlib
import os
import signal
import stat
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


def drop_lost_output() -> None:
    """After a hangup (a closed terminal, a dropped ssh session) the terminal is gone, and a pipe
    into `tee` or `less` in the same job goes with it: a write to them fails (EIO, EPIPE), and a
    print or a log line would end the run before its save, or Python's exit flush would turn exit
    129 into 120. Standard output and error that are not regular files are pointed at /dev/null;
    output into a file (nohup, `> log`, a scheduler's log) carries on."""
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in (1, 2):
            with contextlib.suppress(OSError):
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    os.dup2(null, fd)
    finally:
        os.close(null)


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
        if signum == getattr(signal, "SIGHUP", None):
            drop_lost_output()
        if not self.signum and os.environ.get("LOCAL_RANK", "0") == "0":
            # Said at once (a step can take half a minute); os.write is safe inside a handler.
            with contextlib.suppress(OSError):  # nobody left to read it: the save matters, not the line
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
