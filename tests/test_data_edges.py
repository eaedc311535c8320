"""Bad input at the edges of the data: every case ends in a clear answer (docs/data.md, bad input).
All data is generated here, tiny; the only run is a short subprocess that stops before step 1."""
import logging
import subprocess
import sys
import warnings

import numpy as np
import pytest
from PIL import Image

from helpers import cfg, class_tree, train_args, transforms_32
from vramfit import data as D
from vramfit.errors import VramfitError


def broken_tree(root, per_class=6):
    for c in ("a", "b"):
        (root / c).mkdir(parents=True)
        for i in range(per_class):
            (root / c / f"{i}.jpg").write_bytes(np.random.default_rng(i).bytes(300))
    return root


def test_every_image_unreadable_with_workers_stops_cleanly_within_seconds(tmp_path):
    root = broken_tree(tmp_path / "broken")
    cmd = [sys.executable, "-m", "vramfit.cli", "train", *train_args(root, None), "--set", "data.num_workers=2",
           "--global-batch", "4", "--output", str(tmp_path / "runs")]
    # Before: the worker's traceback, then the process waited forever on workers that ignore SIGTERM.
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "No readable training image" in proc.stderr and f"{root}/a/" in proc.stderr
    assert "HINT:" in proc.stderr


def test_every_image_unreadable_without_workers_names_the_files(tmp_path, transforms):
    root = broken_tree(tmp_path / "broken")
    s = D.load_splits(cfg(root, val_fraction=0.2))
    ds = D.ImageDataset(s.train, s.image_column, s.label_column, transforms[0], 32, 0, train=True)
    loader = D.make_loader(ds, batch_sampler=D.StepBatchSampler(len(ds), 4, 0, 1, seed=0))
    with pytest.raises(VramfitError) as e:  # before: "most files are unreadable", none named
        next(iter(loader))
    lines = e.value.message.splitlines()
    assert lines[0].startswith("No readable training image") and "(9 files of the 9 in" in lines[0]
    assert len(lines) == 10 and all(line.strip().startswith(str(root)) and line.endswith("not an image")
                                    for line in lines[1:])
    assert "scan-data" in e.value.hint


def test_an_empty_class_folder_is_named_and_recorded(tmp_path, capsys):
    from vramfit.cli import run

    root = class_tree(tmp_path / "photos", {"cat": 4, "dog": 4})
    (root / "fox").mkdir()
    (root / "owl").mkdir()
    (root / "owl" / "notes.txt").write_text("no images here")
    s = D.load_splits(cfg(root))
    assert s.class_names == ["cat", "dog"] and s.empty_classes == ["fox", "owl"]
    (note,) = [n for n in s.notes if "without images" in n]
    assert "fox, owl" in note and "2 classes: cat, dog" in note
    run(["scan-data", "--data", str(root)])
    assert "note: class folder(s) without images left out: fox, owl" in capsys.readouterr().out
    # In split folders, a class folder is named with its split.
    split = tmp_path / "split"
    class_tree(split / "train", {"cat": 3, "dog": 3})
    class_tree(split / "val", {"cat": 1, "dog": 1})
    (split / "train" / "fox").mkdir()
    assert D.load_source(cfg(split)).empty_classes == ["train/fox"]


def test_a_missing_relative_path_is_called_missing_not_a_hub_id(tmp_path, monkeypatch):
    import datasets

    calls = []

    def no_hub(path, *a, **kw):
        calls.append(path)
        raise FileNotFoundError(f"Dataset '{path}' doesn't exist on the Hub")

    monkeypatch.setattr(datasets, "load_dataset", no_hub)
    monkeypatch.chdir(tmp_path)
    class_tree(tmp_path / "data" / "cats", {"x": 1})
    for path in ("data/cat", "./someone/photos", "some/relative/path"):
        with pytest.raises(VramfitError) as e:
            D.load_splits(cfg(path))
        assert "no such file or folder" in e.value.message and "Hub" not in e.value.message, path
    with pytest.raises(VramfitError, match="data holds cats"):
        D.load_splits(cfg("data/cat"))
    assert calls == []
    # Not path-like and not on disk: both readings fail, and the message says both.
    with pytest.raises(VramfitError) as e:
        D.load_splits(cfg("someone/photos"))
    assert calls == ["someone/photos"]
    assert "no such local folder" in e.value.message and "Hub dataset id" in e.value.message
    assert "doesn't exist on the Hub" in e.value.message and "./someone/photos" in e.value.hint


