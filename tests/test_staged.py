"""Freezing that holds (weights and BatchNorm statistics), staged fine-tuning (head first, then the
whole network, its optimizer state carried over), per-layer LRs from timm, BatchNorm options."""

from __future__ import annotations

import json
import logging

import pytest
import timm
import torch
from helpers import tiny_args
from safetensors.torch import load_file, save_file

from vramfit.config import Config, ModelConfig, OptimConfig
from vramfit.models import freezing
from vramfit.models.create import create_model

STEPS = 10  # 160 training images / global batch 16


def small_args(*extra):
    """tiny_args on 160 images (10 steps per epoch), micro-batch 4, from a local weight file."""
    return tiny_args("--set", "data.limit_train_samples=160", "--set", "data.limit_val_samples=40",
                     "--micro-batch", "4", *extra)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A test_resnet weight file that is not a fresh init (its BatchNorm statistics moved)."""
    torch.manual_seed(123)
    model = timm.create_model("test_resnet", num_classes=10)
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(8, 3, 32, 32))
    path = tmp_path_factory.mktemp("weights") / "test_resnet.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return path


def _weights(run_dir, step):
    return load_file(str(run_dir / "checkpoints" / f"step-{step}" / "model.safetensors"))


def _under(key, prefixes):
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def test_frozen_stages_keep_their_weights_and_statistics(train_cli, pretrained):
    frozen = ["conv1", "bn1", "layer1"]
    run_dir, code = train_cli(*small_args("--set", f"model.pretrained_path={pretrained}",
                                          "--set", "model.freeze=[conv1,bn1,layer1]"))
    assert code == 0
    start, end = load_file(str(pretrained)), _weights(run_dir, STEPS)
    kept = [k for k in end if _under(k, frozen)]
    assert any("running_mean" in k for k in kept) and any("num_batches_tracked" in k for k in kept)
    assert all(torch.equal(end[k], start[k]) for k in kept)
    later = [k for k in end if k.startswith("layer2.") and k in start]
    assert any("running_var" in k and not torch.equal(end[k], start[k]) for k in later)
    assert any(k.endswith("conv1.weight") and not torch.equal(end[k], start[k]) for k in later)


@pytest.fixture(scope="module")
def staged_args(pretrained):
    return small_args("--epochs", "2", "--set", "train.freeze_epochs=1", "--set", "train.log_every_steps=1",
                      "--set", f"model.pretrained_path={pretrained}", "--set", "optim.layer_decay=0.7")


@pytest.fixture(scope="module")
def staged_ref(staged_args, tmp_path_factory):
    from vramfit.cli import run

    out = tmp_path_factory.mktemp("staged")
    said, logger = logging.FileHandler(out / "said.log"), logging.getLogger("vramfit")
    level = logger.level
    logger.addHandler(said)  # what the run printed, for the figures it names
    logger.setLevel(logging.INFO)
    try:
        assert run(["train", "--output", str(out), "--run-name", "ref", *staged_args]) == 0
    finally:
        logger.removeHandler(said)
        logger.setLevel(level)
        said.close()
    return out / "ref"


def test_staged_fine_tuning_trains_the_head_then_everything(staged_ref, pretrained):
    start = load_file(str(pretrained))
    first, second = _weights(staged_ref, STEPS), _weights(staged_ref, 2 * STEPS)
    body = [k for k in first if not k.startswith("fc.")]
    assert all(torch.equal(first[k], start[k]) for k in body)  # epoch 1: only the head trained
    assert not torch.equal(first["fc.weight"], second["fc.weight"])
    assert any(not torch.equal(second[k], start[k]) for k in body if "running" in k)  # statistics move again
    assert any(not torch.equal(second[k], start[k]) for k in body if k.endswith("conv1.weight"))
    # The head's optimizer state continues over the unfreeze; the rest starts at the unfreeze.
    opt = torch.load(staged_ref / "checkpoints" / f"step-{2 * STEPS}" / "optimizer.bin", weights_only=False)
    steps = {part: {float(opt["state"][i]["step"]) for g in opt["param_groups"] if g["part"] == part
                    for i in g["params"]} for part in ("head", "body")}
    assert steps == {"head": {2.0 * STEPS}, "body": {float(STEPS)}}
    summary = json.loads((staged_ref / "summary.json").read_text())
    head, whole = summary["phases"]
    assert (head["name"], head["epochs"], whole["name"], whole["first_epoch"]) == ("head", 1, "all", 2)
    assert head["trainable_params"] == 96 * 10 + 10 < whole["trainable_params"]  # test_resnet: 96 features
    assert head["predicted_peak_bytes"] < whole["predicted_peak_bytes"]
    assert 0 < head["predicted_reserved_bytes"] < whole["predicted_reserved_bytes"]
    assert head["measured_peak_bytes"] is None and whole["measured_peak_bytes"] is None  # no GPU here


@pytest.mark.parametrize("stop_at", [4, STEPS + 4], ids=["head-phase", "all-phase"])
def test_staged_run_resumed_in_either_phase_is_bitwise_identical(train_cli, staged_args, staged_ref, stop_at):
    cut, code = train_cli(*staged_args, "--set", f"debug.signal_at_step={stop_at}", run_name="cut")
    assert code == 143
    cut, code = train_cli(*staged_args, run_name="cut")
    assert code == 0
    a, b = _weights(staged_ref, 2 * STEPS), _weights(cut, 2 * STEPS)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = [json.loads(line) for line in (cut / "metrics.jsonl").read_text().splitlines()]
    ref_rows = [json.loads(line) for line in (staged_ref / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/lr"] for r in rows if r["kind"] == "train"] == [r["train/lr"] for r in ref_rows if r["kind"] == "train"]


def test_layer_decay_gives_each_parameter_timms_lr():
    from timm.optim import param_groups_layer_decay

    from vramfit.train.optim import create_optimizer, create_scheduler

    model = timm.create_model("resnet18", num_classes=4)
    cfg = OptimConfig(lr=1e-3, layer_decay=0.6, warmup_epochs=0, schedule="constant")
    opt = create_optimizer(model, cfg)
    create_scheduler(opt, cfg, steps_per_epoch=5, epochs=2).step_update(0)
    ours = {id(p): (g["lr"], g["weight_decay"]) for g in opt.param_groups for p in g["params"]}
    theirs = {id(p): (1e-3 * g["lr_scale"], g["weight_decay"])
              for g in param_groups_layer_decay(model, weight_decay=cfg.weight_decay, layer_decay=0.6)
              for p in g["params"]}
    assert ours.keys() == theirs.keys()
    assert all(ours[k][0] == pytest.approx(theirs[k][0], rel=1e-12) and ours[k][1] == theirs[k][1] for k in ours)
    assert len({round(lr, 12) for lr, _ in ours.values()}) > 3  # several layer groups
    head = {id(p) for p in model.fc.parameters()}
    assert all(ours[k][0] == pytest.approx(1e-3) for k in head)
    assert {g["part"] for g in opt.param_groups if any(id(p) in head for p in g["params"])} == {"head"}


def test_unfreeze_warmup_ramps_the_rest_and_not_the_head():
    from vramfit.train.optim import Schedule, create_optimizer, create_scheduler, head_lr

    model = timm.create_model("test_resnet", num_classes=4)
    cfg = OptimConfig(lr=1e-2, warmup_epochs=0, schedule="constant", unfreeze_warmup_epochs=1.0)
    opt = create_optimizer(model, cfg)
    sched = create_scheduler(opt, cfg, steps_per_epoch=4, epochs=3, unfreeze_step=4)
    assert isinstance(sched, Schedule)
    body = [g for g in opt.param_groups if g["part"] == "body"]
    seen = []
    for step in range(10):
        sched.step_update(step)
        assert head_lr(opt) == pytest.approx(1e-2)
        seen.append(body[0]["lr"])
    assert seen[:4] == [pytest.approx(1e-2)] * 4  # frozen phase: no ramp (no gradient either)
    assert seen[4:9] == [pytest.approx(1e-2 * k / 5) for k in range(1, 6)]
    assert seen[9] == pytest.approx(1e-2)


def test_a_frozen_batchnorm_stays_in_eval_mode_whatever_calls_train():
    import copy

    model = create_model(ModelConfig(name="test_resnet", freeze=["bn1", "layer1"]), 4, load_weights=False)
    model.train()
    assert not model.bn1.training and not model.layer1[0].bn1.training and model.layer2[0].bn1.training
    assert not copy.deepcopy(model).bn1.training  # the EMA copy too
    assert freezing.min_micro_batch(model) == 2  # layer2's BatchNorm still needs two samples
    freezing.unfreeze(model, ["bn1", "layer1"])
    model.train()
    assert model.bn1.training and model.bn1.weight.requires_grad


def test_freezing_saves_memory_in_the_plan():
    from vramfit.planner import estimate
    from vramfit.planner.advice import config_with

    cfg = Config.model_validate({"model": {"name": "resnet18"}, "data": {"image_size": 64},
                                 "train": {"global_batch": 16, "epochs": 2}})
    whole = estimate(cfg, 10, 16, "no")
    early = estimate(config_with(cfg, {"model.freeze": ["conv1", "bn1", "layer1", "layer2"]}), 10, 16, "no")
    model = create_model(cfg.model, 10, load_weights=False)
    head_only = estimate(config_with(cfg, {"model.freeze": freezing.body_prefixes(model, ["fc"])}), 10, 16, "no")
    assert head_only.peak_bytes < early.peak_bytes < whole.peak_bytes


def test_body_prefixes_cover_everything_but_the_head():
    model = timm.create_model("convnext_atto", num_classes=3)
    heads = freezing.classifier_names(model)
    body = freezing.body_prefixes(model, heads)
    assert heads == ["head.fc"] and "head.norm" in body and "stem" in body
    left = [n for n, _ in model.named_parameters() if not _under(n, body)]
    assert left and all(_under(n, heads) for n in left)


def test_bn_momentum_and_sync_on_one_process(train_cli):
    model = create_model(ModelConfig(name="test_resnet", bn_momentum=0.01), 4, load_weights=False)
    assert {m.momentum for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)} == {0.01}
    run_dir, code = train_cli(*small_args("--set", "model.bn=sync", "--micro-batch", "16"))
    assert code == 0


def test_small_micro_batches_with_train_batchnorm_get_the_choices(train_cli, caplog):
    with caplog.at_level(logging.INFO, logger="vramfit"):
        run_dir, code = train_cli(*small_args())
    assert code == 0
    err = caplog.text
    assert "BatchNorm normalises groups of 4" in err and "model.bn=freeze" in err and "--grad-checkpointing" in err
    assert "bn: sync changes nothing" not in err


@pytest.mark.parametrize("args, words", [
    (["--set", "train.freeze_epochs=1"], "fewer than train.epochs"),
    (["--set", "optim.layer_decay=0"], "layer_decay"),
    (["--set", "optim.layer_decay=1.5"], "layer_decay"),
    (["--set", "train.freeze_epochs=1", "--epochs", "3", "--set", "model.freeze=[fc]"], "covers the classifier head"),
    (["--set", "model.freeze=[layer9]"], "matches no module"),
], ids=["freeze-epochs", "decay-0", "decay-big", "head-frozen", "typo"])
def test_bad_staging_settings_exit_2_before_anything_starts(tmp_path, capsys, pretrained, args, words):
    weights = ["--set", f"model.pretrained_path={pretrained}"]  # staging runs on trained weights only
    run_dir, code = _main(tmp_path, *small_args(*args, *weights))
    assert code == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err and not run_dir.exists()


def _main(tmp_path, *args, run_name="t"):
    """`vramfit train` in-process as the command line runs it: the exit code, the error printed."""
    from vramfit.cli import main

    out = tmp_path / "runs"
    with pytest.raises(SystemExit) as e:
        main(["train", "--output", str(out), "--run-name", run_name, *args])
    return out / run_name, e.value.code


def test_no_nameable_head_and_sync_under_fsdp_are_refused(tmp_path, capsys, monkeypatch, pretrained):
    monkeypatch.setattr(timm.models.resnet.ResNet, "get_classifier", lambda self: torch.nn.Identity())
    run_dir, code = _main(tmp_path, *small_args("--epochs", "2", "--set", "train.freeze_epochs=1",
                                                "--set", f"model.pretrained_path={pretrained}"))
    assert code == 2 and "no classifier head timm can name" in capsys.readouterr().err
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    run_dir, code = _main(tmp_path, *small_args("--set", "model.bn=sync"), run_name="fsdp")
    assert code == 2 and "cannot run under FSDP" in capsys.readouterr().err and not run_dir.exists()


# ---- precise BatchNorm (model.precise_bn) ------------------------------------------------------

class _Batch:
    def __init__(self, images, labels):
        self.images, self.labels = images, labels


def _statistics_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                                torch.nn.Conv2d(4, 4, 3), torch.nn.BatchNorm2d(4))
    freezing.freeze(model, ["0", "1"])  # the first BatchNorm frozen: it keeps its statistics
    with torch.no_grad():
        model[1].running_mean.fill_(0.5)
    return model


def _recalibrate(model, batches, stop=None, labels=None):
    from types import SimpleNamespace

    from vramfit.train.validation import EvalState, recalibrate_batchnorm

    acc = SimpleNamespace(device=torch.device("cpu"))
    labels = labels or [torch.zeros(len(x), dtype=torch.long) for x in batches]
    return recalibrate_batchnorm(acc, model, [_Batch(x, y) for x, y in zip(batches, labels)],
                                 lambda x: x, EvalState(micro_batch=64), seed=0, stop_requested=stop)


def test_precise_bn_keeps_unreadable_blanks_out_of_the_statistics():
    """A blank (label -1) is stood in for by a readable image of its batch: the statistics are
    those of the batch with that image in the blank's place, and the shapes stay the same."""
    torch.manual_seed(2)
    x = torch.randn(6, 3, 12, 12) + 3
    blanked = x.clone()
    blanked[[1, 4]] = 0.0  # what an unreadable image arrives as
    labels = torch.tensor([0, -1, 0, 0, -1, 0])
    model, ref = _statistics_model(), _statistics_model()
    _recalibrate(model, [blanked], labels=[labels])
    _recalibrate(ref, [x[[0, 0, 2, 3, 2, 5]]])  # blanks 1 and 4 <- readable images 0 and 2
    assert torch.allclose(model[4].running_mean, ref[4].running_mean, atol=1e-6)
    assert torch.allclose(model[4].running_var, ref[4].running_var, atol=1e-6)


