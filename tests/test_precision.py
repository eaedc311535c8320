"""One rule turns the precision a run asks for into the one it runs with (vramfit.runtime.precision), and
every consumer says what ran: the launch, the planner, lr-find, summary.json, the run name."""
import pytest

from vramfit.errors import VramfitError
from vramfit.runtime.precision import planned, requested_name, resolve


@pytest.mark.parametrize("asked, device, bf16, runs, noted", [
    ("auto", "cuda", True, "bf16", False),
    ("auto", "cuda", False, "fp16", False),  # a GPU before Ampere: fp16 with loss scaling
    ("bf16", "cuda", False, "fp16", True),
    ("bf16", "cuda", True, "bf16", False),
    ("fp16", "cuda", True, "fp16", False),
    ("fp32", "cuda", True, "fp32", False),
    ("auto", "cpu", None, "fp32", False),
    ("fp32", "cpu", None, "fp32", False),
    ("fp16", "cpu", None, "fp32", True),  # no fp16 autocast on a CPU: said
    ("bf16", "cpu", None, "bf16", False),
])
def test_what_runs_for_what_was_asked(asked, device, bf16, runs, noted):
    p = resolve(asked, device, bf16_supported=bf16)
    assert (p.requested, p.name, p.note is not None) == (asked, runs, noted)
    assert p.accelerate == ("no" if runs == "fp32" else runs)
    assert p.scales_loss == (runs == "fp16")


def test_fp16_on_a_cpu_runs_fp16_only_when_asked_to():
    assert resolve("fp16", "cpu", fp16_on_cpu=True).name == "fp16"
    assert resolve("auto", "cpu", fp16_on_cpu=True).name == "fp32"


def test_auto_is_a_rule_of_the_card_never_a_measurement(monkeypatch):
    """`train.precision: auto` under `train.fit: fastest`: bf16 on a card with bf16, fp16 (loss
    scaled) on one without, fp32 on a CPU, from the card alone: no step is measured for it, and no
    fit candidate holds a precision (bench/fit_sweep.py --precisions measures bf16 against fp16)."""
    import dataclasses

    import torch

    from vramfit.config import Config
    from vramfit.runtime.precision import here
    from vramfit.tuning import fit

    def no_measure(*_):
        raise AssertionError("the precision was measured")

    monkeypatch.setattr(fit, "measure", no_measure)
    cfg = Config.model_validate({"model": {"name": "test_resnet"}, "train": {"precision": "auto", "fit": "fastest"}})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for bf16, runs in ((True, "bf16"), (False, "fp16")):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *_, has=bf16, **__: has)
        p = here(cfg)
        assert (p.requested, p.name, p.note, p.scales_loss) == ("auto", runs, None, runs == "fp16")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert here(cfg).name == "fp32"
    assert "precision" not in {f.name for f in dataclasses.fields(fit.Settings)}


def test_every_spelling_is_one_name_and_a_wrong_one_is_said():
    assert [requested_name(n) for n in ("no", "32", "fp32", "bf16-mixed", "16-mixed", None, "AUTO")] == \
        ["fp32", "fp32", "fp32", "bf16", "fp16", "auto", "auto"]
    with pytest.raises(VramfitError, match="Unknown precision `fp8`"):
        requested_name("fp8")


def test_the_planner_plans_for_a_gpu_with_bf16():
    from vramfit.config import Config
    from vramfit.planner import estimate

    assert planned("auto").accelerate == "bf16" and planned("no").accelerate == "no"
    cfg = Config.model_validate({"model": {"name": "test_resnet"}, "data": {"image_size": 32},
                                 "train": {"global_batch": 4, "precision": "auto"}})
    assert estimate(cfg, 10, 4).precision == "bf16"


def test_a_cpu_run_says_fp32_where_auto_was_asked():
    """summary.json, plan.json and the run's identity say what ran (the tiny run asks for `auto`)."""
    import json

    from _trained_runs import trained_run
    from vramfit.store import checkpoint

    run = trained_run("a")
    if not run.real:
        pytest.skip("the tiny run did not train (its own tests say why)")
    assert "precision: auto" in (run.path / "config.yaml").read_text()  # what was asked, kept as asked
    assert json.loads((run.path / "summary.json").read_text())["precision"] == "fp32"
    assert json.loads((run.path / "plan.json").read_text())["precision"] == "no"  # as Accelerate names it
    state = checkpoint.read_state(checkpoint.latest(run.path / "checkpoints"))
    assert state["identity"]["train.precision"] == "fp32"


def test_the_default_run_name_holds_what_runs():
    from vramfit.config import build_config
    from vramfit.runtime.precision import here
    from vramfit.store.runfolder import RunPaths

    cfg = build_config("quickstart")
    assert cfg.train.precision == "auto"
    name = RunPaths.of(cfg, here(cfg).name).name
    assert "-fp32-" in name and "auto" not in name  # on this CPU
