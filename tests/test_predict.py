"""`vramfit eval` and `vramfit predict` on a tiny trained run: they agree with each other and with the
training's own evaluation; bad input is one clear paragraph and exit 2."""
import json
import shutil

import pytest
from PIL import Image

from _trained_runs import trained_run


@pytest.fixture(scope="module")
def run():
    return trained_run("a")


@pytest.fixture(scope="module")
def evaluated(run):
    from vramfit.cli import run as cli

    assert cli(["eval", "--run", str(run.path)]) == 0
    return json.loads((run.path / "eval-val.json").read_text())


def _main(argv, capsys):
    from vramfit.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return e.value.code, out, err


def _val_split(run_dir):
    from vramfit.commands.eval import run_data_config
    from vramfit.commands.trained import TrainedModel
    from vramfit.data import load_splits

    return load_splits(run_data_config(TrainedModel(run_dir, device="cpu")))


def test_eval_writes_report_and_confusion_png(run, evaluated):
    summary = json.loads((run.path / "summary.json").read_text())
    assert evaluated["split"] == "val" and evaluated["samples"] == 120
    assert evaluated["class_names"] == [str(i) for i in range(10)]
    assert len(evaluated["per_class"]) == 10 and sum(c["samples"] for c in evaluated["per_class"]) == 120
    matrix = evaluated["confusion_matrix"]
    assert sum(map(sum, matrix)) == 120
    assert sum(matrix[i][i] for i in range(10)) / 120 == pytest.approx(evaluated["top1"])
    assert evaluated["top1"] <= evaluated["top5"]
    if run.real:  # model/ holds the best epoch's weights: the same images give the same accuracy
        assert abs(evaluated["top1"] - summary["best_accuracy"]) <= 1 / 120 + 1e-9
    with Image.open(run.path / "confusion-val.png") as png:
        assert png.format == "PNG" and min(png.size) > 300


def test_predict_on_validation_images_agrees_with_eval(run, evaluated, capsys):
    from vramfit.cli import run as cli

    from vramfit.commands.trained import ColumnItems

    splits = _val_split(run.path)
    files = [item["path"] for item in ColumnItems(splits.val, splits.image_column)]
    labels = splits.val[splits.label_column]
    assert cli(["predict", "--run", str(run.path), "--json", "--top-k", "3", *files]) == 0
    preds = json.loads(capsys.readouterr().out)
    assert [p["file"] for p in preds] == files
    assert all(len(p["predictions"]) == 3 for p in preds)
    top1 = [int(p["predictions"][0]["label"]) for p in preds]
    assert sum(t == y for t, y in zip(top1, labels)) / len(labels) == pytest.approx(evaluated["top1"])
    for t, y in zip(top1, labels):  # row = true class, column = predicted, as in eval's matrix
        evaluated["confusion_matrix"][y][t] -= 1
    assert not any(any(row) for row in evaluated["confusion_matrix"])


def test_predict_table_csv_and_an_unreadable_file(run, tmp_path, capsys):
    good = tmp_path / "good.png"
    Image.new("L", (8, 8), 128).save(good)
    bad = tmp_path / "broken.jpg"
    bad.write_bytes(b"not an image")
    code, out, err = _main(["predict", "--run", str(run.path), str(good), str(bad), "--csv"], capsys)
    assert code == 2
    assert out.splitlines()[0] == "file,rank,label,probability" and len(out.splitlines()) == 6
    assert "broken.jpg: not an image" in err and "1 of 2 image(s) could not be read" in err and "HINT:" in err
    code, out, _ = _main(["predict", "--run", str(run.path), str(tmp_path / "good.png")], capsys)
    assert code == 0 and out.splitlines()[0].split() == ["file", "top-1", "top-2", "top-3", "top-4", "top-5"]


def _class_folder(root, names, per_class=2, splits=("",)):
    for split in splits:
        for n in names:
            d = root / split / n
            d.mkdir(parents=True)
            for i in range(per_class):
                Image.new("L", (8, 8), 40 * i).save(d / f"{i}.png")
    return root