def test_precise_bn_counts_nothing_of_a_batch_of_unreadable_images_only():
    torch.manual_seed(3)
    x = torch.randn(6, 3, 12, 12) + 3
    model, ref = _statistics_model(), _statistics_model()
    blanks = torch.zeros(4, 3, 12, 12)
    assert _recalibrate(model, [x, blanks], labels=[torch.zeros(6, dtype=torch.long), torch.full((4,), -1)]) == 1
    assert _recalibrate(ref, [x]) == 1
    for k, b in ref[4].named_buffers():
        assert torch.equal(model[4].get_buffer(k), b), k
    assert [m.training for m in model.modules()] == [m.training for m in ref.modules()]  # modes put back


def test_precise_bn_is_an_equal_weight_average_and_leaves_frozen_norms_alone():
    torch.manual_seed(1)
    batches = [torch.randn(8, 3, 12, 12) * (1 + i) + i for i in range(5)]
    model, ref = _statistics_model(), _statistics_model()
    model[4].momentum = ref[4].momentum = 0.03
    frozen_before = {k: b.clone() for k, b in model[1].named_buffers()}
    assert _recalibrate(model, batches) == 5
    # torch's own equal-weight recomputation on the same tensors, the frozen norm left out of it
    ref[1].reset_running_stats = lambda: None
    ref[1].momentum = 0.0
    torch.optim.swa_utils.update_bn([(x, 0) for x in batches], ref)
    assert torch.allclose(model[4].running_mean, ref[4].running_mean, atol=1e-6)
    assert torch.allclose(model[4].running_var, ref[4].running_var, atol=1e-6)
    assert all(torch.equal(b, frozen_before[k]) for k, b in model[1].named_buffers())
    assert model[4].momentum == 0.03 and model.training and not model[1].training


