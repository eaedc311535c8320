"""When a step does not fit: the cheapest changes that make it fit (`advise`), and what they are
made of (lighter backbones of the same family, freezing the first stages)."""

from __future__ import annotations

from typing import Any

import torch

from ..batching import grad_accum_steps, largest_chunk, resolve_micro_batch
from ..config import Config
from ..runtime.precision import planned
from .estimate import GiB, MemoryEstimate, estimate, pick_micro_batch

_FAMILIES: list[list[str]] = [
    ["resnet18", "resnet34", "resnet50", "resnet101", "resnet152", "resnet200"],
    ["resnet18d", "resnet34d", "resnet50d", "resnet101d", "resnet152d", "resnet200d"],
    ["resnext26ts", "resnext50_32x4d", "resnext101_32x8d"],
    ["wide_resnet50_2", "wide_resnet101_2"],
    [f"efficientnet_b{i}" for i in range(9)],
    [f"tf_efficientnet_b{i}" for i in range(9)],
    ["efficientnetv2_rw_t", "efficientnetv2_rw_s", "efficientnetv2_rw_m"],
    ["tf_efficientnetv2_b0", "tf_efficientnetv2_b1", "tf_efficientnetv2_b2", "tf_efficientnetv2_b3",
     "tf_efficientnetv2_s", "tf_efficientnetv2_m", "tf_efficientnetv2_l", "tf_efficientnetv2_xl"],
    ["convnext_atto", "convnext_femto", "convnext_pico", "convnext_nano", "convnext_tiny",
     "convnext_small", "convnext_base", "convnext_large", "convnext_xlarge", "convnext_xxlarge"],
    ["convnextv2_atto", "convnextv2_femto", "convnextv2_pico", "convnextv2_nano", "convnextv2_tiny",
     "convnextv2_base", "convnextv2_large", "convnextv2_huge"],
    ["mobilenetv3_small_100", "mobilenetv3_large_100"],
    ["regnety_002", "regnety_004", "regnety_008", "regnety_016", "regnety_032", "regnety_040",
     "regnety_064", "regnety_080", "regnety_120", "regnety_160", "regnety_320"],
    ["vit_tiny_patch16_224", "vit_small_patch16_224", "vit_base_patch16_224", "vit_large_patch16_224",
     "vit_huge_patch14_224"],
]


def lighter_backbones(name: str, n: int = 2) -> list[str]:
    """Up to `n` smaller members of the model's family, nearest first (resnet50 -> resnet34, resnet18;
    efficientnet_b3 -> b2, b0). The weight tag is dropped: timm's default weights of each."""
    arch = name.split(".", 1)[0]
    for fam in _FAMILIES:
        if arch in fam:
            smaller = fam[: fam.index(arch)][::-1]
            if len(smaller) > n:  # nearest, then the smallest (the biggest step down)
                smaller = smaller[: n - 1] + [smaller[-1]]
            return smaller
    return []


def _freeze_options(cfg: Config, num_classes: int) -> list[list[str]]:
    """Parameter-name prefixes that freeze the stem + first stage, and the stem + two stages."""
    from ..models.create import create_model

    with torch.device("meta"):
        try:
            model = create_model(cfg.model.model_copy(update={"freeze": []}), num_classes, load_weights=False,
                                 image_size=cfg.data.image_size)
        except Exception:  # noqa: BLE001
            return []
    info = [f.get("module") for f in getattr(model, "feature_info", []) or [] if f.get("module")]
    names = [n for n, _ in model.named_parameters()]
    out: list[list[str]] = []
    for k in (1, 2):  # keep at least two stages and the head trainable
        if len(info) <= k + 1:
            break
        end = info[k]
        last = max((i for i, n in enumerate(names) if n.startswith(end + ".")), default=None)
        if last is None:
            continue
        prefixes: list[str] = []
        for n in names[: last + 1]:
            stage = [m for m in info if n.startswith(m + ".")]
            parts = n.split(".")
            p = max(stage, key=len) if stage else (
                ".".join(parts[:2]) if len(parts) > 2 and parts[1].isdigit() else parts[0])
            if p not in prefixes:
                prefixes.append(p)
        if prefixes not in out:
            out.append(prefixes)
    return out


