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


def test_lr_find_in_a_job_log_plots_beside_the_run_and_says_what_it_used(tmp_path):
    """Piped (a job log): plain progress lines, never a carriage return; the plot beside the run
    folder the same settings train into, its path printed; the settings it ran with, said."""
    import os
    import subprocess
    import sys

    from vramfit.config import build_config
    from vramfit.store.runfolder import RunPaths

    args = ["lr-find", "--recipe", "quickstart", "--image-size", "24", "--steps", "10",
            "--output", str(tmp_path), "--set", "data.limit_train_samples=640"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "vramfit.cli", *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "\r" not in proc.stderr + proc.stdout and "lr-find: step 1/10" in proc.stderr
    cfg = build_config("quickstart", ["data.limit_train_samples=640"],
                       {"data.image_size": 24, "output": str(tmp_path)})
    plot = RunPaths.of(cfg, "fp32").lr_find_plot
    assert plot.parent == tmp_path and plot.is_file() and not (tmp_path / "lr_find.png").exists()
    assert f"plot: {plot}" in proc.stdout and "@ 24 px" in proc.stdout and "fp32" in proc.stdout


def test_the_defaults_said_are_those_of_the_config_used(caplog):
    """A backbone's defaults are named for what fills the command's own config only: naming the
    run (which builds the recipe's config to compare with) names none of its own."""
    from vramfit.config import build_config
    from vramfit.store.runfolder import RunPaths

    with caplog.at_level("INFO", logger="vramfit"):
        cfg = build_config("rtx3060", ["hardware.allow_cpu=true"],
                           {"model.name": "resnet34", "data.image_size": 64})
        RunPaths.of(cfg, "bf16")
    said = [r.getMessage() for r in caplog.records if "defaults (not set" in r.getMessage()]
    assert cfg.data.image_size == 64 and said and all("image_size" not in m for m in said), said
