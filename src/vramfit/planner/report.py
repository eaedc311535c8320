"""`vramfit plan`: the plan as a dict (--json, plan.json) and as the text it prints."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from ..batching import MicroBatch, grad_accum_steps, per_process_batch, resolve_micro_batch
from ..config import Config
from ..runtime.collectives import BLOCK_BYTES
from ..runtime.precision import planned
from .advice import advise, config_with
from .estimate import (ALLOCATOR_OVERHEAD_FRACTION, CUDA_CONTEXT_BYTES, CUDA_WORKSPACE_BYTES, GiB,
                       budget_bytes_for, estimate_table, get_profile, pick_micro_batch,
                       reported_total_bytes)


def _gib(n: int | float) -> str:
    return f"{n / GiB:.2f}"


def _table_sizes(per_process: int, *also: int | None) -> list[int]:
    """Powers of two up to the share, the share itself, and the micro-batches the plan names."""
    sizes = {per_process, *(m for m in also if m)}
    p = 1
    while p <= per_process:
        sizes.add(p)
        p *= 2
    return sorted(sizes)


def _micro_batch(cfg: Config, num_classes: int, per_proc: int, num_processes: int, budget: int | None,
                 requested) -> tuple[MicroBatch, int | None]:
    """The micro-batch the run would use (batching's one rule) and the planner's pick for the card."""
    pick = None
    if budget is not None:
        pick = pick_micro_batch(cfg, num_classes, per_proc, budget, num_processes=num_processes)[0]
    sized = None if budget is None else (lambda _share: pick or 1)
    return resolve_micro_batch(requested, per_proc, pick=sized), pick


def _size_rows(cfg: Config, num_classes: int, mb: MicroBatch, budget: int | None, precision: str,
               num_processes: int, full_peak: int) -> list[dict]:
    """Progressive resizing: the micro-batch at every size the run may train at, by the rule a run
    follows (tuning.size_plans): the planner's pick at each size where the micro-batch is its to pick on a
    card, never below the full size's; otherwise the full size's micro-batch, whose peak bounds it."""
    from ..data.progressive import possible_sizes
    from .size_picks import planner_pick, planner_picks, size_picks

    sizes = possible_sizes(cfg)
    pick = (planner_pick(cfg, num_classes, mb, budget, precision, num_processes)
            if budget is not None and planner_picks(mb) else None)
    picks = size_picks(sizes, mb, full_peak, cfg.data.image_size, pick)
    return [{"image_size": s, "micro_batch": m, "predicted_peak_bytes": peak, "predicted_at_size": at}
            for s, (m, peak, at) in sorted(picks.items())]


def _size_lines(rows: list[dict]) -> list[str]:
    """The sizes in runs of one micro-batch, for the printed plan."""
    lines, runs = ["progressive resizing: micro-batch per image size (the global batch is the same at every size)"], []
    for row in rows:
        if runs and runs[-1][0]["micro_batch"] == row["micro_batch"]:
            runs[-1].append(row)
        else:
            runs.append([row])
    for group in runs:
        lo, hi = group[0]["image_size"], group[-1]["image_size"]
        px = f"{lo} px" if lo == hi else f"{lo}-{hi} px"
        peak = max((r["predicted_peak_bytes"] or 0) for r in group)
        lines.append(f"  {px:<12} micro-batch {group[0]['micro_batch']:>4}  predicted peak <= {_gib(peak)} GiB")
    return lines


def run_plan(cfg: Config, num_classes: int, num_processes: int = 1, memory_gib: float | None = None,
             micro_batch: int | None = None, as_json: bool = False, out=None,
             total_bytes: int | None = None) -> dict:
    """What `vramfit plan` prints (to `out`, default sys.stdout); returns the same content as a
    dict (--json and plan.json; its `text` key holds the printed text). `total_bytes`: plan for a
    detected card's reported total instead of a card size (`vramfit doctor`)."""
    t0 = time.perf_counter()
    per_proc = per_process_batch(cfg.train.global_batch, num_processes)
    prec = planned(cfg.train.precision).accelerate
    budget = budget_bytes_for(cfg, memory_gib, total_bytes)
    requested = micro_batch if micro_batch is not None else cfg.train.micro_batch
    mb, pick = _micro_batch(cfg, num_classes, per_proc, num_processes, budget, requested)
    table = estimate_table(cfg, num_classes, _table_sizes(per_proc, pick, mb.size),
                           num_processes=num_processes, per_process_batch=per_proc)
    est = next(e for e in table if e.micro_batch == mb.size)
    fits_chosen = None if budget is None else est.peak_bytes <= budget
    advice = []
    if budget is not None and not fits_chosen:
        asked = config_with(cfg, {"train.micro_batch": mb.size}) if requested != "auto" else cfg
        advice = advise(asked, num_classes, per_proc, budget, num_processes=num_processes)
    prof = get_profile(cfg, num_classes, prec)
    result: dict[str, Any] = {
        "model": cfg.model.name, "image_size": cfg.data.image_size, "num_classes": num_classes,
        "precision": prec, "requested_precision": cfg.train.precision, "optimizer": cfg.optim.name,
        "grad_checkpointing": cfg.model.grad_checkpointing, "channels_last": cfg.model.channels_last,
        "freeze": list(cfg.model.freeze), "num_params": prof.num_params, "num_trainable": prof.num_trainable,
        "all_grads_bytes": prof.trainable_bytes,
        "global_batch": cfg.train.global_batch, "num_processes": num_processes,
        "memory_gib": None if total_bytes is not None else (memory_gib or cfg.hardware.memory_gib),
        "card_total_bytes": total_bytes if total_bytes is not None else (
            None if budget is None else reported_total_bytes(memory_gib or cfg.hardware.memory_gib)),
        "safety_margin": cfg.hardware.safety_margin, "budget_bytes": budget,
        **mb.as_dict(),
        "fits": fits_chosen, "pick": pick, "predicted_peak_bytes": est.peak_bytes,
        "estimate": est.as_dict(),
        "table": [{"micro_batch": e.micro_batch, "grad_accum_steps": grad_accum_steps(per_proc, e.micro_batch),
                   "peak_bytes": e.peak_bytes, "peak_gib": round(e.peak_bytes / GiB, 2),
                   "fits": None if budget is None else e.peak_bytes <= budget} for e in table],
        "advice": advice,
        "constants": {"cuda_context_bytes": CUDA_CONTEXT_BYTES, "cuda_workspace_bytes": CUDA_WORKSPACE_BYTES,
                      "allocator_overhead_fraction": ALLOCATOR_OVERHEAD_FRACTION, "block_bytes": BLOCK_BYTES},
        "method": "fake-tensor trace of one step, linear in micro-batch" if prof.linear
                  else "fake-tensor trace of one step per micro-batch",
    }
    if cfg.data.progressive_resize is not None:
        result["sizes"] = _size_rows(cfg, num_classes, mb, budget, prec, num_processes, est.peak_bytes)
    result["planner_seconds"] = round(time.perf_counter() - t0, 2)
    result["text"] = format_plan(result)
    out = out if out is not None else sys.stdout
    if as_json:
        out.write(json.dumps({k: v for k, v in result.items() if k != "text"}, indent=1) + "\n")
    else:
        out.write(result["text"] + "\n")
    return result


_LINES = [
    ("params_bytes", "parameters", "fp32 weights of every layer (+ BatchNorm statistics)"),
    ("grads_bytes", "gradients", "fp32, trainable parameters only"),
    ("optimizer_bytes", "optimizer state", None),
    ("activations_bytes", "activations", "saved by the forward for backward, + the input batch"),
    ("temporaries_bytes", "temporaries", "backward/step working memory alive at the peak"),
    ("allocator_overhead_bytes", "allocator", None),
    ("cuda_context_bytes", "CUDA context", "context + cuBLAS/cuDNN workspaces (constant)"),
]


def _set_arg(key: str, value: Any) -> str:
    """`key=value` as `--set` parses it (YAML), quoted for the shell where needed."""
    if isinstance(value, list):
        arg = f"{key}=[{','.join(str(v) for v in value)}]"
        return f"'{arg}'"
    if isinstance(value, bool):
        return f"{key}={str(value).lower()}"
    return f"{key}={value}"


def format_plan(r: dict) -> str:
    e = r["estimate"]
    prec = {"no": "fp32", "bf16": "bf16 autocast", "fp16": "fp16 autocast"}[r["precision"]]
    opt_note = ("AdamW: exp_avg + exp_avg_sq per trainable weight" if r["optimizer"] == "adamw"
                else "SGD: momentum buffer per trainable weight")
    extras = [x for x in (("grad checkpointing" if r["grad_checkpointing"] else ""),
                          ("channels_last" if r["channels_last"] else ""),
                          (f"frozen: {', '.join(r['freeze'])}" if r["freeze"] else "")) if x]
    lines = [
        f"vramfit plan: {r['model']} @ {r['image_size']}px, {prec}, {r['optimizer']}, {r['num_classes']} classes"
        + (f", {', '.join(extras)}" if extras else ""),
        f"  {r['num_params'] / 1e6:.1f} M parameters ({r['num_trainable'] / 1e6:.1f} M trainable); "
        f"per-process batch {r['per_process_batch']} = global {r['global_batch']} / {r['num_processes']} process(es)",
    ]
    if r["budget_bytes"] is not None:
        card = (f"{r['memory_gib']:g} GB card ({_gib(r['card_total_bytes'])} GiB as reported)"
                if r["memory_gib"] is not None else f"this card's {_gib(r['card_total_bytes'])} GiB")
        lines.append(f"  budget {_gib(r['budget_bytes'])} GiB = {card} x (1 - {r['safety_margin']:g} safety margin)")
    else:
        lines.append("  no memory budget (set hardware.memory_gib or --memory-gib to pick a micro-batch)")
    verdict = "" if r["fits"] is None else ("  fits" if r["fits"] else "  DOES NOT FIT")
    lines.append(f"micro-batch {r['micro_batch']} ({r['micro_batch_source']}) x {r['grad_accum_steps']} "
                 f"accumulation step(s): predicted peak {_gib(e['peak_bytes'])} GiB{verdict}")
    if r.get("micro_batch_note"):
        lines.append(f"  ({r['micro_batch_note']})")
    for key, label, note in _LINES:
        if key == "optimizer_bytes":
            note = opt_note
        if key == "grads_bytes" and r["num_processes"] > 1:
            note += "; + the gradient reducer's buckets (one more copy)"
        elif key == "grads_bytes" and e["grads_bytes"] < r["all_grads_bytes"]:
            note += f"; {_gib(r['all_grads_bytes'])} GiB once all exist (the peak comes before)"
        if key == "allocator_overhead_bytes":
            note = f"caching-allocator rounding/fragmentation ({ALLOCATOR_OVERHEAD_FRACTION:.0%} of allocated)"
        lines.append(f"  {label:<16}{_gib(e[key]):>7} GiB  {note}")
    lines.append(f"  {'peak':<16}{_gib(e['peak_bytes']):>7} GiB  what nvidia-smi would show "
                 f"(peak during {e['peak_phase']}; allocated {_gib(e['allocated_bytes'])} GiB)")
    lines.append("micro-batch x accumulation -> predicted peak")
    for row in r["table"]:
        fit = "" if row["fits"] is None else ("  fits" if row["fits"] else "  too big")
        star = " <" if row["micro_batch"] == r["micro_batch"] else ""
        lines.append(f"  {row['micro_batch']:>6} x {row['grad_accum_steps']:<4} {row['peak_gib']:>7.2f} GiB{fit}{star}")
    if r["budget_bytes"] is not None:
        if r["pick"] is None:
            lines.append("pick: none -- even micro-batch 1 does not fit")
        else:
            steps = next(row["grad_accum_steps"] for row in r["table"] if row["micro_batch"] == r["pick"])
            lines.append(f"pick: micro-batch {r['pick']} ({steps} accumulation step(s)), the largest that fits")
    if r["advice"]:
        lines.append("to make it fit (cheapest first):")
        for a in r["advice"]:
            sets = " ".join(f"--set {_set_arg(k, v)}" for k, v in a["set"].items())
            lines.append(f"  {a['change']:<44} micro-batch {a['micro_batch']:>4}  peak {a['peak_gib']:.2f} GiB"
                         f"  ({a['why']})\n      {sets}")
    elif r["fits"] is False:
        lines.append("no single change found that fits; try a smaller data.image_size")
    if r.get("sizes"):
        lines += _size_lines(r["sizes"])
    return "\n".join(lines)
