"""Tar shards from other tools (no vramfit index: timm's `_info.json`, or counted by a scan), and the
options and commands on shards: data.limit_*, model.precise_bn, scan-data, eval, a changed shard set."""

from __future__ import annotations

import io
import json
import shutil
import tarfile

import pytest

from helpers import PREPARED_SUBSET, last_weights, same_weights, source_args


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """digits as shards (5 train of 32, 2 val of 20), then made like another tool's: no index.json,
    no offset files (.idx)."""
    from vramfit.cli import run

    out = tmp_path_factory.mktemp("wds") / "digits-wds"
    assert run(["prepare", "--data", "digits", "--output", str(out), "--format", "webdataset",
                "--shard-samples", "32", *PREPARED_SUBSET]) == 0
    (out / "index.json").unlink()
    for sidecar in out.glob("*.idx"):
        sidecar.unlink()
    return out



def _copy(shards, tmp_path):
    return shutil.copytree(shards, tmp_path / "copy")


def _write(path, labels, label_ext="json"):
    """A shard as another tool writes it: 8 px PNGs with a `.json` label naming the class, or a `.cls`."""
    from PIL import Image

    with tarfile.open(path, "w") as tar:
        for i, label in enumerate(labels):
            png = io.BytesIO()
            Image.new("RGB", (8, 8), (label * 20, 0, 0)).save(png, "PNG")
            named = {"label": label, "class_name": f"c{label}"}
            text = str(label) if label_ext == "cls" else json.dumps(named)
            for ext, data in (("png", png.getvalue()), (label_ext, text.encode())):
                member = tarfile.TarInfo(f"{i:06d}.{ext}")
                member.size = len(data)
                tar.addfile(member, io.BytesIO(data))


def test_an_index_less_brace_pattern_is_counted_by_a_scan_and_trains(shards, train_cli):
    from vramfit.data.shards import read_index

    pattern = str(shards / "train-{000000..000003}.tar")
    index = read_index(pattern)
    assert [s.samples for s in index.splits["train"]] == [32] * 4  # the fifth is not in the pattern
    assert [s.samples for s in index.splits["val"]] == [32, 8]
    assert index.class_names == [str(i) for i in range(10)]
    run_dir, code = train_cli(*source_args(pattern))
    assert code == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["global_step"] == 8  # 128 samples / 16


def test_timms_info_file_gives_the_splits_and_counts(shards, tmp_path):
    """timm's `_info.json` (reader_wds: split filenames + shard_lengths) is believed, not scanned: a
    wrong length is found when the shard is read."""
    from vramfit.config import DataConfig
    from vramfit.data import load_splits
    from vramfit.errors import VramfitError

    data = _copy(shards, tmp_path)
    info = {"name": "digits", "splits": {
        "train": {"name": "train", "filenames": ["train-{000000..000004}.tar"], "shard_lengths": [32] * 5,
                  "num_samples": 160},
        "validation": {"name": "validation", "filenames": ["val-000000.tar", "val-000001.tar"],
                       "shard_lengths": [32, 8], "num_samples": 40}}}
    (data / "_info.json").write_text(json.dumps(info))
    splits = load_splits(DataConfig(source=str(data)))
    assert len(splits.train) == 160 and len(splits.val) == 40 and "1 validation" not in splits.description
    info["splits"]["validation"]["shard_lengths"] = [32, 9]
    (data / "_info.json").write_text(json.dumps(info))
    with pytest.raises(VramfitError) as e:
        load_splits(DataConfig(source=str(data)))
    assert "val-000001.tar" in e.value.message and "9" in e.value.message


def test_a_json_label_names_its_class_and_no_validation_shards_is_refused(tmp_path):
    from vramfit.config import DataConfig
    from vramfit.data import load_splits
    from vramfit.errors import VramfitError

    write = _write
    write(tmp_path / "set-train-0.tar", [0, 1, 2, 1])
    with pytest.raises(VramfitError) as e:
        load_splits(DataConfig(source=str(tmp_path / "set-train-{0..0}.tar")))
    assert "no validation split" in e.value.message and "val-000000.tar" in e.value.hint
    write(tmp_path / "set-validation-0.tar", [2, 0])
    splits = load_splits(DataConfig(source=str(tmp_path / "set-train-{0..0}.tar")))
    assert splits.class_names == ["c0", "c1", "c2"] and len(splits.train) == 4 and len(splits.val) == 2
    assert [splits.val[i]["label"] for i in range(2)] == [2, 0]


def test_a_changed_shard_set_refuses_resume(shards, tmp_path, train_cli):
    from vramfit.errors import VramfitError

    data = _copy(shards, tmp_path)
    args = source_args(data / "train-{000000..000003}.tar", "--epochs", "2")
    run_dir, code = train_cli(*args, "--set", "debug.signal_at_step=3")
    assert code == 143
    shutil.copy(data / "train-000004.tar", data / "train-000005.tar")  # the pattern's string is unchanged
    with pytest.raises(VramfitError, match=r"data.listing: '7 files, \w+' -> '8 files, \w+'"):
        train_cli(*args)
    (data / "train-000005.tar").unlink()
    run_dir, code = train_cli(*args)
    assert code == 0


