"""`vramfit doctor` and `--recipe auto`: what this machine is, and which recipe fits it.

`doctor` reports the versions that decide what runs (python, torch, CUDA, cuDNN, driver,
accelerate, timm, datasets), each GPU (name, total and free memory, compute capability, bf16, TF32,
memory other processes hold), the host (CPU cores, RAM) and the shipped recipe that fits the first
card; given a recipe it plans it for this card, given data it checks that the images come out at
the recipe's size, and `--diff RUN_DIR` lists what differs from the machine a run came from. On a
machine without a GPU it says so and still answers what it can.

`--recipe auto` picks among the shipped single-card recipes by the card's memory (the largest
recipe whose card the detected one is at least as large as) and bf16 support, and says why.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

import yaml

from ..config import PACKAGE_RECIPES
from ..errors import VramfitError
from ..runtime.gpucheck import driver_too_old, driver_version, no_gpu_reason
from ..runtime.precision import resolve as resolve_precision

GiB = 2**30
# A card counts as a recipe's card when it reports at least this share of what that card reports
# (drivers and ECC settings move the reported total by a few tens of MiB).
SAME_CARD = 0.98


@dataclass(frozen=True)
class Card:
    """What decides the recipe and the plan: a detected GPU, or a stand-in for one in tests."""

    name: str
    total_bytes: int  # as PyTorch reports it (get_device_properties().total_memory)
    bf16: bool
    capability: tuple[int, int] = (0, 0)
    free_bytes: int | None = None
    others_bytes: int | None = None  # held by other processes (approximate)

    @property
    def tf32(self) -> bool:
        return self.capability >= (8, 0)


@dataclass(frozen=True)
class AutoRecipe:
    name: str
    sets: list[str]  # `--set` overrides for this card, weaker than the user's own
    why: str


def detect_cards(with_free: bool = False) -> list[Card]:
    """The CUDA devices this process sees. `with_free` also measures free memory, which creates a
    CUDA context on each card: only for `doctor`, never on the way into a run."""
    import torch

    if not torch.cuda.is_available():
        return []
    cards = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        free = others = None
        if with_free:
            from ..planner import CUDA_CONTEXT_BYTES

            free, total = torch.cuda.mem_get_info(i)
            others = max(0, total - free - CUDA_CONTEXT_BYTES)  # ours: the context just created
        cards.append(Card(p.name, p.total_memory, (p.major, p.minor) >= (8, 0), (p.major, p.minor),
                          free, others))
    return cards


def _single_card_recipes() -> list[tuple[float, str, str]]:
    """(card size as sold in GB, recipe name, precision) of the shipped one-GPU recipes."""
    out = []
    for path in sorted(PACKAGE_RECIPES.glob("*.yaml")):
        tree = yaml.safe_load(path.read_text()) or {}
        hw = tree.get("hardware") or {}
        if hw.get("memory_gib") and hw.get("gpus", 1) == 1:
            out.append((hw["memory_gib"], path.stem, (tree.get("train") or {}).get("precision", "auto")))
    return sorted(out)


def auto_recipe(card: Card | None) -> AutoRecipe:
    """The shipped recipe for this card: the largest whose card it matches in memory, with the
    precision the card has (bf16 on Ampere and newer, fp16 with loss scaling before)."""
    from ..planner import reported_total_bytes

    if card is None:
        quick = yaml.safe_load((PACKAGE_RECIPES / "quickstart.yaml").read_text()) or {}
        runs = resolve_precision((quick.get("train") or {}).get("precision", "auto"), "cpu").name
        return AutoRecipe("quickstart", [], f"no CUDA GPU here: the quickstart's settings ({runs} on the "
                                            "CPU, small images); `vramfit plan` still predicts GPU memory")
    recipes = _single_card_recipes()
    fitting = [r for r in recipes if card.total_bytes >= SAME_CARD * reported_total_bytes(r[0])]
    gib, name, precision = fitting[-1] if fitting else recipes[0]
    have = f"{card.name}: {card.total_bytes / GiB:.2f} GiB, {'bf16' if card.bf16 else 'no bf16'}"
    why = (f"{have}; the largest recipe for a card of at most its memory ({gib:g} GB)" if fitting else
           f"{have}; smaller than every recipe's card, so the smallest ({gib:g} GB) with `micro_batch: "
           f"auto` sized to this card")
    sets = []
    if precision == "bf16" and not card.bf16:
        sets, why = ["train.precision=fp16"], why + "; fp16 with loss scaling instead of the recipe's bf16"
    elif precision == "fp16" and card.bf16:
        sets, why = ["train.precision=bf16"], why + "; bf16 instead of the recipe's fp16 (no loss scaling)"
    return AutoRecipe(name, sets, why)


def resolve_auto(sets: list[str]) -> tuple[str, list[str]]:
    """`--recipe auto`: the recipe for this process's card, and the `--set` list with the card's
    overrides first (the user's own come after and win). Says which and why, once per machine."""
    cards = detect_cards()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    choice = auto_recipe(cards[local % len(cards)] if cards else None)
    if local == 0:
        print(f"vramfit: --recipe auto -> {choice.name} ({choice.why})", file=sys.stderr)
    return choice.name, [*choice.sets, *sets]


# ---------------------------------------------------------------------------------------------
# The report


def machine() -> dict:
    """Versions, host and devices, under the keys a run's env.json uses (so --diff compares them)."""
    import psutil

    from ..store.tracking import environment

    # environment() describes a run's Accelerator; here there is none, so a one-process stand-in.
    env = environment(SimpleNamespace(num_processes=1, distributed_type="NO", device="cpu"))
    for key in ("num_processes", "distributed_type", "device"):
        env.pop(key, None)
    mem = psutil.virtual_memory()
    env.update(driver=driver_version(), cpu_usable=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
               else os.cpu_count(), ram_total_bytes=mem.total, ram_available_bytes=mem.available)
    return env


def diff_run(run_dir: str, now: dict) -> list[dict]:
    """What differs between this machine and the one `run_dir` (its env.json) ran on."""
    from ..store.runfolder import RunPaths

    path = RunPaths.at(run_dir).env
    try:
        then = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise VramfitError(f"Cannot read {path}: {e}.", hint="pass a run folder (it holds env.json)") from None
    keys = [k for k in then if k in now and k not in ("ram_available_bytes",)]
    return [{"key": k, "run": then[k], "here": now[k]} for k in keys if then[k] != now[k]]


def check_data(cfg) -> dict:
    """A few training images through the recipe's train transform: they must come out at the
    recipe's image size (a resize that is never applied shows up here, not as an OOM later)."""
    import torch

    from ..data import ImageDataset, build_transforms, load_splits
    from ..models.create import create_model, data_config

    splits = load_splits(cfg.data)
    with torch.device("meta"):  # only the model's pretrained data config is needed
        model = create_model(cfg.model, len(splits.class_names), load_weights=False,
                             image_size=cfg.data.image_size)
    train_tf, _ = build_transforms(cfg.data, data_config(model, cfg.data.image_size, cfg.data.crop_pct))
    ds = ImageDataset(splits.train, splits.image_column, splits.label_column, train_tf, cfg.data.image_size,
                      cfg.train.seed, train=True)
    shapes = [list(ds[(i, 0, 1)].image.shape) for i in range(min(4, len(ds)))]
    want = [3, cfg.data.image_size, cfg.data.image_size]
    return {"source": cfg.data.source, "classes": len(splits.class_names), "train_images": len(splits.train),
            "val_images": len(splits.val), "sample_shapes": shapes, "expected_shape": want,
            "ok": bool(shapes) and all(s == want for s in shapes), "notes": list(splits.notes)}


def plan_here(cfg, cards: list[Card], num_classes: int) -> dict:
    """The recipe's plan for the first card here, or for the recipe's own card without one."""
    import io

    from ..planner import run_plan
    from ..tuning.probe import usable_total_bytes

    total = usable_total_bytes(cfg, cards[0].total_bytes) if cards else None
    plan = run_plan(cfg, num_classes, num_processes=1, total_bytes=total, out=io.StringIO())
    keep = ("model", "image_size", "precision", "global_batch", "micro_batch", "grad_accum_steps",
            "micro_batch_source", "predicted_peak_bytes", "budget_bytes", "fits", "pick")
    return {**{k: plan[k] for k in keep}, "for": "this card" if cards else "the recipe's card (no GPU here)",
            "recipe": cfg.recipe, "advice": [a["change"] for a in plan["advice"]]}


def precision_here(cfg, cards: list[Card]) -> dict:
    """What a run of `cfg` (None: the defaults) trains in on this machine: precision.resolve, the
    rule the run itself starts with, so doctor and the run's start line never differ."""
    from ..config import Config

    cfg = cfg if cfg is not None else Config()
    device = "cuda" if cards else "cpu"
    p = resolve_precision(cfg.train.precision, device, bf16_supported=cards[0].bf16 if cards else None,
                          fp16_on_cpu=cfg.debug.fp16_on_cpu)
    return {"requested": p.requested, "runs": p.name, "device": device, "note": p.note}


def doctor(cfg=None, with_data: bool = False, run_dir: str | None = None, as_json: bool = False,
           out=None) -> dict:
    """What `vramfit doctor` prints; returns it as a dict (`--json`)."""
    now = machine()
    cards = detect_cards(with_free=True)
    fit = auto_recipe(cards[0] if cards else None)
    rep: dict = {"machine": now, "gpus": [{**asdict(c), "tf32": c.tf32} for c in cards],
                 "recipe_that_fits": asdict(fit)}
    classes = None
    if with_data:
        rep["data"] = check_data(cfg)
        classes = rep["data"]["classes"]
    rep["precision"] = precision_here(cfg, cards)
    if cfg is not None:
        rep["plan"] = plan_here(cfg, cards, classes or (10 if cfg.data.source == "digits" else 1000))
    if run_dir:
        rep["diff"] = diff_run(run_dir, now)
    out = out if out is not None else sys.stdout
    out.write((json.dumps(rep, indent=1, default=str) if as_json else format_report(rep)) + "\n")
    return rep


def _gib(n) -> str:
    return "?" if n is None else f"{n / GiB:.2f} GiB"


def format_report(rep: dict) -> str:
    m = rep["machine"]
    lines = ["vramfit doctor",
             f"  python {m.get('python')}, torch {m.get('torch')} (CUDA {m.get('cuda')}, cuDNN {m.get('cudnn')}), "
             f"driver {m.get('driver') or 'none'}, accelerate {m.get('accelerate')}, timm {m.get('timm')}, "
             f"datasets {m.get('datasets')}",
             f"  host: {m.get('cpu_count')} CPU cores ({m.get('cpu_usable')} usable), RAM "
             f"{_gib(m.get('ram_total_bytes'))} ({_gib(m.get('ram_available_bytes'))} available)"]
    old = driver_too_old(m.get("driver"), m.get("cuda"))
    if old:
        lines.append(f"driver: {old}: update it, or install a torch built for an older CUDA")
    if not rep["gpus"]:
        why = no_gpu_reason(m.get("cuda"), os.environ.get("CUDA_VISIBLE_DEVICES"), m.get("driver"))
        lines.append(f"GPUs: none visible ({why}): training runs on the CPU (a GPU recipe needs "
                     "--set hardware.allow_cpu=true); `vramfit plan` still predicts GPU memory for any card")
    for i, g in enumerate(rep["gpus"]):
        lines.append(f"GPU {i}: {g['name']}, {_gib(g['total_bytes'])} total, {_gib(g['free_bytes'])} free, "
                     f"compute {g['capability'][0]}.{g['capability'][1]}, bf16 {'yes' if g['bf16'] else 'no'}, "
                     f"TF32 {'yes' if g['tf32'] else 'no'}, other processes hold about {_gib(g['others_bytes'])}")
    p = rep["precision"]
    where = "GPU" if p["device"] == "cuda" else "CPU"
    lines.append(f"precision: {p['requested']} trains in {p['runs']} on this {where}"
                 + (f" ({p['note']})" if p["note"] else ""))
    fit = rep["recipe_that_fits"]
    lines.append(f"recipe that fits: {fit['name']}" + (f" with {' '.join('--set ' + s for s in fit['sets'])}"
                                                       if fit["sets"] else "") + f" ({fit['why']})")
    if "data" in rep:
        d = rep["data"]
        lines.append(f"data {d['source']}: {d['train_images']} train / {d['val_images']} validation images, "
                     f"{d['classes']} classes; images come out at {d['sample_shapes'][0] if d['sample_shapes'] else '-'}"
                     f" for {d['expected_shape']}: {'ok' if d['ok'] else 'DOES NOT MATCH'}")
    if "plan" in rep:
        p = rep["plan"]
        verdict = "" if p["fits"] is None else (": fits" if p["fits"] else ": DOES NOT FIT (" + "; ".join(p["advice"][:3]) + ")")
        budget = f" of a {_gib(p['budget_bytes'])} budget" if p["budget_bytes"] else " (no card size to fit)"
        lines.append(f"plan of {p['recipe'] or 'this config'} for {p['for']}: {p['model']} @ {p['image_size']} px, "
                     f"micro-batch {p['micro_batch']} x {p['grad_accum_steps']}, predicted peak "
                     f"{_gib(p['predicted_peak_bytes'])}{budget}{verdict}")
    if "diff" in rep:
        lines.append("same as the machine of that run" if not rep["diff"] else "differs from the machine of that run:")
        lines += [f"  {d['key']}: {d['run']} -> {d['here']}" for d in rep["diff"]]
    return "\n".join(lines)