def test_precise_bn_interrupted_puts_the_statistics_back():
    from vramfit.train.step import StepInterrupted

    model = _statistics_model()
    before = {k: b.clone() for k, b in model.state_dict().items()}
    calls = iter([0, 0, 15])
    with pytest.raises(StepInterrupted):
        _recalibrate(model, [torch.randn(4, 3, 12, 12) for _ in range(4)], stop=lambda: next(calls))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_precise_bn_changes_the_statistics_not_the_training_and_resumes_exactly(train_cli, pretrained):
    common = small_args("--set", f"model.pretrained_path={pretrained}")
    plain, code = train_cli(*common, run_name="plain")
    assert code == 0
    precise, code = train_cli(*common, "--set", "model.precise_bn=64", run_name="precise")
    assert code == 0
    a, b = _weights(plain, STEPS), _weights(precise, STEPS)
    stats = [k for k in a if "running_" in k]
    assert all(torch.equal(a[k], b[k]) for k in a if k not in stats and "num_batches" not in k)
    assert all(not torch.equal(a[k], b[k]) for k in stats)
    exported = load_file(str(precise / "model" / "model.safetensors"))  # one epoch: the best
    assert all(torch.equal(exported[k], b[k]) for k in stats)
    cut, code = train_cli(*common, "--set", "model.precise_bn=64", "--set", "debug.signal_in_eval=1",
                          run_name="cut")
    assert code == 143
    cut, code = train_cli(*common, "--set", "model.precise_bn=64", run_name="cut")
    assert code == 0
    c = _weights(cut, STEPS)
    assert all(torch.equal(b[k], c[k]) for k in b)
    from vramfit.errors import VramfitError

    with pytest.raises(VramfitError, match="precise_bn: 64 -> 0"):  # part of the maths
        train_cli(*common, run_name="cut")


