"""`vramfit train`: one run, read top to bottom: launch, resume point, build, loop, finish.

The pieces live in their own modules: precision (which one runs), launch (the process: Accelerate,
threads), runfolder (where the run lives), setup (building the typed `Run`), resume (which
checkpoint, and whether it may be used), batching (the micro-batch rule), engine (one optimizer
step), validation (one evaluation), loop (the epochs), summary (the figures a run is compared by),
faults (debug injections).
"""

from __future__ import annotations

from . import fit, launch, precision, setup, sizeplan, summary
from .config import Config
from .runfolder import RunPaths


def train(cfg: Config) -> dict:
    """Train `cfg` to its last epoch (or resume it); exits 128 + the signal when one stopped it."""
    # ---------------------------------------------------------------- launch
    runs_in = precision.here(cfg)
    paths = RunPaths.of(cfg, runs_in.name)
    L = launch.start(cfg, paths.dir, runs_in)
    signum, result = _launched(cfg, L, paths)
    if signum:
        raise SystemExit(128 + int(signum))
    return result


def _launched(cfg: Config, L: launch.Launch, paths: RunPaths) -> tuple[int, dict]:
    from .loop import Trainer
    from .signals import SignalFlag
    from .tracking import RunLog, tracker_names

    setup.preflight(cfg, L)  # settings the model or the launch cannot take, before any data loads

    with setup.claimed(cfg, L, paths):  # --output writable, the run folder locked for this run
        # ---------------------------------------------------------------- resume decision
        # The settings are checked against the checkpoint before anything else, even for a run that
        # finished: a changed command never silently does nothing.
        start = setup.find_start(cfg, L, paths)
        done = setup.finished_summary(cfg, L, start, paths)
        if done is not None:
            return 0, done

        # ---------------------------------------------------------------- data, model, optimizer, step
        run = setup.build(cfg, L, paths, start)
        run.size_plans = sizeplan.plan_sizes(run)  # progressive resizing: a micro-batch per size
        run.fit_segments = sizeplan.fit_segments(run, fit.min_segment_steps(cfg))
        run.fit = fit.choose(run)  # train.fit: fastest measures its candidates on the first batches
        run.notes += [n for n in (sizeplan.size_note(run),) if n]
        setup.write_run_folder(run)
        runlog = RunLog(L.acc, paths.dir, use_trackers=bool(tracker_names(cfg.tracking.tracker)),
                        resumed_step=start.point.state.global_step if start.point else None)
        summary.say_start(run)

        # ---------------------------------------------------------------- loop
        flag = SignalFlag().install()
        trainer = Trainer(run, runlog, flag)
        try:
            signum = trainer.fit()

            # ------------------------------------------------------------ finish
            # Still under the flag: a second stop signal while the summary is written (a terminal's
            # second Ctrl-C, a parent-death signal again) is only recorded, not the end of the process.
            result = summary.build(run, trainer.clock)
            summary.finish(result, run, signum)
            runlog.summary(result)
            if runlog.use_trackers:
                L.acc.end_training()
        finally:
            flag.restore()
    return signum, result
