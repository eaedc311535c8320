"""Parquet / arrow files and Hub datasets read in place (`data.streaming: true`), and tar shards at
fsspec URLs: resolved per split, trained in the tar shards' order, resumed bitwise, damaged files
and stalled or unreachable stores named."""

from __future__ import annotations

import os
import threading

import pytest

from helpers import PREPARED_SUBSET, last_weights, same_weights, source_args

STREAMING = ("--set", "data.streaming=true")



@pytest.fixture(scope="module")
def digits_tables(tmp_path_factory):
    """160 train / 40 validation digits with their image bytes embedded: four train parquet files
    of several row groups and one validation file, and the same rows saved with `save_to_disk`."""
    import datasets

    from vramfit.config import DataConfig
    from vramfit.data import load_splits

    src = load_splits(DataConfig(source="digits", val_fraction=0.2, limit_train_samples=160,
                                 limit_val_samples=40))
    feats = datasets.Features({"image": datasets.Image(), "label": src.train.features["label"]})

    def embedded(ds):
        rows = ds[:]
        images = []
        for im in rows["image"]:
            with open(im["path"], "rb") as f:
                images.append({"bytes": f.read(), "path": os.path.basename(im["path"])})
        return datasets.Dataset.from_dict({"image": images, "label": rows["label"]}, features=feats)

    root = tmp_path_factory.mktemp("tables")
    train, val = embedded(src.train), embedded(src.val)
    (root / "pq").mkdir()
    for i in range(4):
        train.shard(4, i, contiguous=True).to_parquet(root / "pq" / f"train-{i:05d}-of-00004.parquet",
                                                     batch_size=16)
    val.to_parquet(root / "pq" / "validation-00000-of-00001.parquet")
    datasets.DatasetDict({"train": train, "validation": val}).save_to_disk(str(root / "saved"))
    return root


def test_a_folder_a_glob_and_saved_arrow_files_resolve_per_split_without_reading_rows(digits_tables):
    """The folder through `datasets.load_dataset_builder` (its data_files), a glob by file names,
    `save_to_disk` arrow files memory-mapped; row counts from the footers, class names from the
    files' features; a row reads as the map-style source's row."""
    from vramfit.config import DataConfig
    from vramfit.data import load_splits
    from vramfit.data.tables import TableSamples

    ref = load_splits(DataConfig(source=str(digits_tables / "pq")))  # map-style, loaded whole
    for source in (digits_tables / "pq", f"{digits_tables}/pq/*.parquet", digits_tables / "saved",
                   f"file://{digits_tables}/pq"):
        s = load_splits(DataConfig(source=str(source), streaming=True))
        assert isinstance(s.train, TableSamples), source
        assert (len(s.train), len(s.val)) == (160, 40) and s.class_names == [str(i) for i in range(10)]
        assert s.train.shards[0].path.endswith(("train-00000-of-00004.parquet", ".arrow"))
        first = s.train[0]
        assert first["label"] == ref.train[0]["label"] and first["image"]["bytes"] == ref.train[0]["image"]["bytes"]
        assert s.val[39]["label"] == ref.val[39]["label"]
    four = load_splits(DataConfig(source=str(digits_tables / "pq"), streaming=True))
    assert [s.samples for s in four.train.shards] == [40] * 4
    assert four.train[3 * 2 ** 40 + 39]["label"] == ref.train[159]["label"]  # file 3, its last row


def test_a_source_without_a_validation_split_is_refused_with_a_hint(digits_tables, tmp_path):
    from vramfit.config import DataConfig
    from vramfit.data import load_splits
    from vramfit.errors import VramfitError

    with pytest.raises(VramfitError) as e:
        load_splits(DataConfig(source=f"{digits_tables}/pq/train-*.parquet", streaming=True))
    assert "no validation split" in e.value.message and "vramfit prepare" in e.value.hint


