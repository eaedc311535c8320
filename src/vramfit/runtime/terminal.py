"""Ctrl-C under `accelerate launch` in a terminal: the trainer alone in the terminal's foreground.

A terminal sends Ctrl-C's SIGINT to its whole foreground process group: the launcher and the
trainer alike. Accelerate's launcher for one process then waits a quarter of a second for the
trainer (Python's `Popen.wait`), prints a KeyboardInterrupt traceback and exits, and the shell's
prompt returns while the trainer is still saving; its "Stopped by signal 2" lands after the prompt.
No launcher setting changes that. So the trainer moves into a process group of its own and makes it
the terminal's foreground: Ctrl-C reaches the trainer alone, which saves and exits 130, and the
launcher ends after it (quietly under `-q`), so the prompt comes after the save.

The shell's job control keeps working: Ctrl-Z (now sent to the trainer's group only) gives the
terminal back, rejoins the launcher's group and stops all of it, so the shell sees its job stop;
`fg` continues that group, and the trainer takes the foreground again (`bg` leaves it in the
background, where the shell put the job). At exit the terminal goes back to the launcher's group.

Plain POSIX job control (os.setpgid / os.tcsetpgrp); no library does this for a child of a launcher.
"""

from __future__ import annotations

import atexit
import os
import signal
import threading
import time
from dataclasses import dataclass, field

from .signals import under_launcher

WATCH_SECONDS = 0.5  # how often a job continued in the background looks whether it is in front


@dataclass
class Foreground:
    """The trainer's hold on the terminal. `home`: the launcher's process group (the shell's job)."""

    fd: int
    home: int
    pid: int  # the trainer's: a process forked from it that still has the Ctrl-Z handler stops as usual
    watcher: threading.Thread | None = field(default=None, repr=False)

    def take(self) -> None:
        """Into a group of this process's own (its loader workers follow it), in the foreground."""
        os.setpgid(0, 0)
        self._hand_to(os.getpgrp())

    def give_back(self) -> None:
        try:
            if os.tcgetpgrp(self.fd) == os.getpgrp() != self.home:
                self._hand_to(self.home)
        except OSError:  # the terminal is gone (closed window): nothing to give back
            pass

    def _hand_to(self, pgid: int) -> None:
        # A process outside the foreground that sets it gets SIGTTOU unless it blocks it (a mask,
        # unlike a handler, can be set from any thread).
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTTOU})
        try:
            os.tcsetpgrp(self.fd, pgid)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)

    def stop_job(self, _signum=None, _frame=None) -> None:
        """Ctrl-Z: the whole job stops, as it would have without the separate group."""
        if os.getpid() != self.pid:
            os.kill(os.getpid(), signal.SIGSTOP)
            return
        own = os.getpgrp()
        self.give_back()
        os.setpgid(0, self.home)
        _signal_group(own, signal.SIGSTOP)  # the loader workers, left in the trainer's group
        os.killpg(self.home, signal.SIGSTOP)  # this process too: it returns once continued
        _signal_group(own, signal.SIGCONT)
        self.continued()

    def continued(self, _signum=None, _frame=None) -> None:
        """Continued (`fg`, `bg`): in front again, or once the shell brings the job to the front
        (its `fg` of a job running in the background sends no signal, so a thread watches)."""
        if os.getpid() != self.pid or os.getpgrp() != self.home or self._take_if_in_front() is not False:
            return
        if self.watcher is None or not self.watcher.is_alive():
            self.watcher = threading.Thread(target=self._take_when_in_front, daemon=True)
            self.watcher.start()

    def _take_if_in_front(self) -> bool | None:
        """Took the foreground (True), not in front yet (False), the terminal is gone (None)."""
        try:
            if os.tcgetpgrp(self.fd) != self.home:
                return False
            self.take()
            return True
        except OSError:
            return None

    def _take_when_in_front(self) -> None:
        while os.getpgrp() == self.home and self._take_if_in_front() is False:
            time.sleep(WATCH_SECONDS)


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):  # no other process left in it
        pass


def hold_foreground() -> Foreground | None:
    """When this process is the single trainer a launcher started in a terminal's foreground
    (`accelerate launch` of one process), take the foreground for it alone; None otherwise (no
    terminal, in the background, several processes: torchrun's agent handles Ctrl-C for those)."""
    if os.name != "posix" or not under_launcher() or "LOCAL_RANK" in os.environ:
        return None
    try:
        fd = os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY)
    except OSError:  # no controlling terminal: a job log, a pipe, a service
        return None
    try:
        home = os.getpgrp()
        if os.tcgetpgrp(fd) != home or os.getpgid(os.getppid()) != home or os.getsid(0) == os.getpid():
            os.close(fd)
            return None
        held = Foreground(fd, home, os.getpid())
        held.take()
    except OSError:
        os.close(fd)
        return None
    signal.signal(signal.SIGTSTP, held.stop_job)
    signal.signal(signal.SIGCONT, held.continued)
    atexit.register(held.give_back)
    return held
