"""Images/second of parquet files read streamed (`data.streaming: true`, data.tables) against the same
files loaded as a map-style dataset, through the same ImageDataset, transform and loader.

The files: --images 500x375 JPEGs (bench/data_throughput.py's photo-like ones) written by `datasets`
(row groups of 100 rows, as it writes image datasets), 4 train files and a validation file. Cases:
map-style (StepBatchSampler); streamed with the default shuffle buffer; streamed with a row-group
cache of --small-cache-mb, a stand-in for a dataset many times the cache (each row may cost its row
group's read); streamed with that cache and a shuffle buffer of one row group.

    python bench/parquet_stream.py                  # ~1 minute on 2 CPU cores
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from data_throughput import data_cfg_at, photo_like, time_epochs


def write_files(root: Path, n: int, noise: int) -> None:
    import datasets

    feats = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b"])})
    rows = {"image": [{"bytes": photo_like(500, 375, i, noise), "path": f"{i}.jpg"} for i in range(n)],
            "label": [i % 2 for i in range(n)]}
    ds = datasets.Dataset.from_dict(rows, features=feats)
    val = n // 5
    ds.select(range(val)).to_parquet(root / "validation-00000.parquet")
    train = ds.select(range(val, n))
    for i in range(4):
        train.shard(4, i, contiguous=True).to_parquet(root / f"train-{i:05d}.parquet")


def loader_rate(root: Path, args, streaming: bool, buffer: int = 16384, cache_mb: int | None = None) -> float:
    from vramfit import data as D
    from vramfit.config import DataConfig
    from vramfit.data.shards import ShardStepSampler

    cfg = DataConfig(source=str(root), image_size=args.image_size, streaming=streaming,
                     cache_dir=str(root / "cache"))
    splits = D.load_splits(cfg)
    if cache_mb is not None:
        splits.train.cache_bytes = cache_mb * 2 ** 20
    train_tf, _ = D.build_transforms(cfg, data_cfg_at(args.image_size), "cuda")
    ds = D.ImageDataset(splits.train, splits.image_column, splits.label_column, train_tf, args.image_size,
                        0, True, device_jitter=D.device_jitter(cfg, "cuda"))
    if streaming:
        sampler = ShardStepSampler(splits.train, args.batch, 0, 1, seed=0, buffer=buffer)
    else:
        sampler = D.StepBatchSampler(len(ds), args.batch, 0, 1, seed=0)
    loader = D.make_loader(ds, batch_sampler=sampler, workers=args.workers)
    return time_epochs(loader, args.epochs, sampler.set_epoch)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=600)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--noise", type=int, default=12)
    ap.add_argument("--small-cache-mb", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2, help="measurements per case; the best counts")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        write_files(root, args.images, args.noise)
        size = sum(f.stat().st_size for f in root.glob("train-*.parquet")) / 2 ** 20
        print(f"{args.images} images, train files {size:.1f} MiB, written in {time.perf_counter() - t0:.0f} s")
        cases = {"map-style": dict(streaming=False),
                 "streamed": dict(streaming=True),
                 f"streamed, {args.small_cache_mb} MiB cache": dict(streaming=True, cache_mb=args.small_cache_mb),
                 f"streamed, {args.small_cache_mb} MiB cache, buffer 100": dict(
                     streaming=True, cache_mb=args.small_cache_mb, buffer=100)}
        best = {name: 0.0 for name in cases}
        for _ in range(args.repeats):  # interleaved, so a busy moment of the machine hits every case
            for name, kw in cases.items():
                best[name] = max(best[name], loader_rate(root, args, **kw))
        base = best["map-style"]
        for name, ips in best.items():
            print(f"{name:40s} {ips:8.1f} img/s  {ips / base:5.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
