"""`vramfit train`: one run, read top to bottom: launch, resume point, build, loop, finish.

The pieces live in their own modules: runtime.precision (which one runs), runtime.launch (the
process: Accelerate, threads), store.runfolder (where the run lives), train.build (building the
typed `Run`), store.resume (which checkpoint, and whether it may be used), batching (the
micro-batch rule), train.step (one optimizer step), train.validation (one evaluation), train.loop
(the epochs), train.summary (the figures a run is compared by), train.faults (debug injections).
"""

from __future__ import annotations

from ..config import Config
from ..runtime import launch, precision
from ..store.runfolder import RunPaths
from ..tuning import fit, size_plans
from . import build, summary


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
    from ..runtime.signals import SignalFlag
    from ..store.tracking import RunLog, tracker_names
    from .loop import Trainer

    build.preflight(cfg, L)  # settings the model or the launch cannot take, before any data loads

    with build.claimed(cfg, L, paths):  # --output writable, the run folder locked for this run
        # ---------------------------------------------------------------- resume decision
        # The settings are checked against the checkpoint before anything else, even for a run that
        # finished: a changed command never silently does nothing.
        start = build.find_start(cfg, L, paths)
        done = build.finished_summary(cfg, L, start, paths)
        if done is not None:
            return 0, done

        # ---------------------------------------------------------------- data, model, optimizer, step
        run = build.build(cfg, L, paths, start)
        run.size_plans = size_plans.plan_sizes(run)  # progressive resizing: a micro-batch per size
        run.fit_segments = size_plans.fit_segments(run, fit.min_segment_steps(cfg))
        run.fit = fit.choose(run)  # train.fit: fastest measures its candidates on the first batches
        run.notes += [n for n in (size_plans.size_note(run),) if n]
        build.write_run_folder(run)
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
