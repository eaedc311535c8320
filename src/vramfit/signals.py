"""Stop signals: the handler only records the signal; the run agrees and saves at a safe point."""

from __future__ import annotations

import signal

from .collectives import STOP_SIGNALS


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
        self.signum = signum

    def raise_flag(self, signum: int = signal.SIGTERM) -> None:
        """As if `signum` had arrived (keeps the first one)."""
        self.signum = self.signum or int(signum)

    def restore(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old = {}
