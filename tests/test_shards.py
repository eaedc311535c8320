"""WebDataset tar shards: `vramfit prepare --format webdataset`, training from them read in place,
the order of each process's share, exact resume, damaged shards."""

from __future__ import annotations

import json
import tarfile

import pytest

from vramfit.cli import run
from helpers import PREPARED_SUBSET, class_tree, last_weights, same_weights, source_args



def _prepare(out, *extra):
    return run(["prepare", "--data", "digits", "--output", str(out), "--format", "webdataset", *extra])


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    out = tmp_path_factory.mktemp("wds") / "digits-wds"
    assert _prepare(out, "--shard-samples", "32", *PREPARED_SUBSET) == 0
    return out



def test_prepare_writes_shards_with_the_images_as_stored_and_an_index(shards):
    from vramfit.config import DataConfig
    from vramfit.data import load_splits

    index = json.loads((shards / "index.json").read_text())
    assert index["format"] == "webdataset" and index["class_names"] == [str(i) for i in range(10)]
    train, val = index["splits"]["train"], index["splits"]["val"]
    assert train["samples"] == 160 and val["samples"] == 40
    assert [s["name"] for s in train["shards"]] == [f"train-{i:06d}.tar" for i in range(5)]
    assert all(s["samples"] == 32 for s in train["shards"])
    # the same images a run from the source trains on (the same holdout and limits), bytes untouched
    src = load_splits(DataConfig(source="digits", val_fraction=0.2, limit_train_samples=160,
                                 limit_val_samples=40))
    with tarfile.open(shards / "train-000000.tar") as tar:
        names = tar.getnames()
        key = int(names[0].split(".")[0])  # a sample's key is its row in the split (written shuffled)
        assert names[:2] == [f"{key:08d}.png", f"{key:08d}.cls"]
        first = tar.extractfile(names[0]).read()
        label = int(tar.extractfile(names[1]).read())
    with open(src.train[key]["image"]["path"], "rb") as f:
        assert f.read() == first
    assert label == src.train[key]["label"]
    assert train["order"] == "shuffled" and train["split_seed"] == 0 and val["order"] == "source"


def _labels(shard) -> list[int]:
    with tarfile.open(shard) as tar:
        return [int(tar.extractfile(m).read()) for m in tar.getmembers() if m.name.endswith(".cls")]


def test_prepare_writes_train_shuffled_by_the_split_seed_and_the_same_bytes_twice(tmp_path):
    """A folder lists its classes one after the other; the first train shard mixes them, in an
    order that is a function of data.split_seed: prepare twice writes the same bytes, another seed
    another order. Validation keeps the source's order."""
    src = tmp_path / "src"
    classes = {f"c{k}": 8 for k in range(10)}
    class_tree(src / "train", classes)
    class_tree(src / "val", {c: 2 for c in classes})
    for out, seed in (("a", 0), ("b", 0), ("c", 1)):
        assert run(["prepare", "--data", str(src), "--output", str(tmp_path / out), "--format", "webdataset",
                    "--shard-samples", "16", "--set", f"data.split_seed={seed}"]) == 0
    first = _labels(tmp_path / "a" / "train-000000.tar")
    assert len(set(first)) >= 6 and first != sorted(first)
    assert sorted(_labels(tmp_path / "a" / "val-000000.tar")) == _labels(tmp_path / "a" / "val-000000.tar")
    files = sorted(f.name for f in (tmp_path / "a").iterdir())
    assert files == sorted(f.name for f in (tmp_path / "b").iterdir()) and "train-000004.tar" in files
    for name in files:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert _labels(tmp_path / "c" / "train-000000.tar") != first


