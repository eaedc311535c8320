"""The planner against every public fit / out-of-memory pair in bench/published_memory.csv.

Each row of the data is one training configuration someone ran on a known card (model, image size,
batch, precision, layout, optimizer), with its outcome: `ran` or `oom`; where the source gives one,
a measured peak. The trace gives each row's allocated peak exactly as the planner sees it; what
the trace cannot see is two named constants of `vramfit.planner.estimate`:

    predicted peak = segments(allocated x (1 + ALLOCATOR_OVERHEAD_FRACTION))
                     + CUDA_CONTEXT_BYTES + CUDA_WORKSPACE_BYTES

Only the sum of the context and the workspace shows in a fit / out-of-memory outcome, so the fit
is over (that sum, the fraction): at margin 0 no batch that ran may be predicted over its card;
among those choices, the one that predicts the most out-of-memory batches over theirs (ties: the
one whose misses are nearest their card, then the smaller fraction). The safety margin is then
the smallest (in 0.01 steps, at least MARGIN_FLOOR) for which the default pick stays below every
batch that ran out of memory.

    python bench/memory_check.py --published        # table with the planner's constants (CPU, minutes)
    python bench/memory_check.py --published --fit  # + the fit and the margin it implies
    python bench/memory_check.py --published --fit --with bench_out/memory_check.json   # + a card's own rows
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vramfit import planner as P
from vramfit.config import Config

DATA = Path(__file__).resolve().parent / "published_memory.csv"
GiB, MiB = 2**30, 2**20
CLASSES = 1000  # every published row trains an ImageNet head
# The margin also covers what no public row shows (a display on the card, a driver's own use): it
# is never set below this.
MARGIN_FLOOR = 0.05
# The grid the fit searches: the context + workspace sum, and the allocator fraction.
SUM_GRID = [i * 16 * MiB for i in range(0, 161)]  # 0 .. 2.5 GiB
FRACTION_GRID = [i / 200 for i in range(0, 81)]  # 0 .. 0.40


@dataclass
class Row:
    source: str
    card: str
    card_gb: float
    torch: str
    precision: str  # fp32 | fp16 | bf16
    layout: str  # nchw | nhwc
    optimizer: str
    model: str
    image_size: int
    batch: int
    outcome: str  # ran | oom
    measured_peak_gib: float | None
    notes: str
    total_bytes: int | None = None  # the card's reported total where known exactly (a measured card)

    @property
    def total(self) -> int:
        return self.total_bytes or P.reported_total_bytes(self.card_gb)

    def config(self) -> Config:
        return Config.model_validate({
            "model": {"name": self.model, "channels_last": self.layout == "nhwc"},
            "data": {"image_size": self.image_size},
            "train": {"global_batch": self.batch, "micro_batch": self.batch,
                      "precision": {"fp32": "no"}.get(self.precision, self.precision),
                      "label_smoothing": 0.0, "clip_grad_norm": None},
            "optim": {"name": self.optimizer},
        })


def load(path: Path = DATA) -> list[Row]:
    with path.open(newline="") as f:
        rows = []
        for r in csv.DictReader(f):
            rows.append(Row(
                source=r["source"], card=r["card"], card_gb=float(r["card_gb"]), torch=r["torch"],
                precision=r["precision"], layout=r["layout"], optimizer=r["optimizer"], model=r["model"],
                image_size=int(r["image_size"]), batch=int(r["batch"]), outcome=r["outcome"],
                measured_peak_gib=float(r["measured_peak_gib"]) if r["measured_peak_gib"] else None,
                notes=r["notes"]))
    return rows


def measured_rows(path: Path) -> list[Row]:
    """The rows a `bench/memory_check.py` run on a card adds (its $OUT/memory_check.json): every
    measured step without checkpointing (ran, with its measured peak, on the whole card) and every
    probe of the pick check (ran or out of memory, under the capped card)."""
    import json

    data = json.loads(Path(path).read_text())
    info = data["summary"]
    torch_version = ".".join(str(info["torch"]).split(".")[:2])
    device, total, cap = info["device"], info.get("device_total_bytes"), info.get("cap_bytes")
    precision = {"no": "fp32"}

    def row(model, prec, batch, outcome, card, card_total, peak=None, notes=""):
        return Row(f"memory_check.json ({path})", card, card_total / GiB, torch_version,
                   precision.get(prec, prec), "nchw", "adamw", model, 224, batch, outcome,
                   peak / GiB if peak else None, notes, total_bytes=card_total)

    rows = [row(r["model"], r["precision"], r["micro_batch"], "ran", device, total, r["measured_peak"],
                "measured step; no checkpointing")
            for r in data.get("rows", []) if total and not r["grad_checkpointing"]]
    for r in data.get("picks", []) if cap else []:
        for batch, ok in r.get("outcomes", {}).items():
            rows.append(row(r["model"], r["precision"], int(batch), "ran" if ok else "oom",
                            f"{device} capped at {cap / GiB:g} GiB", cap, notes="pick-check probe"))
    return rows


def allocated(row: Row) -> int:
    """The trace's allocated peak of one step of this row (no constants in it)."""
    return P.estimate(row.config(), CLASSES, row.batch, per_process_batch=row.batch).allocated_bytes


