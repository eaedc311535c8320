"""What a run records in its trackers: an offline W&B run of a real (tiny) training run (config with
plan and environment, per-step metrics, the per-eval table, confusion matrix and misclassified
images, the summary) that its resumed run appends to; TensorBoard next to it; the sweep file."""
import json
import os
import stat
import struct
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

from helpers import REPO, tiny_args
from vramfit.runtime.launch import forget

CLASSES = [str(i) for i in range(10)]


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


def _train(out, *extra):
    """A real tiny run through the run loop, with W&B (offline) and TensorBoard on."""
    from vramfit.cli import run

    forget()
    try:
        code = run(["train", *tiny_args("--tracker", "wandb,tensorboard", *extra), "--output", str(out),
                    "--run-name", "tracked"])
    except SystemExit as e:
        code = e.code
    import wandb

    wandb.teardown()  # wandb's service writes the run file after `finish`; the tests read it next
    forget()
    return code


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    """Interrupted after step 10 (a SIGTERM as the loop sees it), then resumed to the end of the
    epoch (30 steps, evaluated at step 30): two W&B segments of one run."""
    out = tmp_path_factory.mktemp("tracked")
    assert _train(out, "--set", "debug.signal_at_step=10") == 143
    run_dir = out / "tracked"
    (first,) = (run_dir / "wandb").glob("offline-run-*")
    assert _train(out) == 0
    (second,) = [p for p in (run_dir / "wandb").glob("offline-run-*") if p != first]
    run_id = first.name.rsplit("-", 1)[-1]
    return run_dir, run_id, first, second


def test_offline_wandb_run_holds_config_metrics_eval_views_and_summary(tracked):
    run_dir, run_id, first, second = tracked
    recs = _records_by_type(first / f"run-{run_id}.wandb")
    (run,) = recs["run"]
    assert run.run_id == run_id and run.display_name == run_dir.name
    assert run.run_group == "digits"  # grouped by dataset
    assert {"model:test_resnet", "device:cpu", "precision:fp32"} <= set(run.tags)  # what ran, not `auto`
    config = {u.key: json.loads(u.value_json) for c in recs["config"] for u in c.update}
    assert (config["train"]["precision"], config["train"]["requested_precision"]) == ("fp32", "auto")
    assert config["model"]["name"] == "test_resnet" and config["train"]["global_batch"] == 16
    assert config["plan"]["micro_batch"] == 16 and config["env"]["torch"] == torch.__version__
    assert sorted(h["_step"] for h in _history(recs) if "train/loss" in h) == [1, 10]
    recs = _records_by_type(second / f"run-{run_id}.wandb")
    history = _history(recs)
    assert sorted(h["_step"] for h in history if "train/loss" in h) == [20, 30]
    assert not any(k in h for h in history for k in ("loss", "accuracy", "val_accuracy"))  # grouped names only
    at_eval = {k for h in history if h.get("_step") == 30 for k in h}
    assert {"val/accuracy", "val/top5", "val/loss", "val/mean_class_accuracy", "epoch/seconds"} <= at_eval
    assert any(k.startswith("val/per_class_accuracy") for k in at_eval)
    assert any(k.startswith("val/confusion_matrix") for k in at_eval)
    assert any(k.startswith("val/misclassified") for k in at_eval)
    (table,) = (second / "files" / "media" / "table" / "val").glob("per_class_accuracy_30_*.table.json")
    rows = json.loads(table.read_text())
    assert rows["columns"] == ["class", "accuracy", "samples"] and [r[0] for r in rows["data"]] == CLASSES
    assert list((second / "files" / "media" / "images" / "val").glob("misclassified_30_*.png"))
    summary = {"/".join(u.nested_key) or u.key: json.loads(u.value_json) for s in recs["summary"] for u in s.update}
    best = json.loads((run_dir / "summary.json").read_text())["best_accuracy"]
    assert summary["best_accuracy"] == pytest.approx(best) and summary["global_step"] == 30
    # W&B's summary of the validation accuracy is its best (define_metric), not the last one.
    assert summary["val/accuracy"] == {"max": pytest.approx(best)}