def test_long_names_pax_and_gnu_headers_are_read_as_tarfile_reads_them(tmp_path):
    """Names over 100 characters (GNU long-name and pax headers), a ustar prefix, a directory
    member and a .json label: the header offsets and the samples are tarfile's."""
    import io

    from vramfit.data.shards import Shard, ShardSamples, scan

    def add(tar, name, payload, kind=tarfile.REGTYPE):
        info = tarfile.TarInfo(name)
        info.type, info.size = kind, len(payload) if kind == tarfile.REGTYPE else 0
        tar.addfile(info, io.BytesIO(payload) if kind == tarfile.REGTYPE else None)

    deep = "d" * 90 + "/" + "e" * 60  # over 100 characters: a ustar prefix, or a long-name header
    rows = [(f"{deep}/a{i}" if i % 2 else f"s{i}", bytes([i]) * (700 * i + 1), i) for i in range(6)]
    for fmt in (tarfile.GNU_FORMAT, tarfile.PAX_FORMAT, tarfile.USTAR_FORMAT):
        path = tmp_path / f"{fmt}.tar"
        with tarfile.open(path, "w", format=fmt) as tar:
            add(tar, "dir/", b"", tarfile.DIRTYPE)
            for key, image, label in rows:
                add(tar, f"{key}.jpg", image)
                add(tar, f"{key}.json" if label % 3 else f"{key}.cls",
                    (f'{{"label": {label}}}' if label % 3 else str(label)).encode())
        with tarfile.open(path) as tar:
            expect = [m.offset for m in tar.getmembers() if m.name.endswith(".jpg")]
        assert list(scan(str(path))) == expect, fmt
        samples = ShardSamples([Shard(str(path), len(rows))])
        got = [samples[off] for off in expect]
        assert [g["label"] for g in got] == [label for *_, label in rows]
        assert [g["image"]["bytes"] for g in got] == [image for _, image, _ in rows]
        assert got[1]["image"]["path"] == f"{path}/{rows[1][0]}.jpg"


def test_prepare_refuses_a_folder_that_is_not_empty(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "a").write_text("")
    with pytest.raises(Exception) as e:
        _prepare(tmp_path / "x")
    assert "not empty" in str(e.value)


@pytest.mark.parametrize("n,batch", [(160, 16), (157, 16), (161, 16), (33, 64)])
def test_every_process_reads_its_own_share_and_an_epoch_sees_each_sample_once(shards, n, batch):
    """The union over processes of an epoch's samples is the epoch, exactly once, at any process
    count (a last step of one sample is dropped, as for every source); each process's steps have
    the sizes `batching.rank_shares` gives."""
    from vramfit import batching
    from vramfit.data.shards import ShardSamples, ShardStepSampler, read_index

    every = ShardSamples(read_index(str(shards)).splits["train"])
    samples = ShardSamples(every.shards)
    samples.num_samples = n  # the count the index gives; the shards hold at least that many
    steps = batching.steps_per_epoch(n, batch)
    expect = n if n % batch != 1 else n - 1
    for world in (1, 2, 3):
        ids, per_step = [], []
        for rank in range(world):
            sampler = ShardStepSampler(samples, batch, rank, world, seed=0, buffer=20, partitions=6)
            shares = list(sampler)
            assert len(shares) == steps
            per_step.append([len([k for k in s if k[0] >= 0]) for s in shares])
            ids += [k[0] for s in shares for k in s if k[0] >= 0]
        assert len(ids) == len(set(ids)) == expect
        for t in range(steps):
            assert [p[t] for p in per_step] == batching.rank_shares(min(batch, n - t * batch), world, 6)
            assert [p[t] for p in per_step] == sampler.shares(min(batch, n - t * batch))
            assert 1 not in [p[t] for p in per_step]


