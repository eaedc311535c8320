"""WebDataset tar shards, read in place: a run's splits without materialising the dataset.

A sample is the run of consecutive tar members sharing a key (`00000042.jpg`, `00000042.cls`), as
WebDataset writes them. A sample is named by its *location*: shard number x 2**40 + the byte offset
of its first header, so a loader worker reads it with one seek, whatever worker it lands in.

The order of an epoch (a pure function of (seed, epoch), the same at every process count that
divides `data.shard_partitions`; docs/data.md; MosaicML Streaming's "canonical nodes" do the same):
1. the train shards are permuted by (seed, epoch);
2. their samples, concatenated in that order, are cut into C = `data.shard_partitions` contiguous
   partitions, each sized to what it gives the epoch's steps (`batching.partition_shares`): each
   sample is seen once an epoch, except a last step of one sample, dropped as for every source;
3. each partition is read (its tar headers, no image bytes) through its own shuffle buffer of
   `data.shuffle_buffer // C` locations seeded by (seed, epoch, partition), and step t takes from
   each partition its share of the step;
4. each of P processes reads a contiguous block of C / P partitions: its share of a step is its
   partitions' part of it, so the steps, and the samples of each, are the same at any such P.
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
from typing import Callable, Iterator

import numpy as np

from .. import batching
from ..errors import VramfitError
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
    file, or a brace pattern of them."""
    if "{" in source and ".." in source or source.endswith(".tar"):
        return True
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
        return tarfile.open(path, "r:")
    except (OSError, tarfile.TarError) as e:
        raise _unreadable(path, f"{type(e).__name__}: {e}") from None


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
        tar.close()


class ShardSamples:
    """The samples of some shards, read by location (`ImageDataset`'s `hf`): `self[loc]` is a row
    {"image": {"bytes", "path"}, "label"}. `len` is the index's count."""

    def __init__(self, shards: list[Shard]):
        self.shards = list(shards)
        self.num_samples = sum(s.samples for s in shards)
        self._files: dict[int, tarfile.TarFile] = {}

    def __len__(self) -> int:
        return self.num_samples

    def __getstate__(self):  # open files stay in the process that opened them
        return {**self.__dict__, "_files": {}}

    def _tar(self, shard_no: int) -> tarfile.TarFile:
        tar = self._files.get(shard_no)
        if tar is None:
            if len(self._files) >= OPEN_SHARDS:
                self._files.pop(next(iter(self._files))).close()
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
        self.locs = np.asarray([n * 2 ** SHARD_BITS + off for n, shard in enumerate(samples.shards)
                                for off in _checked_scan(shard)], dtype=np.int64)

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


def partition_sizes(num_samples: int, global_batch: int, partitions: int) -> list[int]:
    """Each fixed partition's samples in an epoch: what it gives the epoch's steps
    (`batching.partition_shares`), so that each partition is used up exactly at the epoch's end."""
    full, rest = divmod(num_samples, global_batch)
    sizes = [full * q for q in batching.partition_shares(global_batch, partitions)]
    if batching.steps_per_epoch(num_samples, global_batch) > full:
        sizes = [a + b for a, b in zip(sizes, batching.partition_shares(rest, partitions))]
    return sizes


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
    """`StepBatchSampler`'s contract (set_epoch, len, shares, shares of (location, epoch,
    step_samples[, size]) keys) for tar shards, in the order the module docstring describes."""

    def __init__(self, samples: ShardSamples, global_batch: int, rank: int, num_processes: int,
                 seed: int, buffer: int, size_at: Callable[[int], int] | None = None, partitions: int = 8):
        self.samples, self.global_batch, self.seed, self.buffer = samples, global_batch, seed, buffer
        self.rank, self.num_processes, self.size_at = rank, num_processes, size_at
        self.partitions = partitions
        per = batching.check_partitions(partitions, num_processes)
        self.mine = range(rank * per, (rank + 1) * per)  # this process's block of partitions
        self.n = len(samples)
        self.epoch, self.start_step = 0, 0

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        self.epoch, self.start_step = epoch, start_step

    def __len__(self) -> int:
        return batching.steps_per_epoch(self.n, self.global_batch) - self.start_step

    def shares(self, step_samples: int) -> list[int]:
        """Each process's samples of a step of `step_samples` (what train.step splits)."""
        return batching.rank_shares(step_samples, self.num_processes, self.partitions)

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
                for k, off in enumerate(_checked_scan(shard)):
                    if start <= pos + k < stop:
                        yield shard_no * 2 ** SHARD_BITS + off
            pos += shard.samples
            if pos >= stop:
                return

    def partition(self, epoch: int, c: int, start: int, size: int) -> Iterator[int]:
        """Partition `c` of the epoch: its range of the shard order through its own buffer, seeded
        by (seed, epoch, partition), so no process count enters its order."""
        rng = random.Random(mix_seed(self.seed, epoch, c, "partition"))
        size_of_buffer = max(1, self.buffer // self.partitions)
        return buffered(self.locations(epoch, start, start + size), size_of_buffer, rng)

    def __iter__(self):
        per_epoch = batching.steps_per_epoch(self.n, self.global_batch)
        sizes = partition_sizes(self.n, self.global_batch, self.partitions)
        starts = [sum(sizes[:c]) for c in range(self.partitions)]
        streams = {c: self.partition(self.epoch, c, starts[c], sizes[c]) for c in self.mine}
        for step in range(per_epoch):
            n = min(self.global_batch, self.n - step * self.global_batch)
            takes = batching.partition_shares(n, self.partitions)
            locs = [next(streams[c]) for c in self.mine for _ in range(takes[c])]
            if step < self.start_step:
                continue  # read, not yielded: a resume continues at the same position
            size = () if self.size_at is None else (self.size_at(self.epoch * per_epoch + step),)
            yield [(loc, self.epoch, n, *size) for loc in locs] or [(NO_SAMPLE, self.epoch, n, *size)]


@dataclass
class ShardIndex:
    """What `index.json` says: class names and each split's shards with their sample counts."""

    root: Path
    class_names: list[str]
    splits: dict[str, list[Shard]]


def read_index(source: str) -> ShardIndex:
    """The shards `--data` names: a folder with `index.json`, or a `.tar` / brace pattern whose
    folder holds one (then the pattern picks the train shards, the index the rest)."""
    src = os.path.expanduser(source)
    folder = Path(src) if Path(src).is_dir() else Path(src).parent
    index = folder / INDEX
    if not index.is_file():
        raise VramfitError(f"--data {source}: no {INDEX} next to the shards ({index}).",
                           hint="write the shards with `vramfit prepare --data SRC --output DIR --format "
                                "webdataset`, which writes the index (class names, shards, sample counts)")
    try:
        meta = json.loads(index.read_text())
        splits = {name: [Shard(str(folder / s["name"]), int(s["samples"])) for s in part["shards"]]
                  for name, part in meta["splits"].items()}
        class_names = [str(c) for c in meta["class_names"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise VramfitError(f"{index} is not a shard index: {type(e).__name__}: {e}",
                           hint="re-write it with `vramfit prepare --format webdataset`") from None
    if not Path(src).is_dir():
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
        size = os.stat(shard.path).st_size
    except OSError as e:
        raise _unreadable(shard.path, e.strerror or type(e).__name__) from None
    if size % tarfile.BLOCKSIZE or size < 2 * tarfile.BLOCKSIZE:
        raise _unreadable(shard.path, f"{size} bytes, not a whole number of 512-byte tar blocks (truncated?)")
