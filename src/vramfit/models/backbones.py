"""Per-backbone defaults: the LR, drop-path rate and image size a backbone fine-tunes well at.

They fill in what neither the recipe nor the command line states, so `--model` switches these
with the backbone: `--recipe rtx3060 --model convnext_tiny` trains ConvNeXt at ConvNeXt's LR, not at
the ResNet50 LR a recipe tuned for ResNet50 would otherwise carry. A recipe that states a value
(the quickstart's 32 px digits, its LR) keeps it for any backbone. Precedence: command line >
`--set` > recipe > this table > code defaults.

The LRs are AdamW fine-tuning LRs from pretrained ImageNet weights, stated at BASE_BATCH samples per
step and scaled to the run's global batch (`optim.scaled_lr`); with SGD the table's LR is not used.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

log = logging.getLogger("vramfit")

BASE_BATCH = 128  # the global batch the LRs below are stated at (optim.lr_base_batch)


@dataclass(frozen=True)
class Backbone:
    lr: float  # AdamW, fine-tuning, at BASE_BATCH
    drop_path_rate: float  # stochastic depth: more for deeper / attention models
    image_size: int  # the resolution its pretrained weights were trained at


BACKBONES: dict[str, Backbone] = {
    "resnet34": Backbone(1e-3, 0.0, 224),
    "resnet50": Backbone(5e-4, 0.05, 224),
    "efficientnet_b0": Backbone(1e-3, 0.1, 224),
    "efficientnet_b3": Backbone(5e-4, 0.2, 288),
    "mobilenetv3_large_100": Backbone(1e-3, 0.1, 224),
    "convnext_tiny": Backbone(2e-4, 0.1, 224),
    # ViTs are built for the run's image size; timm resamples pretrained position embeddings to it.
    "vit_small_patch16_224": Backbone(1.5e-4, 0.1, 224),
    "vit_base_patch16_224": Backbone(1e-4, 0.1, 224),
}


def backbone(name: str) -> Backbone | None:
    """The table's entry for a timm model name (a weight tag such as `.a1_in1k` is ignored)."""
    return BACKBONES.get(name.split(".", 1)[0])


def fill_backbone_defaults(tree: dict, say: bool = True) -> dict:
    """A copy of `tree` (the config as nested dicts, before validation) with the backbone's
    defaults for `model.drop_path_rate`, `data.image_size` and, with AdamW, `optim.lr` (with
    `optim.lr_base_batch`, the batch the LR is stated at) where `tree` says nothing. `say`: name
    them; off for a config built only to compare with (a run's name), which a command never uses."""
    entry = backbone(str(tree.get("model", {}).get("name", "")))
    if entry is None:
        return tree
    out = copy.deepcopy(tree)
    filled = []
    for section, key, value in (("model", "drop_path_rate", entry.drop_path_rate),
                                ("data", "image_size", entry.image_size)):
        if key not in out.setdefault(section, {}):
            out[section][key] = value
            filled.append(f"{section}.{key}={value}")
    optim = out.setdefault("optim", {})
    if "lr" not in optim and optim.get("name", "adamw") == "adamw":
        optim["lr"], optim["lr_base_batch"] = entry.lr, BASE_BATCH
        filled.append(f"optim.lr={entry.lr:g} at global batch {BASE_BATCH}")
    if filled and say:
        log.info("%s defaults (not set by the recipe or the command line): %s", tree["model"]["name"],
                 ", ".join(filled))
    return out