def test_eval_on_a_named_split_and_a_class_mismatch(run, tmp_path, capsys):
    from vramfit.cli import run as cli

    digits = _class_folder(tmp_path / "digits", [str(i) for i in range(10)], splits=("train", "test"))
    assert cli(["eval", "--run", str(run.path), "--data", str(digits), "--split", "test"]) == 0
    report = json.loads((run.path / "eval-digits-test.json").read_text())
    assert report["samples"] == 20 and (run.path / "confusion-digits-test.png").is_file()
    assert cli(["eval", "--run", str(run.path), "--data", str(digits / "test")]) == 0  # no split: all of it
    assert json.loads((run.path / "eval-test-all.json").read_text())["samples"] == 20
    pets = _class_folder(tmp_path / "pets", ["cat", "dog"])
    code, _, err = _main(["eval", "--run", str(run.path), "--data", str(pets)], capsys)
    err = " ".join(err.split())  # the message is wrapped at 100 columns
    assert code == 2 and "cat, dog" in err and "0, 1, 2" in err and "HINT:" in err
    code, _, err = _main(["eval", "--run", str(run.path), "--data", str(digits), "--split", "tset"], capsys)
    err = " ".join(err.split())  # said in the command's own words, not the config key behind it
    assert code == 2 and "--split tset: is not a split of" in err and "use --split with one of its splits: train, test" in err
    assert "data.val_split" not in err


def test_run_folder_without_a_model(run, tmp_path, capsys):
    half = tmp_path / "half"
    shutil.copytree(run.path, half, ignore=shutil.ignore_patterns("model", "checkpoints"))
    for argv in (["eval", "--run", str(half)], ["predict", "--run", str(half), str(half / "config.yaml")],
                 ["export", "--run", str(half), "--format", "onnx"]):
        code, _, err = _main(argv, capsys)
        assert code == 2 and "has no trained model" in err and "HINT:" in err


@pytest.mark.parametrize("damage", ["model/config.json", "model/model.safetensors", "summary.json"])
def test_a_damaged_file_in_a_finished_run_is_named(run, tmp_path, capsys, damage):
    """A truncated file (a disk that filled, a copy cut short): eval, predict and export exit 2
    naming it, never a JSONDecodeError or SafetensorError traceback."""
    copy = tmp_path / "copy"
    shutil.copytree(run.path, copy, ignore=shutil.ignore_patterns("checkpoints"))
    f = copy / damage
    f.write_bytes(f.read_bytes()[: len(f.read_bytes()) // 2])
    commands = [["eval", "--run", str(copy)], ["predict", "--run", str(copy), str(copy / "config.yaml")],
                ["export", "--run", str(copy), "--format", "torchscript", "--output", str(tmp_path / "ts")]]
    for argv in commands if damage.startswith("model/") else commands[2:]:  # summary.json: the model card
        code, _, err = _main(argv, capsys)
        said = " ".join(err.split())
        assert code == 2 and f"{f} is damaged and cannot be read" in said and "HINT:" in said, (argv, err)


def test_loader_workers_give_the_same_scores(run):
    """Workers decode on a GPU machine: the same logits, in input order, unreadable ones listed."""
    import torch

    from vramfit.commands.trained import ColumnItems, TrainedModel

    tm = TrainedModel(run.path, device="cpu")
    splits = _val_split(run.path)
    items = [*ColumnItems(splits.val.select(range(12)), splits.image_column), {"bytes": b"junk", "path": "x.png"}]
    alone, shared = tm.scores(items, batch_size=5, workers=0), tm.scores(items, batch_size=5, workers=2)
    assert alone.positions == shared.positions == list(range(12))
    assert torch.equal(alone.logits, shared.logits)
    assert shared.unreadable == [(12, "x.png: not an image")]


def test_predict_into_a_closed_pipe_ends_quietly(run, tmp_path):
    """`vramfit predict ... --csv | head -1`: the reader closes the pipe after one line; the command
    ends as `cat` would (141, SIGPIPE's), with nothing on stderr."""
    import subprocess
    import sys

    images = tmp_path / "imgs"
    for i in range(300):  # more CSV than a pipe holds, so the writer meets the closed end
        (images / str(i % 3)).mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (8, 8), (i % 256, 0, 0)).save(images / str(i % 3) / f"{i}.png")
    cmd = [sys.executable, "-m", "vramfit.cli", "predict", "--run", str(run.path), str(images), "--csv"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and first.startswith(b"file,rank,label,probability")
    assert err == "", err
