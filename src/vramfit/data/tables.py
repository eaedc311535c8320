"""Parquet / arrow shards read in place (`data.streaming: true`): a folder of them, a glob, or a Hub
dataset id, local or at an fsspec URL, without materialising the dataset.

The ordering is the tar shards' (data.shards: `ShardStepSampler`, its buffer and its count-based
resume); only the reading differs. A sample's location is file number x 2**40 + row index, and a
file's row count comes from its footer (parquet) or its record batches' headers (a memory-mapped
arrow file): no image byte is read at start. A reader reads the whole row group holding a row (the
smallest unit parquet decodes) and keeps the row groups it decoded in a cache of
`data.table_cache_mb` per loader worker, least recently used first out, so the neighbours the
shuffle buffer asks for next are there while the buffer's window of row groups fits the cache.
Every worker is dealt batches from the whole window, so each needs all of it: where the footers'
row-group sizes say the window does not fit, a start note says so with the numbers (`window_note`).

Which files are which split: `datasets.load_dataset_builder(source).config.data_files`, the
library's own resolution, which reads a local folder as it reads a Hub repository (whose files
it names as `hf://` URLs); a glob is split by the file names (`schema.split_of`). A streamed
source is never held out at training time: without a validation split it is refused (a hold-out
would need every row's label read first; `vramfit prepare` writes one once).
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import PurePosixPath
from types import SimpleNamespace

import numpy as np

from ..config import DataConfig
from ..errors import VramfitError
from . import stores
from .builtin import cache_root, local_source
from .schema import VAL_SPLITS, pick_image_column, pick_label_column, split_of
from .shards import SHARD_BITS, OPEN_SHARDS, Shard, ShardSamples

KINDS = (".parquet", ".arrow")
FOOTER_THREADS = 16  # footers read at once at start (each a small range request on a remote store)


def unreadable(path: str, why: str) -> VramfitError:
    return VramfitError(f"Shard {path} is unreadable: {why}.",
                        hint="replace or remove the file; to check a dataset once, `vramfit prepare --data "
                             "SRC --output DIR --format webdataset` reads every row")


class TableSamples(ShardSamples):
    """The rows of some parquet / arrow files, read by location: `self[loc]` is a row
    {"image": {"bytes", "path"}, "label"}, as `ShardSamples` gives a tar sample."""

    def __init__(self, shards: list[Shard], image_col: str, label_col: str, num_classes: int,
                 read_timeout_s: float | None = None, cache_bytes: int | None = None):
        super().__init__(shards, read_timeout_s)
        self.image_col, self.label_col, self.num_classes = image_col, label_col, num_classes
        self.cache_bytes = cache_bytes or DataConfig().table_cache_mb * 2 ** 20
        self._groups: OrderedDict = OrderedDict()  # (file, row group) -> (first row, table)
        self._cached = 0
        # Rows read and row groups read for them by this process (bench/parquet_stream.py reads them).
        self.rows_read = self.groups_read = 0

    def __getstate__(self):  # open files, decoded rows and their counts stay in the process that read them
        return {**self.__dict__, "_files": {}, "_groups": OrderedDict(), "_cached": 0, "rows_read": 0,
                "groups_read": 0}

    def offsets(self, shard_no: int) -> range:
        return range(self.shards[shard_no].samples)

    def replacement(self, loc: int, k: int) -> int:
        shard_no, row = divmod(int(loc), 2 ** SHARD_BITS)
        return shard_no * 2 ** SHARD_BITS + (row + k) % self.shards[shard_no].samples

    def _reader(self, shard_no: int):
        reader = self._files.get(shard_no)
        if reader is None:
            if len(self._files) >= OPEN_SHARDS:
                self._files.pop(next(iter(self._files))).close()
            reader = self._files[shard_no] = TableFile(self.shards[shard_no].path)
        return reader

    def _rows(self, shard_no: int, row: int):
        """(first row, table) of the row group holding `row`, from the cache or read."""
        reader = self._reader(shard_no)
        group = reader.group_of(row)
        key = (shard_no, group)
        hit = self._groups.get(key)
        if hit is not None:
            self._groups.move_to_end(key)
            return hit
        hit = self._groups[key] = reader.read_group(group, [self.image_col, self.label_col])
        self.groups_read += 1
        self._cached += hit[1].nbytes
        while self._cached > self.cache_bytes and len(self._groups) > 1:
            self._cached -= self._groups.popitem(last=False)[1][1].nbytes
        return hit

    def __getitem__(self, loc: int) -> dict:
        import pyarrow as pa

        shard_no, row = divmod(int(loc), 2 ** SHARD_BITS)
        path = self.shards[shard_no].path
        try:
            first, table = self._rows(shard_no, row)
            self.rows_read += 1
            rec = table.slice(row - first, 1).to_pylist()[0]
        except (OSError, pa.ArrowException, ValueError, IndexError) as e:
            raise unreadable(path, f"{type(e).__name__} at row {row}: {e}") from None
        label = rec[self.label_col]
        if not isinstance(label, int) or not 0 <= label < self.num_classes:
            raise unreadable(path, f"row {row} has no class label ({self.label_col} = {label!r})")
        return {"image": _image(rec[self.image_col], f"{path} row {row}"), "label": label}


def _image(value, where: str) -> dict:
    """A `datasets.Image(decode=False)` item from what the image column holds."""
    if isinstance(value, dict):
        return {"bytes": value.get("bytes"), "path": value.get("path") or where}
    if isinstance(value, (bytes, bytearray)):
        return {"bytes": bytes(value), "path": where}
    return {"bytes": None, "path": value}


class TableFile:
    """One parquet or arrow file: its row groups' first rows, its bytes decoded (parquet: the footer's
    row-group sizes; arrow: 0, it is mapped, not cached) and a row group's columns."""

    def __init__(self, path: str):
        import pyarrow as pa
        import pyarrow.ipc as ipc
        import pyarrow.parquet as pq

        self.path, self._stream, self._table = path, None, None
        if path.lower().endswith(".arrow"):
            if stores.is_url(path):  # an arrow stream has no footer to seek by: parquet is the remote format
                raise unreadable(path, "arrow files are read memory-mapped, from a local disk only")
            try:  # `save_to_disk` writes the stream layout, others the file layout; mapped, not read
                self._table = ipc.open_stream(pa.memory_map(path)).read_all()
            except pa.ArrowInvalid:
                self._table = ipc.open_file(pa.memory_map(path)).read_all()
            self.num_rows, self.starts = self._table.num_rows, np.zeros(1, dtype=np.int64)
            self.nbytes = 0  # mapped, not cached
            return
        self._stream = stores.open_binary(path) if stores.is_url(path) else None
        self._parquet = pq.ParquetFile(self._stream or path)
        meta = self._parquet.metadata
        rows = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
        self.num_rows = int(sum(rows))
        self.nbytes = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))  # decoded
        self.starts = np.concatenate([[0], np.cumsum(rows)[:-1]]).astype(np.int64)

    def group_of(self, row: int) -> int:
        return int(np.searchsorted(self.starts, row, side="right")) - 1

    def read_group(self, group: int, columns: list[str]):
        if self._table is not None:
            return 0, self._table.select(columns)  # memory-mapped: counted, but paged in by the OS
        return int(self.starts[group]), self._parquet.read_row_group(group, columns=columns)

    def schema(self):
        return self._table.schema if self._table is not None else self._parquet.schema_arrow

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()


