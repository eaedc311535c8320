"""WebDataset tar shards, read in place: a run's splits without materialising the dataset.

A sample is the run of consecutive tar members sharing a key (`00000042.jpg`, `00000042.cls`), as
WebDataset writes them. A sample is named by its *location*: shard number x 2**40 + the byte offset
of its first header, so a loader worker reads it with one seek, whatever worker it lands in.

The order of an epoch (a pure function of (seed, epoch, process count), docs/data.md):
1. the train shards are permuted by (seed, epoch);
2. their samples, concatenated in that order, are cut into one contiguous range per process, sized
   so that each process holds exactly its share (`batching.rank_slice`) of every optimizer step:
   each sample is seen once an epoch, except a last step of one sample, dropped as for every source;
3. each process reads the tar headers of its range (no image bytes) through a shuffle buffer of
   `data.shuffle_buffer` locations seeded by (seed, epoch, rank), and cuts the result into steps.
The buffer holds locations, not images, so host memory stays bounded by it and the workers'
prefetch. A resume re-reads the headers of the steps already trained and skips them by count: the
same samples in the same order, and the same augmentation (seeded by (seed, epoch, location)).
The loader workers decode the samples of the batches they are given, so the order does not depend
on the worker count (which `num_workers: auto` measures at each start).

Why tar reading is written here with Python's `tarfile` rather than taken from a library: none of
them gives count-exact mid-epoch resume of a shuffled tar stream. `webdataset` leaves resume to the
user (webdataset/webdataset#271) and its buffer is seeded per worker; HF `datasets` streaming
(`load_dataset("webdataset", streaming=True)`) restores `IterableDataset.state_dict()` without the
shuffle buffer's contents (datasets#7056, closed); MosaicML `streaming` resumes exactly, the same
at any node count, but reads its own MDS/CSV/JSONL shards, not tars; LitData likewise reads its own
chunk format. A tar is a 512-byte header before each member, which `tarfile.TarInfo.fromtarfile`
parses (with pax / GNU long names), so the hand-written part is the ordering, not the format.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import random
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from .. import batching
from ..errors import VramfitError
from . import stores
from .folders import IMAGE_EXTENSIONS
from .ordering import NO_SAMPLE, mix_seed

INDEX = "index.json"
FORMAT = "webdataset"
SHARD_BITS = 40  # a shard up to 1 TB; up to 2**23 shards in a 63-bit location
LABEL_EXTENSIONS = (".cls", ".json")
SPLIT_PREFIXES = {"train": "train", "val": "val", "validation": "val", "valid": "val", "test": "test"}
OPEN_SHARDS = 8  # open files a reader keeps, per process


def is_shards(source: str) -> bool:
    """Whether `--data` names tar shards: a folder holding `index.json` of this format, a `.tar`
    file, or a brace pattern of them (a local path or an fsspec URL)."""
    if "{" in source and ".." in source or source.endswith(".tar"):
        return True
    if stores.is_url(source):
        index = stores.join(source, INDEX)
        try:
            return stores.exists(index) and json.loads(stores.read_text(index)).get("format") == FORMAT
        except (OSError, ValueError):
            return False
    index = Path(source).expanduser() / INDEX
    if not index.is_file():
        return False
    try:
        return json.loads(index.read_text()).get("format") == FORMAT
    except (OSError, ValueError):
        return False


def expand_braces(pattern: str) -> list[str]:
    """`train-{000000..000003}.tar` -> the four names (zero padding kept), as WebDataset writes them."""
    m = re.search(r"\{(\d+)\.\.(\d+)\}", pattern)
    if not m:
        return sorted(glob.glob(os.path.expanduser(pattern))) or [pattern]
    lo, hi, width = int(m.group(1)), int(m.group(2)), len(m.group(1))
    return [n for i in range(lo, hi + 1)
            for n in expand_braces(pattern[:m.start()] + str(i).zfill(width) + pattern[m.end():])]


@dataclass(frozen=True)
class Shard:
    path: str
    samples: int


def _unreadable(path: str, why: str) -> VramfitError:
    return VramfitError(f"Shard {path} is unreadable: {why}.",
                        hint="re-write it (`vramfit prepare --format webdataset`) or remove it and its "
                             "entry from index.json")


def _open(path: str) -> tarfile.TarFile:
    try:
        if stores.is_url(path):  # seeks on it are range requests (data.stores)
            return tarfile.open(fileobj=stores.open_binary(path), mode="r:")
        return tarfile.open(path, "r:")
    except (OSError, tarfile.TarError) as e:
        raise _unreadable(path, f"{type(e).__name__}: {e}") from None


def _close(tar: tarfile.TarFile) -> None:
    tar.close()
    tar.fileobj.close()  # a file given to tarfile (a URL's) is left open by tar.close()


def _stem(name: str) -> str:
    head, base = os.path.split(name)
    return os.path.join(head, base.split(".", 1)[0])


def scan(path: str) -> Iterator[int]:
    """Header offsets of the samples of one shard, in order (no image bytes are read). A truncated
    or damaged shard raises a VramfitError naming it."""
    tar = _open(path)
    try:
        key = None
        while True:
            try:
                info = tar.next()
            except (tarfile.TarError, OSError, EOFError) as e:
                raise _unreadable(path, f"{type(e).__name__}: {e} (truncated?)") from None
            if info is None:
                return
            tar.members = []  # tarfile keeps every member read; a long shard must not grow memory
            if info.isfile() and _stem(info.name) != key:
                key = _stem(info.name)
                yield info.offset
    finally:
        _close(tar)


class ShardSamples:
    """The samples of some shards, read by location (`ImageDataset`'s `hf`): `self[loc]` is a row
    {"image": {"bytes", "path"}, "label"}. `len` is the index's count."""

    def __init__(self, shards: list[Shard], read_timeout_s: float | None = None):
        self.shards = list(shards)
        self.num_samples = sum(s.samples for s in shards)
        self.read_timeout_s = read_timeout_s  # the watch on the main process's reads of remote shards
        self._files: dict[int, tarfile.TarFile] = {}

    def __len__(self) -> int:
        return self.num_samples

    def __getstate__(self):  # open files stay in the process that opened them
        return {**self.__dict__, "_files": {}}

    def _tar(self, shard_no: int) -> tarfile.TarFile:
        tar = self._files.get(shard_no)
        if tar is None:
            if len(self._files) >= OPEN_SHARDS:
                _close(self._files.pop(next(iter(self._files))))
            tar = self._files[shard_no] = _open(self.shards[shard_no].path)
        return tar

    def __getitem__(self, loc: int) -> dict:
        shard_no, offset = divmod(int(loc), 2 ** SHARD_BITS)
        path = self.shards[shard_no].path
        tar = self._tar(shard_no)
        image, label, key = None, None, None
        try:
            while True:
                tar.fileobj.seek(offset)
                try:
                    info = tarfile.TarInfo.fromtarfile(tar)
                except tarfile.HeaderError:  # the end of the archive
                    break
                if key is not None and _stem(info.name) != key:
                    break
                key = _stem(info.name)
                ext = os.path.splitext(info.name)[1].lower()
                if ext in IMAGE_EXTENSIONS or ext in LABEL_EXTENSIONS:
                    tar.fileobj.seek(info.offset_data)
                    data = tar.fileobj.read(info.size)
                    if ext in LABEL_EXTENSIONS:
                        label = _label(data, ext)
                    else:
                        image = {"bytes": data, "path": f"{path}/{info.name}"}
                offset = info.offset_data + -(-info.size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
        except (OSError, tarfile.TarError, ValueError) as e:
            raise _unreadable(path, f"{type(e).__name__} at byte {offset}: {e}") from None
        if label is None:
            raise _unreadable(path, f"sample {key} has no .cls or .json label")
        return {"image": image or {"bytes": b"", "path": f"{path}/{key} (no image member)"}, "label": label}

    def offsets(self, shard_no: int) -> Iterable[int]:
        """The offsets of one shard's samples, in order (the location's low bits), checked against
        the index's count. A remote shard's headers are read whole under the read watch
        (data.stores.within): the sampler reads them in the main process, which no worker watch covers."""
        shard = self.shards[shard_no]
        if self.read_timeout_s is None or not stores.is_url(shard.path):
            return _checked_scan(shard)
        return stores.within(self.read_timeout_s, f"reading the tar headers of {shard.path}",
                             lambda: list(_checked_scan(shard)))

    def replacement(self, loc: int, k: int) -> int:
        """The k-th candidate in place of an unreadable image: the sample k places after it in its
        shard, wrapping (a function of the location only, so a resume replaces it the same way)."""
        shard_no = int(loc) // 2 ** SHARD_BITS
        locs = _shard_locations(self.shards[shard_no].path)
        pos = locs.index(int(loc) % 2 ** SHARD_BITS)
        return shard_no * 2 ** SHARD_BITS + locs[(pos + k) % len(locs)]


@functools.lru_cache(maxsize=4)
def _shard_locations(path: str) -> list[int]:
    return list(scan(path))


def _label(data: bytes, ext: str) -> int:
    if ext == ".cls":
        return int(data.decode().strip())
    obj = json.loads(data)
    return int(obj["label"] if isinstance(obj, dict) else obj)


class IndexedSamples:
    """Every sample of some shards by position (validation: `ImageDataset` asks for row i), from one
    header scan; 8 bytes a sample of host memory."""

    def __init__(self, samples: ShardSamples):
        self.samples = samples
        self.locs = np.asarray([n * 2 ** SHARD_BITS + off for n in range(len(samples.shards))
                                for off in samples.offsets(n)], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.locs)

    def __getitem__(self, i: int) -> dict:
        return self.samples[int(self.locs[int(i)])]


def _checked_scan(shard: Shard) -> Iterator[int]:
    n = 0
    for off in scan(shard.path):
        n += 1
        yield off
    if n != shard.samples:
        raise _unreadable(shard.path, f"it holds {n} samples, its index says {shard.samples} (truncated?)")


def process_totals(num_samples: int, global_batch: int, num_processes: int) -> list[list[int]]:
    """Per optimizer step of an epoch, each process's number of samples (`batching.rank_shares`)."""
    steps = batching.steps_per_epoch(num_samples, global_batch)
    return [batching.rank_shares(min(global_batch, num_samples - t * global_batch), num_processes)
            for t in range(steps)]


def buffered(stream: Iterator[int], size: int, rng: random.Random) -> Iterator[int]:
    """A shuffle through a buffer of `size` items: each incoming item takes the place of a random
    one, which is yielded; the rest, shuffled, at the end."""
    buf: list[int] = []
    for item in stream:
        if len(buf) < size:
            buf.append(item)
            continue
        j = rng.randrange(size)
        buf[j], item = item, buf[j]
        yield item
    rng.shuffle(buf)
    yield from buf


class ShardStepSampler:
    """`StepBatchSampler`'s contract (set_epoch, len, shares of (location, epoch, step_samples[,
    size]) keys) for tar shards, in the order the module docstring describes."""

    def __init__(self, samples: ShardSamples, global_batch: int, rank: int, num_processes: int,
                 seed: int, buffer: int, size_at: Callable[[int], int] | None = None):
        self.samples, self.global_batch, self.seed, self.buffer = samples, global_batch, seed, buffer
        self.rank, self.num_processes, self.size_at = rank, num_processes, size_at
        self.n = len(samples)
        self.epoch, self.start_step = 0, 0

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        self.epoch, self.start_step = epoch, start_step

    def __len__(self) -> int:
        return batching.steps_per_epoch(self.n, self.global_batch) - self.start_step

    def shard_order(self, epoch: int) -> list[int]:
        return np.random.default_rng(mix_seed(self.seed, epoch, "shards")).permutation(
            len(self.samples.shards)).tolist()

    def locations(self, epoch: int, start: int, stop: int) -> Iterator[int]:
        """Locations [start, stop) of the epoch's concatenated shard order; only the shards that
        overlap the range are opened."""
        pos = 0
        for shard_no in self.shard_order(epoch):
            shard = self.samples.shards[shard_no]
            if pos + shard.samples > start and pos < stop:
                for k, off in enumerate(self.samples.offsets(shard_no)):
                    if start <= pos + k < stop:
                        yield shard_no * 2 ** SHARD_BITS + off
            pos += shard.samples
            if pos >= stop:
                return

    def __iter__(self):
        shares = process_totals(self.n, self.global_batch, self.num_processes)
        per_epoch = len(shares)
        start = sum(sum(s[:self.rank]) for s in shares)
        mine = sum(s[self.rank] for s in shares)
        rng = random.Random(mix_seed(self.seed, self.epoch, self.rank, "buffer"))
        stream = buffered(self.locations(self.epoch, start, start + mine), self.buffer, rng)
        for step, s in enumerate(shares):
            locs = [next(stream) for _ in range(s[self.rank])]
            if step < self.start_step:
                continue  # read, not yielded: a resume continues at the same position
            size = () if self.size_at is None else (self.size_at(self.epoch * per_epoch + step),)
            n = sum(s)
            yield [(loc, self.epoch, n, *size) for loc in locs] or [(NO_SAMPLE, self.epoch, n, *size)]


@dataclass
class ShardIndex:
    """What `index.json` says: class names and each split's shards with their sample counts."""

    root: Path | str  # a local folder, or the URL of a remote one
    class_names: list[str]
    splits: dict[str, list[Shard]]


def read_index(source: str) -> ShardIndex:
    """The shards `--data` names: a folder with `index.json`, or a `.tar` / brace pattern whose
    folder holds one (then the pattern picks the train shards, the index the rest). Local paths and
    fsspec URLs alike (data.stores)."""
    src = source if stores.is_url(source) else os.path.expanduser(source)
    if stores.is_url(src):
        folder: Path | str = src.rstrip("/") if stores.is_dir(src) else stores.parent(src)
    else:
        folder = Path(src) if Path(src).is_dir() else Path(src).parent
    index = stores.join(str(folder), INDEX)
    if not stores.exists(index):
        raise VramfitError(f"--data {source}: no {INDEX} next to the shards ({index}).",
                           hint="write the shards with `vramfit prepare --data SRC --output DIR --format "
                                "webdataset`, which writes the index (class names, shards, sample counts)")
    try:
        meta = json.loads(stores.read_text(index))
        splits = {name: [Shard(stores.join(str(folder), s["name"]), int(s["samples"]))
                         for s in part["shards"]]
                  for name, part in meta["splits"].items()}
        class_names = [str(c) for c in meta["class_names"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise VramfitError(f"{index} is not a shard index: {type(e).__name__}: {e}",
                           hint="re-write it with `vramfit prepare --format webdataset`") from None
    if not stores.is_dir(src):
        wanted = {os.path.abspath(p) for p in expand_braces(src)}
        known = {os.path.abspath(s.path): s for s in splits.get("train", [])}
        missing = sorted(wanted - set(known))
        if missing:
            raise VramfitError(f"--data {source}: {missing[0]} is not a train shard of {index}.",
                               hint=f"the index lists {len(known)} train shard(s)")
        splits["train"] = [known[p] for p in sorted(wanted)]
    for shards in splits.values():
        for s in shards:
            _check_size(s)
    return ShardIndex(folder, class_names, splits)


def _check_size(shard: Shard) -> None:
    """A cheap check at start (no byte read): present, and a whole number of tar blocks (a copy cut
    short rarely ends on one); a damage that passes it is named when the shard is read."""
    try:
        size = stores.size(shard.path)
    except OSError as e:
        raise _unreadable(shard.path, e.strerror or type(e).__name__) from None
    if size % tarfile.BLOCKSIZE or size < 2 * tarfile.BLOCKSIZE:
        raise _unreadable(shard.path, f"{size} bytes, not a whole number of 512-byte tar blocks (truncated?)")