def test_precise_bn_set_to_true_is_refused_with_a_count_to_give():
    """`model.precise_bn=true` would read as 1 image, whose statistics wreck every BatchNorm."""
    from vramfit.config import build_config
    from vramfit.errors import VramfitError

    for value in ("true", "false"):
        with pytest.raises(VramfitError, match="takes a number of train images"):
            build_config("quickstart", [f"model.precise_bn={value}"])
    assert build_config("quickstart", ["model.precise_bn=2048"]).model.precise_bn == 2048


# ---- staged fine-tuning needs trained weights ---------------------------------------------------

def test_staging_without_pretrained_weights_trains_everything_from_the_first_step(tmp_path):
    """A head trained alone on random features learns nothing the later epochs keep: without
    pretrained weights the run is one phase `all` from the first epoch, with a note saying why;
    with model.pretrained_path (or the Hub's weights) it stays staged."""
    from vramfit.config import build_config
    from vramfit.train.phases import phases_of

    with torch.device("meta"):
        model = timm.create_model("test_resnet", num_classes=10)
    sets = ["model.name=test_resnet", "train.freeze_epochs=1", "train.epochs=1"]
    random_init = build_config(None, [*sets, "model.pretrained=false"])  # epochs 1 is no longer refused
    [whole] = phases_of(random_init, model)
    assert (whole.name, whole.first_epoch, whole.end_epoch, whole.freeze) == ("all", 0, 1, ())
    assert "train.freeze_epochs 1 is not applied" in whole.note and "whole network trains" in whole.note
    for weights in (f"model.pretrained_path={tmp_path / 'w.safetensors'}", "model.pretrained=true"):
        staged = build_config(None, [*sets, "train.epochs=2", weights])
        assert [(p.name, p.first_epoch, p.note) for p in phases_of(staged, model)] == [("head", 0, None),
                                                                                       ("all", 1, None)]
    with pytest.raises(Exception, match="fewer than train.epochs"):
        build_config(None, [*sets, "model.pretrained=true"])