def footer_of(path: str) -> tuple[int, int, int]:
    """A file's (rows, bytes of its row groups decoded (`TableFile.nbytes`), row groups) from its
    footer; a file that is not whole or not parquet / arrow is named."""
    import pyarrow as pa

    try:
        reader = TableFile(path)
    except (OSError, pa.ArrowException, ValueError) as e:
        raise unreadable(path, f"{type(e).__name__}: {e} (truncated?)") from None
    reader.close()
    return reader.num_rows, reader.nbytes, len(reader.starts)


# A row stays in the shuffle buffer a while after its neighbours were drawn (a draw is uniform over
# the buffer, so a row's stay is geometric), and each partition's buffer straddles a row group:
# measured by bench/parquet_stream.py's counter, a cache of the window's bytes still reads a row group
# for half the rows, three times it plus a row group per partition for a few percent.
CACHE_WINDOWS = 3


def cache_need(cfg: DataConfig, rows: int, groups: int, processes: int, buffer: int) -> float:
    """The rows a loader worker's cache should hold for a process's window: each of its partitions
    CACHE_WINDOWS times its buffer and one row group, at most the process's share of the split."""
    mine = cfg.shard_partitions / processes
    return min(rows / processes, mine * (CACHE_WINDOWS * buffer / cfg.shard_partitions + rows / groups))


