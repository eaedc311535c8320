"""Stop signals: the handler only records the signal; the run agrees and saves at a safe point."""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import sys

# The signals that mean "stop this job": each saves the last completed step, then exits 128 + signal
# (before the first step, while the run is set up, there is nothing to save: it ends at once).
# TERM: kill, docker stop, Kubernetes, Slurm's scancel and time limit, PBS's qdel and walltime; INT:
# Ctrl-C, LSF's bkill; HUP: a closed terminal or a dropped ssh session; USR1 and USR2: Slurm's
# `--signal` (USR1 by default), Grid Engine's `-notify` (USR1 before a suspend, USR2 before a kill),
# LSF's run limit (USR2); XCPU: a CPU-time limit (ulimit -t, Grid Engine's s_cpu, LSF's CPULIMIT).
# QUIT (Ctrl-\) is left to its default on purpose: the one way to stop at once without saving
# when a save itself hangs (the last complete checkpoint is kept, checkpoints being atomic).
STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGXCPU")
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


class StoppedInSetup(BaseException):
    """A stop signal before the first step. Not an Exception, as KeyboardInterrupt is not: a
    library's `except Exception` (an optional import tried, a cache write attempted) must not
    swallow it."""

    def __init__(self, signum: int):
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        super().__init__(f"stopped by {name} before training began (while the run was being set up): no step "
                         "was trained, so there is nothing to save; checkpoints saved before are kept.")
        self.exit_code = 128 + int(signum)


def _stop_setup(signum, _frame) -> None:
    if signum == getattr(signal, "SIGHUP", None):
        drop_lost_output()
    raise StoppedInSetup(signum)


_before_training: dict = {}  # signal -> its handler before `stops_setup` (what the trainer's flag restores)


@contextlib.contextmanager
def stops_setup():
    """While a run is set up (torch loading, the data read, the model built, the fit measured), a
    stop signal ends the command at once with a line saying so (`StoppedInSetup`), instead
    of the signal's silent default. The trainer's `SignalFlag` takes over from it at the first step.
    Raised from the handler as Python raises KeyboardInterrupt, so the run folder's lock and every
    half-written temporary file are let go on the way out."""
    for name in STOP_SIGNALS:
        s = getattr(signal, name, None)
        if s is not None:
            _before_training[s] = signal.signal(s, _stop_setup)
    try:
        yield
    finally:
        for s, h in _before_training.items():
            signal.signal(s, h)
        _before_training.clear()


class SignalFlag:
    def __init__(self):
        self.signum = 0
        self._old: dict = {}

    def install(self) -> "SignalFlag":
        for name in STOP_SIGNALS:
            s = getattr(signal, name, None)
            if s is not None:
                old = signal.signal(s, self._handle)
                # After the run, a signal is no longer one that stopped its set-up.
                self._old[s] = _before_training.get(s, old) if old is _stop_setup else old
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
