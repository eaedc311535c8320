"""`vramfit train ARGS...` with fp16 standing in as the faster precision: each fp16 candidate's
measured images per second (the real measurement, its forward autocast to fp16) counted ten times.
Run under torchrun by tests/test_fit.py (the precision's relaunch in two processes); with
`--no-probe`, a probe fails the run instead (a resume must not measure)."""
import sys

from vramfit import fit
from vramfit.cli import main

measured = fit.measure


def fp16_faster(run, settings, batches):
    ips = measured(run, settings, batches)
    return ips * 10 if ips and settings.precision == "fp16" else ips


def no_probe(*_):
    raise AssertionError("a resume probed again")


args = sys.argv[1:]
fit.measure = no_probe if args[:1] == ["--no-probe"] else fp16_faster
main(["train", *(a for a in args if a != "--no-probe")])