@dataclass
class Constants:
    fixed: int  # context + workspace
    fraction: float  # allocator overhead

    def peak(self, alloc: int) -> int:
        """The planner's peak for an allocated peak, with these constants."""
        return P.allocator_reserve(alloc, self.fraction) + self.fixed


@dataclass
class Score:
    constants: Constants
    ran_over: int  # batches that ran, predicted over their card (must be 0)
    oom_caught: int  # out-of-memory batches predicted over their card
    oom_total: int

    @property
    def oom_share(self) -> float:
        return self.oom_caught / self.oom_total if self.oom_total else 1.0


def score(rows: list[Row], allocs: list[int], c: Constants) -> Score:
    over = [c.peak(a) > r.total for r, a in zip(rows, allocs)]
    return Score(c, sum(o for o, r in zip(over, rows) if r.outcome == "ran"),
                 sum(o for o, r in zip(over, rows) if r.outcome == "oom"), sum(r.outcome == "oom" for r in rows))


def fit(rows: list[Row], allocs: list[int]) -> Score:
    """(context + workspace, allocator fraction) with no batch that ran predicted over its card and
    the most out-of-memory batches predicted over theirs; among equal counts the fraction nearest
    the measured peaks, then the smaller one (module docstring). For each fraction the sum is as
    large as the tightest batch that ran allows: a larger one only predicts more."""
    total = np.array([r.total for r in rows], dtype=np.float64)
    ran = np.array([r.outcome == "ran" for r in rows])
    measured = np.array([(r.measured_peak_gib or 0) * GiB for r in rows])
    best = None
    for fraction in FRACTION_GRID:
        body = np.array([P.allocator_reserve(a, fraction) for a in allocs], dtype=np.float64)
        fixed = float(np.floor((total - body)[ran].min() / MiB) * MiB) if ran.any() else 0.0
        if fixed < 0:
            continue  # some batch that ran does not fit even without a context
        pred = body + fixed
        err = np.abs(pred[measured > 0] / measured[measured > 0] - 1)
        key = (int(((pred > total) & ~ran).sum()), -float(np.median(err)) if len(err) else 0.0, -fraction)
        if best is None or key > best[0]:
            best = (key, Constants(int(fixed), fraction))
    if best is None:
        raise SystemExit("no constants keep every batch that ran within its card: see the residuals")
    return score(rows, allocs, best[1])


def margin_for(rows: list[Row], allocs: list[int], c: Constants) -> float:
    """The smallest margin (0.01 steps, >= MARGIN_FLOOR) whose budget every out-of-memory batch's
    predicted peak exceeds: the default pick is then below each of them."""
    need = max((1 - c.peak(a) / r.total for r, a in zip(rows, allocs) if r.outcome == "oom"), default=0.0)
    return max(MARGIN_FLOOR, math.ceil(need * 100 - 1e-9) / 100)


def verdict(row: Row, predicted: int, margin: float) -> str:
    if row.outcome == "ran":
        return "ok" if predicted <= row.total else "RAN, predicted over"
    if predicted > row.total:
        return "ok"
    return "ok (margin)" if predicted > row.total * (1 - margin) else "OOM under the default pick"