def test_streamed_parquet_trains_and_resumes_bitwise_after_a_signal(digits_tables, train_cli, caplog):
    """The tar shards' exact resume holds for parquet rows: a run stopped mid-epoch by a signal and
    resumed ends with the weights of an uninterrupted streamed run, bit for bit, also when resumed
    with another row-group cache (data.table_cache_mb: execution only, said at the resume)."""
    caplog.set_level("INFO", logger="vramfit")
    args = source_args(digits_tables / "pq", *STREAMING)
    full, code = train_cli(*args, run_name="full")
    assert code == 0
    part, code = train_cli(*args, "--set", "debug.signal_at_step=4", run_name="part")
    assert code == 143
    caplog.clear()
    part, code = train_cli(*args, "--set", "data.table_cache_mb=1", run_name="part")
    assert code == 0
    assert same_weights(last_weights(full), last_weights(part))
    assert "data.table_cache_mb: 256 -> 1" in caplog.text


def _wide_rows(root, rows: int, row_bytes: int, group: int):
    """`rows` train rows of `row_bytes` incompressible image bytes in row groups of `group`, and a
    validation file: the footers give the window's bytes; no image is decoded at start."""
    import datasets
    import numpy as np

    feats = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b"])})
    rng = np.random.default_rng(0)
    ds = datasets.Dataset.from_dict(
        {"image": [{"bytes": rng.bytes(row_bytes), "path": f"{i}.jpg"} for i in range(rows)],
         "label": [i % 2 for i in range(rows)]}, features=feats)
    root.mkdir()
    for i in range(2):
        ds.shard(2, i, contiguous=True).to_parquet(root / f"train-{i:05d}.parquet", batch_size=group)
    ds.select(range(group)).to_parquet(root / "validation-00000.parquet")
    return root


def test_a_window_larger_than_the_row_group_cache_is_said_with_its_numbers(tmp_path, monkeypatch):
    """400 rows of 10 KB (4 MB) in row groups of 10: the default buffer's window is the whole split,
    which a 1 MiB cache does not hold (the note: its size, the cache that holds it, the buffer that
    fits) and 4 MiB does; two processes halve a process's window; a buffer of 50 needs 3x its
    window and a row group per partition; row groups of 50 leave no buffer that fits 1 MiB."""
    from vramfit.config import DataConfig
    from vramfit.data import load_splits

    src = str(_wide_rows(tmp_path / "wide", 400, 10_000, 10))
    monkeypatch.delenv("WORLD_SIZE", raising=False)

    def notes(source=src, **settings):
        return load_splits(DataConfig(source=source, streaming=True, **settings)).notes

    said = notes(table_cache_mb=1)
    assert len(said) == 1 and "~400 rows of data.shuffle_buffer 16384 over 1 process(es)" in said[0]
    assert "10 KB a row" in said[0]
    assert "cache of ~4 MiB" in said[0] and "more than data.table_cache_mb=1" in said[0]
    fits = int(said[0].split("data.shuffle_buffer=")[1].split()[0])
    assert "Set data.table_cache_mb=4 " in said[0] and 4 <= fits <= 12  # (1 MiB / 10 KB / 8 - 10) x 8 / 3
    assert notes(table_cache_mb=4) == [] and notes(table_cache_mb=1, shuffle_buffer=fits) == []
    assert notes(table_cache_mb=1, shuffle_buffer=fits + 4) != []
    monkeypatch.setenv("WORLD_SIZE", "2")
    two = notes(table_cache_mb=1)
    assert "~200 rows" in two[0] and "cache of ~2 MiB" in two[0]
    monkeypatch.delenv("WORLD_SIZE")
    small = notes(table_cache_mb=1, shuffle_buffer=50)  # 8 x (3 x 50 / 8 + 10) rows: 2.2 MiB
    assert "~50 rows" in small[0] and "cache of ~3 MiB" in small[0]
    big_groups = str(_wide_rows(tmp_path / "groups", 400, 10_000, 50))
    assert "no data.shuffle_buffer fits this cache" in notes(big_groups, table_cache_mb=1)[0]


