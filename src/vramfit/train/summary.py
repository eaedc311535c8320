"""summary.json and the closing line: the figures a finished (or stopped) run is compared by."""

from __future__ import annotations

import logging
import math

import torch

log = logging.getLogger("vramfit")


def build(run, clock) -> dict:
    """summary.json of a `train.build.Run` as it stands (finished or stopped), timed by `loop.Clock`."""
    from ..batching import grad_accum_steps

    L, state, step_state, class_names = run.launch, run.state, run.step.state, run.splits.class_names
    now = torch.cuda.max_memory_reserved(L.acc.device) if L.device_type == "cuda" else None
    peak = max([now, *run.phase_peaks.values()]) if now is not None else None
    summary = {
        "run_name": run.paths.name, "best_accuracy": state.best_accuracy, "final_accuracy": state.final_accuracy,
        "epochs": state.epoch, "global_step": state.global_step, "global_batch": run.cfg.train.global_batch,
        "micro_batch": step_state.micro_batch,
        "grad_accum_steps": grad_accum_steps(run.micro.per_process_batch, step_state.micro_batch),
        "num_processes": L.world, "precision": L.precision.name,
        "images_per_second": clock.images_per_second,
        "peak_memory_bytes": peak,
        # The planner's figure for the same quantity (allocator reserve, no CUDA context), the
        # largest over phases (each phase's is in `phases`): the two side by side show how good
        # the plan was.
        "predicted_peak_memory_bytes": run.planned_reserved_bytes,
        # Train images replaced (every occurrence), and validation images the last evaluation left out.
        "skipped_samples": state.skipped_samples, "val_skipped_samples": len(state.val_unreadable),
        "skipped_steps": state.skipped_steps,
        "oom_retries": step_state.oom_retries, "micro_batch_changes": step_state.history,
        "resume_changes": state.resume_changes,  # settings a resume was allowed to change, from their step
        "wall_seconds": clock.wall_seconds, "finished": state.finished,
        "unreadable_files": sorted(state.bad_files), "val_unreadable_files": state.val_unreadable,
        "num_classes": len(class_names), "class_names": class_names, "empty_classes": run.splits.empty_classes,
        "phases": phases(run, now),
        "fit": run.fit.as_dict() if run.fit is not None else None,
    }
    # Every reader of summary.json expects JSON: no NaN or infinity, ever.
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in summary.items()}


def phases(run, now: int | None = None) -> list[dict]:
    """What trained when: one entry per phase (phases.Phase) and, with progressive resizing, per
    image size within it (data.progressive.segments), with its plan and, on a GPU, its measured peak
    (max_memory_reserved, as `predicted_reserved_bytes` plans it: no CUDA context); None for one
    this launch did not run (it ran before a resume, or is still to come)."""
    from ..data.progressive import segments

    spe, step = run.steps_per_epoch, run.state.global_step
    parts = segments(run.phases, run.sizes, spe)
    standing = next((i for i, (_, sp) in enumerate(parts) if sp.first_step <= step < sp.end_step), len(parts) - 1)
    out = []
    for i, (p, span) in enumerate(parts):
        full = span.image_size == run.cfg.data.image_size
        plan = run.phase_plan(p, None if full else span.image_size)
        epochs = span.steps / spe
        out.append({"name": p.name, "first_epoch": span.first_step // spe + 1,
                    "epochs": int(epochs) if epochs.is_integer() else round(epochs, 3),
                    "image_size": span.image_size, "first_step": span.first_step + 1, "steps": span.steps,
                    "trainable_params": plan.trainable_params, "micro_batch": plan.micro.size,
                    "predicted_peak_bytes": plan.predicted_peak_bytes,
                    "predicted_at_size": plan.predicted_at_size or span.image_size,
                    "predicted_reserved_bytes": plan.reserved_bytes,
                    "measured_peak_bytes": run.phase_peaks.get((p.name, span.image_size),
                                                                now if i == standing else None),
                    **({"note": p.note} if p.note else {})})
    return out


