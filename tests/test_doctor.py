"""`vramfit doctor` and `--recipe auto`: stand-in cards pick the expected recipe; no GPU is fine."""
import json

import pytest

from vramfit.cli import main, resolve_config, run
from vramfit.commands import doctor as D

GiB = 2**30


def card(gib: float, bf16: bool = True, name: str = "stand-in") -> D.Card:
    return D.Card(name, int(gib * GiB), bf16, (8, 6) if bf16 else (7, 5))


@pytest.mark.parametrize("reported,bf16,recipe,sets", [
    (5.79, False, "gtx1660ti", []),  # 6 GB Turing: the fp16 recipe as it is
    (5.79, True, "gtx1660ti", ["train.precision=bf16"]),  # 6 GB Ampere: bf16, no loss scaling
    (7.79, True, "rtx3070", []),
    (11.75, True, "rtx3060", []),
    (15.78, False, "rtx3060", ["train.precision=fp16"]),  # 16 GB V100: no bf16
    (23.68, True, "rtx3090", []),  # 24 GB: RTX 3090 / 4090
    (39.39, True, "a100", []),
    (79.15, True, "h100", []),
    (3.8, True, "gtx1660ti", ["train.precision=bf16"]),  # smaller than every recipe's card: the smallest
])
def test_auto_picks_the_recipe_for_the_card(reported, bf16, recipe, sets):
    choice = D.auto_recipe(card(reported, bf16))
    assert (choice.name, choice.sets) == (recipe, sets), choice.why
    assert f"{reported:.2f} GiB" in choice.why


def test_auto_without_a_gpu_is_the_quickstart(monkeypatch, capsys):
    monkeypatch.setattr(D, "detect_cards", lambda with_free=False: [])
    cfg = resolve_config("auto")
    assert cfg.recipe == "quickstart" and cfg.data.source == "digits"
    assert "--recipe auto -> quickstart" in capsys.readouterr().err


def test_auto_on_a_card_without_bf16_and_the_users_own_set_wins(monkeypatch, capsys):
    monkeypatch.setattr(D, "detect_cards", lambda with_free=False: [card(15.78, False, "Tesla V100-PCIE-16GB")])
    cfg = resolve_config("auto")
    assert (cfg.recipe, cfg.train.precision, cfg.model.name) == ("rtx3060", "fp16", "resnet50")
    assert "no bf16" in capsys.readouterr().err
    assert resolve_config("auto", sets=["train.precision=fp32"]).train.precision == "fp32"


def test_doctor_runs_without_a_gpu_and_says_so(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["doctor"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "torch" in text and "CPU cores" in text and "recipe that fits" in text
    if "GPU 0" not in text:
        assert "none visible" in text
    (tmp_path / "env.json").write_text(json.dumps({"torch": "0.0-old", "python": "2.7"}))
    with pytest.raises(SystemExit) as e:
        main(["doctor", "--json", "--diff", str(tmp_path)])
    assert e.value.code == 0
    rep = json.loads(capsys.readouterr().out)
    assert {"machine", "gpus", "recipe_that_fits", "diff"} <= set(rep)
    assert {d["key"] for d in rep["diff"]} == {"torch", "python"}


def test_doctor_checks_the_recipe_and_its_data(capsys):
    assert run(["doctor", "--recipe", "quickstart", "--data", "digits", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["data"]["ok"] and rep["data"]["sample_shapes"][0] == [3, 32, 32] and rep["data"]["classes"] == 10
    assert rep["plan"]["model"] == "resnet18" and rep["plan"]["predicted_peak_bytes"] > 0


def test_doctor_names_images_that_do_not_come_out_at_the_recipes_size(monkeypatch, capsys):
    """The "resize written but never applied" case: reported, and the exit code says so."""
    never_resized = {"source": "photos", "classes": 2, "train_images": 8, "val_images": 2,
                     "sample_shapes": [[3, 3000, 4000]], "expected_shape": [3, 32, 32], "ok": False, "notes": []}
    monkeypatch.setattr(D, "check_data", lambda cfg: never_resized)
    assert run(["doctor", "--recipe", "quickstart", "--data", "digits"]) == 1
    assert "[3, 3000, 4000] for [3, 32, 32]: DOES NOT MATCH" in capsys.readouterr().out


@pytest.mark.parametrize("recipe", ["quickstart", "rtx3060", "gtx1660ti"])
def test_doctor_says_the_precision_the_run_starts_with(recipe, monkeypatch, capsys):
    """One rule says what trains (precision.resolve): doctor reads it, as the run's start line
    does (`precision.here`), whatever the recipe asks; a bf16 recipe on a CPU runs bf16."""
    import torch

    from vramfit.runtime import precision

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = resolve_config(recipe, sets=["hardware.allow_cpu=true"])
    here = D.precision_here(cfg, [])
    assert here["runs"] == precision.here(cfg).name and here["device"] == "cpu"
    assert here["runs"] == {"quickstart": "fp32", "rtx3060": "bf16", "gtx1660ti": "fp32"}[recipe]
    on_v100 = D.precision_here(cfg, [card(15.78, False)])
    assert on_v100["runs"] == precision.resolve(cfg.train.precision, "cuda", bf16_supported=False).name
    monkeypatch.setattr(D, "detect_cards", lambda with_free=False: [])
    D.doctor(None)
    text = capsys.readouterr().out
    assert "precision: auto trains in fp32 on this CPU" in text
    assert "quickstart's settings (fp32 on the CPU" in text


def test_doctor_plans_within_the_budget_a_run_plans_within():
    """A 12 GB recipe on an 80 GB card: the run plans for 12 GB (tuning.probe.usable_total_bytes),
    so doctor's plan does too; a card smaller than the recipe's plans for the card."""
    from vramfit.planner import budget_bytes_for, reported_total_bytes

    cfg = resolve_config("rtx3060", sets=["hardware.allow_cpu=true"])
    twelve = budget_bytes_for(cfg, total_bytes=reported_total_bytes(cfg.hardware.memory_gib))
    assert D.plan_here(cfg, [card(79.15)], 1000)["budget_bytes"] == twelve
    assert D.plan_here(cfg, [card(7.79)], 1000)["budget_bytes"] == budget_bytes_for(cfg, total_bytes=int(7.79 * GiB))
