"""Streaming libraries against vramfit's loaders: images/s, exact mid-epoch resume, order per process count.

The same generated images (320x240 JPEGs, bench/data_throughput.py's `photo_like`), the same DataLoader
(workers, batch, prefetch 4, persistent workers) and the same per-image work (vramfit's JPEG draft
decode, then its train transform: RandomResizedCrop + flip, uint8) for every case:

  map-style   ImageDataset on the image folder + StepBatchSampler (the baseline)
  vramfit     the folder's tar shards read in place (ShardSamples + ShardStepSampler, data/shards.py)
  webdataset  webdataset.WebDataset on the same tars, a shuffle buffer of data.shuffle_buffer
  hf          HF datasets `load_dataset("webdataset", data_files=tars, streaming=True)`, the same buffer
  mosaic      MosaicML streaming.StreamingDataset on MDS shards written from the same tars' samples
  litdata     LitData StreamingDataset on chunks `litdata.optimize` wrote from the same samples
A library case whose package is missing is skipped with the reason printed, so the bench runs in
the project's venv with the two vramfit cases only. Library cases decode in the DataLoader's
collate_fn, which runs in the workers, as ImageDataset's __getitem__ does.

Resume (measured): take 2 batches of epoch 0, save the case's state (vramfit: the epoch and step;
HF: IterableDataset.state_dict() at 0 workers, as multi-worker state needs torchdata's
StatefulDataLoader; mosaic / litdata: their StreamingDataLoader.state_dict()), rebuild everything,
resume, and compare the next batch's sample ids with an uninterrupted run's third batch. webdataset
has no state: "replay" says whether a rebuilt pipeline, skipping 2 batches, gives that batch.
Order at another process count: measured for vramfit's samplers (2 processes: each step's samples
against 1 process's), from the libraries' documentation for the others ("doc").

    python bench/stream_libraries.py                         # ~3 minutes on 2 CPU cores
    python bench/stream_libraries.py --images 2000 --repeats 3 --workers 2
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import shutil
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from data_throughput import data_cfg_at, loader_kwargs, make_folder, time_epochs  # noqa: E402

PACKAGES = {"webdataset": "webdataset", "hf": "datasets", "mosaic": "streaming", "litdata": "litdata"}
# What each library's documentation says of its order at another process count.
ORDER_DOC = {
    "webdataset": "no (doc: shards split by node, then worker; a buffer each)",
    "hf": "no (doc: split_dataset_by_node gives shards to nodes; a buffer each)",
    "mosaic": "yes (doc: fixed num_canonical_nodes, 'elastic determinism')",
    "litdata": "resume only (doc: num_canonical_nodes keeps the first run's layout)",
}


@dataclass
class Data:
    """The generated images in each case's format (a library's, only where it is installed)."""
    folder: Path
    shards: Path
    tars: list[str] = field(default_factory=list)
    mds: Path | None = None
    lit: Path | None = None


def missing(case: str) -> str | None:
    package = PACKAGES.get(case)
    if package is None or importlib.util.find_spec(package) is not None:
        return None
    return f"`{package}` is not installed"


def tar_samples(tars: list[str]):
    """(key, jpeg bytes, label) of each sample of the tars, in order."""
    for path in tars:
        with tarfile.open(path) as tar:
            parts: dict = {}
            for info in tar:
                stem, ext = os.path.splitext(info.name)
                parts.setdefault(stem, {})[ext] = tar.extractfile(info).read()
                if {".jpg", ".cls"} <= parts[stem].keys():
                    got = parts.pop(stem)
                    yield int(stem), got[".jpg"], int(got[".cls"])


def lit_item(sample):
    key, data, label = sample
    return {"key": key, "image": data, "label": label}


def make_data(work: Path, args) -> Data:
    from vramfit.commands.prepare import prepare_shards
    from vramfit.config import DataConfig

    data = Data(work / "folder", work / "shards")
    if not data.folder.exists():
        make_folder(data.folder, args.images, (320, 240), 10, 12, max(1, len(os.sched_getaffinity(0))))
    if not data.shards.exists():
        prepare_shards(DataConfig(source=str(data.folder)), str(data.shards), shard_samples=256,
                       log=open(os.devnull, "w"))
    data.tars = sorted(str(p) for p in data.shards.glob("train-*.tar"))
    if not missing("mosaic"):
        from streaming import MDSWriter

        data.mds = work / "mds"
        if not data.mds.exists():
            with MDSWriter(out=str(data.mds), columns={"key": "int", "image": "bytes", "label": "int"}) as w:
                for key, image, label in tar_samples(data.tars):
                    w.write({"key": key, "image": image, "label": label})
    if not missing("litdata"):
        import litdata

        data.lit = work / "litdata"
        if not data.lit.exists():
            litdata.optimize(fn=lit_item, inputs=list(tar_samples(data.tars)), output_dir=str(data.lit),
                             chunk_bytes="64MB", num_workers=1, verbose=False)
    return data


def fields_wds(s):
    return s["jpg"], int(s["cls"]), int(s["__key__"])


def fields_hf(s):
    return s["jpg"]["bytes"], int(s["cls"]), int(s["__key__"])


def fields_own(s):  # MDS and LitData: the columns written above
    return s["image"], int(s["label"]), int(s["key"])


class DecodeCollate:
    """A library's samples -> (uint8 images, labels, ids): ImageDataset's decode and transform."""

    def __init__(self, transform, draft: int, fields):
        self.transform, self.draft, self.fields = transform, draft, fields

    def __call__(self, samples):
        import torch

        from vramfit.data.decode import decode_with_size
        from vramfit.data.loader import stack_images

        images, labels, ids = [], [], []
        for s in samples:
            data, label, key = self.fields(s)
            images.append(self.transform(decode_with_size({"bytes": data, "path": None}, self.draft)[0]))
            labels.append(label)
            ids.append(key)
        return stack_images(images), torch.tensor(labels), torch.tensor(ids)


def transform(args):
    from vramfit import data as D
    from vramfit.config import DataConfig

    size = args.image_size
    train_tf, _ = D.build_transforms(DataConfig(image_size=size), data_cfg_at(size), "cuda")  # a GPU run's
    return train_tf, D.draft_size(train_tf, args.image_size)


def vramfit_loader(case: str, data: Data, args, rank: int = 0, processes: int = 1, workers=None):
    """(loader, sampler) of vramfit's map-style (the folder) or streamed (the tar shards) path."""
    from vramfit import data as D
    from vramfit.config import DataConfig
    from vramfit.data.shards import ShardStepSampler

    source = data.folder if case == "map-style" else data.shards
    cfg = DataConfig(source=str(source), image_size=args.image_size, num_workers=args.workers)
    src = D.load_source(cfg) if case == "map-style" else D.load_splits(cfg)
    tf, _ = transform(args)
    ds = D.ImageDataset(src.train, src.image_column, src.label_column, tf, args.image_size, 0, True)
    if case == "map-style":
        sampler = D.StepBatchSampler(len(ds), args.batch, rank, processes, seed=0)
    else:
        sampler = ShardStepSampler(src.train, args.batch, rank, processes, seed=0, buffer=cfg.shuffle_buffer,
                                   partitions=cfg.shard_partitions)
    w = args.workers if workers is None else workers
    return D.make_loader(ds, batch_sampler=sampler, workers=w), sampler


