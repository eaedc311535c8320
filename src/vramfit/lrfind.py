"""`vramfit lr-find`: the learning-rate range test on the recipe's model, data and global batch.

The sweep itself is torch-lr-finder's (Smith 2015, the fastai procedure): the LR grows exponentially
from `start_lr` to `end_lr`, one optimizer step per global batch, the sweep stops once the loss
exceeds 5x its best (divergence), and the model and optimizer are put back as they were. What is
ours: the batches (the run's own sample order, loader transforms and micro-batch split, normalised
on the device; without the device augmentations of vramfit.augment, which only make the loss
noisier), the smoothing, the suggestion, the plot, and what is printed.

The suggestion is a tenth of the LR at the smoothed loss's minimum (fastai's "minimum / 10"): the
minimum sits where the loss is about to diverge, and a tenth of it is where it still falls fast.
The loss is smoothed forwards and backwards (zero phase): the usual one-way running average lags,
and with ~12 steps per decade its lag alone moves the minimum up by about 2x in LR.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import numpy as np
import torch

from . import batching
from .config import Config, accelerate_precision

SMOOTHING = 0.2  # weight of each new loss in the running average, run forwards then backwards
DIVERGE = 5.0  # stop once the loss exceeds this many times its best


class _Batches:
    """Micro-batches of full global batches in the run's order, epoch after epoch, as the
    (inputs, labels) the range test takes: `per_step` of them make one optimizer step."""

    def __init__(self, loader, sampler, normalize, global_batch: int, micro: int):
        self.loader, self.sampler, self.normalize = loader, sampler, normalize
        self.global_batch, self.epoch = global_batch, 0
        self.bounds = batching.chunk_bounds(global_batch, batching.grad_accum_steps(global_batch, micro))

    @property
    def per_step(self) -> int:
        return len(self.bounds)

    def __iter__(self):
        self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        for batch in self.loader:
            if len(batch.labels) != self.global_batch:
                continue  # a short final batch would split differently
            images = self.normalize(batch.images)
            labels = batch.labels.to(images.device)
            for s, e in self.bounds:
                yield images[s:e], labels[s:e]


def smooth(losses: list[float], weight: float = SMOOTHING) -> np.ndarray:
    """A running average forwards, then the same backwards over it: smooth, and no lag."""
    def ema(x):
        out, avg = np.empty(len(x)), x[0]
        for i, v in enumerate(x):
            avg = weight * v + (1 - weight) * avg
            out[i] = avg
        return out

    return ema(ema(np.asarray(losses, dtype=float))[::-1])[::-1]


def suggest(lrs: list[float], losses: list[float]) -> float:
    """A tenth of the LR at the smoothed loss's minimum."""
    return float(lrs[int(np.argmin(smooth(losses)))]) / 10


def _setup(cfg: Config, device: torch.device):
    """The run's model, optimizer, data order and micro-batch, for one process."""
    from .data import ImageDataset, StepBatchSampler, build_transforms, load_splits, make_loader, normalizer
    from .models import create_model, data_config
    from .optim import create_optimizer

    splits = load_splits(cfg.data, cfg.train.seed)
    model = create_model(cfg.model, len(splits.class_names), image_size=cfg.data.image_size).to(device)
    data_cfg = data_config(model, cfg.data.image_size, cfg.data.crop_pct)
    train_tf, _ = build_transforms(cfg.data, data_cfg, device.type)
    ds = ImageDataset(splits.train, splits.image_column, splits.label_column, train_tf, cfg.data.image_size,
                      cfg.train.seed, train=True)
    sampler = StepBatchSampler(len(ds), cfg.train.global_batch, 0, 1, cfg.train.seed)
    loader = make_loader(ds, batch_sampler=sampler, workers=0, pin=device.type == "cuda", seed=cfg.train.seed)
    pick = None
    if device.type == "cuda" and cfg.train.micro_batch == "auto":
        from .memory import auto_pick

        pick = auto_pick(cfg, len(splits.class_names), model, device)
    micro = batching.resolve_micro_batch(cfg.train.micro_batch, cfg.train.global_batch, pick=pick).size
    batches = _Batches(loader, sampler, normalizer(data_cfg, device, cfg.model.channels_last),
                       cfg.train.global_batch, micro)
    return model, create_optimizer(model, cfg.optim, cfg.train.global_batch), batches


def _amp(cfg: Config, device: torch.device) -> dict:
    """torch-lr-finder's mixed-precision settings for the recipe's precision on this device."""
    precision = accelerate_precision(cfg.train.precision)
    if device.type != "cuda" or precision == "no":
        return {}
    if precision == "auto" or (precision == "bf16" and not torch.cuda.is_bf16_supported()):
        precision = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return {"amp_backend": "torch", "amp_config": {"device_type": "cuda", "dtype": dtype},
            "grad_scaler": torch.amp.GradScaler("cuda", enabled=precision == "fp16")}


def plot(lrs: list[float], losses: list[float], suggestion: float, path: Path, title: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(lrs, losses, color="tab:blue", alpha=0.3, linewidth=1, label="loss of each step")
    ax.plot(lrs, smooth(losses), color="tab:blue", label="smoothed")
    ax.axvline(suggestion, color="tab:red", linestyle="--", label=f"suggested {suggestion:.2g}")
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("training loss")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def lr_find(cfg: Config, num_iter: int = 100, start_lr: float = 1e-7, end_lr: float = 10.0,
            plot_path: str | Path = "lr_find.png", out=None) -> dict:
    """Sweep, suggest, plot, print; the model ends as it started. Returns what it printed."""
    from torch_lr_finder import LRFinder, TrainDataLoaderIter

    from .optim import scaled_lr

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, optimizer, batches = _setup(cfg, device)
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=cfg.train.label_smoothing, ignore_index=-1)
    finder = LRFinder(model, optimizer, criterion, device=device, **_amp(cfg, device))
    with contextlib.redirect_stdout(sys.stderr):  # the library's own messages are not the result
        finder.range_test(TrainDataLoaderIter(batches), start_lr=start_lr, end_lr=end_lr, num_iter=num_iter,
                          smooth_f=0.0, diverge_th=DIVERGE, accumulation_steps=batches.per_step)
    finder.reset()  # weights, BatchNorm statistics and optimizer state as before the sweep
    lrs, losses = finder.history["lr"], finder.history["loss"]
    lr = suggest(lrs, losses)
    stated, _ = scaled_lr(cfg.optim, cfg.train.global_batch)
    g = cfg.train.global_batch
    plot(lrs, losses, lr, Path(plot_path), f"{cfg.model.name}, global batch {g}")
    result = {"suggested_lr": lr, "recipe_lr": stated, "global_batch": g, "steps": len(lrs),
              "stopped_early": len(lrs) < num_iter, "plot": str(plot_path),
              "lrs": [float(x) for x in lrs], "losses": [float(x) for x in losses]}
    out = out if out is not None else sys.stdout
    out.write(f"lr-find: {len(lrs)} steps from {start_lr:g}" + (" (stopped: the loss diverged)"
                                                                 if result["stopped_early"] else "")
              + f"; suggested LR {lr:.3g} at global batch {g} (the recipe's: {stated:.3g}); plot: {plot_path}\n"
              f"  use it: --set optim.lr={lr:.3g} --set optim.lr_base_batch={g}\n")
    return result