def test_resumed_run_appends_to_the_same_wandb_run(tracked):
    """The W&B run id is kept in the checkpoint: the resumed segment is the same W&B run."""
    from vramfit.store import checkpoint

    run_dir, run_id, first, second = tracked
    assert first.name.endswith(run_id) and second.name.endswith(run_id)
    assert _records_by_type(second / f"run-{run_id}.wandb")["run"][0].run_id == run_id
    assert checkpoint.read_state(checkpoint.latest(run_dir / "checkpoints"))["wandb_run_id"] == run_id
    times = [json.loads(line)["time"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert times == sorted(times)  # the resumed clock continues the file's


def test_metrics_jsonl_names_its_figures_as_the_trackers_do(tracked):
    """One name per figure: the W&B history's keys at a step are metrics.jsonl's at that step."""
    run_dir, run_id, first, second = tracked
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    by_step = {}
    for r in rows:
        by_step.setdefault(r["step"], set()).update(k for k in r if k not in ("step", "time", "kind"))
    history = _history(_records_by_type(second / f"run-{run_id}.wandb"))
    for step in (20, 30):
        logged = {k for h in history if h.get("_step") == step for k in h if not k.startswith("_")}
        assert by_step[step] <= logged
    train = next(r for r in rows if r["kind"] == "train")
    assert {"train/loss", "train/accuracy", "train/lr", "train/micro_batch", "train/image_size",
            "memory/host_rss_bytes", "epoch"} <= set(train)
    assert {"val/accuracy", "val/top5", "val/loss", "epoch/seconds"} <= set(next(r for r in rows if r["kind"] == "eval"))


def test_run_folders_of_earlier_versions_read_under_todays_names(tmp_path):
    from vramfit.store.tracking import read_metrics

    f = tmp_path / "metrics.jsonl"
    f.write_text('{"step": 1, "time": 0.5, "kind": "train", "epoch": 0, "loss": 2.3, "lr": 0.1, '
                 '"mem_peak_bytes": 7, "host_rss_bytes": 9}\n'
                 '{"step": 2, "time": 1.0, "kind": "eval", "epoch": 1, "val_accuracy": 0.5, '
                 '"skipped_samples": 0, "epoch_seconds": 3.0}\n'
                 '{"step": 3, "time": 1.5, "kind": "train", "train/loss": 2.0, "memory/peak_bytes": 8}\n{"step"')
    assert read_metrics(f) == [
        {"step": 1, "time": 0.5, "kind": "train", "epoch": 0, "train/loss": 2.3, "train/lr": 0.1,
         "memory/peak_bytes": 7, "memory/host_rss_bytes": 9},
        {"step": 2, "time": 1.0, "kind": "eval", "epoch": 1, "val/accuracy": 0.5, "epoch/skipped_samples": 0,
         "epoch/seconds": 3.0},
        {"step": 3, "time": 1.5, "kind": "train", "train/loss": 2.0, "memory/peak_bytes": 8}]
    assert read_metrics(tmp_path / "missing.jsonl") == []


def test_tensorboard_is_a_second_tracker(tracked):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tracked[0]
    tb = run_dir / "tensorboard"
    tags = {"scalars": set(), "images": set()}
    for events in tb.glob("events.out.tfevents.*"):
        acc = EventAccumulator(str(events), size_guidance={"images": 0, "scalars": 0})
        acc.Reload()
        for kind in tags:
            tags[kind] |= set(acc.Tags()[kind])
    assert {"train/loss", "train/accuracy", "val/accuracy", "val/class_accuracy/3",
            "summary/best_accuracy"} <= tags["scalars"]
    assert {"val/confusion_matrix", "val/misclassified"} <= tags["images"]
    segments = list(tb.glob("*/hparams.yml"))  # the flattened config, with the plan and environment
    assert len(segments) == 2  # the interrupted run and its resume
    for hparams in segments:
        flat = yaml.safe_load(hparams.read_text())  # plain values only: safe_load reads it
        assert (flat["train/precision"], flat["train/requested_precision"]) == ("fp32", "auto")
        assert flat["env/torch"] == torch.__version__


def test_tracker_setting():
    from vramfit.config import build_config
    from vramfit.errors import VramfitError
    from vramfit.store.tracking import tracker_names

    assert tracker_names("none") == [] and tracker_names("wandb") == ["wandb"]
    assert tracker_names("wandb,tensorboard") == ["wandb", "tensorboard"]
    with pytest.raises(VramfitError, match="Unknown tracker `mlflow`"):
        tracker_names("wandb,mlflow")
    assert build_config(None, [], {"tracking.tracker": "tensorboard"}).tracking.tracker == "tensorboard"


def test_dataset_group_and_tags(tmp_path):
    from vramfit.config import build_config
    from vramfit.store.tracking import dataset_group, run_tags

    (tmp_path / "flowers").mkdir()
    assert dataset_group(str(tmp_path / "flowers")) == "flowers"
    assert dataset_group("uoft-cs/cifar10") == "uoft-cs/cifar10"
    cfg = build_config("rtx3060", [], {})
    gpu = {"device": "cuda:0", "device_names": ["NVIDIA GeForce RTX 3060"] * 2, "num_processes": 2}
    tags = run_tags(cfg, gpu, "bf16")
    assert "device:2x NVIDIA GeForce RTX 3060" in tags and "precision:bf16" in tags
    assert all(len(t) <= 64 for t in run_tags(cfg.model_copy(update={"recipe": "r" * 200}), gpu, "bf16"))


def test_misclassified_are_the_most_confident_mistakes():
    from vramfit.store.accuracy import misclassified

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


def test_the_record_continues_from_the_checkpoint_and_a_fresh_start_keeps_the_old_aside(tmp_path):
    from vramfit.store.tracking import continue_record

    f = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "kind": "train", "loss": 1.0 / s}) for s in (1, 2, 3, 4)]
    f.write_text("\n".join(lines) + "\n" + '{"step": 5, "kind": "tr')  # cut short by a kill
    continue_record(f, 2)
    assert f.read_text() == "\n".join(lines[:2]) + "\n"
    continue_record(f, None)  # every checkpoint was damaged: the run starts over
    assert not f.exists() and [p.read_text() for p in tmp_path.glob("metrics.jsonl.before-*")] == \
        ["\n".join(lines[:2]) + "\n"]