def library_loader(case: str, data: Data, args, workers=None):
    """(loader, dataset) of a library case: its dataset, shuffled, through a DataLoader (its own
    StreamingDataLoader where it has one, for its state_dict)."""
    import torch

    from vramfit.config import DataConfig

    w = args.workers if workers is None else workers
    tf, draft = transform(args)
    buffer = DataConfig().shuffle_buffer
    kw = dict(batch_size=args.batch, **loader_kwargs(w))
    if case == "webdataset":
        import webdataset as wds

        ds = wds.WebDataset(data.tars, shardshuffle=len(data.tars), seed=0, empty_check=False
                            ).shuffle(buffer, seed=0)  # its default seeds by pid and time
        return torch.utils.data.DataLoader(ds, collate_fn=DecodeCollate(tf, draft, fields_wds), **kw), ds
    if case == "hf":
        import datasets

        ds = datasets.load_dataset("webdataset", data_files={"train": data.tars}, split="train",
                                   streaming=True)
        ds = ds.decode(False).shuffle(seed=0, buffer_size=buffer)
        return torch.utils.data.DataLoader(ds, collate_fn=DecodeCollate(tf, draft, fields_hf), **kw), ds
    if case == "mosaic":
        import streaming

        ds = streaming.StreamingDataset(local=str(data.mds), shuffle=True, shuffle_seed=0,
                                        batch_size=args.batch)
        return streaming.StreamingDataLoader(ds, collate_fn=DecodeCollate(tf, draft, fields_own), **kw), ds
    import litdata

    ds = litdata.StreamingDataset(input_dir=str(data.lit), shuffle=True, seed=0)
    return litdata.StreamingDataLoader(ds, collate_fn=DecodeCollate(tf, draft, fields_own), **kw), ds


def images_per_second(case: str, data: Data, args) -> float:
    if case in ("map-style", "vramfit"):
        loader, sampler = vramfit_loader(case, data, args)
        return time_epochs(loader, args.epochs, sampler.set_epoch)
    loader, ds = library_loader(case, data, args)
    set_epoch = getattr(ds, "set_epoch", None) if case == "hf" else None
    try:
        return time_epochs(loader, args.epochs, set_epoch)
    finally:
        del loader, ds
        gc.collect()