def config_with(cfg: Config, sets: dict[str, Any]) -> Config:
    """`cfg` with dotted keys set (`{"train.precision": "bf16"}`), validated again."""
    data = cfg.model_dump()
    for dotted, value in sets.items():
        node = data
        *path, last = dotted.split(".")
        for k in path:
            node = node[k]
        node[last] = value
    return Config.model_validate(data)


def advise(cfg: Config, num_classes: int, per_process_batch: int, budget_bytes: int, *,
           num_processes: int = 1) -> list[dict]:
    """When the configured step does not fit: the cheapest changes that make it fit.

    Each option fits `budget_bytes` at the micro-batch it names; sorted by what it costs the user
    (same maths first, then speed, then what is trained, then the model itself).
    """
    pick, _ = pick_micro_batch(cfg, num_classes, per_process_batch, budget_bytes, num_processes=num_processes)
    if pick is not None and (cfg.train.micro_batch == "auto" or largest_chunk(
            per_process_batch, resolve_micro_batch(cfg.train.micro_batch, per_process_batch).size) <= pick):
        return []  # the configured split fits (`auto` takes the pick)
    prec = planned(cfg.train.precision).accelerate
    singles: list[tuple[float, str, dict, str]] = []
    if prec == "no":
        singles.append((1, "bf16 autocast", {"train.precision": "bf16"},
                        "activations in 16 bit; needs an Ampere or newer GPU (RTX 30xx/40xx, A100, H100)"))
        singles.append((2, "fp16 autocast", {"train.precision": "fp16"},
                        "any CUDA GPU; loss scaling, rare skipped steps"))
    if not cfg.model.grad_checkpointing:
        singles.append((3, "gradient checkpointing", {"model.grad_checkpointing": True},
                        "recomputes the forward in backward: ~20-30% slower, same maths"))
    if not cfg.model.freeze:
        for j, prefixes in enumerate(_freeze_options(cfg, num_classes)):
            singles.append((4 + j, f"freeze {', '.join(prefixes)}", {"model.freeze": prefixes},
                            "early stages keep their (pretrained) weights; changes what is trained"))
    for j, name in enumerate(lighter_backbones(cfg.model.name)):
        singles.append((6 + j, f"lighter backbone {name}", {"model.name": name},
                        "a different model: expect lower accuracy"))

    out: list[dict] = []

    def option(cost: float, change: str, sets: dict, why: str, est: MemoryEstimate) -> dict:
        return {"change": change, "set": {**sets, "train.micro_batch": est.micro_batch}, "cost": cost,
                "why": why, "micro_batch": est.micro_batch,
                "grad_accum_steps": grad_accum_steps(per_process_batch, est.micro_batch),
                "peak_bytes": est.peak_bytes, "peak_gib": round(est.peak_bytes / GiB, 2)}

    def consider(cost: float, change: str, sets: dict, why: str) -> bool:
        try:
            p, table = pick_micro_batch(config_with(cfg, sets), num_classes, per_process_batch, budget_bytes,
                                        num_processes=num_processes)
        except Exception:  # noqa: BLE001 - a variant this model cannot take is simply not offered
            return False
        if p is None:
            return False
        out.append(option(cost, change, sets, why, next(e for e in table if e.micro_batch == p)))
        return True

    if pick is not None:  # the configured micro-batch is too big, a smaller one fits: free
        est = estimate(cfg, num_classes, pick, num_processes=num_processes, per_process_batch=per_process_batch)
        out.append(option(0, f"micro-batch {pick} x {grad_accum_steps(per_process_batch, pick)} accumulation steps", {},
                          "same maths, same model; only slower per sample", est))
    for cost, change, sets, why in singles:
        consider(cost, change, sets, why)

    if not [o for o in out if o["cost"] > 0]:
        # Nothing alone fits at any micro-batch: stack the changes, cheapest first.
        stacked: dict = {}
        names, total = [], 0.0
        for cost, change, sets, why in singles:
            if any(k in stacked for k in sets):
                continue  # one precision, one freeze list, one backbone
            stacked.update(sets)
            names.append(change)
            total += cost
            if len(names) > 1 and consider(total, " + ".join(names), dict(stacked),
                                           "no single change is enough"):
                break
    out.sort(key=lambda o: (o["cost"], -o["micro_batch"]))
    return out



