"""The GPU benches of bench/gpu_check.sh build commands a GPU recipe accepts.

They run only on a GPU, so a recipe change that makes one of their commands invalid (a staged
recipe given one epoch) would first show on a lent device. Here each command as gpu_check.sh
builds it must pass the configuration and stop at the GPU check: the one thing this machine lacks.
"""

from types import SimpleNamespace

import pytest

from helpers import bench_module as bench
from vramfit.cli import run
from vramfit.config import build_config
from vramfit.errors import VramfitError


def commands(out):
    recipe_run, fit_sweep, progressive = bench("recipe_run"), bench("fit_sweep"), bench("progressive")
    yield recipe_run.train_args("rtx3060", 1024, out)
    yield recipe_run.train_args("rtx3060", 512, out, staged=True)
    for model in ("resnet50", "efficientnet_b0"):
        ns = SimpleNamespace(recipe="rtx3060", model=model, image_size=224, train_samples=1024, epochs=4,
                             resize_set=[])
        share = build_config("rtx3060").train.global_batch  # fit_sweep's share on one process
        # gpu_check.sh's fit stage sweeps ResNet50 in the recipe's precision; the rerun in
        # docs/benchmarks.md sweeps bf16 and fp16 too
        precisions = ["bf16", "fp16"] if model == "resnet50" else None
        for _, extra in fit_sweep.candidates(share, precisions):
            yield [*fit_sweep.base_args(ns, out), "--epochs", "1", "--set", "train.fit=largest", *extra]
        yield [*fit_sweep.base_args(ns, out), "--epochs", "1", *fit_sweep.chooser_args(precisions)]
        yield progressive.base_args(ns, out)
        yield [*progressive.base_args(ns, out), *progressive.resize_args(ns)]


def test_every_gpu_bench_command_is_a_valid_run(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    built = list(commands(tmp_path / "runs"))
    assert len(built) > 10
    for argv in built:
        with pytest.raises(VramfitError) as e:
            run([*argv, "--run-name", "check"])
        assert "torch sees no GPU" in str(e.value), (argv, str(e.value))


def test_the_staged_recipe_run_prints_each_phases_fit(train_cli, tmp_path, monkeypatch, test_resnet_weights):
    """recipe_run --staged reports train.fit: fastest's choice for the head phase and for the whole
    network's, read from a staged run's own summary.json."""
    import json

    from helpers import tiny_args

    monkeypatch.setenv("VRAMFIT_CACHE", str(tmp_path / "cache"))
    run_dir, code = train_cli(*tiny_args("--epochs", "2", "--set", "train.freeze_epochs=1",
                                         "--set", f"model.pretrained_path={test_resnet_weights}",
                                         "--set", "train.fit=fastest"), run_name="staged")
    assert code == 0
    lines = bench("recipe_run").fit_lines(json.loads((run_dir / "summary.json").read_text()))
    assert [line.split(":")[0].strip() for line in lines] == ["fit for phase head", "fit for phase all"]
    assert all("micro 16" in line and "probed in" in line for line in lines), lines


def test_the_progressive_bench_prices_the_schedules_steps_by_their_size():
    """bench/progressive.py's ceiling: every size the progressive run trained at is timed (one step
    at the micro-batch it trained at), priced against the full size's step, and the schedule's
    steps weighted by their count."""
    from vramfit.data.progressive import schedule_of

    cfg = build_config(None, ["model.name=test_resnet", "data.image_size=32", "train.global_batch=16",
                              "data.progressive_resize=true"])
    spans = schedule_of(cfg, 10).spans
    progressive = {"phases": [{"image_size": sp.image_size, "steps": sp.steps, "micro_batch": 8} for sp in spans]}
    rows, best = bench("progressive").ceiling(cfg, {"micro_batch": 16}, progressive)
    assert [(size, steps) for size, steps, _ in rows] == [(sp.image_size, sp.steps) for sp in spans]
    assert rows[-1][0] == 32 and rows[-1][2] == 1.0 and all(cost > 0 for _, _, cost in rows)
    assert best == pytest.approx(sum(steps * cost for _, steps, cost in rows) / 100)
