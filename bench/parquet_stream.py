"""Images/second of parquet files read streamed (`data.streaming: true`, data.tables) against the same
files loaded as a map-style dataset, through the same ImageDataset, transform and loader, and the row
groups read per row read.

The files: --images 500x375 JPEGs (bench/data_throughput.py's photo-like ones, ~50 KB at the default
noise) written by `datasets` in row groups of 100 rows (`to_parquet(batch_size=100)`; left to itself,
datasets 5.2 wrote each of these files as one row group), 4 train files and a validation file.
Cases: map-style (StepBatchSampler); streamed with the default shuffle buffer and
row-group cache (the window, here the whole train split, fits it); streamed with a cache of
--small-cache-mb, the window about 6x the cache as 16384 rows of 100 KB images are to the default
256 MiB (each row may cost its row group's read); that cache with the shuffle buffer the start note
suggests for it (data.tables.window_note); and --extra-buffer cases (data.shuffle_buffer with the
small cache). Each case also prints the start note its settings give, and the row groups read per row
read (`TableSamples.groups_read / rows_read`), counted in a pass without the loader that deals the
sampler's batches round-robin to --workers fresh readers, as the DataLoader deals them to its workers.

    python bench/parquet_stream.py                           # ~7 minutes on 2 CPU cores
    python bench/parquet_stream.py --images 600 --repeats 1  # a quick look
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
    ds.select(range(val)).to_parquet(root / "validation-00000.parquet", batch_size=100)
    train = ds.select(range(val, n))
    for i in range(4):
        train.shard(4, i, contiguous=True).to_parquet(root / f"train-{i:05d}.parquet", batch_size=100)


def data_cfg(root: Path, args, streaming: bool, buffer: int = 16384, cache_mb: int = 256):
    from vramfit.config import DataConfig

    return DataConfig(source=str(root), image_size=args.image_size, streaming=streaming,
                      cache_dir=str(root / "cache"), shuffle_buffer=buffer, table_cache_mb=cache_mb)


def sampler_of(splits, cfg, args, streaming: bool):
    from vramfit import data as D
    from vramfit.data.shards import ShardStepSampler

    if streaming:
        return ShardStepSampler(splits.train, args.batch, 0, 1, seed=0, buffer=cfg.shuffle_buffer,
                                partitions=cfg.shard_partitions)
    return D.StepBatchSampler(len(splits.train), args.batch, 0, 1, seed=0)


def loader_rate(root: Path, args, **case) -> float:
    from vramfit import data as D

    cfg = data_cfg(root, args, **case)
    splits = D.load_splits(cfg)
    train_tf, _ = D.build_transforms(cfg, data_cfg_at(args.image_size), "cuda")
    ds = D.ImageDataset(splits.train, splits.image_column, splits.label_column, train_tf, args.image_size,
                        0, True, device_jitter=D.device_jitter(cfg, "cuda"))
    sampler = sampler_of(splits, cfg, args, case["streaming"])
    loader = D.make_loader(ds, batch_sampler=sampler, workers=args.workers)
    return time_epochs(loader, args.epochs, sampler.set_epoch)


def group_reads(root: Path, args, **case) -> tuple[float, list[str]]:
    """(row groups read per row read over epoch 1, the start notes), the batches dealt round-robin to
    `args.workers` readers as the DataLoader deals them (each worker has its own cache)."""
    import pickle

    from vramfit import data as D

    cfg = data_cfg(root, args, **case)
    splits = D.load_splits(cfg)
    sampler = sampler_of(splits, cfg, args, True)
    sampler.set_epoch(1)
    readers = [pickle.loads(pickle.dumps(splits.train)) for _ in range(max(1, args.workers))]
    for k, batch in enumerate(sampler):
        for loc, *_ in batch:
            readers[k % len(readers)][loc]
    return sum(r.groups_read for r in readers) / sum(r.rows_read for r in readers), splits.notes


def main(argv=None) -> int:
    import pyarrow.parquet as pq

    from vramfit.data.tables import buffer_for

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=4000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--noise", type=int, default=12)
    ap.add_argument("--small-cache-mb", type=int, default=24)
    ap.add_argument("--extra-buffer", type=int, action="append", default=[],
                    help="also time the small cache with this data.shuffle_buffer (repeatable)")
    ap.add_argument("--repeats", type=int, default=2, help="measurements per case; the best counts")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        write_files(root, args.images, args.noise)
        size = sum(f.stat().st_size for f in root.glob("train-*.parquet")) / 2 ** 20
        print(f"{args.images} images, train files {size:.1f} MiB, written in "
              f"{time.perf_counter() - t0:.0f} s")
        small = args.small_cache_mb
        rows = args.images - args.images // 5
        groups = sum(pq.ParquetFile(f).metadata.num_row_groups for f in root.glob("train-*.parquet"))
        fits = buffer_for(data_cfg(root, args, True, cache_mb=small), rows, int(size * 2 ** 20), groups, 1)
        cases = {"map-style": dict(streaming=False),
                 "streamed": dict(streaming=True),
                 f"streamed, {small} MiB cache": dict(streaming=True, cache_mb=small),
                 **{f"streamed, {small} MiB cache, buffer {b}": dict(
                     streaming=True, cache_mb=small, buffer=b) for b in ({fits, *args.extra_buffer} - {0})}}
        reads = {name: group_reads(root, args, **kw) for name, kw in cases.items() if kw["streaming"]}
        best = {name: 0.0 for name in cases}
        for _ in range(args.repeats):  # interleaved, so a busy moment of the machine hits every case
            for name, kw in cases.items():
                best[name] = max(best[name], loader_rate(root, args, **kw))
        base = best["map-style"]
        for name, ips in best.items():
            per_row, notes = reads.get(name, (None, []))
            said = f"  {per_row:.3f} row groups read a row" if per_row is not None else ""
            print(f"{name:40s} {ips:8.1f} img/s  {ips / base:5.2f}x{said}")
            for n in notes:
                print(f"    note: {n}")
    return 0
if __name__ == "__main__":
    raise SystemExit(main())
