"""`vramfit lr-find` on the quickstart: a sensible suggestion, a real PNG, the model put back."""
import io

import torch
from PIL import Image

from vramfit.cli import parser
from vramfit.commands import lr_find
from vramfit.config import build_config


def test_lr_find_on_the_quickstart(tmp_path, monkeypatch, capsys):
    """The quickstart's data, model and global batch; 50 steps from 1e-4 to 1 (the default density,
    12.5 steps a decade), so it diverges and stops before the end."""
    kept = {}

    def build(cfg):
        run, batches = build_run(cfg)
        kept["model"], kept["before"] = run.model, {k: v.clone() for k, v in run.model.state_dict().items()}
        return run, batches

    build_run = lr_find.build
    monkeypatch.setattr(lr_find, "build", build)
    torch.manual_seed(0)
    cfg = build_config("quickstart")
    out = io.StringIO()
    threads = torch.get_num_threads()
    # One thread: ~12 s on 2 idle cores, and 4x less than two when the cores are shared (two
    # threads then wait on each other at every op).
    torch.set_num_threads(1)
    try:
        r = lr_find.lr_find(cfg, num_iter=50, start_lr=1e-4, end_lr=1.0, plot_path=tmp_path / "lr.png",
                            out=out)
    finally:
        torch.set_num_threads(threads)
    assert r["recipe_lr"] == 0.002 and r["global_batch"] == 64
    assert r["recipe_lr"] / 3 <= r["suggested_lr"] <= 3 * r["recipe_lr"], r["suggested_lr"]
    assert r["stopped_early"] and r["steps"] < 50  # the loss diverged before LR 1
    after = kept["model"].state_dict()
    assert all(torch.equal(after[k], v) for k, v in kept["before"].items())  # weights and BN statistics
    with Image.open(tmp_path / "lr.png") as png:
        png.verify()
        assert png.format == "PNG" and png.size[0] > 300
    assert "suggested LR" in out.getvalue() and "--set optim.lr=" in out.getvalue()
    leaked = capsys.readouterr()
    assert "finder_name" not in leaked.out + leaked.err  # the library's own lines are not printed


def test_suggestion_is_a_tenth_of_the_smoothed_minimum():
    lrs = [10 ** (-4 + i / 10) for i in range(30)]
    losses = [2.0 - 0.05 * i if i < 20 else 1.0 + 0.3 * (i - 20) for i in range(30)]  # minimum at i = 20
    losses[5] = 0.1  # one lucky batch at a low LR is not the minimum
    assert lrs[12] / 10 <= lr_find.suggest(lrs, losses) <= lrs[21] / 10


def test_the_command_line_takes_lr_find():
    ns = parser().parse_args(["lr-find", "--recipe", "quickstart", "--steps", "30", "--plot", "x.png"])
    assert (ns.command, ns.steps, ns.plot, ns.start_lr, ns.end_lr) == ("lr-find", 30, "x.png", 1e-7, 10.0)


def test_the_plot_goes_where_it_is_said_to(tmp_path):
    """`--plot DIR` writes DIR/lr_find.png, `--plot NAME` NAME.png (matplotlib's own default), and
    the path returned is the one written, which is the one printed."""
    lrs, losses = [1e-4 * 1.5 ** i for i in range(20)], [2.0 - 0.05 * i for i in range(20)]
    assert lr_find.plot(lrs, losses, 1e-3, tmp_path, "t") == tmp_path / "lr_find.png"
    assert lr_find.plot(lrs, losses, 1e-3, tmp_path / "sweep", "t") == tmp_path / "sweep.png"
    for written in (tmp_path / "lr_find.png", tmp_path / "sweep.png"):
        with Image.open(written) as png:
            assert png.format == "PNG"
    assert not (tmp_path / "sweep").exists()