def buffer_for(cfg: DataConfig, rows: int, nbytes: int, groups: int, processes: int) -> int:
    """The largest data.shuffle_buffer whose window data.table_cache_mb holds (`cache_need`); 0: none."""
    held = cfg.table_cache_mb * 2 ** 20 / (nbytes / rows) / (cfg.shard_partitions / processes)
    return max(0, int((held - rows / groups) * cfg.shard_partitions / CACHE_WINDOWS))


def window_note(cfg: DataConfig, rows: int, nbytes: int, groups: int, processes: int) -> str | None:
    """A start note where a process's window of the shuffle buffer (its partitions' buffers: about
    data.shuffle_buffer / `processes` rows of the train split's `rows` in `groups` row groups, which
    hold `nbytes` decoded) needs more than a loader worker's row-group cache, with the ways out; None
    where it fits. The order is never changed for the cache: it is a function of (seed, epoch) and
    the run's settings."""
    if not rows or not nbytes:
        return None
    per_row = nbytes / rows
    window = min(cfg.shuffle_buffer, rows) / processes
    need_mb = math.ceil(cache_need(cfg, rows, groups, processes, cfg.shuffle_buffer) * per_row / 2 ** 20)
    if need_mb <= cfg.table_cache_mb:
        return None
    fits = buffer_for(cfg, rows, nbytes, groups, processes)
    smaller = (f"or data.shuffle_buffer={fits} or less (fits this cache; a change of order, so of the run)"
               if fits else f"no data.shuffle_buffer fits this cache (each of a process's partitions holds a "
               f"row group of ~{rows / groups:.0f} rows)")
    return (f"parquet streaming: a process's shuffle window (~{window:.0f} rows of data.shuffle_buffer "
            f"{cfg.shuffle_buffer} over {processes} process(es), {per_row / 1e3:.0f} KB a row by the "
            f"files' footers) needs a row-group cache of ~{need_mb} MiB in each loader worker, "
            f"more than data.table_cache_mb={cfg.table_cache_mb}: many rows will cost a read of their "
            f"whole row group. Set data.table_cache_mb={need_mb} (host memory: that times "
            f"the workers of each process), {smaller}")


@dataclass
class Streamed:
    """A streamed source's splits, as `sources.Splits` takes them."""

    train: TableSamples
    val: TableSamples
    class_names: list[str]
    description: str
    notes: list[str]


def resolve(cfg: DataConfig) -> Streamed:
    """`--data` with data.streaming: its files per split, their row counts and the class names, read
    under the read watch (a stalled store ends the run with a message, data.stores.within)."""
    return stores.within(cfg.read_timeout_s, f"resolving the files of {cfg.source}", _resolve, cfg)


