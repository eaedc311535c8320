"""The one writer (runtime/storage.py) under real faults: a full disk (a small tmpfs), a run folder
removed mid-run, names longer than a folder name can be."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from helpers import (class_tree, last_weights, remove_tree, same_weights, tiny_args, train_args,
                     wait_for_lines)
from vramfit.errors import VramfitError
from vramfit.runtime import storage
from vramfit.store import checkpoint


@contextlib.contextmanager
def full_disk(path, size="1m"):
    """A real file system of `size` at `path`, filled to the last byte; skipped where this machine
    cannot mount one."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root and a machine that allows mount")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(disk):
    with contextlib.suppress(OSError), open(disk / "filler", "wb", buffering=0) as f:
        while True:
            f.write(b"\0" * 4096)


def test_a_full_disk_keeps_the_file_as_it_was_and_names_the_path_and_the_free_space(tmp_path):
    with full_disk(tmp_path / "disk") as disk:
        storage.write_json(disk / "summary.json", {"step": 1})
        fill(disk)
        storage.watch(disk)  # a run's folder: its files move with --output
        try:
            with pytest.raises(VramfitError) as e:
                storage.write_json(disk / "summary.json", {"step": 2, "pad": "x" * 100_000},
                                   "the run's summary")
        finally:
            storage.unwatch(disk)
        message = " ".join(str(e.value).split())
        assert e.value.exit_code == 2 and e.value.hint.startswith(f"free space on the disk holding {disk}")
        assert "pick another --output" in e.value.hint
        with pytest.raises(VramfitError) as e:  # a command's own file (--csv, --plot): no --output to pick
            storage.write_json(disk / "runs.json", {"pad": "x" * 100_000}, "the table")
        assert "--output" not in e.value.hint and "name a file on another disk" in e.value.hint
        assert f"Could not write the run's summary {disk / 'summary.json'}: the disk is full" in message
        assert "free under" in message
        assert json.loads((disk / "summary.json").read_text()) == {"step": 1}
        assert sorted(p.name for p in disk.iterdir()) == ["filler", "summary.json"]  # no temp file left
        with pytest.raises(VramfitError) as e:  # permission, not space: the fix says so
            subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
            storage.write_json(disk / "summary.json", {"step": 3})
        assert e.value.hint.startswith(f"mount {disk} writable") and "free under" not in str(e.value)


def test_output_on_a_full_or_read_only_disk_is_told_by_the_storages_recognition(tmp_path):
    """`--output`'s probe before anything loads reads the errno as every writer does
    (storage.os_cause): the cause, the free space where it is the space, and the fix."""
    from vramfit.train.build import check_writable

    with full_disk(tmp_path / "disk") as disk:
        fill(disk)
        with pytest.raises(VramfitError) as e:
            check_writable(disk / "runs")
        assert f"Cannot write into --output {disk / 'runs'}: the disk is full; " in e.value.message
        assert "free under" in e.value.message and "--output PATH" in e.value.hint
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        with pytest.raises(VramfitError) as e:
            check_writable(disk)
        assert e.value.message == f"Cannot write into --output {disk}: the file system is read-only."


def test_the_best_model_on_a_full_disk_keeps_the_previous_model_whole(tmp_path):
    """timm writes the weights with safetensors, whose full-disk error has no errno
    (`SafetensorError`): the storage itself is asked. model/ is the old complete folder after."""
    import timm

    from vramfit.models.create import export

    model = timm.create_model("resnet18", num_classes=3)
    cfg = {"input_size": (3, 32, 32), "mean": (0.5,) * 3, "std": (0.5,) * 3}
    with full_disk(tmp_path / "disk", "80m") as disk:
        with storage.atomic_folder(disk / "model", "the best model") as folder:
            export(model, folder, ["a", "b", "c"], cfg)
        before = load_file(disk / "model" / "model.safetensors")
        with torch.no_grad():
            model.fc.weight.add_(1.0)
        with pytest.raises(VramfitError) as e:  # the second copy (45 MB) does not fit beside the first
            need = storage.tensor_bytes(model)
            with storage.atomic_folder(disk / "model", "the best model", need) as folder:
                export(model, folder, ["a", "b", "c"], cfg)
        assert "the best model" in str(e.value) and "the disk is full" in str(e.value)
        after = load_file(disk / "model" / "model.safetensors")
        assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in after)
        assert sorted(p.name for p in disk.iterdir()) == ["model"]
        assert json.loads((disk / "model" / "class_names.json").read_text()) == ["a", "b", "c"]


