"""`vramfit compare --plot --csv` on two real short runs, and the history it plots."""
import csv
import json

import pytest
from PIL import Image

from _trained_runs import trained_run


def test_compare_plot_and_csv_of_two_real_runs(tmp_path, capsys):
    from vramfit.cli import run as cli

    a, b = trained_run("a"), trained_run("b")
    png, table = tmp_path / "compare.png", tmp_path / "out.csv"
    assert cli(["compare", str(a.path), str(b.path), "--plot", str(png), "--csv", str(table),
                "--sort", "best_accuracy"]) == 0
    out = capsys.readouterr().out
    header = out.splitlines()[0].split()
    assert {"data", "model", "best", "img/s", "planned"} <= set(header) and "accum" not in header
    assert max(len(line) for line in out.splitlines()) <= 120
    rows = {line.split()[0]: line for line in out.splitlines()[2:4]}
    assert set(rows) == {"a", "b"} and all(" digits " in line for line in rows.values())
    assert cli(["compare", str(a.path), str(b.path), "--wide"]) == 0
    assert {"accum", "ckpt", "to", "best", "data"} <= set(capsys.readouterr().out.splitlines()[0].split())
    with Image.open(png) as im:
        assert im.format == "PNG" and im.size[0] > 1200 and im.size[1] > 400
    with open(table, newline="") as f:
        got = {r["run"]: r for r in csv.DictReader(f)}
    assert set(got) == {"a", "b"} and {r["data"] for r in got.values()} == {"digits"}
    assert got["b"]["grad_checkpointing"] == "True" and got["a"]["grad_checkpointing"] == "False"
    if b.real:
        assert got["b"]["grad_accum_steps"] == "2" and got["a"]["grad_accum_steps"] == "1"
    for r in got.values():
        assert 0 < float(r["seconds_to_best"]) <= float(r["wall_seconds"])
    accs = [float(got[n]["best_accuracy"]) for n in (out.splitlines()[2].split()[0], out.splitlines()[3].split()[0])]
    assert accs == sorted(accs, reverse=True)


def test_history_time_continues_across_resumed_segments(tmp_path):
    """A resumed segment's clock restarts at 0: the history's time continues. The first rows are
    as run folders of earlier versions wrote them (`val_accuracy`), the resumed ones as today's."""
    from vramfit.commands.compare import eval_history

    records = [{"step": 10, "time": 5.0, "kind": "train", "loss": 2.0},
               {"step": 20, "time": 9.0, "kind": "eval", "val_accuracy": 0.5},
               # resumed from step 10: the clock restarted, step 20 is evaluated again
               {"step": 20, "time": 3.0, "kind": "eval", "val/accuracy": 0.6},
               {"step": 40, "time": 8.0, "kind": "eval", "val/accuracy": 0.7}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 4')  # last line cut short
    assert [(e["time"], e["accuracy"]) for e in eval_history(path)] == [(9.0, 0.5), (12.0, 0.6), (17.0, 0.7)]


def test_short_labels_and_a_bad_sort_key(tmp_path):
    from vramfit.commands.compare import compare, short_labels
    from vramfit.errors import VramfitError

    assert short_labels(["qs-resnet18-32px-s0", "qs-efficientnet_b0-32px-s0"]) == ["resnet18", "efficientnet_b0"]
    assert short_labels(["x-a", "x-a"]) == ["x-a", "x-a"]
    run = tmp_path / "r"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"best_accuracy": 0.5}))
    with pytest.raises(VramfitError, match="--sort best_acc"):
        compare([str(run)], sort="best_acc")


def test_a_damaged_run_among_several_is_named_and_the_rest_compared(tmp_path, capsys):
    """An output folder where one run's summary.json was cut short: that run is named and left
    out, the others are compared; named alone, it is an error with a hint (exit 2)."""
    import shutil

    from vramfit.cli import main, run as cli

    out = tmp_path / "runs"
    shutil.copytree(trained_run("a").path, out / "a", ignore=shutil.ignore_patterns("checkpoints", "model"))
    shutil.copytree(out / "a", out / "cut")
    (out / "cut" / "summary.json").write_text('{"best_accuracy": 0.9, "epo')
    assert cli(["compare", str(out)]) == 0
    captured = capsys.readouterr()
    assert "skipping" in captured.err and "cut" in captured.err and "is damaged" in captured.err
    assert [line.split()[0] for line in captured.out.splitlines()[2:]] == ["a"]
    with pytest.raises(SystemExit) as e:
        main(["compare", str(out / "cut")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "is damaged" in err and "HINT:" in err and "Traceback" not in err


def test_the_default_table_fits_120_columns_with_long_run_names(tmp_path, capsys):
    """Default run names are long (recipe, model, size, batch, precision, seed, what differs): the
    table shortens them (the parts all share left out, then cut with an ellipsis) to fit 120
    columns; --wide keeps them whole."""
    import shutil

    from vramfit.cli import run as cli

    src = trained_run("a").path
    names = [f"quickstart-resnet18-32px-gb64-fp32-s0-digits-lr{v}-with-a-long-tail-of-settings-that-differ"
             for v in ("0.001", "0.002")]
    for n in names:
        shutil.copytree(src, tmp_path / n)
    assert cli(["compare", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(map(len, lines)) <= 120 and len(lines) == 4
    assert {line.split()[0] for line in lines[2:]} == {"lr0.001", "lr0.002"}
    assert cli(["compare", str(tmp_path), "--wide"]) == 0
    assert {line.split()[0] for line in capsys.readouterr().out.splitlines()[2:]} == set(names)


def test_csv_and_plot_into_a_folder_write_inside_it_and_say_where(tmp_path, capsys):
    """`--csv DIR` / `--plot DIR` (an existing folder) write DIR/runs.csv and DIR/compare.png, as
    `cp FILE DIR` would, and the lines say the paths written; a plot named without an extension
    gets `.png` and is told as such."""
    from vramfit.cli import run as cli

    a = trained_run("a")
    folder = tmp_path / "out"
    folder.mkdir()
    assert cli(["compare", str(a.path), "--csv", str(folder), "--plot", str(folder)]) == 0
    out = capsys.readouterr().out
    assert f"table written to {folder / 'runs.csv'}\n" in out
    assert f"plot written to {folder / 'compare.png'}\n" in out
    assert (folder / "runs.csv").read_text().startswith("run,") and (folder / "compare.png").is_file()
    assert cli(["compare", str(a.path), "--plot", str(tmp_path / "fig")]) == 0
    assert f"plot written to {tmp_path / 'fig.png'}\n" in capsys.readouterr().out
    assert (tmp_path / "fig.png").is_file()