def test_huge_images_give_one_note_not_a_pil_warning_per_file(tmp_path, monkeypatch, caplog, transforms):
    from vramfit.commands.scan_data import scan_data

    root = class_tree(tmp_path / "photos", {"a": 6, "b": 6}, size=(40, 40))  # 1600 pixels each
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # PIL warns above this, fails above 2x
    s = D.load_splits(cfg(root, val_fraction=0.25))
    ds = D.ImageDataset(s.train, s.image_column, s.label_column, transforms[0], 32, 0, train=True)
    sampler = D.StepBatchSampler(len(ds), 3, 0, 1, seed=0)
    loader = D.make_loader(ds, batch_sampler=sampler)
    with warnings.catch_warnings(record=True) as raised, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        for epoch in range(2):
            sampler.set_epoch(epoch)
            assert sum(len(b.indices) for b in loader) == 9
        with open(tmp_path / "scan.txt", "w") as out:
            assert scan_data(cfg(root), workers=1, out=out) == 0
    assert not [w for w in raised if issubclass(w.category, Image.DecompressionBombWarning)]
    notes = [r.getMessage() for r in caplog.records if "huge images" in r.getMessage()]
    assert len(notes) == 1 and notes[0].startswith("note: huge images") and "40x40" in notes[0]


def test_the_run_seed_does_not_choose_the_validation_images(tmp_path):
    from vramfit.config import build_config

    root = class_tree(tmp_path / "photos", {"a": 20, "b": 20})
    paths = lambda ds: sorted(r["path"] for r in ds["image"])  # noqa: E731

    def val_of(*sets):
        c = build_config(None, ["data.val_fraction=0.25", "data.limit_val_samples=6", *sets],
                         {"data.source": str(root)})
        return paths(D.load_splits(c.data).val)

    assert val_of("train.seed=1") == val_of("train.seed=2") == val_of()
    assert val_of("data.split_seed=1") != val_of()


def test_a_named_split_loads_for_evaluation_with_the_run_classes(tmp_path):
    class_tree(tmp_path / "train", {"cat": 4, "dog": 4})
    class_tree(tmp_path / "test", {"cat": 2, "dog": 1}, seed=2)
    s = D.load_splits(cfg(tmp_path))  # no validation split: held out of train, test untouched
    assert len(s.train) + len(s.val) == 8
    assert any("test split left for `vramfit eval --split test`" in n for n in s.notes)
    test = D.load_eval_split(cfg(tmp_path), "test", s.class_names)
    assert len(test) == 3 and sorted(test["label"]) == [0, 0, 1]
    with pytest.raises(VramfitError, match="was trained on"):
        D.load_eval_split(cfg(tmp_path), "test", ["ant", "bee"])


def test_prepare_keeps_a_test_split_as_test_not_as_validation(tmp_path, capsys):
    from vramfit.commands.prepare import prepare

    class_tree(tmp_path / "src" / "train", {"cat": 4, "dog": 4}, size=(12, 12))
    class_tree(tmp_path / "src" / "test", {"cat": 2, "dog": 1}, size=(12, 12), seed=2)
    report = prepare(cfg(tmp_path / "src"), str(tmp_path / "dst"), max_side=12, workers=1)
    assert report["written"] == {"train": 8, "test": 3}  # before: the test split became `validation`
    src = D.load_source(cfg(tmp_path / "dst"))
    assert src.val is None and src.held_out == ["test"]
    assert len(D.load_eval_split(cfg(tmp_path / "dst"), "test", src.class_names)) == 3


@pytest.fixture(scope="module")
def transforms():
    return transforms_32()


def test_caches_that_cannot_be_written_move_to_the_output_folder(tmp_path, monkeypatch, capsys):
    """A read-only or broken HOME: the datasets, evaluate and vramfit caches cannot be written
    (here: their paths run through a file, which stops root too). The run moves them under
    --output/.cache, says so with the setting to use, and trains a parquet source to the end."""
    import datasets
    import evaluate

    from helpers import encode, picture
    from vramfit.cli import main

    blocked = tmp_path / "home-is-a-file"
    blocked.write_text("")
    for env in ("VRAMFIT_CACHE", "HF_DATASETS_CACHE", "HF_METRICS_CACHE"):
        monkeypatch.setenv(env, str(blocked / env.lower()))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", blocked / "datasets")
    monkeypatch.setattr(evaluate.config, "HF_METRICS_CACHE", str(blocked / "metrics"))
    rows = [{"image": {"bytes": encode(picture(24, 24, i), "PNG"), "path": None}, "label": i % 2} for i in range(24)]
    src = tmp_path / "train.parquet"
    datasets.Dataset.from_list(rows).cast_column("image", datasets.Image()).to_parquet(str(src))
    out = tmp_path / "runs"
    with pytest.raises(SystemExit) as e:
        main(["train", *train_args(src, out), "--output", str(out), "--run-name", "ro"])
    err = " ".join(capsys.readouterr().err.split())
    assert e.value.code == 0, err
    for name, env in (("datasets", "HF_DATASETS_CACHE"), ("evaluate", "HF_METRICS_CACHE")):
        assert f"the {name} cache {blocked}" in err and f"using {out / '.cache' / name}" in err and f"set {env}" in err
    assert (out / "ro" / "summary.json").is_file() and "Traceback" not in err

