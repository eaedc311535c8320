"""Switching the backbone re-tunes and re-plans; the LR follows the global batch."""
import json
import math

import pytest
import torch

from vramfit.cli import run
from vramfit.config import OptimConfig, build_config
from vramfit.models.backbones import BACKBONES, BASE_BATCH, backbone
from vramfit.train.optim import create_optimizer, create_scheduler, scaled_lr


def test_lr_follows_the_global_batch():
    adamw = OptimConfig(lr=1e-3, lr_base_batch=128)
    assert scaled_lr(adamw, 128) == (1e-3, None)  # the stated batch: the same maths
    lr, note = scaled_lr(adamw, 512)
    assert lr == pytest.approx(2e-3) and "sqrt" in note and "512" in note
    assert scaled_lr(adamw, 32)[0] == pytest.approx(5e-4)
    sgd = OptimConfig(name="sgd", lr=0.1, lr_base_batch=256)
    assert scaled_lr(sgd, 1024)[0] == pytest.approx(0.4) and "linear" in scaled_lr(sgd, 1024)[1]
    assert scaled_lr(OptimConfig(lr=1e-3), 4096) == (1e-3, None)  # no reference batch: as given


def test_optimizer_and_schedule_run_at_the_scaled_lr():
    model = torch.nn.Linear(4, 2)
    cfg = OptimConfig(lr=1e-3, lr_base_batch=64, warmup_epochs=0, schedule="constant")
    opt = create_optimizer(model, cfg, global_batch=256)
    assert all(g["lr"] == pytest.approx(2e-3) for g in opt.param_groups)
    sched = create_scheduler(opt, cfg, steps_per_epoch=10, epochs=2, global_batch=256)
    sched.step_update(num_updates=15)
    assert all(g["lr"] == pytest.approx(2e-3) for g in opt.param_groups)
    same = create_optimizer(model, cfg)  # without a global batch: the stated LR
    assert all(g["lr"] == pytest.approx(1e-3) for g in same.param_groups)


def test_the_table_covers_the_usual_backbones():
    for name in ("resnet50", "resnet34", "efficientnet_b0", "efficientnet_b3", "mobilenetv3_large_100",
                 "convnext_tiny", "vit_small_patch16_224", "vit_base_patch16_224"):
        assert name in BACKBONES
    assert backbone("resnet50.a1_in1k") is BACKBONES["resnet50"] and backbone("resnet18") is None


def test_switching_the_backbone_takes_its_defaults_unless_stated():
    cfg = build_config("rtx3060", flags={"model.name": "convnext_tiny"})
    want = BACKBONES["convnext_tiny"]
    assert (cfg.optim.lr, cfg.optim.lr_base_batch, cfg.model.drop_path_rate) == (want.lr, BASE_BATCH, want.drop_path_rate)
    b3 = build_config("rtx3060", flags={"model.name": "efficientnet_b3"})
    assert b3.data.image_size == 288 and b3.optim.lr == BACKBONES["efficientnet_b3"].lr
    # What the command line or the recipe states wins: the quickstart's digits size and LR stay.
    mine = build_config("rtx3060", sets=["model.drop_path_rate=0.3"], flags={"model.name": "convnext_tiny",
                                                                               "optim.lr": 1e-4})
    assert (mine.optim.lr, mine.model.drop_path_rate) == (1e-4, 0.3)
    quick = build_config("quickstart", flags={"model.name": "resnet50"})
    assert (quick.data.image_size, quick.optim.lr, quick.optim.lr_base_batch) == (32, 0.002, 64)
    sgd = build_config(None, sets=["optim.name=sgd", "optim.lr=0.1"], flags={"model.name": "resnet50"})
    assert sgd.optim.lr_base_batch is None  # the table's LRs are AdamW's


def test_the_rtx3060_recipe_keeps_its_maths_at_its_batch():
    cfg = build_config("rtx3060")
    assert scaled_lr(cfg.optim, cfg.train.global_batch) == (5e-4, None)
    lr, _ = scaled_lr(cfg.optim, 256)
    assert lr == pytest.approx(5e-4 * math.sqrt(2))


def test_plan_picks_a_micro_batch_for_each_backbone(capsys):
    """`vramfit plan --recipe rtx3060 --model X`: the micro-batch follows the backbone's cost."""
    picks = {}
    for name in ("resnet50", "resnet34"):
        run(["plan", "--recipe", "rtx3060", "--model", name, "--global-batch", "512", "--json"])
        plan = json.loads(capsys.readouterr().out)
        assert plan["model"] == name and plan["micro_batch_source"] == "auto" and plan["fits"]
        picks[name] = plan["micro_batch"]
    assert picks["resnet34"] > picks["resnet50"], picks


def test_a_one_step_run_has_its_lr_and_no_scheduler_warning(caplog):
    """One optimizer step in the whole run (a tiny dataset): the LR of that step is the base LR, and
    timm's "cosine annealing will have no effect" warning does not reach the user."""
    import logging

    model = torch.nn.Linear(4, 2)
    cfg = OptimConfig(lr=1e-3, warmup_epochs=1.0)
    opt = create_optimizer(model, cfg)
    with caplog.at_level(logging.WARNING):
        sched = create_scheduler(opt, cfg, steps_per_epoch=1, epochs=1)
    assert not [r for r in caplog.records if "no effect" in r.getMessage()]
    sched.step_update(num_updates=0)
    assert all(g["lr"] == pytest.approx(1e-3) for g in opt.param_groups)
