"""What a run records in its trackers: an offline W&B run of the quickstart (config with plan and
environment, per-step metrics, the per-eval table, confusion matrix and misclassified images, the
summary) that a resumed run appends to; TensorBoard next to it; the sweep file."""
import json
import os
import stat
import struct
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from PIL import Image

from _trained_runs import reset_accelerate
from conftest import REPO

CLASSES = [str(i) for i in range(10)]
ENV = {"device": "cpu", "device_names": ["cpu"], "num_processes": 1, "torch": torch.__version__}
PLAN = {"micro_batch": 64, "estimate": {"peak_bytes": 713031680}}


def wandb_records(path: Path):
    """The records of a `.wandb` file (LevelDB log format: 32 KiB blocks of checksummed chunks,
    each a protobuf `Record` or a piece of one); wandb ships no public reader."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):  # FULL or LAST
            record = pb.Record()
            record.ParseFromString(buf)
            yield record


def _records_by_type(path: Path) -> dict:
    out = {}
    for r in wandb_records(path):
        kind = r.WhichOneof("record_type")
        out.setdefault(kind, []).append(getattr(r, kind))
    return out


def _history(recs) -> list[dict]:
    return [{"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in h.item}
            for h in recs.get("history", [])]


def _segment(cfg, run_dir, run_id, steps, evaluate_at=None):
    """What one process of the run loop does with the trackers, from start to end_training."""
    from accelerate import Accelerator

    from vramfit import tracking

    reset_accelerate()
    acc = Accelerator(cpu=True, log_with=tracking.log_with(cfg))
    tracking.start_trackers(acc, cfg, run_dir, run_dir.name, run_id=run_id, env=ENV, plan=PLAN)
    log = tracking.RunLog(acc, run_dir, use_trackers=True)
    for step in steps:
        log.log({"kind": "train", "epoch": 0, "loss": 2.0 / step, "lr": 1e-3}, step)
    if evaluate_at:
        g = torch.Generator().manual_seed(0)
        labels = torch.arange(60) % 10
        logits = torch.randn(60, 10, generator=g) + 3 * torch.nn.functional.one_hot(labels, 10)
        log.log({"kind": "eval", "epoch": 1, "val_accuracy": 0.8}, evaluate_at)
        report = tracking.log_evaluation(acc, logits, labels, CLASSES, evaluate_at, indices=torch.arange(60) + 100,
                                         load_image=lambda i: Image.new("L", (8, 8), int(i)))
        log.summary({"best_accuracy": report["top1"], "global_step": evaluate_at, "precision": "no"})
    acc.end_training()
    # wandb's service process writes the run file after `finish` returns; a process exit waits for
    # it, and so does teardown (the test reads the file next).
    import wandb

    wandb.teardown()
    return acc


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    from vramfit import tracking
    from vramfit.config import build_config

    out = tmp_path_factory.mktemp("tracked")
    cfg = build_config("quickstart", [], {"output": str(out), "tracking.tracker": "wandb,tensorboard"})
    run_dir = out / cfg.resolved_run_name()
    run_id = tracking.wandb_run_id(None)
    _segment(cfg, run_dir, run_id, steps=[1, 10, 20], evaluate_at=23)
    (first,) = (run_dir / "wandb").glob("offline-run-*")
    return cfg, run_dir, run_id, first


def test_offline_wandb_run_holds_config_metrics_eval_views_and_summary(tracked):
    cfg, run_dir, run_id, first = tracked
    recs = _records_by_type(first / f"run-{run_id}.wandb")
    (run,) = recs["run"]
    assert run.run_id == run_id and run.display_name == run_dir.name
    assert run.run_group == "digits"  # grouped by dataset
    assert {"recipe:quickstart", "model:resnet18", "device:cpu"} <= set(run.tags)
    config = {u.key: json.loads(u.value_json) for c in recs["config"] for u in c.update}
    assert config["model"]["name"] == "resnet18" and config["train"]["global_batch"] == 64
    assert config["plan"] == PLAN and config["env"]["torch"] == torch.__version__
    history = _history(recs)
    losses = {h["_step"]: h["loss"] for h in history if "loss" in h}
    assert losses == {1: 2.0, 10: 0.2, 20: 0.1}
    at_eval = {k for h in history if h.get("_step") == 23 for k in h}
    assert {"val_accuracy", "val/mean_class_accuracy"} <= at_eval
    assert any(k.startswith("val/per_class_accuracy") for k in at_eval)
    assert any(k.startswith("val/confusion_matrix") for k in at_eval)
    assert any(k.startswith("val/misclassified") for k in at_eval)
    (table,) = (first / "files" / "media" / "table" / "val").glob("per_class_accuracy_23_*.table.json")
    rows = json.loads(table.read_text())
    assert rows["columns"] == ["class", "accuracy", "samples"] and [r[0] for r in rows["data"]] == CLASSES
    assert list((first / "files" / "media" / "images" / "val").glob("misclassified_23_*.png"))
    summary = {"/".join(u.nested_key) or u.key: json.loads(u.value_json) for s in recs["summary"] for u in s.update}
    assert 0 < summary["best_accuracy"] <= 1 and summary["global_step"] == 23


def test_resumed_run_appends_to_the_same_wandb_run(tracked):
    from vramfit import tracking

    cfg, run_dir, run_id, first = tracked
    state = {"global_step": 23, "wandb_run_id": run_id}  # as the checkpoint keeps it
    assert tracking.wandb_run_id(state) == run_id
    _segment(cfg, run_dir, tracking.wandb_run_id(state), steps=[30])
    runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(p.name.endswith(run_id) for p in runs)
    (second,) = [p for p in runs if p != first]
    recs = _records_by_type(second / f"run-{run_id}.wandb")
    assert recs["run"][0].run_id == run_id
    assert [h["_step"] for h in _history(recs) if "loss" in h] == [30]
    times = [json.loads(line)["time"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert times == sorted(times)  # the resumed clock continues the file's


def test_tensorboard_is_a_second_tracker(tracked):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, run_dir, _, _ = tracked
    tb = run_dir / "tensorboard"
    tags = {"scalars": set(), "images": set()}
    for events in tb.glob("events.out.tfevents.*"):
        acc = EventAccumulator(str(events), size_guidance={"images": 0, "scalars": 0})
        acc.Reload()
        for kind in tags:
            tags[kind] |= set(acc.Tags()[kind])
    assert {"loss", "val_accuracy", "val_class_accuracy/3", "summary/best_accuracy"} <= tags["scalars"]
    assert {"val/confusion_matrix", "val/misclassified"} <= tags["images"]
    assert list(tb.glob("*/hparams.yml"))  # the flattened config, with the plan and environment


def test_tracker_setting():
    from vramfit.config import build_config
    from vramfit.errors import VramfitError
    from vramfit.tracking import tracker_names

    assert tracker_names("none") == [] and tracker_names("wandb") == ["wandb"]
    assert tracker_names("wandb,tensorboard") == ["wandb", "tensorboard"]
    with pytest.raises(VramfitError, match="Unknown tracker `mlflow`"):
        tracker_names("wandb,mlflow")
    assert build_config(None, [], {"tracking.tracker": "tensorboard"}).tracking.tracker == "tensorboard"


def test_dataset_group_and_tags(tmp_path):
    from vramfit.config import build_config
    from vramfit.tracking import dataset_group, run_tags

    (tmp_path / "flowers").mkdir()
    assert dataset_group(str(tmp_path / "flowers")) == "flowers"
    assert dataset_group("uoft-cs/cifar10") == "uoft-cs/cifar10"
    cfg = build_config("rtx3060", [], {})
    gpu = {"device": "cuda:0", "device_names": ["NVIDIA GeForce RTX 3060"] * 2, "num_processes": 2}
    assert "device:2x NVIDIA GeForce RTX 3060" in run_tags(cfg, gpu)
    assert all(len(t) <= 64 for t in run_tags(cfg.model_copy(update={"recipe": "r" * 200}), gpu))


def test_misclassified_are_the_most_confident_mistakes():
    from vramfit.metrics import misclassified

    logits = torch.tensor([[5.0, 0.0], [0.0, 1.0], [0.0, 9.0], [3.0, 0.0]])
    labels = torch.tensor([0, 0, 0, 1])
    assert [m["row"] for m in misclassified(logits, labels, 5)] == [2, 3, 1]
    assert misclassified(logits, labels, 1)[0] == {"row": 2, "label": 0, "predicted": 1,
                                                   "probability": pytest.approx(torch.tensor([0.0, 9.0]).softmax(0)[1].item())}


def test_sweep_runs_every_grid_point_with_its_own_run_folder(tmp_path):
    """Each grid point through the sweep's own command, with a stand-in `accelerate` that prints what
    it was given: the train flags parse and set exactly the swept keys."""
    import itertools

    from wandb.sdk.launch.sweeps.utils import create_sweep_command_args

    from vramfit.cli import parser
    from vramfit.config import build_config

    sweep = yaml.safe_load((REPO / "sweeps" / "backbones.yaml").read_text())
    fake = tmp_path / "accelerate"
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    params = sweep["parameters"]
    grid = list(itertools.product(*(p["values"] for p in params.values())))
    assert len(grid) == 12
    for i, values in enumerate(grid):
        args = create_sweep_command_args({"args": {k: {"value": v} for k, v in zip(params, values)}})
        cmd = [a for c in sweep["command"] for a in (args[c[2:-1]] if c.startswith("${") else [c])]
        env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "WANDB_RUN_ID": f"id{i}"}
        argv = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout.splitlines()
        assert argv[:2] == ["launch", "train.py"]
        ns = parser().parse_args(["train", *argv[2:]])
        flags = {k: v for k, v in vars(ns).items() if "." in k and v is not None}
        cfg = build_config(ns.recipe, ns.sets, {**flags, "run_name": ns.run_name})
        assert (cfg.model.name, cfg.train.precision, cfg.model.grad_checkpointing) == values
        assert cfg.run_name == f"sweep-id{i}" and cfg.recipe == "rtx3060" and cfg.tracking.tracker == "wandb"
