"""`vramfit lr-find`: the learning-rate range test on the recipe's model, data and global batch.

The sweep itself is torch-lr-finder's (Smith 2015, the fastai procedure): the LR grows exponentially
from `start_lr` to `end_lr`, one optimizer step per global batch, the sweep stops once the loss
exceeds 5x its best (divergence), and the model and optimizer are put back as they were. What is
ours: the batches (the run's own sample order, loader transforms and micro-batch split, normalised
on the device; without the device augmentations of vramfit.data.augment, which only make the loss
noisier), the smoothing, the suggestion, the plot, and what is printed.

The suggestion is a tenth of the LR at the smoothed loss's minimum (fastai's "minimum / 10"): the
minimum sits where the loss is about to diverge, and a tenth of it is where it still falls fast.
The loss is smoothed forwards and backwards (zero phase): the usual one-way running average lags,
and with ~12 steps per decade its lag alone moves the minimum up by about 2x in LR.
"""

from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path

import numpy as np
import torch

from .. import batching
from ..config import Config

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
    # Never below where the sweep started: a minimum at its first steps (a sweep too short to see
    # the loss fall) says nothing about lower LRs.
    return max(float(lrs[int(np.argmin(smooth(losses)))]) / 10, float(lrs[0]))


def build(cfg: Config):
    """The run `vramfit train` would build (train.build.build: model, optimizer, data order, loaders,
    micro-batch, precision), for this one process, with no trackers and no run folder. Returns
    the run and the sweep's batches."""
    from ..runtime import launch
    from ..store.runfolder import RunPaths
    from ..train import build as train_build

    L = launch.start(cfg)  # no run folder: no trackers
    run = train_build.build(cfg, L, RunPaths.of(cfg, L.precision.name))
    batches = _Batches(run.loaders.train, run.loaders.sampler, run.loaders.normalize, cfg.train.global_batch,
                       run.micro.size)
    return run, batches


def amp_settings(precision) -> dict:
    """torch-lr-finder's mixed-precision settings for what the run runs (a `precision.Precision`):
    its autocast, and a GradScaler for fp16."""
    if precision.autocast_dtype is None:
        return {}
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return {"amp_backend": "torch", "amp_config": {"device_type": device_type, "dtype": precision.autocast_dtype},
            "grad_scaler": torch.amp.GradScaler(device_type, enabled=precision.scales_loss)}


def plot(lrs: list[float], losses: list[float], suggestion: float, path: Path, title: str) -> Path:
    """Returns the path written (a folder: lr_find.png in it)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from ..store.figures import save_png

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
    return save_png(fig, path, dpi=100, default_name="lr_find.png")


@contextlib.contextmanager
def plain_progress(module, every: int = 10):
    """torch-lr-finder's tqdm bar in a terminal; anywhere else (a job log, a pipe) a plain line every
    `every` steps instead, so a log file holds no carriage returns. The library takes no option for
    its bar, so its module's `tqdm` name is swapped for the sweep and put back."""
    if sys.stderr.isatty():
        yield
        return
    bar = module.tqdm

    def lines(iterable):
        n = len(iterable)
        for i, item in enumerate(iterable, 1):
            if i == 1 or i % every == 0:  # before the step: the sweep may stop inside any step
                print(f"lr-find: step {i}/{n}", file=sys.stderr, flush=True)
            yield item

    module.tqdm = lines
    try:
        yield
    finally:
        module.tqdm = bar


def lr_find(cfg: Config, num_iter: int = 100, start_lr: float = 1e-7, end_lr: float = 10.0,
            plot_path: str | Path | None = None, out=None) -> dict:
    """Sweep, suggest, plot, print; the model ends as it started. Returns what it printed.
    `plot_path` None: beside the run folder these settings train into (runfolder.RunPaths.lr_find_plot)."""
    import torch_lr_finder.lr_finder as library
    from torch_lr_finder import LRFinder, TrainDataLoaderIter

    from ..train.optim import scaled_lr

    run, batches = build(cfg)
    # The inner optimizer: the finder scales fp16 losses with its own GradScaler.
    optimizer = getattr(run.optimizer, "optimizer", run.optimizer)
    for group in optimizer.param_groups:  # the run's LR schedule is not stepped here: the sweep sets the LR
        group.pop("initial_lr", None)
    # The run's own loss (train.step.StepMaths), averaged over each micro-batch: the finder divides it
    # by the accumulation steps itself.
    finder = LRFinder(run.model, optimizer, run.step.maths.mean_loss, device=run.launch.acc.device,
                      **amp_settings(run.launch.precision))
    # The library prints its own lines ("See the graph with {finder_name}.plot()"); what it found is
    # said below, in vramfit's words.
    with contextlib.redirect_stdout(io.StringIO()), plain_progress(library):
        finder.range_test(TrainDataLoaderIter(batches), start_lr=start_lr, end_lr=end_lr, num_iter=num_iter,
                          smooth_f=0.0, diverge_th=DIVERGE, accumulation_steps=batches.per_step)
    finder.reset()  # weights, BatchNorm statistics and optimizer state as before the sweep
    lrs, losses = finder.history["lr"], finder.history["loss"]
    lr = suggest(lrs, losses)
    stated, _ = scaled_lr(cfg.optim, cfg.train.global_batch)
    g, size, precision = cfg.train.global_batch, cfg.data.image_size, run.launch.precision.name
    plot_path = Path(plot_path) if plot_path is not None else run.paths.lr_find_plot
    plot_path = plot(lrs, losses, lr, plot_path, f"{cfg.model.name} @ {size} px, global batch {g}, {precision}")
    # The settings the sweep really ran with (the config it built the run from), said with it.
    result = {"suggested_lr": lr, "recipe_lr": stated, "global_batch": g, "model": cfg.model.name,
              "image_size": size, "precision": precision, "micro_batch": run.micro.size, "steps": len(lrs),
              "stopped_early": len(lrs) < num_iter, "plot": str(plot_path),
              "lrs": [float(x) for x in lrs], "losses": [float(x) for x in losses]}
    out = out if out is not None else sys.stdout
    out.write(f"lr-find on {cfg.model.name} @ {size} px, global batch {g} (micro-batch {run.micro.size}), "
              f"{precision}: {len(lrs)} steps from {start_lr:g}" + (" (stopped: the loss diverged)"
                                                                    if result["stopped_early"] else "")
              + f"; suggested LR {lr:.3g} at global batch {g} (the recipe's: {stated:.3g}); plot: {plot_path}\n"
              f"  use it: --set optim.lr={lr:.3g} --set optim.lr_base_batch={g}\n")
    return result
