"""`vramfit train`: one run, read top to bottom: launch, resume point, build, loop, finish.

The pieces live in their own modules: precision (which one runs), launch (the process: Accelerate,
threads), runfolder (where the run lives), setup (building the typed `Run`), resume (which
checkpoint, and whether it may be used), batching (the micro-batch rule), engine (one optimizer
step), validation (one evaluation), loop (the epochs), summary (the figures a run is compared by),
faults (debug injections).
"""

from __future__ import annotations

from . import fit, launch, precision, resume, setup, sizeplan, summary
from .config import Config
from .runfolder import RunPaths, discard_if_unused


def train(cfg: Config) -> dict:
    """Train `cfg` to its last epoch (or resume it); exits 128 + the signal when one stopped it."""
    signum, result = _train(cfg)
    if signum:
        raise SystemExit(128 + int(signum))
    return result


# The first launch, and one in the precision `train.fit: fastest` chose there, which takes that
# choice as given: a third would be a fault of vramfit's.
MAX_LAUNCHES = 2


def _train(cfg: Config) -> tuple[int, dict]:
    """Launch and train. Where the fit chose another precision than the launch's (`auto`), the run
    starts again in it, before anything of it is written, with that choice (fit.Relaunch)."""
    chosen, given = continued_precision(cfg), None
    for _ in range(MAX_LAUNCHES):
        # ------------------------------------------------------------ launch
        runs_in = precision.here(cfg, chosen)
        paths = RunPaths.of(cfg, runs_in.name)
        L = launch.start(cfg, paths.dir, runs_in)
        try:
            return _launched(cfg, L, paths, given)
        except fit.Relaunch as again:
            chosen, given = again.precision, again.result
        _abandon(L, paths)
    raise RuntimeError(f"train.fit: fastest chose the precision {chosen} after {MAX_LAUNCHES} launches in others")


def continued_precision(cfg: Config) -> str | None:
    """Under `train.precision: auto` measured by the fit: the precision of the checkpoint the run
    continues (in whichever of its run folders holds it), so that a resume starts in it."""
    choices = precision.fit_choices(cfg) if cfg.train.fit == "fastest" else ()
    folders = {p: RunPaths.of(cfg, precision.NAMES[p]).checkpoints for p in choices}
    return resume.continued_precision(cfg, folders) if folders else None


def _abandon(L: launch.Launch, paths: RunPaths) -> None:
    """Before a relaunch: the launch's folder goes if nothing was written into it; its model,
    optimizer and Accelerator state are let go, and the device memory they held with them (Accelerate's
    free_memory: its references, then the garbage collector and the allocator's cache)."""
    if L.main:
        discard_if_unused(paths)
    L.acc.free_memory()
    launch.forget()


def _launched(cfg: Config, L: launch.Launch, paths: RunPaths, given: fit.FitResult | None) -> tuple[int, dict]:
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
        run.fit = fit.choose(run, given)  # train.fit: fastest measures its candidates on the first batches
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