@pytest.mark.slow  # trains the tiny run and runs the ONNX exporter: about 90 s on 2 cores
def test_an_onnx_export_on_a_full_disk_blames_the_disk_and_leaves_no_model_onnx(tmp_path, capsys):
    pytest.importorskip("onnxscript")
    from _trained_runs import trained_run
    from vramfit.cli import main

    run = trained_run("a")
    with full_disk(tmp_path / "disk", "1m") as disk:
        fill(disk)
        with pytest.raises(SystemExit) as e:
            main(["export", "--run", str(run.path), "--format", "onnx", "--output", str(disk / "export")])
        err = " ".join(capsys.readouterr().err.split())
        assert e.value.code == 2 and "the disk is full" in err and "Traceback" not in err, err
        assert "torchscript" not in err and "HINT:" in err
        assert not list((disk / "export").glob("*.onnx*"))


def test_a_torchscript_export_on_a_full_disk_is_told_not_an_abort(tmp_path, capsys):
    """torch's C++ writer aborts the process on a full disk (SIGABRT, C++ frames): the model is
    serialised in memory and written by the one writer, so it ends as every full disk does."""
    from _trained_runs import trained_run
    from vramfit.cli import main

    run = trained_run("a")
    with full_disk(tmp_path / "disk", "1m") as disk:
        fill(disk)
        with pytest.raises(SystemExit) as e:
            main(["export", "--run", str(run.path), "--format", "torchscript",
                  "--output", str(disk / "export")])
        err = " ".join(capsys.readouterr().err.split())
        assert e.value.code == 2 and "Could not write the TorchScript model" in err
        assert "the disk is full" in err
        assert "HINT:" in err and "Traceback" not in err and not list((disk / "export").iterdir())


@pytest.mark.slow  # a trained run and a predict / an lr sweep in a new process
def test_predict_csv_into_a_file_on_a_full_disk_names_the_standard_output(tmp_path):
    from _trained_runs import trained_run

    run = trained_run("a")
    images = class_tree(tmp_path / "imgs", {"a": 40})
    with full_disk(tmp_path / "disk", "1m") as disk:
        fill(disk)
        with open(disk / "labels.csv", "w") as out:
            proc = subprocess.run([sys.executable, "-m", "vramfit.cli", "predict", "--run", str(run.path),
                                   str(images), "--csv"], stdout=out, stderr=subprocess.PIPE, text=True,
                                  timeout=300)
        err = " ".join(proc.stderr.split())
        assert proc.returncode == 2, err[-2000:]
        said = f"Could not write the standard output {disk / 'labels.csv'}: the disk is full; 0 bytes free"
        assert said in err
        assert "HINT:" in err and "Traceback" not in err