def test_a_staged_run_without_pretrained_weights_says_so_and_trains_one_epoch(train_cli, caplog):
    with caplog.at_level(logging.INFO, logger="vramfit"):
        run_dir, code = train_cli(*small_args("--set", "train.freeze_epochs=1"))  # --epochs 1
    assert code == 0
    assert "train.freeze_epochs 1 is not applied" in caplog.text and "staged fine-tuning:" not in caplog.text
    [phase] = json.loads((run_dir / "summary.json").read_text())["phases"]
    assert (phase["name"], phase["first_step"], phase["steps"]) == ("all", 1, STEPS)
    assert "whole network trains from the first step" in phase["note"]


def test_the_planned_peak_is_the_largest_over_phases_wherever_it_is_read(staged_ref):
    """One planned peak: summary.json, the start line, compare (table and CSV) and the model card
    all show the whole-network phase's, not the head phase's the run started in."""
    import csv
    import io

    from vramfit.commands.compare import compare
    from vramfit.commands.model_card import body
    from vramfit.commands.trained import TrainedModel
    from vramfit.planner import bytes_text

    summary = json.loads((staged_ref / "summary.json").read_text())
    head, whole = summary["phases"]
    planned = summary["predicted_peak_memory_bytes"]
    assert planned == whole["predicted_reserved_bytes"] > head["predicted_reserved_bytes"]
    said = bytes_text(planned)
    start = next(line for line in (staged_ref.parent / "said.log").read_text().splitlines()
                 if line.startswith("memory: planned peak"))
    assert start.startswith(f"memory: planned peak {said} ")
    assert f"head {bytes_text(head['predicted_reserved_bytes'])}" in start
    out = io.StringIO()
    compare([str(staged_ref)], out=out, csv_path=str(staged_ref.parent / "runs.csv"))
    row = next(csv.DictReader((staged_ref.parent / "runs.csv").open()))
    assert int(row["predicted_peak_memory_bytes"]) == planned
    assert f"planned {said}," in body(TrainedModel(staged_ref, device="cpu"), [])
