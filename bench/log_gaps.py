"""The longest silence of a command whose output goes to a job log: run it with stdout and stderr
into one pipe (not a terminal, so nothing is line-buffered for it), stamp each line as it arrives
(time.monotonic) and report the longest gap between lines, and the lines around it.

    python bench/log_gaps.py [--log FILE] [--max-gap S] -- vramfit train --recipe quickstart

Exit 1 when `--max-gap` is given and exceeded (the command's own failure exits with its code).
What a person tailing the log sees is what the pipe carries, so a line held in a buffer counts as
silence here, as it does for them.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass, field


@dataclass
class Gaps:
    lines: list[tuple[float, str]] = field(default_factory=list)  # (seconds since start, line)
    returncode: int | None = None

    def longest(self) -> tuple[float, int]:
        """The longest gap in seconds (from the start to the first line too) and the index of
        the line that ended it."""
        stamps = [0.0] + [t for t, _ in self.lines]
        gaps = [(b - a, i) for i, (a, b) in enumerate(zip(stamps, stamps[1:]))]
        return max(gaps, default=(0.0, -1))


def watch(command: list[str], log_path: str | None = None) -> Gaps:
    """Run `command` with its output piped, each line stamped on arrival."""
    out = Gaps()
    t0 = time.monotonic()
    log = open(log_path, "w", encoding="utf-8") if log_path else None
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as proc:
        for raw in proc.stdout:  # one line at a time, as the pipe delivers it
            t = time.monotonic() - t0
            line = raw.decode("utf-8", "replace").rstrip("\n")
            out.lines.append((t, line))
            if log:
                log.write(f"{t:8.2f}  {line}\n")
                log.flush()
        out.returncode = proc.wait()
    if log:
        log.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--log", help="write the stamped lines here")
    p.add_argument("--max-gap", type=float, help="exit 1 when the longest gap is longer (seconds)")
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    gaps = watch(command, args.log)
    gap, i = gaps.longest()
    wall = gaps.lines[-1][0] if gaps.lines else 0.0
    print(f"{len(gaps.lines)} lines in {wall:.1f} s; longest gap {gap:.1f} s", file=sys.stderr)
    if i >= 0:
        before = gaps.lines[i - 1][1] if i > 0 else "(start)"
        print(f"  after:  {before[:160]}\n  before: {gaps.lines[i][1][:160]}", file=sys.stderr)
    if gaps.returncode:
        return gaps.returncode
    return 1 if args.max_gap is not None and gap > args.max_gap else 0


if __name__ == "__main__":
    raise SystemExit(main())