@pytest.mark.slow  # a trained run and a predict / an lr sweep in a new process
def test_lr_find_plot_into_a_read_only_folder_says_permission_denied(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    drop = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--"] if os.geteuid() == 0 else []
    args = tiny_args()
    del args[args.index("--epochs"):args.index("--epochs") + 2]  # lr-find runs steps, not epochs
    proc = subprocess.run([*drop, sys.executable, "-m", "vramfit.cli", "lr-find", *args, "--steps", "10",
                           "--output", str(tmp_path / "runs"), "--plot", str(ro / "lr.png")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    err = " ".join(proc.stderr.split())
    assert proc.returncode == 2, err[-2000:]
    assert f"Could not write the figure {ro / 'lr.png'}: permission denied. Everything saved" in err
    assert f"HINT: give this user write permission on {ro}, or name a file on another disk" in err
    assert "Traceback" not in err
    assert list(ro.iterdir()) == []


def test_the_run_folder_removed_mid_run_stops_the_run_and_is_not_recreated(tmp_path):
    args = ["train", *tiny_args("--epochs", "20", "--set", "train.log_every_steps=1"),
            "--output", str(tmp_path), "--run-name", "gone"]
    _ends_as_removed(args, tmp_path, lambda _proc: wait_for_lines(tmp_path / "gone" / "metrics.jsonl", 3),
                     lambda: remove_tree(tmp_path / "gone"))  # a cleanup script, mid-run
    assert not (tmp_path / "gone").exists()  # never silently rebuilt as if the run were whole


def _ends_as_removed(args: list[str], cwd, until, fault) -> None:
    """The run folder taken away mid-run (`_fault_mid_run`): the removed-folder message."""
    assert "was removed while the run was writing it" in _fault_mid_run(args, cwd, until, fault)


def _fault_mid_run(args: list[str], cwd, until, fault) -> str:
    """`vramfit` run with `args` in a new process; once `until(proc)` returns, `fault()` lands: the
    run must end with exit 2, a HINT and no traceback. Its standard error, on one line."""
    proc = subprocess.Popen([sys.executable, "-m", "vramfit.cli", *args], cwd=cwd,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        until(proc)
        fault()
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    flat = " ".join(err.split())
    assert proc.returncode == 2, err[-3000:]
    assert "HINT:" in flat and "Traceback" not in err, err[-3000:]
    return flat


# 10 steps, a checkpoint every 2: a fault lands between two saves within seconds.
SHORT = tiny_args("--set", "data.limit_train_samples=160", "--set", "data.limit_val_samples=32",
                  "--set", "checkpoint.every_steps=2", "--set", "train.log_every_steps=1")


@pytest.fixture(scope="module")
def short_reference(tmp_path_factory):
    """The uninterrupted run a run resumed after a storage fault must equal bit for bit."""
    from vramfit.cli import run
    from vramfit.runtime.launch import forget

    out = tmp_path_factory.mktemp("ref")
    try:
        assert run(["train", *SHORT, "--output", str(out), "--run-name", "ref"]) == 0
    finally:
        forget()
    return last_weights(out / "ref")


def _until(check, proc, timeout=120.0):
    import time

    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None and not check():
        time.sleep(0.01)
    assert check(), "the run ended before the fault could land"


def test_a_disk_filled_mid_run_stops_it_and_once_freed_the_same_command_resumes_bitwise(
        tmp_path, train_cli, short_reference):
    with full_disk(tmp_path / "disk", "24m") as disk:
        args = ["train", *SHORT, "--output", str(disk), "--run-name", "full"]
        saved = lambda: checkpoint.list_steps(disk / "full" / "checkpoints")  # noqa: E731
        flat = _fault_mid_run(args, tmp_path, lambda proc: _until(saved, proc),
                              lambda: fill(disk))  # another program took the space, mid-run
        assert "the disk is full" in flat
        saved = checkpoint.list_steps(disk / "full" / "checkpoints")
        assert saved and saved[-1][0] < 10 and not list((disk / "full" / "checkpoints").glob(".tmp-*"))
        (disk / "filler").unlink()  # space freed: the same command goes on from the newest checkpoint
        run_dir, code = train_cli(*SHORT, run_name="full", output=disk)
        assert code == 0
        assert same_weights(short_reference, last_weights(run_dir))


def test_tensorboards_writer_on_a_full_disk_is_told_once_and_the_checkpoint_resumes_bitwise(
        tmp_path, train_cli, short_reference):
    """TensorBoard writes its event file from a thread of its own, and its OSError names no file:
    the run ends with vramfit's message naming the run folder (exit 2), no traceback from that
    thread, and once space is freed the same command resumes from the checkpoint bit for bit."""
    pytest.importorskip("tensorboard")
    args = [*SHORT, "--tracker", "tensorboard"]
    run_dir, code = train_cli(*args, "--set", "debug.signal_at_step=4", run_name="tb", output=tmp_path)
    assert code == 143 and [s for s, _ in checkpoint.list_steps(run_dir / "checkpoints")] == [2, 4]
    # TensorBoard's folder on a disk of its own, full: its writer is the one that meets it.
    shutil.rmtree(run_dir / "tensorboard")
    with full_disk(run_dir / "tensorboard", "2m") as disk:
        fill(disk)
        cmd = [sys.executable, "-m", "vramfit.cli", "train", *args, "--output", str(tmp_path),
               "--run-name", "tb"]
        proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        flat = " ".join(proc.stderr.split())
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert flat.count("vramfit: error:") == 1, flat[-3000:]
        assert "the disk is full" in flat and "HINT:" in flat
        assert f"free under {disk}" in flat, flat[-800:]  # its own disk, named from the writer's file
        assert "Traceback" not in proc.stderr and "Exception in thread" not in proc.stderr
        assert checkpoint.is_complete(checkpoint.list_steps(run_dir / "checkpoints")[-1][1])
        (disk / "filler").unlink()  # space freed: the same command goes on
        run_dir, code = train_cli(*args, run_name="tb", output=tmp_path)
        assert code == 0
        assert same_weights(short_reference, last_weights(run_dir))


def test_the_output_folder_gone_mid_run_and_back_resumes_bitwise(tmp_path, train_cli, short_reference):
    """--output moved away mid-run (a network disk dropped, a folder renamed by a script): the run
    stops with the message, exit 2; once the folder is back, the same command resumes from its
    newest complete checkpoint and ends bit for bit as the uninterrupted run."""
    out, away = tmp_path / "runs", tmp_path / "away"
    args = ["train", *SHORT, "--output", str(out), "--run-name", "moved"]
    saved = lambda: checkpoint.list_steps(out / "moved" / "checkpoints")  # noqa: E731
    _ends_as_removed(args, tmp_path, lambda proc: _until(saved, proc), lambda: os.rename(out, away))
    assert not out.exists()  # never recreated
    os.rename(away, out)
    run_dir, code = train_cli(*SHORT, run_name="moved", output=out)
    assert code == 0
    assert same_weights(short_reference, last_weights(run_dir))


def test_a_run_name_longer_than_a_folder_name_is_refused_before_anything_runs(tmp_path, capsys):
    from vramfit.cli import main

    for name in ("r" * 256, "é" * 128):  # 256 bytes: 256 characters, or 128 two-byte ones
        with pytest.raises(SystemExit) as e:
            main(["train", *tiny_args(), "--output", str(tmp_path), "--run-name", name])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "256 bytes" in err and "HINT:" in err and "Traceback" not in err
    assert not list(tmp_path.iterdir())


def test_a_default_run_name_from_a_long_data_folder_fits_and_stays_the_same(tmp_path):
    """A data folder named with 250 bytes (multi-byte letters) trains into a default run folder
    that fits a folder name, readable, and the same command names it the same."""
    from vramfit.config import build_config
    from vramfit.runtime.storage import NAME_MAX_BYTES
    from vramfit.store.runfolder import default_run_name

    data = class_tree(tmp_path / ("données-" + "é" * 60 + "x" * 120), {"cat": 6, "dog": 6})
    assert len(data.name.encode()) == 249
    cfg = build_config(None, [], {"data.source": str(data), "model.name": "test_resnet", "optim.lr": 0.123})
    name = default_run_name(cfg, "fp32")
    assert len(name.encode()) <= NAME_MAX_BYTES and "données-éé" in name
    assert name == default_run_name(cfg, "fp32")
    other = build_config(None, [], {"data.source": str(data) + "2", "model.name": "test_resnet",
                                    "optim.lr": 0.123})
    assert default_run_name(other, "fp32") != name
    proc = subprocess.run([sys.executable, "-m", "vramfit.cli", "train",
                           *train_args(data, tmp_path, "--output", str(tmp_path / "runs"))],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert len(run_dir.name.encode()) <= NAME_MAX_BYTES
    assert (run_dir / "model" / "model.safetensors").is_file()
