"""The precision a run asked for, resolved into the one it runs with: one rule, used by the launch,
the planner, lr-find, the summary, run names, W&B tags and TensorBoard hparams.

`auto` is bf16 on a GPU with bf16, fp16 (with loss scaling) on one without, fp32 on a CPU: a rule,
never a measurement. On a card with bf16 both run at the same tensor-core rate, and bf16 keeps fp32's
range without loss scaling; bench/fit_sweep.py `--precisions bf16,fp16` measures the two side by side.
bf16 asked on a GPU without it runs fp16; fp16 asked on a CPU runs fp32 (unless `debug.fp16_on_cpu`).
The planner plans for a GPU with bf16 (`planned`): it runs without a device.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import normalize_precision
from ..errors import VramfitError

# Accelerate's name (`Accelerator(mixed_precision=...)`) -> the name said everywhere else.
NAMES = {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}
_OTHER_NAMES = {"bf16-mixed": "bf16", "fp16-mixed": "fp16", "16-mixed": "fp16"}  # Lightning's


@dataclass(frozen=True)
class Precision:
    requested: str  # as configured: auto | fp32 | bf16 | fp16
    accelerate: str  # what runs, as Accelerate names it: no | bf16 | fp16
    note: str | None = None  # said at start when what runs differs from what was asked

    @property
    def name(self) -> str:
        """What runs, as summaries, run names, tags and hparams say it: fp32 | bf16 | fp16."""
        return NAMES[self.accelerate]

    @property
    def scales_loss(self) -> bool:
        """fp16 trains with a GradScaler (which handles non-finite gradients itself)."""
        return self.accelerate == "fp16"

    @property
    def autocast_dtype(self):
        """The dtype autocast computes in (None: fp32, no autocast)."""
        import torch

        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.accelerate)


def requested_name(requested: str | None) -> str:
    """auto | fp32 | bf16 | fp16 for any accepted spelling (`no`, `32`, `bf16-mixed`, ...)."""
    name = normalize_precision(str(requested if requested is not None else "auto").lower())
    name = _OTHER_NAMES.get(name, name)
    if name not in ("auto", "fp32", "bf16", "fp16"):
        raise VramfitError(f"Unknown precision `{requested}`.", hint="use fp32, bf16, fp16 or auto")
    return name


def resolve(requested: str | None, device_type: str, *, bf16_supported: bool | None = None,
            fp16_on_cpu: bool = False) -> Precision:
    """The precision a run on `device_type` runs with. `bf16_supported` None: ask the GPU."""
    asked = requested_name(requested)
    if device_type == "cuda":
        if bf16_supported is None:
            import torch

            bf16_supported = torch.cuda.is_bf16_supported()
        if asked == "auto":
            return Precision(asked, "bf16" if bf16_supported else "fp16")
        if asked == "bf16" and not bf16_supported:
            return Precision(asked, "fp16", "this GPU has no bf16 support: using fp16 (with loss scaling) instead")
        return Precision(asked, "no" if asked == "fp32" else asked)
    if asked == "fp16" and fp16_on_cpu:
        return Precision(asked, "fp16")
    if asked in ("auto", "fp32"):
        return Precision(asked, "no")
    if asked == "fp16":
        return Precision(asked, "no", f"fp16 needs a CUDA GPU; on {device_type} training runs in fp32")
    return Precision(asked, asked)


def here(cfg) -> Precision:
    """What `cfg` runs with on this machine (before any Accelerator exists)."""
    import torch

    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return resolve(cfg.train.precision, device_type, fp16_on_cpu=cfg.debug.fp16_on_cpu)


def planned(requested: str | None) -> Precision:
    """What the planner plans for: the precision on a GPU with bf16. Accepts Accelerate's names too."""
    return resolve(requested, "cuda", bf16_supported=True)