def batch_ids(loader, count: int, skip: int = 0) -> list[list[int]]:
    out = []
    for k, batch in enumerate(loader):
        if k >= skip:
            ids = batch.indices if hasattr(batch, "indices") else batch[2]
            out.append(sorted(ids.tolist()))
        if len(out) == count:
            break
    return out


def resumes(case: str, data: Data, args) -> str:
    """Whether the batch after a save at 2 batches, resumed in a rebuilt pipeline, is an
    uninterrupted run's third batch (see the module docstring)."""
    if case in ("map-style", "vramfit"):
        loader, sampler = vramfit_loader(case, data, args)
        sampler.set_epoch(0)
        want = batch_ids(loader, 3)[2]
        loader, sampler = vramfit_loader(case, data, args)
        sampler.set_epoch(0, start_step=2)  # the state a checkpoint keeps
        return "yes" if batch_ids(loader, 1)[0] == want else "NO"
    workers = 0 if case == "hf" else args.workers  # HF: the state is the dataset's, in this process
    loader, ds = library_loader(case, data, args, workers)
    want = batch_ids(loader, 3)[2]
    del loader, ds
    gc.collect()
    if case == "webdataset":
        loader, ds = library_loader(case, data, args, workers)
        replay = batch_ids(loader, 1, skip=2)[0] == want
        return f"no state; replay {'yes' if replay else 'no'}"
    loader, ds = library_loader(case, data, args, workers)
    batch_ids(loader, 2)
    state = ds.state_dict() if case == "hf" else loader.state_dict()
    del loader, ds
    gc.collect()
    loader, ds = library_loader(case, data, args, workers)
    (ds if case == "hf" else loader).load_state_dict(state)
    got = (batch_ids(loader, 1) or [[]])[0]  # nothing left: resumed past the samples it had read
    del loader, ds
    gc.collect()
    return ("yes" if got == want else f"no ({len(set(got) & set(want))}/{len(want)} ids)") + \
        (" (0 workers)" if case == "hf" else "")


def same_order_at_two(case: str, data: Data, args) -> str:
    """vramfit's samplers: each step's samples at 2 processes against 1 process's (measured)."""
    if case not in ("map-style", "vramfit"):
        return ORDER_DOC[case]
    from vramfit.data import NO_SAMPLE  # the placeholder of a process's empty share

    def steps(rank: int, processes: int):
        sampler = vramfit_loader(case, data, args, rank, processes, workers=0)[1]
        sampler.set_epoch(0)
        return [sorted(key[0] for key in step if key[0] != NO_SAMPLE) for step in sampler]

    one, (r0, r1) = steps(0, 1), (steps(0, 2), steps(1, 2))
    return "yes (measured)" if one == [sorted(a + b) for a, b in zip(r0, r1)] else "NO (measured)"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=2000, help="320x240 JPEGs generated")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each case, interleaved; the best counts")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--epochs", type=int, default=1, help="timed epochs (after a few untimed batches)")
    ap.add_argument("--cases", default="map-style,vramfit,webdataset,hf,mosaic,litdata")
    ap.add_argument("--workdir", help="keep the generated files here (default: a temporary folder)")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)  # the main process only collates; decoding happens in the workers
    cases = args.cases.split(",")
    for case in cases:
        if missing(case):
            print(f"skipped {case}: {missing(case)}")
    cases = [c for c in cases if not missing(c)]
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="vramfit-libs-"))
    t_start = time.time()
    try:
        data = make_data(work, args)
        best = {c: 0.0 for c in cases}
        # Interleaved, each repeat starting at the next case: a burst of other load hits one run of
        # each case, and no case always runs first.
        for rep in range(args.repeats):
            for case in cases[rep % len(cases):] + cases[:rep % len(cases)]:
                best[case] = max(best[case], images_per_second(case, data, args))
                print(f"  {case}: {best[case]:.1f} images/s", flush=True)
        rows = [(c, best[c], resumes(c, data, args), same_order_at_two(c, data, args)) for c in cases]
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    print_table(rows, args)
    print(f"total {time.time() - t_start:.0f} s")
    return 0


def print_table(rows, args) -> None:
    base = dict((c, ips) for c, ips, *_ in rows).get("map-style")
    print(f"\n{args.images} 320x240 JPEGs; images/s best of {args.repeats}, {args.workers} workers, "
          f"batch {args.batch}, {args.image_size} px, {args.epochs} timed epoch(s)")
    print(f"{'case':<12}{'images/s':>10}{'ratio':>8}  {'exact resume':<28}order at another process count")
    for case, ips, resume, order in rows:
        ratio = f"{ips / base:.2f}x" if base else "-"
        print(f"{case:<12}{ips:>10.1f}{ratio:>8}  {resume:<28}{order}")


if __name__ == "__main__":
    sys.exit(main())
