"""The pictures vramfit draws: confusion matrix, misclassified images, runs compared.

matplotlib's object API (`Figure` + the Agg canvas) and never `pyplot`: no global figure state, no
GUI backend to pick, nothing left open when many figures are drawn in one long training run.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ..errors import VramfitError
from ..runtime.storage import atomic_path, named_output

# Above this many classes the cells are too small to write counts or every class name into.
ANNOTATE_MAX_CLASSES = 20
TICK_LABELS_MAX_CLASSES = 60


def save_png(fig: Figure, path: Path, dpi: int = 120, default_name: str = "figure.png") -> Path:
    """Into `path` (a folder: `default_name` in it; no extension: `.png` added, as matplotlib
    would), whole or not at all; returns the path written, which is what the user is told."""
    path = named_output(path, default_name)
    if not path.suffix:
        path = path.with_name(path.name + ".png")
    canvas = FigureCanvasAgg(fig)
    if path.suffix[1:].lower() not in canvas.get_supported_filetypes():
        raise VramfitError(f"{path}: `{path.suffix}` is not an image format matplotlib writes.",
                           hint=f"name a .png file (or .svg, .pdf), e.g. {path.with_suffix('.png')}")
    with atomic_path(path, "the figure") as tmp:
        fig.savefig(tmp, dpi=dpi, bbox_inches="tight", format=path.suffix[1:].lower())
    return path


def to_array(fig: Figure, dpi: int = 100) -> np.ndarray:
    """HxWx3 uint8 pixels, what TensorBoard's `add_image` and `wandb.Image` both take."""
    fig.set_dpi(dpi)
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[:, :, :3].copy()


def confusion_figure(matrix, class_names: list[str], title: str = "") -> Figure:
    """Rows: true class, columns: predicted class. Colour is the row fraction (so a rare class is as
    visible as a common one); the written number is the count."""
    m = np.asarray(matrix, dtype=np.int64)
    n = len(class_names)
    rows = m.sum(axis=1, keepdims=True)
    frac = np.divide(m, rows, out=np.zeros(m.shape, dtype=float), where=rows > 0)
    side = min(4.0 + 0.35 * n, 16.0)
    fig = Figure(figsize=(side + 1.2, side))
    ax = fig.add_subplot()
    im = ax.imshow(frac, cmap="Blues", vmin=0.0, vmax=1.0, interpolation="nearest")
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label="fraction of the true class")
    if n <= TICK_LABELS_MAX_CLASSES:
        ax.set_xticks(range(n), labels=class_names, rotation=90 if max(map(len, class_names)) > 3 else 0)
        ax.set_yticks(range(n), labels=class_names)
    if n <= ANNOTATE_MAX_CLASSES:
        for i in range(n):
            for j in range(n):
                if m[i, j]:
                    ax.text(j, i, str(m[i, j]), ha="center", va="center", fontsize=8,
                            color="white" if frac[i, j] > 0.5 else "black")
    ax.set_xlabel("predicted class")
    ax.set_ylabel("true class")
    ax.set_title(title)
    return fig


def image_grid_figure(images: list, captions: list[str], columns: int = 8, title: str = "") -> Figure:
    """Images (PIL or HxWxC uint8) in a grid, each with its caption above it."""
    n = max(1, len(images))
    cols = min(columns, n)
    rows = -(-n // cols)
    fig = Figure(figsize=(1.9 * cols, 2.1 * rows + (0.4 if title else 0)))
    for k, (img, cap) in enumerate(zip(images, captions)):
        ax = fig.add_subplot(rows, cols, k + 1)
        ax.imshow(np.asarray(img), interpolation="nearest")
        ax.set_title(cap, fontsize=8)
        ax.axis("off")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def compare_figure(runs: list[dict]) -> Figure:
    """Validation accuracy against wall time for every run, next to peak memory and throughput.

    Each run: `label`, `times` and `accuracies` (its evaluations, seconds since its start),
    `peak_gib` (measured, or None), `planned_gib` (or None) and `images_per_second` (or None)."""
    fig = Figure(figsize=(15, 0.8 + max(4.5, 0.45 * len(runs))), layout="constrained")
    grid = fig.add_gridspec(1, 3, width_ratios=[2.2, 1, 1])
    colors = [f"C{i % 10}" for i in range(len(runs))]
    _accuracy_panel(fig.add_subplot(grid[0]), runs, colors)
    memory = fig.add_subplot(grid[1])
    _memory_panel(memory, runs, colors)
    speed = fig.add_subplot(grid[2], sharey=memory)
    _bar_panel(speed, runs, colors, [r.get("images_per_second") for r in runs],
               "training throughput (images/s)", "{:.0f}")
    _run_axis(memory, runs)  # once: the axes share their rows
    speed.tick_params(labelleft=False)  # the run names are on the memory panel, same rows
    fig.suptitle(f"{len(runs)} runs: accuracy over time, memory, speed (one colour per run)")
    return fig


def _accuracy_panel(ax, runs: list[dict], colors: list[str]) -> None:
    longest = max((max(r["times"]) for r in runs if r["times"]), default=0.0)
    unit, scale = ("min", 60.0) if longest > 600 else ("s", 1.0)
    for r, c in zip(runs, colors):
        t = np.asarray(r["times"], dtype=float) / scale
        if len(t):
            ax.plot(t, r["accuracies"], marker="o", color=c, label=r["label"])
            best = int(np.argmax(r["accuracies"]))
            ax.scatter([t[best]], [r["accuracies"][best]], s=120, facecolors="none", edgecolors=c)
    ax.set_xlim(left=0)
    ax.set_xlabel(f"wall time ({unit})")
    ax.set_ylabel("validation accuracy")
    ax.set_title("validation accuracy vs wall time (circle: best)")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=9)


def _memory_panel(ax, runs: list[dict], colors: list[str]) -> None:
    y = np.arange(len(runs))
    measured = [r.get("peak_gib") for r in runs]
    planned = [r.get("planned_gib") for r in runs]
    ax.barh(y, [v or 0 for v in measured], color=colors, height=0.6, label="measured")
    ax.barh(y, [v or 0 for v in planned], fill=False, hatch="//", edgecolor="0.3", height=0.6,
            label="planned")
    for i, (m, p) in enumerate(zip(measured, planned)):
        text = f"{m:.2f}" if m is not None else "not measured"
        if p is not None:
            text += f" (plan {p:.2f})"
        ax.text(max(m or 0, p or 0), i, f" {text}", va="center", fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    ax.set_title("peak device memory (GiB)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=2, fontsize=8)
    ax.margins(x=0.6)


def _bar_panel(ax, runs: list[dict], colors: list[str], values: list, title: str, fmt: str) -> None:
    y = np.arange(len(runs))
    ax.barh(y, [v or 0 for v in values], color=colors, height=0.6)
    for i, v in enumerate(values):
        ax.text(v or 0, i, " " + (fmt.format(v) if v is not None else "n/a"), va="center", fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(title)
    ax.margins(x=0.3)


def _run_axis(ax, runs: list[dict]) -> None:
    ax.set_yticks(range(len(runs)), labels=[r["label"] for r in runs], fontsize=9)
    ax.invert_yaxis()  # first run on top, as in the table