# Below this many images per normalisation group, BatchNorm's batch statistics get noisy enough to
# cost accuracy (Wu & He 2018, "Group Normalization", Fig. 1: ResNet-50's error rises below 16
# images per GPU and sharply below 8).
SMALL_BN_GROUP = 16


def small_batch_norm_note(cfg: Config, num_classes: int, micro: int, per_process: int, world: int, *,
                          sync: bool, precision: str | None = None, budget_bytes: int | None = None) -> str | None:
    """Said at start when train-mode BatchNorm normalises groups smaller than SMALL_BN_GROUP: the
    choices, each with its cost from the plan (the largest micro-batch that fits with gradient
    checkpointing on a known card, else the predicted peak at SMALL_BN_GROUP)."""
    group = micro * world if sync else micro
    if group >= SMALL_BN_GROUP:
        return None
    kept = ("the pretrained statistics stay fixed" if cfg.model.pretrained or cfg.model.pretrained_path
            else "the statistics stay at their initial values: useful only with pretrained weights")
    choices = [f"--set model.bn=freeze ({kept}; {_peak(cfg, num_classes, micro, per_process, precision, {'model.bn': 'freeze'})})"]
    if per_process > micro and not cfg.model.grad_checkpointing:
        choices.append(_checkpointing_choice(cfg, num_classes, per_process, precision, budget_bytes))
    if not sync:
        choices.append(f"--set model.bn=sync on {'these ' + str(world) if world > 1 else 'several'} GPU processes "
                       f"(statistics over {micro} x processes images; one all-gather per BatchNorm layer)")
    return (f"BatchNorm normalises groups of {group} image(s) (micro-batch {micro}{' x ' + str(world) + ' processes' if sync else ''}): "
            f"below {SMALL_BN_GROUP} its batch statistics are noisy; choices: " + "; ".join(choices))


def _peak(cfg: Config, num_classes: int, micro: int, per_process: int, precision: str | None, sets: dict) -> str:
    try:
        est = estimate(config_with(cfg, sets), num_classes, micro, precision, per_process_batch=per_process)
    except Exception:  # noqa: BLE001 - a variant the tracer cannot follow: named without its figure
        return "its memory could not be planned"
    return f"predicted peak {est.peak_bytes / GiB:.2f} GiB at micro-batch {micro}"


def _checkpointing_choice(cfg: Config, num_classes: int, per_process: int, precision: str | None,
                          budget_bytes: int | None) -> str:
    sets = {"model.grad_checkpointing": True}
    if budget_bytes is not None:
        try:
            pick, _ = pick_micro_batch(config_with(cfg, sets), num_classes, per_process, budget_bytes,
                                       precision=precision)
        except Exception:  # noqa: BLE001
            pick = None
        if pick:
            return (f"--grad-checkpointing --micro-batch {pick} (fits this card with the margin; the forward "
                    "runs twice: ~20-30% slower)")
    target = min(per_process, SMALL_BN_GROUP)
    return (f"--grad-checkpointing --micro-batch {target} ({_peak(cfg, num_classes, target, per_process, precision, sets)}; "
            "the forward runs twice: ~20-30% slower)")