def say_start(run) -> None:
    """The start lines of a `train.build.Run`: what it trains on, the notes, the batch split, the
    resume point."""
    from ..batching import grad_accum_steps

    L, splits, loaders, point = run.launch, run.splits, run.loaders, run.start.point
    if not L.main:
        return
    micro = run.step.state.micro_batch  # the first step's (a fit's choice, or at a resized run's first size)
    notes = [*splits.notes, *L.notes, *run.start.notes, *run.notes, *run.plan.notes]
    log.info("vramfit: %s | %s | %d classes, %d train / %d val images%s", run.paths.name, splits.description,
             len(splits.class_names), len(splits.train), len(splits.val), "".join(f"\n  note: {n}" for n in notes))
    log.info("batch: global %d = micro %d x accum %d x %d process(es) | precision %s | device %s | "
             "%d steps/epoch, %d loader workers (%s)", run.cfg.train.global_batch, micro,
             grad_accum_steps(run.micro.per_process_batch, micro), L.world, L.precision.name, L.acc.device, run.steps_per_epoch,
             loaders.workers, loaders.workers_why)
    planned = planned_line(run)
    if planned:
        log.info("%s", planned)
    if run.fit is not None and run.fit.mode == "fastest":
        from ..tuning.fit import table
        from ..tuning.size_plans import segment_start

        start = segment_start(run, run.plan.phase, run.sizes.size_at(run.state.global_step))
        log.info("%s", table(run.fit.of(run.plan.phase, start) or run.fit, named=len(run.phases) > 1,
                             sized=run.sizes.on))
    if point:
        st = point.state
        log.info("Resumed from %s: epoch %d/%d continues after its step %d/%d (global step %d)", point.path,
                 st.epoch_number, run.cfg.train.epochs, st.step_in_epoch, run.steps_per_epoch, st.global_step)


def planned_line(run) -> str | None:
    """The planned peak at start: the one figure summary.json, compare and the model card show
    (`Training.planned_reserved_bytes`), with each phase's when there are several."""
    from ..planner import bytes_text

    peak = run.planned_reserved_bytes
    if not peak:
        return None
    plans = [*run.plans, *run.size_plans.values()]
    each = ", ".join(f"{p.phase} {bytes_text(p.reserved_bytes)}" for p in run.plans if p.reserved_bytes)
    card = max((p.predicted_peak_bytes or 0 for p in plans), default=0)
    return (f"memory: planned peak {bytes_text(peak)} reserved by PyTorch"
            + (f" (the largest over phases: {each})" if len(run.plans) > 1 else "")
            + (f"; {bytes_text(card)} on the card with the CUDA context (the predicted peak)"
               if card else ""))


def finish(result: dict, run, signum: int) -> None:
    """summary.json (every process agrees it was written), the trackers' summary, the last line."""
    from ..runtime.collectives import agreed
    from ..runtime.storage import write_json
    from ..store.tracking import scrub

    L, state, run_dir = run.launch, run.state, run.paths.dir
    with agreed("writing the summary", L.acc.device):
        if L.main:
            write_json(run.paths.summary, scrub(result), "the run's summary")
    if signum:
        if L.main:
            log.warning("Stopped by signal %d at global step %d; checkpoint saved. Re-run the same command "
                        "to resume.", signum, state.global_step)
        return
    if L.main:
        closing_line(result, state.best_step, run_dir)


def closing_line(summary: dict, best_step, run_dir) -> None:
    peak, predicted = summary["peak_memory_bytes"], summary["predicted_peak_memory_bytes"]
    ips = summary["images_per_second"]
    if peak and predicted:
        peak_text = f"{peak / 2**30:.2f} GiB reserved (planned {predicted / 2**30:.2f})"
    else:
        peak_text = f"{peak / 2**30:.2f} GiB reserved" if peak else "n/a (CPU)"
    best = summary["best_accuracy"]
    log.info("done in %.0f s: best val accuracy %s (step %s), %s img/s, device peak %s, %d skipped "
             "image(s) (%d unreadable in validation), %d OOM retr%s\n  run folder: %s (summary.json; best "
             "weights in model/)", summary["wall_seconds"], f"{best:.4f}" if best is not None else "n/a",
             best_step, f"{ips:.0f}" if ips else "n/a", peak_text, summary["skipped_samples"],
             summary["val_skipped_samples"], summary["oom_retries"],
             "y" if summary["oom_retries"] == 1 else "ies", run_dir)