def test_every_shipped_file_names_only_figures_the_trackers_log(tracked):
    """Sweeps (their metric), docs (every `group/name` they mention) and compare's columns name
    what a real run logs: its W&B history and summary, and summary.json."""
    import re

    from vramfit.commands.compare import COLUMNS, CSV_FIELDS
    from vramfit.store.tracking import FIGURE_GROUPS, MEMORY_NAMES

    run_dir, run_id, first, second = tracked
    logged = set()
    for segment in (first, second):
        recs = _records_by_type(segment / f"run-{run_id}.wandb")
        logged |= {k.split("/_", 1)[0] for h in _history(recs) for k in h if not k.startswith("_")}
        logged |= {"/".join(u.nested_key) or u.key for s in recs["summary"] for u in s.update}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for events in (run_dir / "tensorboard").glob("events.out.tfevents.*"):
        acc = EventAccumulator(str(events), size_guidance={"images": 0, "scalars": 0})
        acc.Reload()
        logged |= set(acc.Tags()["scalars"]) | set(acc.Tags()["images"])
    logged |= set(MEMORY_NAMES.values())  # the device's figures are logged on a GPU only; tracking names them
    summary = json.loads((run_dir / "summary.json").read_text())
    figures = {k for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    assert figures <= logged  # the W&B summary

    for sweep in (REPO / "sweeps").glob("*.yaml"):
        metric = yaml.safe_load(sweep.read_text())["metric"]["name"]
        assert metric in logged, f"{sweep.name} optimises `{metric}`, which no tracker logs"
    named = re.compile(rf"`((?:{'|'.join(FIGURE_GROUPS)})/[a-z0-9_/]*)(?:<[^`]*>|\.\.\.)?`")
    for doc in [REPO / "README.md", *(REPO / "docs").glob("*.md")]:
        for name in named.findall(doc.read_text()):
            assert name in logged or any(k.startswith(name) for k in logged if name.endswith("/")), \
                f"{doc.name} names `{name}`, which no tracker logs"
    derived = {"seconds_to_best"}  # compare's own, from metrics.jsonl
    for key in [k for _, k in COLUMNS if k] + CSV_FIELDS:
        assert key in summary or key in derived or key in ("run", "path", "data", "model", "image_size",
                                                           "grad_checkpointing"), key
