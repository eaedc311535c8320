"""`vramfit plan --model A,B,C`: backbones side by side by what they cost in memory on one card.

"A lighter backbone" is a memory question, and names mislead: EfficientNet-B0 has a fifth of
ResNet50's parameters but saves about as many activations per image. One row per backbone, each
planned exactly as `vramfit plan --model NAME` would plan it (the backbone's own defaults apply):
parameters, forward GFLOPs per image, the activations the forward saves per image, the predicted
peak at the run's micro-batch, and the largest micro-batch that fits the card (whole, no
accumulation).
"""

from __future__ import annotations

import io
import json
import sys
from typing import Any

from ..config import Config
from ..errors import VramfitError
from ..runtime.precision import planned
from .estimate import GiB, TRACE_BATCHES, budget_bytes_for, estimate, get_profile
from .report import run_plan
from .tracing import ACT, INPUT

# The largest micro-batch searched for (a card larger than any sold today still stops here).
LARGEST_SEARCHED = 8192


def largest_whole_batch(cfg: Config, num_classes: int, budget: int, num_processes: int = 1) -> int:
    """Largest micro-batch whose step, run whole (no accumulation), fits `budget`; 0 if none.
    Peaks grow with the batch (every allocation is a + b * batch, b >= 0), so bisection holds."""
    def fits(m: int) -> bool:
        return estimate(cfg, num_classes, m, num_processes=num_processes,
                        per_process_batch=m).peak_bytes <= budget

    lo, hi = 0, LARGEST_SEARCHED
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def activation_bytes_per_image(cfg: Config, num_classes: int) -> int:
    """What the forward saves for backward per image (+ the input image): the slope between the
    two traced micro-batches of the bytes alive when the forward is done."""
    prof = get_profile(cfg, num_classes, planned(cfg.train.precision).accelerate)
    b1, b2 = TRACE_BATCHES
    at1, at2 = prof.live_at_end_of_forward(b1), prof.live_at_end_of_forward(b2)
    return int((at2[ACT] + at2[INPUT] - at1[ACT] - at1[INPUT]) // (b2 - b1))


def backbone_row(cfg: Config, num_classes: int, num_processes: int, memory_gib: float | None) -> dict[str, Any]:
    """One backbone's row: `run_plan`'s answer for it, plus its cost per image and its largest batch."""
    plan = run_plan(cfg, num_classes, num_processes=num_processes, memory_gib=memory_gib,
                    micro_batch=cfg.train.micro_batch if isinstance(cfg.train.micro_batch, int) else None,
                    out=io.StringIO())
    prof = get_profile(cfg, num_classes, plan["precision"])
    budget = budget_bytes_for(cfg, memory_gib)
    largest = None if budget is None else largest_whole_batch(cfg, num_classes, budget, num_processes)
    return {
        "model": cfg.model.name, "image_size": cfg.data.image_size, "precision": plan["precision"],
        "num_params": plan["num_params"], "gflops_per_image": round(prof.tracer.forward_flops() / 1e9, 3),
        "activation_bytes_per_image": activation_bytes_per_image(cfg, num_classes),
        "micro_batch": plan["micro_batch"], "grad_accum_steps": plan["grad_accum_steps"],
        "predicted_peak_bytes": plan["predicted_peak_bytes"], "fits": plan["fits"],
        "largest_micro_batch": largest,
        "largest_peak_bytes": (estimate(cfg, num_classes, largest, num_processes=num_processes,
                                        per_process_batch=largest).peak_bytes if largest else None),
    }


def format_lineup(rows: list[dict], budget: int, card: str) -> str:
    head = f"vramfit plan: {len(rows)} backbones on {card}, budget {budget / GiB:.2f} GiB"
    cols = f"{'model':<26}{'px':>5}{'params':>9}{'GFLOPs':>8}{'act/img':>10}{'micro':>7}{'peak':>9}{'largest':>9}{'its peak':>10}"
    lines = [head, cols, "-" * len(cols)]
    for r in rows:
        verdict = "" if r["fits"] is None else ("" if r["fits"] else " !")
        largest = "-" if r["largest_micro_batch"] is None else str(r["largest_micro_batch"])
        its = "-" if not r["largest_peak_bytes"] else f"{r['largest_peak_bytes'] / GiB:.2f}G"
        lines.append(f"{r['model']:<26}{r['image_size']:>5}{r['num_params'] / 1e6:>8.1f}M{r['gflops_per_image']:>8.2f}"
                     f"{r['activation_bytes_per_image'] / 2**20:>8.1f}Mi{r['micro_batch']:>7}"
                     f"{r['predicted_peak_bytes'] / GiB:>8.2f}G{verdict:<2}{largest:>7}{its:>10}")
    lines.append("act/img: activations the forward saves per image; peak: predicted at the run's micro-batch "
                 "(! = does not fit); largest: the largest micro-batch that fits whole (no accumulation)")
    return "\n".join(lines)


def run_lineup(cfgs: list[Config], num_classes: int, num_processes: int = 1, memory_gib: float | None = None,
               as_json: bool = False, out=None) -> list[dict]:
    """Plan every config (one per backbone) and print one row each (or --json: the same rows)."""
    if budget_bytes_for(cfgs[0], memory_gib) is None:
        # Without a card the lineup has no "largest that fits": the one question it is asked.
        models = ",".join(cfg.model.name for cfg in cfgs)
        raise VramfitError("vramfit plan --model A,B,C compares what fits on a card, and no card is named "
                           "(no --recipe for a card, no --memory-gib).",
                           hint=f"name the card: `vramfit plan --recipe rtx3060 --model {models}` (a 12 GB "
                                "RTX 3060; the recipe of each card is in docs/recipes.md), or "
                                f"`vramfit plan --memory-gib N --model {models}` for a card of N GB")
    rows = [backbone_row(cfg, num_classes, num_processes, memory_gib) for cfg in cfgs]
    budget = budget_bytes_for(cfgs[0], memory_gib)
    gib = memory_gib or cfgs[0].hardware.memory_gib
    card = f"a {gib:g} GB card"
    out = out if out is not None else sys.stdout
    if as_json:
        out.write(json.dumps({"budget_bytes": budget, "memory_gib": gib, "num_processes": num_processes,
                              "rows": rows}, indent=1) + "\n")
    else:
        out.write(format_lineup(rows, budget, card) + "\n")
    return rows
