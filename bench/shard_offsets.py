"""The sampler's main-process cost per sample on tar shards: an epoch's locations (ShardStepSampler,
no image read) from `prepare`'s offset sidecars against the same shards with the sidecars removed
(every shard's tar headers read each epoch), at a local path and at a `file://` URL (fsspec: range
requests, as at `s3://`).

The shards: --images 500x375 photo-like JPEGs (bench/data_throughput.py's, ~50 KB at the default
noise) written by `vramfit prepare --format webdataset --shard-samples --per-shard`.

    python bench/shard_offsets.py                 # ~1 minute on 2 CPU cores
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from data_throughput import make_folder


def epoch_seconds(source: str, epoch: int) -> float:
    from vramfit.data.shards import ShardSamples, ShardStepSampler, read_index

    samples = ShardSamples(read_index(source).splits["train"], read_timeout_s=60)
    sampler = ShardStepSampler(samples, 32, 0, 1, seed=0, buffer=1024)
    sampler.set_epoch(epoch)
    t0 = time.perf_counter()
    n = sum(len(batch) for batch in sampler)
    assert n >= len(samples) - 32, n
    return time.perf_counter() - t0


def _best(source: str, repeats: int) -> tuple[float, int]:
    """The best epoch's seconds over `repeats` epochs, and the train samples an epoch holds."""
    from vramfit.data.shards import read_index

    n = sum(s.samples for s in read_index(source).splits["train"])
    return min(epoch_seconds(source, e) for e in range(repeats)), n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--per-shard", type=int, default=250, help="samples a shard")
    ap.add_argument("--noise", type=int, default=12, help="+-noise per pixel (sets the JPEG size)")
    ap.add_argument("--repeats", type=int, default=3, help="epochs timed per case; the best counts")
    ap.add_argument("--workdir", help="keep the generated files here (default: a temporary folder)")
    args = ap.parse_args(argv)
    from vramfit.cli import run

    work = Path(args.workdir or tempfile.mkdtemp(prefix="shard-offsets-"))
    folder, wds, scanned = work / "images", work / "wds", work / "wds-no-sidecars"
    if not folder.exists():
        mb = make_folder(folder, args.images, (500, 375), 10, args.noise, 2)
        print(f"{args.images} JPEGs of {mb * 1000:.0f} KB mean")
    if not wds.exists():
        assert run(["prepare", "--data", str(folder), "--output", str(wds), "--format", "webdataset",
                    "--shard-samples", str(args.per_shard), "--set", "data.val_fraction=0.1"]) == 0
    if not scanned.exists():
        shutil.copytree(wds, scanned, ignore=shutil.ignore_patterns("*.idx"))
    print(f"{'case':<34} {'epoch s':>8} {'us/sample':>10} {'vs scan':>8}")
    try:
        for where, prefix in (("local", ""), ("file:// URL", "file://")):
            times = {what: _best(f"{prefix}{path}", args.repeats)
                     for what, path in (("header scan", scanned), ("sidecars", wds))}
            for what, (best, n) in times.items():
                ratio = times["header scan"][0] / best
                print(f"{where + ', ' + what:<34} {best:8.3f} {best / n * 1e6:10.1f} {ratio:7.1f}x")
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