def table(rows: list[Row], allocs: list[int], c: Constants, margin: float) -> str:
    lines = ["| model | px | card | torch | precision | layout | optimizer | batch | outcome | predicted GiB | "
             "card GiB | predicted / card - 1 | verdict |", "|---|---:|---|---|---|---|---|---:|---|---:|---:|---:|---|"]
    for r, a in zip(rows, allocs):
        pred = c.peak(a)
        lines.append(f"| {r.model} | {r.image_size} | {r.card} | {r.torch} | {r.precision} | {r.layout} | "
                     f"{r.optimizer} | {r.batch} | {r.outcome} | {pred / GiB:.2f} | {r.total / GiB:.2f} | "
                     f"{pred / r.total - 1:+.1%} | {verdict(r, pred, margin)} |")
    return "\n".join(lines)


def summary(rows: list[Row], allocs: list[int], c: Constants, margin: float) -> dict:
    s = score(rows, allocs, c)
    preds = [c.peak(a) for r, a in zip(rows, allocs)]
    residuals = sorted(abs(p / r.total - 1) for r, p in zip(rows, preds))
    measured = sorted(abs(p / (r.measured_peak_gib * GiB) - 1) for r, p in zip(rows, preds) if r.measured_peak_gib)
    under = sum(verdict(r, p, margin) == "OOM under the default pick" for r, p in zip(rows, preds))
    return {"rows": len(rows), "ran": len(rows) - s.oom_total, "oom": s.oom_total,
            "ran_predicted_over": s.ran_over, "oom_predicted_over": s.oom_caught,
            "oom_share": round(s.oom_share, 3), "oom_under_default_pick": under,
            "median_abs_residual": round(residuals[len(residuals) // 2], 4),
            "worst_abs_residual": round(residuals[-1], 4),
            "measured_rows": len(measured),
            "median_abs_measured_error": round(measured[len(measured) // 2], 4) if measured else None,
            "worst_abs_measured_error": round(measured[-1], 4) if measured else None,
            "fixed_bytes": c.fixed, "fraction": c.fraction, "margin": margin}


def planner_constants() -> Constants:
    """The planner's own values."""
    return Constants(P.CUDA_CONTEXT_BYTES + P.CUDA_WORKSPACE_BYTES, P.ALLOCATOR_OVERHEAD_FRACTION)


def report(fit_constants: bool = False, path: Path = DATA, measured: list[Path] = ()) -> tuple[str, dict]:
    """The markdown the bench prints: the planner's constants (or fitted ones) against every row
    (+ the rows of each `measured` memory_check.json)."""
    rows = load(path) + [r for m in measured for r in measured_rows(m)]
    allocs = [allocated(r) for r in rows]
    c, margin = planner_constants(), Config().hardware.safety_margin
    head = [f"planner: context + workspace {c.fixed / MiB:.0f} MiB, "
            f"allocator {c.fraction:.3f}, margin {margin:g}"]
    if fit_constants:
        c = fit(rows, allocs).constants
        margin = margin_for(rows, allocs, c)
        head.append(f"fitted: context + workspace {c.fixed / MiB:.0f} MiB, allocator {c.fraction:.3f}; the margin "
                    f"that keeps the default pick below every OOM batch: {margin:g}")
    info = summary(rows, allocs, c, margin)
    head.append(f"{info['rows']} rows: {info['ran']} ran, {info['oom']} out of memory. At margin 0: "
                f"{info['ran_predicted_over']} that ran predicted over the card, {info['oom_predicted_over']} "
                f"of {info['oom']} OOM predicted over ({info['oom_share']:.0%}); at margin {margin:g}: "
                f"{info['oom_under_default_pick']} OOM batches at or under the default pick. |predicted / card - 1|: "
                f"median {info['median_abs_residual']:.1%}, worst {info['worst_abs_residual']:.1%}"
                + (f"; against measured peaks ({info['measured_rows']} rows): median "
                   f"{info['median_abs_measured_error']:.1%}, worst {info['worst_abs_measured_error']:.1%}"
                   if info["measured_rows"] else "; no row states a measured peak"))
    return "\n".join(head) + "\n\n" + table(rows, allocs, c, margin), info