def test_limits_give_their_count_and_a_resume_is_bitwise(shards, train_cli):
    from vramfit.config import DataConfig
    from vramfit.data import load_splits

    cfg = DataConfig(source=str(shards), limit_train_samples=70, limit_val_samples=25)
    splits = load_splits(cfg)
    assert len(splits.train) == 70 and len(splits.val) == 25
    assert sorted(s.samples for s in splits.train.shards) == [6, 32, 32]
    again = load_splits(cfg)
    assert again.train.shards == splits.train.shards  # a fixed subset (data.split_seed)
    seeded = load_splits(cfg.model_copy(update={"split_seed": 1}))
    assert seeded.train.shards != splits.train.shards
    limits = ("--set", "data.limit_train_samples=70", "--set", "data.limit_val_samples=25")
    full, code = train_cli(*source_args(shards, *limits), run_name="full")
    assert code == 0 and json.loads((full / "summary.json").read_text())["global_step"] == 5
    part, code = train_cli(*source_args(shards, *limits, "--set", "debug.signal_at_step=2"), run_name="part")
    assert code == 143
    part, code = train_cli(*source_args(shards, *limits), run_name="part")
    assert code == 0
    assert same_weights(last_weights(full), last_weights(part))


def test_precise_bn_on_shards_draws_fixed_locations(shards, train_cli):
    from vramfit.data.shards import ShardSamples, fixed_locations, read_index

    samples = ShardSamples(read_index(str(shards)).splits["train"])
    locs = fixed_locations(samples, 40, seed=0)
    assert locs == fixed_locations(samples, 40, seed=0) != fixed_locations(samples, 40, seed=1)
    assert len(set(locs)) == 40 and all(samples[loc]["image"]["bytes"] for loc in locs[:5])
    assert len({loc >> 40 for loc in locs}) > 2  # drawn over the split, not from one shard
    run_dir, code = train_cli(*source_args(shards, "--set", "model.precise_bn=40"))
    assert code == 0


def test_scan_data_and_eval_read_shards(shards, tmp_path, train_cli, capsys):
    from vramfit.cli import run

    assert run(["scan-data", "--data", str(shards)]) == 0
    said = capsys.readouterr().out
    assert "200 images (train 160 / val 40)" in said
    run_dir, code = train_cli(*source_args(shards))
    assert code == 0
    assert run(["eval", "--run", str(run_dir)]) == 0
    report = json.loads((run_dir / "eval-val.json").read_text())
    assert report["samples"] == 40
    best = json.loads((run_dir / "summary.json").read_text())["final_accuracy"]
    assert abs(report["top1"] - best) < 1e-6
    with pytest.raises(Exception) as e:
        run(["eval", "--run", str(run_dir), "--split", "test"])
    assert "not a split" in str(e.value)


def test_a_train_label_past_the_validation_labels_of_an_info_file_ends_at_its_shard(tmp_path, train_cli):
    """An info file's counts without class names: the classes are the validation labels (0..4), the
    train labels are read with the train headers, and a 9 ends the run there, named, exit 2."""
    from vramfit.errors import VramfitError

    _write(tmp_path / "train-0.tar", [i % 5 for i in range(16)], "cls")
    _write(tmp_path / "train-1.tar", [i % 5 for i in range(15)] + [9], "cls")
    _write(tmp_path / "val-0.tar", [i % 5 for i in range(10)], "cls")
    info = {"splits": {"train": {"filenames": ["train-{0..1}.tar"], "shard_lengths": [16, 16]},
                       "validation": {"filenames": ["val-0.tar"], "shard_lengths": [10]}}}
    (tmp_path / "_info.json").write_text(json.dumps(info))
    args = source_args(tmp_path, "--set", "data.image_size=32")
    with pytest.raises(VramfitError) as e:
        train_cli(*args)
    assert e.value.exit_code == 2
    assert str(tmp_path / "train-1.tar") in e.value.message and "000015 has label 9" in e.value.message
    assert "5 classes" in e.value.message and "info file" in e.value.hint
    _write(tmp_path / "train-1.tar", [i % 5 for i in range(16)], "cls")
    run_dir, code = train_cli(*args)
    assert code == 0


def test_eval_reads_only_the_split_it_evaluates(tmp_path, train_cli):
    """`eval --data SHARDS` and `--split` read the one split they evaluate: with a train shard
    removed after training both still evaluate."""
    from vramfit.cli import run

    shards = tmp_path / "wds"
    assert run(["prepare", "--data", "digits", "--output", str(shards), "--format", "webdataset",
                "--shard-samples", "32", "--set", "data.val_fraction=0.2",
                "--set", "data.limit_train_samples=64", "--set", "data.limit_val_samples=40"]) == 0
    run_dir, code = train_cli(*source_args(shards))
    assert code == 0
    (shards / "train-000001.tar").unlink()
    assert run(["eval", "--run", str(run_dir), "--data", str(shards)]) == 0
    assert json.loads((run_dir / "eval-wds-val.json").read_text())["samples"] == 40
    assert run(["eval", "--run", str(run_dir), "--split", "val"]) == 0
    assert json.loads((run_dir / "eval-val.json").read_text())["samples"] == 40


def test_a_limited_shards_unreadable_image_is_replaced_within_the_limit(tmp_path):
    """data.limit_*: the replacement of an unreadable image is one of the samples the split holds of
    its shard (the first `samples`), wrapping there, never one past the limit."""
    from vramfit.data.shards import SHARD_BITS, Shard, ShardSamples, scan

    _write(tmp_path / "train-0.tar", list(range(8)), "cls")
    offsets = list(scan(str(tmp_path / "train-0.tar")))
    samples = ShardSamples([Shard(str(tmp_path / "train-0.tar"), 5, 8)])
    last = offsets[4]  # the limit's last sample of shard 0
    got = [samples.replacement(last, k) % 2 ** SHARD_BITS for k in (1, 2, 5)]
    assert got == [offsets[0], offsets[1], last]
    whole = ShardSamples([Shard(str(tmp_path / "train-0.tar"), 8)])
    assert whole.replacement(last, 1) == offsets[5]
