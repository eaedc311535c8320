"""Progressive resizing (`data.progressive_resize`): Composer's schedule, a loader that crops at
the step's size, a micro-batch per size, the sizes in the record, an exact resume mid-ramp, and
bad settings refused before anything starts."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import metrics, tiny_args
from safetensors.torch import load_file

from vramfit.config import Config, ProgressiveResize
from vramfit.data.progressive import Schedule, possible_sizes
from vramfit.planner.size_picks import bisect_sizes, planner_pick

RESIZE = ("--set", "data.progressive_resize=true", "--epochs", "2")


def _refused(tmp_path, *args) -> int:
    """`vramfit train ARGS` as the command line runs it: the exit code (no run folder may appear)."""
    from vramfit.cli import main

    out = tmp_path / "refused"
    with pytest.raises(SystemExit) as e:
        main(["train", "--output", str(out), "--run-name", "bad", *args])
    assert not (out / "bad" / "checkpoints").exists()
    return e.value.code


def _summary(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


def _last_weights(run_dir):
    ckpt = sorted((run_dir / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))[-1]
    return load_file(ckpt / "model.safetensors")


def test_the_schedule_is_composers():
    s = Schedule(224, 1000, ProgressiveResize())
    sizes = [s.size_at(i) for i in range(1000)]
    assert sizes == sorted(sizes)  # never shrinks
    assert sizes[0] == 112 and all(x == 112 for x in sizes[:500])  # initial_scale 0.5 until delay_fraction
    assert all(x == 224 for x in sizes[800:]) and sizes[780] < 224  # the last finetune_fraction at full size
    assert all(x % 4 == 0 for x in sizes)  # size_increment
    # halfway up the ramp (step 650): scale 0.75
    assert s.size_at(650) == 168
    assert [sp.image_size for sp in s.spans] == s.sizes and s.spans[0].first_step == 0
    assert sum(sp.steps for sp in s.spans) == 1000
    assert Schedule(224, 1000).sizes == [224] and not Schedule(224, 10).on


def test_one_key_turns_it_on_with_the_others_at_their_defaults():
    c = Config.model_validate({"data": {"progressive_resize": {"initial_scale": 0.6}}})
    assert c.data.progressive_resize == ProgressiveResize(initial_scale=0.6)
    assert ProgressiveResize() == ProgressiveResize(initial_scale=0.5, delay_fraction=0.5, finetune_fraction=0.2,
                                                    size_increment=4)
    assert Config.model_validate({"data": {"progressive_resize": True}}).data.progressive_resize == ProgressiveResize()
    assert Config.model_validate({"data": {"progressive_resize": False}}).data.progressive_resize is None
    assert Config().data.progressive_resize is None
    c = Config.model_validate({"data": {"image_size": 30, "progressive_resize": {}}})
    assert possible_sizes(c) == [16, 20, 24, 28, 30]  # the full size need not be a multiple of the step


@pytest.mark.parametrize("sets, says", [
    (["data.progressive_resize.initial_scale=0"], "greater than 0"),
    (["data.progressive_resize.initial_scale=1.5"], "less than or equal to 1"),
    (["data.progressive_resize.delay_fraction=0.7", "data.progressive_resize.finetune_fraction=0.4"], "over 1"),
    (["data.progressive_resize.initial_scale=0.1"], "below the smallest size"),
    (["data.progressive_resize.size_increment=0"], "greater than or equal to 1"),
])
def test_bad_settings_exit_2_before_anything_starts(tmp_path, capsys, sets, says):
    args = [a for s in sets for a in ("--set", s)]
    assert _refused(tmp_path, *tiny_args(*args)) == 2
    assert says in " ".join(capsys.readouterr().err.split())


def test_a_backbone_that_takes_one_size_is_refused_with_the_fix(tmp_path, capsys):
    # MLP-Mixer's token-mixing layers are sized for one patch grid: no timm option changes that.
    code = _refused(tmp_path, *tiny_args("--model", "mixer_s32_224", "--set", "data.progressive_resize=true"))
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2 and "cannot take 16 px inputs" in err and "data.progressive_resize=null" in err


def test_a_vit_is_given_timms_dynamic_size():
    from vramfit.models.create import any_size_kwargs

    assert any_size_kwargs("vit_tiny_patch16_224") == {"dynamic_img_size": True, "dynamic_img_pad": True}
    assert any_size_kwargs("resnet50") == {}


def test_the_loader_crops_at_each_steps_size_and_the_record_shows_it(train_cli):
    run_dir, code = train_cli(*tiny_args(*RESIZE), run_name="pr")
    assert code == 0
    rows = [r for r in metrics(run_dir) if r.get("kind") == "train"]
    sizes = [r["train/image_size"] for r in rows]
    assert sizes[0] == 16 and sizes[-1] == 32 and sizes == sorted(sizes) and len(set(sizes)) >= 3
    s = _summary(run_dir)
    phases = s["phases"]
    assert [p["image_size"] for p in phases] == sorted({p["image_size"] for p in phases})
    assert phases[0]["image_size"] == 16 and phases[-1]["image_size"] == 32
    assert sum(p["steps"] for p in phases) == s["global_step"] == 60
    assert all(p["micro_batch"] == 16 and p["name"] == "all" for p in phases)
    # Not the planner's to pick (the whole share): every size carries the full size's prediction
    assert all(p["predicted_at_size"] == 32 for p in phases)
    assert s["finished"] and s["best_accuracy"] is not None


def test_a_run_stopped_mid_ramp_resumes_exactly(train_cli):
    whole, code = train_cli(*tiny_args(*RESIZE), run_name="whole")
    assert code == 0
    cut, code = train_cli(*tiny_args(*RESIZE, "--set", "debug.signal_at_step=40"), run_name="cut")
    assert code == 143
    assert _summary(cut)["global_step"] == 40
    cut, code = train_cli(*tiny_args(*RESIZE), run_name="cut")  # the same command resumes
    assert code == 0
    a, b = _last_weights(whole), _last_weights(cut)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    before = [r["train/image_size"] for r in metrics(whole) if r.get("kind") == "train"]
    after = [r["train/image_size"] for r in metrics(cut) if r.get("kind") == "train"]
    assert sorted(set(before)) == sorted(set(after))


def test_the_resize_settings_are_part_of_the_maths_for_resume(train_cli, tmp_path, capsys):
    cut, code = train_cli(*tiny_args(*RESIZE, "--set", "debug.signal_at_step=5"), run_name="cut")
    assert code == 143
    from vramfit.cli import main

    with pytest.raises(SystemExit) as e:  # the same run folder, resizing off now
        main(["train", "--output", str(cut.parent), "--run-name", "cut", *tiny_args("--epochs", "2")])
    assert e.value.code == 2 and "progressive_resize" in capsys.readouterr().err


def test_sizes_are_bisected_where_the_pick_can_change():
    calls = []

    def micro_at(size):  # monotone in the size, as the planner's pick: 64 at 112 px ... 16 at 224 px
        return 1 << (64 * 112 * 112 // (size * size)).bit_length() - 1

    def pick(size):
        calls.append(size)
        return micro_at(size), size * 10

    sizes = list(range(112, 228, 4))
    out = bisect_sizes(sizes, pick)
    assert set(out) == set(sizes)
    for s in sizes:
        micro, peak, at = out[s]
        assert micro == micro_at(s)
        assert at >= s and peak == at * 10  # a size not traced carries the next traced one's peak
    assert len(set(calls)) < len(sizes) // 2
    flat = bisect_sizes(sizes, lambda s: (8, s))
    assert {m for m, _, _ in flat.values()} == {8} and {at for _, _, at in flat.values()} <= {112, 224}


def test_the_planner_fits_a_larger_micro_batch_at_a_smaller_size():
    from vramfit.batching import MicroBatch
    from vramfit.planner import estimate

    cfg = Config.model_validate({"model": {"name": "test_resnet"}, "data": {"image_size": 64},
                                 "train": {"global_batch": 64}})
    budget = estimate(cfg, 10, 16, "no").peak_bytes  # micro-batch 16 just fits at 64 px
    pick = planner_pick(cfg, 10, MicroBatch(16, 64, "auto"), budget, "no", 1)
    small, peak = pick(32)
    assert small > 16 and peak <= budget
    assert pick(64)[0] == 16


@pytest.mark.parametrize("workers", [0, 1])
def test_loader_workers_crop_each_step_at_its_size(tmp_path, workers):
    from helpers import DATA_CFG_32, cfg as source_cfg, class_tree

    from vramfit import data as D
    from vramfit.config import DataConfig
    from vramfit.data.loader import SizedTransforms

    root = class_tree(tmp_path / "imgs", {"a": 8, "b": 8}, size=(48, 40), ext=".jpg")
    s = D.load_splits(source_cfg(root, val_fraction=0.25))
    train_tf, _ = D.build_transforms(DataConfig(image_size=32), DATA_CFG_32)
    ds = D.ImageDataset(s.train, s.image_column, s.label_column, train_tf, 32, 0, train=True,
                        sized=SizedTransforms(DataConfig(image_size=32), DATA_CFG_32, "cpu"))
    sched = Schedule(32, 4, ProgressiveResize(delay_fraction=0.25, finetune_fraction=0.25, size_increment=8))
    sampler = D.StepBatchSampler(len(ds), 4, 0, 1, 0, size_at=sched.size_at)
    shapes = [tuple(b.images.shape[-2:]) for b in D.make_loader(ds, batch_sampler=sampler, workers=workers)]
    assert shapes == [(sched.size_at(i),) * 2 for i in range(3)] and shapes[0] == (16, 16)


def test_an_out_of_memory_retry_holds_at_every_larger_size(train_cli):
    # Every forward over 8 images "runs out of memory": the first step comes down to 8, and no
    # later, larger size goes back up.
    run_dir, code = train_cli(*tiny_args(*RESIZE, "--set", "debug.simulate_oom_above=8"), run_name="oom")
    assert code == 0
    rows = [r for r in metrics(run_dir) if r.get("kind") == "train"]
    assert {r["train/micro_batch"] for r in rows} == {8} and len({r["train/image_size"] for r in rows}) >= 3
    s = _summary(run_dir)
    assert s["oom_retries"] == 1 and s["micro_batch"] == 8 and s["finished"]