@pytest.mark.parametrize("n,batch,partitions", [(160, 16, 8), (157, 16, 8), (150, 32, 4), (45, 64, 8)])
def test_every_step_holds_the_same_samples_at_1_2_and_4_processes(shards, n, batch, partitions):
    """MosaicML's canonical nodes: the order is cut into fixed partitions, each process reads a
    block of them, so the steps (concatenated over the ranks) do not depend on the process count;
    a full step is shared evenly."""
    from vramfit import batching
    from vramfit.data.shards import ShardSamples, ShardStepSampler, read_index

    samples = ShardSamples(read_index(str(shards)).splits["train"])
    samples.num_samples = n

    def steps(world, epoch=1, start=0):
        per_rank = []
        for rank in range(world):
            s = ShardStepSampler(samples, batch, rank, world, seed=3, buffer=24, partitions=partitions)
            s.set_epoch(epoch, start)
            per_rank.append([[k[0] for k in share if k[0] >= 0] for share in s])
        return [sum((r[t] for r in per_rank), []) for t in range(len(per_rank[0]))], per_rank

    one, _ = steps(1)
    for world in (2, 4):
        many, per_rank = steps(world)
        assert many == one
        full = batch // world
        assert all(len(r[t]) == full for r in per_rank for t in range(n // batch))
        assert steps(world, start=2)[0] == one[2:]  # a resume at another count continues alike
    assert sorted(sum(one, [])) == sorted(set(sum(one, []))) and len(sum(one, [])) == n - (n % batch == 1)
    assert steps(1, epoch=2)[0] != one
    with pytest.raises(Exception) as e:
        ShardStepSampler(samples, batch, 0, 3, seed=3, buffer=24, partitions=partitions)
    assert "shard_partitions" in str(e.value) and e.value.hint
    assert batching.rank_shares(batch, 2, partitions) == [batch // 2] * 2


def test_the_order_is_a_function_of_seed_and_epoch_and_a_resume_skips_by_count(shards):
    from vramfit.data.shards import ShardSamples, ShardStepSampler, read_index

    samples = ShardSamples(read_index(str(shards)).splits["train"])

    def order(epoch, start=0, seed=0, buffer=20):
        s = ShardStepSampler(samples, 16, 0, 1, seed=seed, buffer=buffer)
        s.set_epoch(epoch, start)
        return [k for share in s for k in share]

    assert order(1) == order(1) and order(1) != order(2) and order(1, seed=1) != order(1)
    assert order(1, start=3) == order(1)[3 * 16:]
    assert sorted(k[0] for k in order(1)) == sorted(k[0] for k in order(2))
    assert order(1, buffer=1) != order(1)


def _without_sidecars(shards, copy):
    import shutil

    shutil.copytree(shards, copy, ignore=shutil.ignore_patterns("*.idx"))
    return copy


@pytest.mark.parametrize("url", [False, True])
def test_prepare_writes_each_shards_offsets_which_a_run_reads_instead_of_its_headers(shards, monkeypatch,
                                                                                    url):
    """The sidecar's offsets are the scan's, for every split; the sampler takes them from it (no
    header read), locally and through fsspec (`file://`)."""
    from vramfit.data import shards as module
    from vramfit.data.shards import ShardSamples, read_index, scan, written_offsets

    index = read_index(f"file://{shards}" if url else str(shards))
    assert set(index.splits) == {"train", "val"}
    for part in index.splits.values():
        for shard in part:
            assert (shards / (shard.path.rsplit("/", 1)[1][:-4] + ".idx")).stat().st_size == 8 * shard.samples
            assert written_offsets(shard).tolist() == list(scan(shard.path))
    expected = [list(ShardSamples(index.splits["train"]).offsets(n)) for n in range(5)]
    monkeypatch.setattr(module, "scan", lambda path: pytest.fail(f"{path}'s headers were scanned"))
    samples = ShardSamples(index.splits["train"], read_timeout_s=10)
    assert [list(samples.offsets(n)) for n in range(5)] == expected


def test_a_sidecar_that_does_not_fit_its_shard_is_not_read(shards, tmp_path):
    """A shard written again after `prepare` (its size is not index.json's), a sidecar of another
    count or cut mid-number: the headers are scanned, the shard's real offsets, never the stale ones;
    an index whose count is not the shard's is named, sidecar or not."""
    import io
    import shutil

    import numpy as np

    from vramfit.data.shards import ShardSamples, read_index, scan, written_offsets
    from vramfit.errors import VramfitError

    copy = tmp_path / "stale"
    shutil.copytree(shards, copy)
    shard = copy / "train-000001.tar"
    with tarfile.open(shard) as src:
        members = [(m, src.extractfile(m).read()) for m in src.getmembers()]
    with tarfile.open(shard, "w", format=tarfile.PAX_FORMAT) as dst:  # a pax header before each member
        for m, data in members:
            m.pax_headers = {"comment": "written again"}
            dst.addfile(m, io.BytesIO(data))
    (copy / "train-000002.idx").write_bytes((copy / "train-000002.idx").read_bytes()[:-8])
    (copy / "train-000003.idx").write_bytes((copy / "train-000003.idx").read_bytes()[:-3])
    (copy / "train-000004.idx").write_bytes(np.arange(32, dtype="<i8").tobytes())  # not tar blocks
    train = read_index(str(copy)).splits["train"]
    old = np.fromfile(copy / "train-000001.idx", dtype="<i8").tolist()
    assert list(scan(str(shard))) != old  # the rewrite moved the samples
    samples = ShardSamples(train)
    for n in range(1, 5):
        assert written_offsets(train[n]) is None
        assert list(samples.offsets(n)) == list(scan(train[n].path))
    assert written_offsets(train[0]) is not None
    index = json.loads((copy / "index.json").read_text())
    index["splits"]["train"]["shards"][0]["samples"] = 33  # the shard and its sidecar hold 32
    (copy / "index.json").write_text(json.dumps(index))
    with pytest.raises(VramfitError, match="train-000000.tar.*holds 32 samples, its index says 33"):
        list(ShardSamples(read_index(str(copy)).splits["train"]).offsets(0))


def test_a_truncated_shard_is_named(tmp_path, shards, train_cli):
    """A VramfitError (`vramfit` prints it with its HINT and exits 2) naming the shard: met while
    reading it, or at start when its size is no whole number of tar blocks."""
    import shutil

    from vramfit.config import DataConfig
    from vramfit.data import load_splits
    from vramfit.errors import VramfitError

    copy = tmp_path / "cut"
    shutil.copytree(shards, copy)
    shard = copy / "train-000002.tar"
    shard.write_bytes(shard.read_bytes()[:4096])  # whole tar blocks: only reading it finds the cut
    with pytest.raises(VramfitError) as e:
        train_cli(*source_args(copy))
    assert "train-000002.tar" in e.value.message and e.value.hint
    odd = copy / "train-000003.tar"
    odd.write_bytes(odd.read_bytes()[:1000])  # a cut the start-up check sees
    with pytest.raises(VramfitError) as e:
        load_splits(DataConfig(source=str(copy)))
    assert "train-000003.tar" in e.value.message and "truncated" in e.value.message


# Scanned headers: slow (the index-less shards of test_shard_sources resume bitwise by the scan by default).
@pytest.mark.parametrize("sidecars", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_streamed_resume_after_a_signal_equals_an_uninterrupted_run_bitwise(shards, train_cli, tmp_path,
                                                                           sidecars):
    """Without the offset sidecars (removed: the headers are scanned) the interrupted run resumes to
    the same weights as the uninterrupted one with them: the same order either way."""
    source = shards if sidecars else _without_sidecars(shards, tmp_path / "scanned")
    full, code = train_cli(*source_args(shards), run_name="full")
    assert code == 0
    part, code = train_cli(*source_args(source, "--set", "debug.signal_at_step=4"),
                           run_name="part")
    assert code == 143
    part, code = train_cli(*source_args(source), run_name="part")
    assert code == 0

    assert same_weights(last_weights(full), last_weights(part))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_sample_a_worker_cannot_read_is_named_without_the_workers_traceback(tmp_path, shards, train_cli,
                                                                              workers):
    """Damage only reading a sample finds (a sample without its label): the loader worker's
    VramfitError travels back in the batch and is raised in the main process as itself, with its
    HINT, not as torch's re-raise carrying the worker's traceback in its message."""
    import shutil

    from vramfit.errors import VramfitError

    copy = tmp_path / "unlabelled"
    shutil.copytree(shards, copy)
    shard = copy / "train-000000.tar"
    with tarfile.open(shard) as src:
        members = [(m, src.extractfile(m).read()) for m in src.getmembers()]
    with tarfile.open(shard, "w", format=tarfile.USTAR_FORMAT) as dst:
        for m, data in members:
            if not m.name.endswith(".cls") or m.name != members[-1][0].name:
                dst.addfile(m, __import__("io").BytesIO(data))
    with pytest.raises(VramfitError) as e:
        train_cli(*source_args(copy, "--set", f"data.num_workers={workers}"))
    assert "train-000000.tar" in e.value.message and "no .cls or .json label" in e.value.message
    assert "Traceback" not in str(e.value) and "re-write it" in (e.value.hint or "")


def test_the_offsets_bench_runs_and_prints_each_case_against_the_scan(capsys):
    from helpers import bench_module

    assert bench_module("shard_offsets").main(["--images", "40", "--per-shard", "10", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    for where in ("local", "file:// URL"):
        assert f"{where}, header scan" in out and f"{where}, sidecars" in out
    assert out.count("x\n") == 4 and "   1.0x" in out