def test_a_cache_holding_the_window_reads_each_row_group_once_an_epoch(tmp_path):
    """The counters bench/parquet_stream.py reads: an epoch through the sampler reads each of the
    8 row groups once with the default cache; a cache of one row group reads one for most rows."""
    from vramfit.config import DataConfig
    from vramfit.data import load_splits
    from vramfit.data.shards import ShardStepSampler

    src = str(_wide_rows(tmp_path / "wide", 400, 10_000, 50))
    for cache_bytes, lo, hi in ((None, 8, 8), (1, 200, 400)):  # 1 byte: the last row group kept
        train = load_splits(DataConfig(source=src, streaming=True)).train
        train.cache_bytes = cache_bytes or train.cache_bytes
        sampler = ShardStepSampler(train, 16, 0, 1, seed=0, buffer=16384)
        for batch in sampler:
            for loc, *_ in batch:
                train[loc]
        assert train.rows_read == 400 and lo <= train.groups_read <= hi, (cache_bytes, train.groups_read)


def test_tar_shards_at_a_file_url_train_as_from_their_path(tmp_path, train_cli):
    """`file://` goes through fsspec (as `s3://`, `hf://` would): the same shards, order and weights."""
    from vramfit.cli import run

    shards = tmp_path / "wds"
    assert run(["prepare", "--data", "digits", "--output", str(shards), "--format", "webdataset",
                "--shard-samples", "48", *PREPARED_SUBSET]) == 0
    local, code = train_cli(*source_args(shards), run_name="local")
    assert code == 0
    url, code = train_cli(*source_args(f"file://{shards}"), run_name="url")
    assert code == 0
    assert same_weights(last_weights(local), last_weights(url))


def test_a_truncated_parquet_file_is_named_with_exit_2_and_a_hint(digits_tables, tmp_path, capsys):
    import shutil

    from vramfit.cli import main

    copy = tmp_path / "cut"
    shutil.copytree(digits_tables / "pq", copy)
    cut = copy / "train-00002-of-00004.parquet"
    cut.write_bytes(cut.read_bytes()[:-100])  # the footer is gone
    with pytest.raises(SystemExit) as e:
        main(["train", "--output", str(tmp_path / "runs"), *source_args(copy, *STREAMING)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "train-00002-of-00004.parquet" in err and "truncated" in err
    assert "HINT:" in err and "Traceback" not in err


def test_a_store_that_stalls_is_named_after_read_timeout(digits_tables, tmp_path):
    """A file that never answers (a FIFO nobody writes: the open blocks, as a hung mount would)
    ends the start with a message after data.read_timeout_s instead of waiting for ever."""
    import shutil
    import time

    from vramfit.config import DataConfig
    from vramfit.data import load_splits
    from vramfit.errors import VramfitError

    copy = tmp_path / "stall"
    shutil.copytree(digits_tables / "pq", copy)
    fifo = copy / "validation-00000-of-00001.parquet"
    fifo.unlink()
    os.mkfifo(fifo)
    t0 = time.monotonic()
    try:
        with pytest.raises(VramfitError) as e:
            load_splits(DataConfig(source=f"{copy}/*.parquet", streaming=True, read_timeout_s=2))
        assert "stalled" in e.value.message and "read_timeout_s" in e.value.message
        assert time.monotonic() - t0 < 30
    finally:  # let the blocked reader go: it is the test's thread, not a run's
        threading.Thread(target=lambda: open(fifo, "wb").close(), daemon=True).start()


def test_a_hub_id_streamed_offline_ends_with_a_clear_message(monkeypatch):
    from vramfit.config import DataConfig
    from vramfit.data import load_splits
    from vramfit.errors import VramfitError

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(VramfitError) as e:
        load_splits(DataConfig(source="vramfit-tests/no-such-dataset", streaming=True))
    assert "vramfit-tests/no-such-dataset" in e.value.message and "offline mode is on" in e.value.hint
