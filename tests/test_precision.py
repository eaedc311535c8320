"""One rule turns the precision a run asks for into the one it runs with (vramfit.precision), and
every consumer says what ran: the launch, the planner, lr-find, summary.json, the run name."""
import pytest

from vramfit.errors import VramfitError
from vramfit.precision import planned, requested_name, resolve


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


def test_auto_takes_the_fits_choice_only_among_its_own():
    """`train.fit: fastest` may choose bf16 or fp16 for `auto` on a GPU with bf16, nothing else; a
    choice auto cannot run (fp16 on a CPU, bf16 on a card without it, any choice of an explicit
    precision) is not taken."""
    from vramfit.config import Config
    from vramfit.precision import fit_choices, here

    chosen = resolve("auto", "cuda", bf16_supported=True, chosen="fp16")
    assert (chosen.name, chosen.requested) == ("fp16", "auto") and "measured faster than bf16" in chosen.note
    assert resolve("auto", "cuda", bf16_supported=True, chosen="bf16").note is None
    assert resolve("auto", "cuda", bf16_supported=False, chosen="bf16").name == "fp16"
    assert resolve("auto", "cuda", bf16_supported=True, chosen="no").name == "bf16"
    assert resolve("bf16", "cuda", bf16_supported=True, chosen="fp16").name == "bf16"
    assert resolve("auto", "cpu", chosen="fp16").name == "fp32"

    def cfg(precision, as_gpu):
        return Config.model_validate({"model": {"name": "test_resnet"}, "train": {"precision": precision},
                                      "debug": {"gpu_precisions_on_cpu": as_gpu}})

    assert fit_choices(cfg("auto", True)) == ("bf16", "fp16")  # this CPU standing in for a GPU with bf16
    assert fit_choices(cfg("auto", False)) == fit_choices(cfg("bf16", True)) == ()
    assert here(cfg("auto", True)).name == "bf16" and here(cfg("auto", True), "fp16").name == "fp16"
    assert here(cfg("fp16", True)).scales_loss  # run as fp16_on_cpu runs it


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
    from vramfit import checkpoint

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
    from vramfit.precision import here
    from vramfit.runfolder import RunPaths

    cfg = build_config("quickstart")
    assert cfg.train.precision == "auto"
    name = RunPaths.of(cfg, here(cfg).name).name
    assert "-fp32-" in name and "auto" not in name  # on this CPU
