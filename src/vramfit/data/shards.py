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
3. each partition is read (its samples' offsets: `prepare`'s sidecar, else the tar headers; no image
   bytes) through its own shuffle buffer of `data.shuffle_buffer // C` locations seeded by (seed,
   epoch, partition), and step t takes from each partition its share of the step;
4. each of P processes reads a contiguous block of C / P partitions: its share of a step is its
   partitions' part of it, so the steps, and the samples of each, are the same at any such P.
The buffer holds locations, not images, so host memory stays bounded by it and the workers'
prefetch. A resume re-reads the offsets of the steps already trained and skips them by count: the
same samples in the same order, and the same augmentation (seeded by (seed, epoch, location)).
The loader workers decode the samples of the batches they are given, so the order does not depend
on the worker count (which `num_workers: auto` measures at each start).

Why tar reading is written here with Python's `tarfile` rather than taken from a library (measured on
the same tars by bench/stream_libraries.py, docs/benchmarks.md): none of them resumes a shuffled tar
stream exactly mid-epoch. `webdataset` keeps no state (webdataset/webdataset#271): with its shard and
buffer shuffles seeded, a rebuilt pipeline replays the same order, so a resume re-reads every sample
before the stop, and (by its documentation) its order follows the split of shards over nodes and
workers; HF `datasets` streaming restores `IterableDataset.state_dict()` without the shuffle buffer's
contents (datasets#7056): resumed after 2 batches it gave none of the next batch's samples, the state
pointing past all the buffer had read; MosaicML `streaming` and LitData resume exactly (MosaicML
documents the same order at any node count), but read only their own formats (MDS, LitData chunks), so
a tar dataset would be written again. Throughput decides nothing: on 2,000 images on 2 shared cores
every library was within 10% of this reader's images/s in the quietest of three runs, and the cases'
order changed from run to run by more than that. A tar is a 512-byte header before each member, which
`tarfile.TarInfo.fromtarfile` parses (with pax / GNU long names), so the hand-written part is the
ordering, not the format.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import random
import re
import tarfile
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePath
from typing import Callable, Iterable, Iterator

import numpy as np

from .. import batching
from ..errors import VramfitError
from . import stores
from .folders import IMAGE_EXTENSIONS
from .ordering import NO_SAMPLE, mix_seed
from .schema import VAL_SPLITS, split_of

INDEX = "index.json"
FORMAT = "webdataset"
SHARD_BITS = 40  # a shard up to 1 TB; up to 2**23 shards in a 63-bit location
LABEL_EXTENSIONS = (".cls", ".json")
OPEN_SHARDS = 8  # open files a reader keeps, per process
INFO_FILES = ("_info.json", "_info.yaml", "info.json")  # timm's reader_wds reads these
NAME_FIELDS = ("class_name", "name")  # a .json label's class name, where it carries one
OFFSETS = ".idx"  # a prepared shard's sidecar (`train-000000.idx`): see `write_offsets`
OFFSET_TYPE = np.dtype("<i8")


def is_shards(source: str) -> bool:
    """Whether `--data` names tar shards: a `.tar` file or a brace pattern of them, or a folder
    holding `index.json` of this format, a timm info file (`_info.json`) or `.tar` files; at an
    fsspec URL, a folder holding `index.json`."""
    if "{" in source and ".." in source or source.endswith(".tar"):
        return True
    if stores.is_url(source):
        index = stores.join(source, INDEX)
        try:
            return stores.exists(index) and _format_of(json.loads(stores.read_text(index))) is not None
        except (OSError, ValueError):
            return False
    folder = Path(source).expanduser()
    if not folder.is_dir():
        return False
    return _vramfit_index(folder) is not None or _info_file(folder) is not None or \
        any(f.suffix == ".tar" for f in folder.iterdir() if f.is_file())


def _format_of(meta) -> dict | None:
    return meta if isinstance(meta, dict) and meta.get("format") == FORMAT else None


def _vramfit_index(folder: Path) -> dict | None:
    index = folder / INDEX
    if not index.is_file():
        return None
    try:
        return _format_of(json.loads(index.read_text()))
    except (OSError, ValueError):
        return None


def _info_file(folder: Path) -> Path | None:
    return next((folder / n for n in INFO_FILES if (folder / n).is_file()), None)


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
    samples: int  # the samples a run uses: the shard's first `samples`
    total: int | None = None  # what the shard holds, where a limit uses fewer (data.limit_*_samples)
    bytes: int | None = None  # its size when `prepare` wrote it (index.json), which its sidecar fits
    offsets: str | None = None  # the sidecar of its samples' header offsets (`write_offsets`), if any


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
    head, sep, base = name.rpartition("/")
    return head + sep + base.split(".", 1)[0]


BLOCK = tarfile.BLOCKSIZE
REGULAR = (tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.CONTTYPE)
PLAIN = (*REGULAR, tarfile.LNKTYPE, tarfile.SYMTYPE, tarfile.CHRTYPE, tarfile.BLKTYPE, tarfile.DIRTYPE,
         tarfile.FIFOTYPE)
OPEN_LOCAL_SHARDS = 64  # a local shard open for reading is one descriptor; a remote one holds a read-ahead
READ_AHEAD = (16 * 1024, 4 * 2**20)  # bounds of a sample's first read: twice the mean span seen so far


class _ShardFile:
    """One shard open for reads at byte offsets: `os.pread` on a local file (one system call, no
    seek), seek + read on a remote one (data.stores: range requests); a `tarfile.TarFile` on it
    only for the headers `_member` leaves to tarfile."""

    def __init__(self, path: str):
        self.path, self._tar = path, None
        try:
            self.fd = None if stores.is_url(path) else os.open(path, os.O_RDONLY)
            self.remote = stores.open_binary(path) if self.fd is None else None
        except OSError as e:
            raise _unreadable(path, f"{type(e).__name__}: {e}") from None

    def read(self, offset: int, n: int) -> bytes:
        if self.fd is not None:
            return os.pread(self.fd, n, offset)
        self.remote.seek(offset)
        return self.remote.read(n)

    def tar(self) -> tarfile.TarFile:
        if self._tar is None:
            self._tar = _open(self.path)
        return self._tar

    def close(self) -> None:
        if self._tar is not None:
            _close(self._tar)
        if self.fd is not None:
            os.close(self.fd)
        else:
            self.remote.close()


def _octal(field: bytes) -> int:
    return int(field.split(b"\0", 1)[0].strip() or b"0", 8)


def _member(file: _ShardFile, offset: int, block: bytes) -> tuple[str, int, int, bool] | None:
    """The member whose header is at `offset` (`block`: the bytes read there, 512 unless the file
    ends): (name, offset of its data, size, whether it is a file), or None at the end of the archive.
    A plain ustar header (what `prepare` and webdataset's writers write for names under 100
    characters) is parsed here, with its checksum: tarfile's `TarInfo.frombuf` decodes all 17
    fields, at over 10x the cost, which the loader would pay for each header of each sample. Any
    other header (pax, GNU long names, a base-256 size, a bad checksum) is read by tarfile's parser,
    which knows them."""
    if len(block) < BLOCK or block.count(0) == BLOCK:
        return None  # as tarfile: the file ends, or a zero block marks the end
    kind = block[156:157]
    if kind in PLAIN and not block[124] & 0x80:
        try:
            # the chksum field counts as 8 spaces; the trailing zeros of the block add nothing
            ok = _octal(block[148:156]) == sum(block[:148]) + 256 + sum(block[156:].rstrip(b"\0"))
            size = _octal(block[124:136])
        except ValueError:
            ok = False
        if ok:
            name = block[:100].split(b"\0", 1)[0].decode(tarfile.ENCODING, "surrogateescape")
            prefix = block[345:500].split(b"\0", 1)[0].decode(tarfile.ENCODING, "surrogateescape")
            name = f"{prefix}/{name}" if prefix else name
            is_file = kind in REGULAR and not name.endswith("/")
            return name, offset + BLOCK, size if is_file else 0, is_file
    tar = file.tar()
    tar.fileobj.seek(offset)
    try:
        info = tarfile.TarInfo.fromtarfile(tar)
    except (tarfile.EOFHeaderError, tarfile.EmptyHeaderError, tarfile.TruncatedHeaderError):
        return None
    return info.name, info.offset_data, info.size if info.isreg() else 0, info.isreg()


def _padded(size: int) -> int:
    return -(-size // BLOCK) * BLOCK


def _members(path: str) -> Iterator[tuple[int, str, int, int, bool, _ShardFile]]:
    """Every member of one shard, in order: (header offset, name, data offset, size, is a file, the
    open shard to read its data from). A truncated or damaged shard raises a VramfitError naming it."""
    file = _ShardFile(path)
    try:
        offset = 0
        while True:
            try:
                member = _member(file, offset, file.read(offset, BLOCK))
                if member is None and offset and not file.read(offset - 1, 1):
                    raise EOFError("unexpected end of data")  # the last member's data is cut
            except (tarfile.TarError, OSError, EOFError) as e:
                raise _unreadable(path, f"{type(e).__name__}: {e} (truncated?)") from None
            if member is None:
                return
            name, data_at, size, is_file = member
            yield offset, name, data_at, size, is_file, file
            offset = data_at + _padded(size)
    finally:
        file.close()


def scan(path: str) -> Iterator[int]:
    """Header offsets of the samples of one shard, in order (no image bytes are read). A truncated
    or damaged shard raises a VramfitError naming it."""
    key = None
    for offset, name, _, _, is_file, _ in _members(path):
        if is_file and _stem(name) != key:
            key = _stem(name)
            yield offset


class _Span:
    """The bytes of a shard from `start` on, read in one read of `n` and extended when a member
    reaches past them."""

    def __init__(self, file: _ShardFile, start: int, n: int):
        self.file, self.start, self.buf = file, start, file.read(start, n)

    def get(self, offset: int, n: int) -> bytes:
        end = offset + n - self.start
        if end > len(self.buf):
            self.buf += self.file.read(self.start + len(self.buf), end - len(self.buf) + BLOCK)
        return self.buf[offset - self.start:end]


class ShardSamples:
    """The samples of some shards, read by location (`ImageDataset`'s `hf`): `self[loc]` is a row
    {"image": {"bytes", "path"}, "label"}. `len` is the index's count. `classes`: where no read at
    start saw these shards' labels (`ShardIndex.unread_labels`), the class count their labels are
    checked against as their headers are read."""

    def __init__(self, shards: list[Shard], read_timeout_s: float | None = None, classes: int | None = None):
        self.shards = list(shards)
        self.num_samples = sum(s.samples for s in shards)
        self.read_timeout_s = read_timeout_s  # the watch on the main process's reads of remote shards
        self.classes = classes
        self._files: dict = {}
        self._spans = [0, 0]  # bytes and samples read: a sample's first read is twice their mean

    def __len__(self) -> int:
        return self.num_samples

    def __getstate__(self):  # open files stay in the process that opened them
        return {**self.__dict__, "_files": {}}

    def _shard_file(self, shard_no: int) -> _ShardFile:
        """The shard open for reading; the least recently used closes past the limit."""
        file = self._files.pop(shard_no, None)
        if file is None:
            path = self.shards[shard_no].path
            if len(self._files) >= (OPEN_SHARDS if stores.is_url(path) else OPEN_LOCAL_SHARDS):
                self._files.pop(next(iter(self._files))).close()
            file = _ShardFile(path)
        self._files[shard_no] = file
        return file

    def __getitem__(self, loc: int) -> dict:
        """The sample at `loc`: its members up to the next key, from one read of its span."""
        shard_no, offset = divmod(int(loc), 2 ** SHARD_BITS)
        path = self.shards[shard_no].path
        file, start = self._shard_file(shard_no), offset
        total, count = self._spans
        ahead = min(max(2 * total // max(count, 1), READ_AHEAD[0]), READ_AHEAD[1])
        image, label, key = None, None, None
        try:
            span = _Span(file, offset, ahead)
            while (member := _member(file, offset, span.get(offset, BLOCK))) is not None:
                name, data_at, size, is_file = member
                if key is not None and _stem(name) != key:
                    break
                key = _stem(name)
                ext = os.path.splitext(name)[1].lower()
                if is_file and (ext in IMAGE_EXTENSIONS or ext in LABEL_EXTENSIONS):
                    data = span.get(data_at, size)
                    if len(data) < size:
                        raise EOFError(f"{name} is cut short (truncated?)")
                    if ext in LABEL_EXTENSIONS:
                        label = _label(data, ext)
                    else:
                        image = {"bytes": data, "path": f"{path}/{name}"}
                offset = data_at + _padded(size)
        except (OSError, EOFError, tarfile.TarError, ValueError) as e:
            raise _unreadable(path, f"{type(e).__name__} at byte {offset}: {e}") from None
        self._spans = [total + offset + BLOCK - start, count + 1]
        if label is None:
            raise _unreadable(path, f"sample {key} has no .cls or .json label")
        return {"image": image or {"bytes": b"", "path": f"{path}/{key} (no image member)"}, "label": label}

    def offsets(self, shard_no: int) -> Iterable[int]:
        """The offsets of one shard's samples, in order (the location's low bits), checked against
        the index's count. A remote shard's headers are read whole under the read watch
        (data.stores.within): the sampler reads them in the main process, which no worker watch covers."""
        shard = self.shards[shard_no]
        if self.read_timeout_s is None or not stores.is_url(shard.path):
            return self._offsets(shard, lazy=True)
        return stores.within(self.read_timeout_s, f"reading the sample offsets of {shard.path}",
                             self._offsets, shard)

    def _offsets(self, shard: Shard, lazy: bool = False) -> Iterable[int]:
        """From the shard's sidecar where it fits the shard (`written_offsets`), else from its headers
        (lazily where `lazy`: a local scan holds no list); labels to check (`classes`) are read with
        the headers."""
        written = None if self.classes is not None else written_offsets(shard)
        if written is not None:
            return written[:shard.samples].tolist()
        rows = _checked_scan(shard, self.classes)
        return rows if lazy else list(rows)

    def replacement(self, loc: int, k: int) -> int:
        """The k-th candidate in place of an unreadable image: the sample k places after it among
        the samples the split holds of its shard (a limit's first `samples`), wrapping (a function
        of the location only, so a resume replaces it the same way)."""
        shard_no = int(loc) // 2 ** SHARD_BITS
        locs = _shard_locations(self.shards[shard_no])[:self.shards[shard_no].samples]
        pos = locs.index(int(loc) % 2 ** SHARD_BITS)
        return shard_no * 2 ** SHARD_BITS + locs[(pos + k) % len(locs)]


@functools.lru_cache(maxsize=4)
def _shard_locations(shard: Shard) -> list[int]:
    """A shard's sample offsets for `replacement`: its sidecar where it fits, else its headers."""
    written = written_offsets(shard)
    return written.tolist() if written is not None else list(scan(shard.path))


def write_offsets(path: str | Path, offsets: list[int]) -> None:
    """A shard's sidecar, written by `prepare` beside it: the offsets of its samples' first headers
    (the locations' low bits), little-endian int64, one a sample, so a run reads 8 bytes a sample
    instead of every header of the shard each epoch. A file of its own rather than a list in
    index.json: ImageNet's 1.28 M offsets would make index.json ~10 MB, read whole at every start."""
    Path(path).write_bytes(np.asarray(offsets, dtype=OFFSET_TYPE).tobytes())


def written_offsets(shard: Shard) -> np.ndarray | None:
    """A shard's offsets from its sidecar, or None where its headers are to be scanned instead: no
    sidecar (shards of other tools, an index-less folder, a sidecar removed), or one that does not
    fit the shard: the shard's size is not index.json's (written again since `prepare`), or the
    sidecar's count is not the index's, or its offsets are not ascending tar blocks inside the shard.
    The scan then reads the shard as it is and checks its count against the index."""
    if shard.offsets is None or shard.bytes is None:
        return None
    try:
        if stores.size(shard.path) != shard.bytes:
            return None
        offs = np.frombuffer(stores.read_bytes(shard.offsets), dtype=OFFSET_TYPE)
    except (OSError, ValueError):  # missing, or not a whole number of int64
        return None
    fits = len(offs) == (shard.samples if shard.total is None else shard.total) and (
        not len(offs) or offs[0] >= 0 and offs[-1] < shard.bytes and not np.any(offs % BLOCK)
        and bool(np.all(np.diff(offs) > 0)))
    return offs if fits else None


def _label(data: bytes, ext: str) -> int:
    if ext == ".cls":
        return int(data.decode().strip())
    obj = json.loads(data)
    return int(obj["label"] if isinstance(obj, dict) else obj)


class IndexedSamples:
    """Every sample of some shards by position (validation: `ImageDataset` asks for row i), from one
    header scan, made when a row is first asked for; 8 bytes a sample of host memory. Given a
    function making the samples (`ShardIndex.samples`), the split's shards are not even checked
    until then: a command's splits are built, only those it uses are read."""

    def __init__(self, samples: ShardSamples | Callable[[], ShardSamples]):
        if callable(samples):
            self.make = samples
        else:
            self.samples = samples

    @functools.cached_property
    def samples(self) -> ShardSamples:
        return self.make()

    @functools.cached_property
    def locs(self) -> np.ndarray:
        samples = self.samples
        return np.asarray([n * 2 ** SHARD_BITS + off for n in range(len(samples.shards))
                           for off in samples.offsets(n)], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.samples)  # the index's count: the scan checks it

    def __getitem__(self, i: int) -> dict:
        return self.samples[int(self.locs[int(i)])]


def _checked_scan(shard: Shard, classes: int | None = None) -> Iterator[int]:
    """The offsets of the samples a run uses of one shard, its count checked; with `classes`, each
    one's label too (read with its header: `labelled`)."""
    n, expect = 0, shard.samples if shard.total is None else shard.total
    rows = ((off, 0, "") for off in scan(shard.path)) if classes is None else \
        ((off, label, key) for off, label, _, key in labelled(shard.path))
    for off, label, key in rows:
        if n < shard.samples:
            if classes is not None and not (label is not None and 0 <= label < classes):
                raise _outside_classes(shard.path, key, label, classes)
            yield off
        n += 1
    if n != expect:
        raise _unreadable(shard.path, f"it holds {n} samples, its index says {expect} (truncated?)")


def _outside_classes(path: str, key: str, label: int | None, classes: int) -> VramfitError:
    what = "no .cls or .json label" if label is None else f"label {label}"
    return VramfitError(
        f"Shard {path}: sample {os.path.basename(key)} has {what}, outside the {classes} classes (0 to "
        f"{classes - 1}) found in the labels of the shards read at start.",
        hint="without class names, the classes are the labels found, and an info file's split counts "
             "leave its train labels unread at start: give the validation split a sample of every "
             "class, remove the info file (every shard's labels are then read at start), or re-write "
             "the shards with `vramfit prepare --format webdataset` (its index.json names the classes)")


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
                for k, off in enumerate(self.samples.offsets(shard_no)):
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


UNCOUNTED = -1  # a shard's count before `survey` (no index or info file gives it)


@dataclass
class ShardIndex:
    """The splits of some shards with their sample counts, and the class names. A split's shards
    are checked (`_check_size`) when it is first asked for (`split`), so a command reads only the
    splits it uses (`vramfit eval`: one); those read at start for their counts or the class names
    are ready at once."""

    root: Path | str  # a local folder, or the URL of a remote one
    class_names: list[str]
    listed: dict[str, list[Shard]]  # each split's shards as the index, info file or names give them
    # Splits whose labels no read at start has seen, where the classes are the labels found (an
    # info file's counts without class names): checked as their headers are read (ShardSamples).
    unread_labels: frozenset[str] = frozenset()
    ready: dict[str, list[Shard]] = field(default_factory=dict, repr=False)

    def split(self, name: str) -> list[Shard]:
        """One split's shards, checked (present, whole tar blocks) and counted."""
        if name not in self.ready:
            for s in self.listed[name]:
                _check_size(s)
            self.ready[name] = list(self.listed[name])
        return self.ready[name]

    @property
    def splits(self) -> dict[str, list[Shard]]:
        """Every split, checked."""
        return {name: self.split(name) for name in self.listed}

    def samples(self, name: str, shards: list[Shard] | None = None,
                read_timeout_s: float | None = None) -> ShardSamples:
        """The samples of split `name` (of `shards`, a limited part of it, where given)."""
        classes = len(self.class_names) if name in self.unread_labels else None
        return ShardSamples(self.split(name) if shards is None else shards, read_timeout_s, classes)


def read_index(source: str) -> ShardIndex:
    """The shards `--data` names: a folder, or a `.tar` / brace pattern in one (the pattern picks the
    train shards, the folder the other splits). Counts and class names come from vramfit's
    `index.json`, else timm's info file (`_info.json`: each split's file names and shard lengths),
    else from one scan of the shards' headers and labels (docs/data.md). At an fsspec URL
    (data.stores), `index.json` only."""
    if stores.is_url(source):
        return _remote_index(source)
    src = os.path.expanduser(source)
    folder = Path(src) if Path(src).is_dir() else Path(src).parent
    meta, info = _vramfit_index(folder), _info_file(folder)
    if meta is not None:
        splits, names, listed_in = _from_index(meta, str(folder)), meta.get("class_names"), str(folder / INDEX)
    elif info is not None:
        splits, names, listed_in = _from_info(info, folder), None, str(info)
    else:
        splits, names, listed_in = _from_names(folder), None, None
    if not Path(src).is_dir():
        _pick_train(source, splits, listed_in)
    index = ShardIndex(folder, [], splits)
    labels: dict[int, str | None] = {}
    for name, shards in splits.items():
        if any(s.samples == UNCOUNTED for s in shards) or names is None and name in VAL_SPLITS:
            index.ready[name] = [_surveyed(s, labels) for s in index.split(name)]
    if names is None:
        names = _class_names(labels, folder)
        index.unread_labels = frozenset(splits) - set(index.ready)
    index.class_names = [str(c) for c in names]
    return index


def _from_index(meta: dict, folder: str) -> dict[str, list[Shard]]:
    try:
        return {name: [_indexed(folder, s) for s in part["shards"]] for name, part in meta["splits"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise VramfitError(f"{stores.join(folder, INDEX)} is not a shard index: {type(e).__name__}: {e}",
                           hint="re-write it with `vramfit prepare --format webdataset`") from None


def _indexed(folder: str, entry: dict) -> Shard:
    """A shard as index.json lists it: {"name", "samples"}, and from `prepare` "bytes" and "offsets"."""
    size, sidecar = entry.get("bytes"), entry.get("offsets")
    return Shard(stores.join(folder, entry["name"]), int(entry["samples"]),
                 bytes=None if size is None else int(size),
                 offsets=None if sidecar is None else stores.join(folder, str(sidecar)))


def _remote_index(source: str) -> ShardIndex:
    """Shards at an fsspec URL: a folder holding `index.json`, or a `.tar` / brace pattern beside one."""
    folder = source.rstrip("/") if stores.is_dir(source) else stores.parent(source)
    index = stores.join(folder, INDEX)
    if not stores.exists(index):
        raise VramfitError(f"--data {source}: no {INDEX} next to the shards ({index}).",
                           hint="shards at a URL need their index: write them with `vramfit prepare --data "
                                "SRC --output DIR --format webdataset` and copy DIR whole to the store")
    try:
        meta = _format_of(json.loads(stores.read_text(index)))
    except (OSError, ValueError) as e:
        raise VramfitError(f"{index} is not a shard index: {type(e).__name__}: {e}",
                           hint="re-write it with `vramfit prepare --format webdataset`") from None
    if meta is None or "class_names" not in meta:
        raise VramfitError(f"{index} is not a vramfit shard index (no format/class_names).",
                           hint="re-write it with `vramfit prepare --format webdataset`")
    splits = _from_index(meta, folder)
    if not stores.is_dir(source):
        _pick_train(source, splits, index)
    return ShardIndex(folder, [str(c) for c in meta["class_names"]], splits)


def _from_info(path: Path, folder: Path) -> dict[str, list[Shard]]:
    """timm's info file (timm/data/readers/reader_wds.py): {"splits": {name: {"filenames": [...],
    "shard_lengths": [...]}}}; a split without shard lengths is counted by a scan."""
    import yaml

    try:
        text = path.read_text()
        meta = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
        splits = {}
        for name, part in meta["splits"].items():
            files = [f for pat in part["filenames"] for f in expand_braces(str(folder / pat))]
            lengths = list(part.get("shard_lengths") or [UNCOUNTED] * len(files))
            if len(lengths) != len(files):
                raise ValueError(f"split {name}: {len(files)} files, {len(lengths)} shard_lengths")
            splits[name] = [Shard(f, int(n)) for f, n in zip(files, lengths)]
        return splits
    except (OSError, ValueError, KeyError, TypeError, AttributeError, yaml.YAMLError) as e:
        raise VramfitError(f"{path} is not a shard info file: {type(e).__name__}: {e}",
                           hint='it needs {"splits": {"train": {"filenames": [...], "shard_lengths": '
                                '[...]}, "validation": {...}}}, as timm writes it; or remove it and the '
                                "shards are counted by a scan") from None


def _from_names(folder: Path) -> dict[str, list[Shard]]:
    splits: dict[str, list[Shard]] = {}
    for f in sorted(folder.glob("*.tar")):
        splits.setdefault(split_of(PurePath(f.name)), []).append(Shard(str(f), UNCOUNTED))
    return splits


def _pick_train(source: str, splits: dict[str, list[Shard]], listed_in: str | None) -> None:
    """The train shards a pattern names: those of the index / info file, or any without one."""
    wanted = [_key(p) for p in expand_braces(source if stores.is_url(source) else os.path.expanduser(source))]
    if listed_in is None:
        for name in list(splits):
            splits[name] = [s for s in splits[name] if _key(s.path) not in wanted]
        splits["train"] = [Shard(p, UNCOUNTED) for p in sorted(wanted)]
        return
    known = {_key(s.path): s for s in splits.get("train", [])}
    missing = sorted(set(wanted) - set(known))
    if missing:
        raise VramfitError(f"--data {source}: {missing[0]} is not a train shard of {listed_in}.",
                           hint=f"it lists {len(known)} train shard(s)")
    splits["train"] = [known[p] for p in sorted(wanted)]


def _key(path: str) -> str:
    return path if stores.is_url(path) else os.path.abspath(path)


def survey(path: str) -> tuple[list[int | None], dict[int, str | None]]:
    """Each sample's label in one shard (None: it has none), and the class name a `.json` label may
    carry: its headers and label members are read, no image bytes."""
    labels: list[int | None] = []
    names: dict[int, str | None] = {}
    for _, label, name, _ in labelled(path):
        labels.append(label)
        if label is not None:
            names[label] = name or names.get(label)
    return labels, names


def labelled(path: str) -> Iterator[tuple[int, int | None, str | None, str]]:
    """Each sample of one shard, in order: (header offset as `scan` gives it, label or None, the
    class name a `.json` label carries or None, key), from its headers and label members."""
    sample: list | None = None  # [offset, label, name, key] of the sample being read
    for offset, member, data_at, size, is_file, file in _members(path):
        if not is_file:
            continue
        if sample is None or _stem(member) != sample[3]:
            if sample is not None:
                yield tuple(sample)
            sample = [offset, None, None, _stem(member)]
        ext = os.path.splitext(member)[1].lower()
        if ext in LABEL_EXTENSIONS:
            try:
                data = file.read(data_at, size)
                if len(data) < size:
                    raise EOFError("unexpected end of data")
                sample[1], sample[2] = _label(data, ext), _class_name(data, ext) or sample[2]
            except (OSError, EOFError, ValueError, KeyError, TypeError) as e:
                raise _unreadable(path, f"{type(e).__name__}: {e}") from None
    if sample is not None:
        yield tuple(sample)


def split_labels(samples: ShardSamples) -> list[int | None]:
    """The labels of every sample of some shards, in position order (`IndexedSamples`'), read
    without the images (an evaluation's targets)."""
    return [label for shard in samples.shards for label in survey(shard.path)[0][:shard.samples]]


def _class_name(data: bytes, ext: str) -> str | None:
    obj = json.loads(data) if ext == ".json" else None
    return next((str(obj[k]) for k in NAME_FIELDS if k in obj), None) if isinstance(obj, dict) else None


def _surveyed(shard: Shard, names: dict[int, str | None]) -> Shard:
    labels, found = survey(shard.path)
    for label, name in found.items():
        names[label] = name or names.get(label)
    return shard if shard.samples != UNCOUNTED else Shard(shard.path, len(labels))


def _class_names(labels: dict[int, str | None], folder: Path) -> list[str]:
    """Classes 0..largest label, named by their `.json` class name where one was seen, else by number."""
    if not labels or min(labels) < 0:
        raise VramfitError(f"The shards of {folder} have no class labels"
                           + (f" (label {min(labels)})" if labels else "") + ".",
                           hint="each sample needs a .cls (an int from 0) or a .json with \"label\"; or "
                                "list the names in index.json (`vramfit prepare --format webdataset`)")
    return [labels.get(i) or str(i) for i in range(max(labels) + 1)]


def limited(shards: list[Shard], limit: int | None, seed: int) -> list[Shard]:
    """data.limit_*_samples on shards: the first `limit` samples of a seeded order of the shards
    (whole shards and the first samples of one more), kept in file order: a fixed subset, like
    every source's seeded subset, so the sampler's order and a resume are unchanged by it."""
    if limit is None or limit >= sum(s.samples for s in shards):
        return shards
    order = np.random.default_rng(mix_seed(seed, "limit")).permutation(len(shards)).tolist()
    keep, left = {}, limit
    for i in order:
        take = min(left, shards[i].samples)
        keep[i] = shards[i] if take == shards[i].samples else replace(shards[i], samples=take,
                                                                        total=shards[i].samples)
        left -= take
        if not left:
            break
    return [keep[i] for i in sorted(keep)]


def fixed_locations(samples: ShardSamples, count: int, seed: int) -> list[int]:
    """`count` locations drawn once by `seed` over the whole split, in a seeded order (model.precise_bn):
    the shards they fall in are scanned up to the last one drawn, so the same on every process."""
    rng = np.random.default_rng(mix_seed(seed, "fixed"))
    drawn = rng.choice(samples.num_samples, size=min(count, samples.num_samples), replace=False)
    wanted = sorted(int(p) for p in drawn)
    at: dict[int, int] = {}
    start, k = 0, 0
    for shard_no, shard in enumerate(samples.shards):
        stop = start + shard.samples
        if k < len(wanted) and wanted[k] < stop:
            for pos, off in enumerate(samples.offsets(shard_no), start):
                while k < len(wanted) and wanted[k] == pos:
                    at[pos], k = shard_no * 2 ** SHARD_BITS + off, k + 1
        start = stop
    return [at[int(p)] for p in drawn]


def _check_size(shard: Shard) -> None:
    """A cheap check at start (no byte read): present, and a whole number of tar blocks (a copy cut
    short rarely ends on one); a damage that passes it is named when the shard is read."""
    try:
        size = stores.size(shard.path)
    except OSError as e:
        raise _unreadable(shard.path, e.strerror or type(e).__name__) from None
    if size % tarfile.BLOCKSIZE or size < 2 * tarfile.BLOCKSIZE:
        raise _unreadable(shard.path, f"{size} bytes, not a whole number of 512-byte tar blocks (truncated?)")