def _resolve(cfg: DataConfig) -> Streamed:
    files, features, desc = data_files(cfg)
    train_name = cfg.train_split or ("train" if "train" in files else next(iter(files)))
    val_name = cfg.val_split or next((s for s in VAL_SPLITS if s in files and s != train_name), None)
    for name, what in ((train_name, "data.train_split"), (val_name, "data.val_split")):
        if name not in files:
            raise VramfitError(
                f"{desc} has no {'validation' if what.endswith('val_split') else 'train'} split"
                + (f" `{name}`" if name else "") + f" (splits: {', '.join(files)}); a streamed source is "
                "not held out at training time.",
                hint="name one with --set {}=SPLIT, write the source once as shards with a held-out "
                     "validation split (`vramfit prepare --data SRC --output DIR --format webdataset`), "
                     "or drop data.streaming to load it whole".format(what))
    footers = {s: stores.parallel(footer_of, files[s], FOOTER_THREADS) for s in (train_name, val_name)}
    shards = {s: [Shard(f, n) for f, (n, *_) in zip(files[s], footers[s])] for s in footers}
    if features is None:  # the features datasets writes into the schema metadata of its files
        import datasets

        features = datasets.Features.from_arrow_schema(TableFile(files[train_name][0]).schema())
    columns = SimpleNamespace(column_names=list(features), features=features)
    image_col = pick_image_column(columns, cfg.image_column)
    label_col = pick_label_column(columns, image_col, cfg.label_column)
    names = list(getattr(features[label_col], "names", None) or [])
    if not names:
        raise VramfitError(f"{desc}: the label column `{label_col}` has no class names (no ClassLabel "
                           f"feature), which streaming needs before any row is read.",
                           hint="drop data.streaming to load it whole (labels are then read and named), "
                                "or write it once with `vramfit prepare --format webdataset`")
    parts = [TableSamples(shards[s], image_col, label_col, len(names), cfg.read_timeout_s,
                          cfg.table_cache_mb * 2 ** 20) for s in (train_name, val_name)]
    # The processes a run is launched as (torchrun, accelerate and vramfit's own launch all set it):
    # each reads its block of the partitions, so its window is its share of the buffer.
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    note = window_note(cfg, *map(sum, zip(*footers[train_name])), processes)
    return Streamed(parts[0], parts[1], names, f"{desc}, streamed ({len(shards[train_name])} "
                    f"{train_name} file(s), {len(shards[val_name])} {val_name})", [note] if note else [])


def data_files(cfg: DataConfig) -> tuple[dict[str, list[str]], object, str]:
    """({split: files}, features or None, description) of a streamed source."""
    src = cfg.source
    if any(c in src for c in "*?[") or src.lower().endswith(KINDS):
        return _by_split(_glob(src), None), None, f"files {src}"
    if stores.is_url(src) and not src.startswith("hf://"):  # a folder in a store: its files, any depth
        folder = src.rstrip("/")
        found = [f for kind in KINDS for f in _glob(f"{folder}/**/*{kind}", missing_ok=True)]
        return _by_split(found, folder), None, f"folder {src}"
    local = local_source(src)
    desc = f"{'folder' if local is not None else 'hub dataset'} {src}"
    builder = _builder(cfg, str(local) if local is not None else src, desc)
    files = {str(k): [str(f) for f in v if str(f).lower().endswith(KINDS)]
             for k, v in (builder.config.data_files or {}).items()}
    files = {k: v for k, v in files.items() if v}
    if not files:
        raise VramfitError(f"{desc} holds no parquet or arrow files to stream.",
                           hint="drop data.streaming to load it as it is, or write it once with "
                                "`vramfit prepare --format webdataset`")
    return files, builder.info.features, desc


def _by_split(files: list[str], folder: str | None) -> dict[str, list[str]]:
    """Files by split, from their names (`schema.split_of`: the path under `folder`, else the name)."""
    out: dict[str, list[str]] = {}
    for f in sorted(files):
        rel = PurePosixPath(f[len(folder) + 1:] if folder else PurePosixPath(f).name)
        out.setdefault(split_of(rel), []).append(f)
    return out


def _glob(pattern: str, missing_ok: bool = False) -> list[str]:
    import fsspec.core

    fs, path = fsspec.core.url_to_fs(os.path.expanduser(pattern))
    found = sorted(fs.glob(path))
    if not found and not missing_ok:
        raise VramfitError(f"--data {pattern}: no file matches.", hint="check the path or pattern")
    if not stores.is_url(pattern):
        return found
    protocol = pattern.split("://", 1)[0]
    return [f if stores.is_url(f) else f"{protocol}://{f}" for f in found]


def _builder(cfg: DataConfig, source: str, desc: str):
    import datasets

    kwargs = {"cache_dir": str(cache_root(cfg.cache_dir) / "hf-datasets")} if cfg.cache_dir else {}
    try:
        return datasets.load_dataset_builder(source, cfg.config, **kwargs)
    except Exception as e:  # noqa: BLE001 - every resolution failure becomes one actionable message
        offline = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("HF_DATASETS_OFFLINE")
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        raise VramfitError(
            f"--data {cfg.source}: could not resolve the files of {desc} to stream: {type(e).__name__}: "
            f"{first}", hint=("offline mode is on (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE): streaming reads "
                              "the Hub, so unset it, or " if offline else "check the id or path, or ")
            + "write the data once as shards (`vramfit prepare --format webdataset`) and pass that folder"
        ) from None
