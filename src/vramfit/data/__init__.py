"""HF `datasets` sources -> decoded, augmented uint8 batches, in an order that is a pure function of
(seed, epoch), so a resumed or rescaled run sees exactly the same samples.

- `sources`: every supported source -> `Splits` (train and validation, labels as ClassLabel);
  `folders` (image folders) and `schema` (split names, columns, labels) serve it; `shards` (tar
  shards) and `tables` (parquet / arrow files, `data.streaming`) are read in place, at a local path
  or a URL (`stores`).
- `ordering`: the sample order of each optimizer step, and the per-sample seeds.
- `loader`: datasets, batches and loaders (`build_loaders`); `workers`: the loader processes.
- `decode`: one image item -> an RGB image, or a `BadImage` saying why; `augment`: colour
  jitter, erasing and mixup on the device; `progressive`: the image size of each step of a
  progressively resized run; `builtin`: the built-in `digits` data.
"""

from .folders import IMAGE_EXTENSIONS, is_image_file
from .loader import (NO_JITTER, TRAIN_DRAFT_FACTOR, Batch, CheckedLoader, ImageDataset, Loaders, Note,
                     Sample, build_loaders, build_transforms, check_batch_shape, collate, color_jitter_on,
                     device_jitter, draft_size, jitter_params, make_loader, normalizer, step_partitions)
from .ordering import NO_SAMPLE, SeededRNG, StepBatchSampler, mix_seed
from .schema import HELD_OUT_SPLITS, IMAGE_COLUMNS, LABEL_COLUMNS, TRAIN_SPLITS, VAL_SPLITS
from .sources import Source, Splits, load_eval_split, load_source, load_splits
from .workers import resolve_workers

__all__ = [
    "IMAGE_EXTENSIONS", "is_image_file",
    "NO_JITTER", "TRAIN_DRAFT_FACTOR", "Batch", "CheckedLoader", "ImageDataset", "Loaders", "Note", "Sample",
    "build_loaders", "build_transforms", "check_batch_shape", "collate", "color_jitter_on", "device_jitter",
    "draft_size", "jitter_params", "make_loader", "normalizer", "step_partitions",
    "NO_SAMPLE", "SeededRNG", "StepBatchSampler", "mix_seed",
    "HELD_OUT_SPLITS", "IMAGE_COLUMNS", "LABEL_COLUMNS", "TRAIN_SPLITS", "VAL_SPLITS",
    "Source", "Splits", "load_eval_split", "load_source", "load_splits",
    "resolve_workers",
]
