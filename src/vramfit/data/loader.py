"""Datasets and loaders: decoded, augmented uint8 batches of one process's share of each optimizer
step, made in loader workers; `build_loaders` makes a run's train and validation loaders in one call.

Problems met in a worker travel back inside the batch (an exception raised there would reach the
run as a traceback): `Batch.bad` (unreadable files, replaced and counted by the run), `Batch.stop`
(no readable image at all, or a source that cannot be read, e.g. a damaged shard: the loader raises
a VramfitError in the main process, with the source's hint where it gave one) and `Batch.notes`
(said once per run, e.g. huge images).
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, NamedTuple

import torch
from PIL import Image

from .. import batching
from ..config import Config, DataConfig
from ..errors import VramfitError
from .decode import BadImage, decode_with_size, describe, quiet_bomb_warnings
from .ordering import NO_SAMPLE, SeededRNG, StepBatchSampler, mix_seed
from .shards import ShardSamples, ShardStepSampler, fixed_locations
from .sources import Splits
from .workers import end_workers_at_exit, init_worker, local_processes, resolve_workers

log = logging.getLogger(__name__)

# RandomResizedCrop at scale s takes a crop whose side is ~sqrt(s) of the image's, so a JPEG is
# drafted (decoded at 1/2, 1/4, 1/8 size) to at most this multiple of the crop size. 1.5x is close
# to the pixel density RandomResizedCrop has on ImageNet itself (shorter side ~1.7x 224), where the
# usual recipes were tuned; decoding more of a 12 Mpx photo costs time (2x: +17%, full detail for
# every crop: +46%) for detail only the smallest crops would see. Measured in docs/data.md.
TRAIN_DRAFT_FACTOR = 1.5
# Images tried in place of an unreadable train image before the run stops.
REPLACEMENT_TRIES = 64
STOP_FILES_LISTED = 10


def color_jitter_on(cfg: DataConfig, device_type: str) -> str | None:
    """Where a run's colour jitter is done: None (off: `color_jitter` 0, or an auto-augment policy
    other than '3a', as timm decides), "loader" (timm's ColorJitter on PIL images in the workers)
    or "device" (vramfit.data.augment, on the batch). `auto`: the device on an accelerator, where it is a
    few passes over the batch instead of a fifth of a worker's time per image; the loader on the
    CPU, where the main process is the trainer and PIL's uint8 kernels are the cheaper form
    (`bench/data_throughput.py` prints both)."""
    if cfg.color_jitter <= 0 or (cfg.auto_augment and "3a" not in cfg.auto_augment):
        return None
    if cfg.color_jitter_on != "auto":
        return cfg.color_jitter_on
    return "loader" if device_type == "cpu" else "device"


def device_jitter(cfg: DataConfig, device_type: str) -> float | None:
    """The strength of the colour jitter the device applies (each sample's parameters drawn by
    ImageDataset), or None where the loader does it or nobody does."""
    return cfg.color_jitter if color_jitter_on(cfg, device_type) == "device" else None


def build_transforms(cfg: DataConfig, data_cfg: dict, device_type: str = "cpu"):
    """timm's train and eval transforms; `device_type` (the run's) decides where colour jitter is."""
    from timm.data import create_transform

    common = dict(input_size=data_cfg["input_size"], interpolation=data_cfg.get("interpolation", "bilinear"),
                  mean=data_cfg["mean"], std=data_cfg["std"], use_prefetcher=True)
    # Random erasing (and colour jitter when it is on the device) are done on normalised batches
    # (vramfit.data.augment), as timm's own prefetcher does for erasing.
    jitter = cfg.color_jitter if color_jitter_on(cfg, device_type) == "loader" else None
    train = create_transform(is_training=True, scale=tuple(cfg.scale), ratio=tuple(cfg.ratio),
                             hflip=cfg.hflip, auto_augment=cfg.auto_augment, re_prob=0.0,
                             color_jitter=jitter, **common)
    val = create_transform(is_training=False, crop_pct=data_cfg.get("crop_pct", 0.875), **common)
    return train, val


class SizedTransforms:
    """timm's train transform at any size (progressive resizing: data.progressive.Schedule), each made once
    per process when first asked for, with the JPEG draft size it needs."""

    def __init__(self, cfg: DataConfig, data_cfg: dict, device_type: str):
        self.cfg, self.data_cfg, self.device_type = cfg, dict(data_cfg), device_type
        self._made: dict[int, tuple] = {}

    def __call__(self, size: int) -> tuple:
        if size not in self._made:
            sized = {**self.data_cfg, "input_size": (3, size, size)}
            train = build_transforms(self.cfg, sized, self.device_type)[0]
            self._made[size] = (train, draft_size(train, size))
        return self._made[size]

    def __getstate__(self):  # sent to the loader workers without what this process made
        return {**self.__dict__, "_made": {}}


def draft_size(transform, image_size: int) -> int:
    """The shorter side a JPEG must keep when decoded at reduced size (`decode_image` target), read
    off the transform that will consume the image, so the draft always follows the crop settings.

    - RandomResizedCrop (train): the crop side is ~sqrt(scale) of the image's, so full detail for
      every crop would need size / sqrt(scale_min) (792 px at 224 and 0.08); capped at
      TRAIN_DRAFT_FACTOR x size (336 px at 224).
    - Resize (eval): exactly the size it resizes to (256 px at 224 and crop_pct 0.875): nothing is
      lost, the resize only starts from fewer pixels.
    """
    for t in getattr(transform, "transforms", [transform]):
        size, scale = getattr(t, "size", None), getattr(t, "scale", None)
        if size is None:
            continue
        side = max(size) if isinstance(size, (tuple, list)) else int(size)
        if isinstance(scale, (tuple, list)) and len(scale) == 2:
            factor = min(1.0 / math.sqrt(max(float(scale[0]), 1e-4)), TRAIN_DRAFT_FACTOR)
            return math.ceil(side * max(1.0, factor))
        if "Resize" in type(t).__name__:
            return side
    return math.ceil(image_size * 1.15)


class Note(NamedTuple):
    kind: str  # said once per loader and kind
    text: str


class Sample(NamedTuple):
    image: torch.Tensor  # uint8 CHW (or whatever the transform returns)
    label: int  # -1: masked out (an unreadable evaluation image, or no sample)
    index: int  # NO_SAMPLE for the placeholder of an empty share
    step_samples: int
    bad: str  # "file: reason" of an unreadable file met, or ""
    stop: str = ""  # why the run cannot go on, or ""
    note: Note | None = None
    jitter: torch.Tensor | None = None  # colour jitter done on the device: see jitter_params
    stop_hint: str = ""  # what to do about `stop`, where the source said (a VramfitError's hint)


# jitter_params that change nothing: factors of 1, the operations in their own order.
NO_JITTER = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 2.0])


def jitter_params(strength: float) -> torch.Tensor:
    """One sample's colour jitter, for the device to apply (vramfit.data.augment.ColorJitter): its
    brightness, contrast and saturation factors and the order of the three operations, as
    (b, c, s, first, second, third). Drawn by torchvision's own ColorJitter.get_params from the
    sample's seeded RNG, like every per-sample augmentation, so a sample's jitter does not depend
    on the batch, the process or the worker it lands in."""
    from torchvision.transforms import ColorJitter

    low_high = (max(0.0, 1.0 - strength), 1.0 + strength)
    order, b, c, s, _ = ColorJitter.get_params(low_high, low_high, low_high, None)
    return torch.tensor([b, c, s, *(int(i) for i in order if int(i) < 3)], dtype=torch.float32)


class ImageDataset(torch.utils.data.Dataset):
    """Decodes in the loader worker through our guarded decoder; a bad file is replaced by a
    deterministic other sample (train) or masked out (eval), and reported by name."""

    def __init__(self, hf, image_col, label_col, transform, image_size, seed, train: bool,
                 device_jitter: float | None = None, sized: SizedTransforms | None = None):
        self.hf, self.image_col, self.label_col = hf, image_col, label_col
        self.transform, self.image_size, self.seed, self.train = transform, image_size, seed, train
        self.device_jitter = device_jitter  # strength of the colour jitter the device applies
        self.draft = draft_size(transform, image_size)
        self.sized = sized  # the transform at a step's own size (a train key's fourth part)

    def _transform_at(self, size: int | None) -> tuple:
        """The transform for `size` px and its draft size (`size` None: the dataset's own)."""
        if size is None or size == self.image_size or self.sized is None:
            return self.transform, self.draft
        return self.sized(size)

    def __len__(self):
        return len(self.hf)

    def _load(self, i, draft: int):
        row = self.hf[int(i)]
        img, (w, h) = decode_with_size(row[self.image_col], draft)
        note = None
        if w * h > (Image.MAX_IMAGE_PIXELS or math.inf):
            note = Note("huge", f"huge images are decoded every epoch (e.g. {describe(row[self.image_col])}: "
                                f"{w}x{h}, over PIL's warning size of {Image.MAX_IMAGE_PIXELS:,} pixels); "
                                f"`vramfit prepare` shrinks a dataset once")
        return img, int(row[self.label_col]), note

    def _empty(self, index: int, step_n: int, bad: str = "", stop: str = "", size: int | None = None,
               stop_hint: str = "") -> Sample:
        jitter = NO_JITTER if self.device_jitter else None
        side = size or self.image_size
        return Sample(torch.zeros(3, side, side, dtype=torch.uint8), -1, index, step_n, bad, stop, jitter=jitter,
                      stop_hint=stop_hint)

    def _key(self, key) -> tuple:
        # A train key: (index, epoch, step_samples[, image size of the step]); eval: the index.
        return (tuple(key) + (None,))[:4] if self.train else (key, 0, 0, None)

    def __getitem__(self, key) -> Sample:
        try:
            return self._item(key)
        except VramfitError as e:
            # The source itself cannot be read (a damaged shard): said by the main process as the
            # error it is, where torch would re-raise it carrying this worker's traceback.
            index, _, step_n, size = self._key(key)
            return self._empty(index, step_n, stop=e.message, size=size, stop_hint=e.hint or "")

    def _item(self, key) -> Sample:
        index, epoch, step_n, size = self._key(key)
        if index == NO_SAMPLE:
            return self._empty(index, step_n, size=size)
        transform, draft = self._transform_at(size)
        bad = ""
        try:
            img, label, note = self._load(index, draft)
        except BadImage as e:
            bad = f"{describe(self.hf[int(index)][self.image_col])}: {e}"
            if not self.train:
                return self._empty(index, step_n, bad)
            try:
                img, label, note = self._replacement(index, draft)
            except _NothingReadable as e:
                return self._empty(index, step_n, bad, stop=_no_readable_message([bad, *e.tried], len(self.hf)),
                                   size=size)
        with SeededRNG(mix_seed(self.seed, epoch, index, "aug")), quiet_bomb_warnings():
            x = transform(img)  # a crop of a huge image warns again
            jitter = jitter_params(self.device_jitter) if self.device_jitter else None
        return Sample(x, label, index, step_n, bad, note=note, jitter=jitter)

    def _replacement(self, index, draft: int):
        # Same replacement on every run (a function of the index only), so resume stays exact.
        n, tried = len(self.hf), []
        # Tar shards (data.shards) name samples by location, and say which stand in for one.
        candidate = getattr(self.hf, "replacement", lambda i, k: (i + k * 7919) % n)
        for k in range(1, REPLACEMENT_TRIES + 1):
            j = candidate(index, k)
            try:
                return self._load(j, draft)
            except BadImage as e:
                tried.append(f"{describe(self.hf[int(j)][self.image_col])}: {e}")
        raise _NothingReadable(tried)


class _NothingReadable(Exception):
    def __init__(self, tried: list[str]):
        super().__init__(f"{len(tried)} images tried")
        self.tried = tried


def _no_readable_message(tried: list[str], n: int) -> str:
    files = list(dict.fromkeys(tried))  # a small dataset repeats candidates
    more = len(files) - STOP_FILES_LISTED
    return (f"No readable training image: {files[0].split(': ')[0]} is unreadable, and so are the "
            f"{REPLACEMENT_TRIES} images tried in its place ({len(files)} files of the {n} in the training "
            f"split):\n  " + "\n  ".join(files[:STOP_FILES_LISTED])
            + (f"\n  ... and {more} more" if more > 0 else ""))


@dataclass
class Batch:
    images: torch.Tensor  # uint8 NCHW
    labels: torch.Tensor
    indices: torch.Tensor
    step_samples: int  # samples in the whole optimizer batch across processes (0 for eval)
    bad: list[str]
    stop: str = ""  # set: the run must stop (see the module docstring)
    notes: list[Note] = field(default_factory=list)
    jitter: torch.Tensor | None = None  # (N, 6) jitter_params of the samples, when the device jitters
    stop_hint: str = ""  # what to do about `stop`, where the source said

    def pin_memory(self) -> "Batch":
        # Called by the loader's pin-memory thread (CUDA runs): torch pins tensors, mappings and
        # sequences but returns any other type as is, and a copy from pageable memory is not
        # asynchronous whatever `non_blocking` says.
        self.images, self.labels = self.images.pin_memory(), self.labels.pin_memory()
        if self.jitter is not None:
            self.jitter = self.jitter.pin_memory()
        return self


def collate(items: list, image_size: int | None = None) -> Batch:
    """One batch of samples; the NO_SAMPLE placeholder of an empty share is left out, so the batch
    may be empty: (0, 3, image_size, image_size) uint8, still carrying the step's sample count."""
    items = [Sample(*it) for it in items]
    real = [it for it in items if it.index != NO_SAMPLE]
    if real:
        images = stack_images([it.image for it in real])
    else:  # the placeholder has the step's size (progressive resizing)
        side = items[0].image.shape[-1] if items else (image_size or 0)
        images = torch.empty((0, 3, side, side), dtype=torch.uint8)
    jitter = torch.stack([it.jitter for it in real]) if real and real[0].jitter is not None else None
    stopped = next((it for it in real if it.stop), None)
    return Batch(images, torch.tensor([it.label for it in real], dtype=torch.long),
                 torch.tensor([it.index for it in real], dtype=torch.long),
                 int(items[0].step_samples) if items else 0, [it.bad for it in real if it.bad],
                 stopped.stop if stopped else "", [it.note for it in real if it.note], jitter,
                 stopped.stop_hint if stopped else "")


def stack_images(images: list) -> torch.Tensor:
    """(N, 3, H, W) uint8 with channels_last strides, from CHW images.

    A PIL image becomes a tensor as a CHW view of its HWC pixels, so stacking them as NHWC is a plain
    copy per image where NCHW would be a transposing one; and inside a loader worker
    `default_collate` writes the stack straight into the shared memory the batch is sent in (a
    stack in ordinary memory is copied there once more). Together ~0.1 ms per 224 px image, a
    twentieth of the worker's work on a 500x375 JPEG. The normalizer gives the model the memory
    format it asks for, so nothing downstream sees the difference."""
    hwc = [torch.as_tensor(im).permute(1, 2, 0).contiguous() for im in images]  # no copy for PIL's
    return torch.utils.data.default_collate(hwc).permute(0, 3, 1, 2)


class CheckedLoader(torch.utils.data.DataLoader):
    """torch's DataLoader, acting in the main process on what its workers report (see the module
    docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.notes_said: set[str] = set()

    def _batches(self):
        try:
            yield from super().__iter__()
        except RuntimeError as e:
            if "timed out" not in str(e):
                raise
            raise VramfitError(f"The data stalled: no batch from the loader workers in {self.timeout:.0f} s "
                               f"(data.read_timeout_s).",
                               hint="check the file system the shards are on (a hung network mount?); "
                                    "raise --set data.read_timeout_s=SECONDS for slow storage") from None

    def __iter__(self):
        for batch in self._batches():
            if batch.stop:
                raise VramfitError(batch.stop, hint=batch.stop_hint or "fix or delete these files (`vramfit "
                                                    "scan-data --data SRC` lists every unreadable one)")
            for note in batch.notes:
                if note.kind not in self.notes_said:
                    self.notes_said.add(note.kind)
                    log.warning("note: %s", note.text)
            yield batch


def make_loader(ds, batch_sampler=None, batch_size=None, workers=0, pin=False, seed=0,
                timeout: float = 0.0) -> CheckedLoader:
    # Its own generator: creating an iterator each epoch must not draw from the global RNG, or a
    # resumed run's dropout stream would be shifted by one draw.
    kw = dict(num_workers=workers, pin_memory=pin,
              collate_fn=partial(collate, image_size=getattr(ds, "image_size", None)),
              generator=torch.Generator().manual_seed(seed))
    if workers > 0:
        kw.update(persistent_workers=True, prefetch_factor=4, worker_init_fn=init_worker, timeout=timeout)
        end_workers_at_exit()
    if batch_sampler is not None:
        return CheckedLoader(ds, batch_sampler=batch_sampler, **kw)
    return CheckedLoader(ds, batch_size=batch_size, shuffle=False, **kw)


def normalizer(data_cfg: dict, device, channels_last: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    mean = torch.tensor(data_cfg["mean"], device=device).view(1, 3, 1, 1) * 255.0
    std = torch.tensor(data_cfg["std"], device=device).view(1, 3, 1, 1) * 255.0
    fmt = torch.channels_last if channels_last else torch.contiguous_format

    def norm(x: torch.Tensor) -> torch.Tensor:
        # One float copy, normalised in place (a uint8 -> float batch at 224 px is 600 KB a sample).
        out = x.to(device, non_blocking=True).to(torch.float32, memory_format=fmt)
        return out.sub_(mean).div_(std)

    return norm


def check_batch_shape(images: torch.Tensor, image_size: int) -> None:
    """The 'resize written but never applied' guard: stop at step 1, not at an OOM later."""
    if images.dim() != 4 or tuple(images.shape[1:]) != (3, image_size, image_size):
        raise VramfitError(
            f"Training batches have shape {tuple(images.shape)}, expected (N, 3, {image_size}, "
            f"{image_size}): the resize/crop transform is not being applied to the images.",
            hint="check data.image_size and that the dataset goes through the train transform")


@dataclass
class Loaders:
    train: CheckedLoader  # this process's share of each optimizer step (StepBatchSampler)
    val: torch.utils.data.DataLoader  # prepared by Accelerate: each process evaluates a part
    sampler: StepBatchSampler
    workers: int  # loader worker processes per loader
    normalize: Callable[[torch.Tensor], torch.Tensor]  # uint8 batch -> normalised float on the device
    workers_why: str = ""  # how `workers` was chosen, for the start line
    statistics: torch.utils.data.DataLoader | None = None  # model.precise_bn's train images (statistics_loader)


def seconds_per_sample(ds: ImageDataset, sampler: StepBatchSampler, budget: float = 0.3, most: int = 16) -> float:
    """What loading one training sample (read, decode, transform) takes in this process: the first
    samples of the run's order after an untimed first one (its first call sets things up), until
    `most` samples or `budget` seconds. Leaves no trace: each sample's augmentation is seeded by
    the sample and the caller's RNGs are restored."""
    keys = list(itertools.islice((key for share in sampler for key in share), most + 1))
    ds[keys[0]]
    t0, n = time.perf_counter(), 0
    for key in keys[1:]:
        ds[key]
        n += 1
        if time.perf_counter() - t0 > budget:
            break
    return (time.perf_counter() - t0) / max(1, n)


def step_partitions(cfg: Config, splits: Splits, world: int) -> int | None:
    """The fixed partitions a step's samples are dealt from (tar shards: data.shard_partitions,
    checked to divide over the processes before the model is built), or None (`rank_shares`)."""
    if not isinstance(splits.train, ShardSamples):
        return None
    batching.check_partitions(cfg.data.shard_partitions, world)
    return cfg.data.shard_partitions


def train_sampler(cfg: Config, splits: Splits, rank: int, world: int, size_at=None):
    """The order of a run's training samples: tar shards have their own (data.shards), every
    other source the global permutation of `StepBatchSampler`."""
    if isinstance(splits.train, ShardSamples):
        return ShardStepSampler(splits.train, cfg.train.global_batch, rank, world, cfg.train.seed,
                                cfg.data.shuffle_buffer, size_at=size_at,
                                partitions=cfg.data.shard_partitions)
    return StepBatchSampler(len(splits.train), cfg.train.global_batch, rank, world, cfg.train.seed,
                            size_at=size_at)


def build_loaders(cfg: Config, splits: Splits, data_cfg: dict, accelerator, eval_batch: int,
                  compute_seconds: float | None = None, size_at: Callable[[int], int] | None = None) -> Loaders:
    """The train and validation loaders of a run, for this process of `accelerator`.
    `compute_seconds` (a CPU run: what one training sample costs the model) lets `num_workers:
    auto` be measured rather than guessed; `size_at` (progressive resizing: data.progressive.Schedule.size_at)
    gives each training step its image size (evaluation stays at data.image_size)."""
    device_type = accelerator.device.type
    train_tf, val_tf = build_transforms(cfg.data, data_cfg, device_type)
    sampler = train_sampler(cfg, splits, accelerator.process_index, accelerator.num_processes, size_at)
    train_ds = ImageDataset(splits.train, splits.image_column, splits.label_column, train_tf,
                            cfg.data.image_size, cfg.train.seed, train=True,
                            device_jitter=device_jitter(cfg.data, device_type),
                            sized=SizedTransforms(cfg.data, data_cfg, device_type) if size_at else None)
    val_ds = ImageDataset(splits.val, splits.image_column, splits.label_column, val_tf,
                          cfg.data.image_size, cfg.train.seed, train=False)
    measure = None if compute_seconds is None else (lambda: (seconds_per_sample(train_ds, sampler), compute_seconds))
    workers, why = resolve_workers(cfg.data, device_type, local_processes(accelerator.num_processes), measure)
    pin = device_type == "cuda"
    streamed = isinstance(splits.train, ShardSamples)
    timeout = cfg.data.read_timeout_s if streamed else 0.0
    train = make_loader(train_ds, batch_sampler=sampler, workers=workers, pin=pin, timeout=timeout)
    val = accelerator.prepare_data_loader(make_loader(val_ds, batch_size=eval_batch, workers=workers, pin=pin))
    stats = None
    if cfg.model.precise_bn:
        stats_ds = ImageDataset(splits.train, splits.image_column, splits.label_column, val_tf,
                                cfg.data.image_size, cfg.train.seed, train=False)
        # Tar shards name samples by location: a seeded draw of them, the same on every process.
        order = fixed_locations(splits.train, cfg.model.precise_bn, cfg.train.seed) if streamed else None
        stats = statistics_loader(stats_ds, cfg.model.precise_bn, eval_batch, cfg.train.seed,
                                  accelerator.process_index, accelerator.num_processes, workers, pin, order)
    return Loaders(train, val, sampler, workers,
                   normalizer(data_cfg, accelerator.device, cfg.model.channels_last), why, stats)


def statistics_loader(ds: ImageDataset, images: int, batch: int, seed: int, rank: int, world: int,
                      workers: int, pin: bool, order: list[int] | None = None) -> CheckedLoader:
    """model.precise_bn's images: the first `images` of a fixed permutation of the train split
    (seeded by the run; `order`: the keys to use instead, tar shards' `fixed_locations`), dealt to
    the processes so each holds as many, in batches of `batch`: every process runs the same number
    of forwards (FSDP's collectives), and one process of a multi-process run sees a share of the same
    set one process would see whole."""
    if order is None:
        order = torch.randperm(len(ds), generator=torch.Generator().manual_seed(seed)).tolist()[:images]
    mine = order[rank::world][:len(order) // world]
    # A last batch of one image is left out: a train-mode BatchNorm over one value per channel fails.
    batches = [b for b in (mine[i:i + batch] for i in range(0, len(mine), batch)) if len(b) > 1]
    return make_loader(ds, batch_sampler=batches, workers=workers, pin=pin)
