"""The run loop's own rules: the logged LR, what a resume says it changed, plan.json after every
override, runs whose validation images are all unreadable, and an --output that cannot be written."""
import contextlib
import json
import logging
import os
import subprocess

import pytest
import torch
from PIL import Image

from helpers import StandInCard, tiny_args


def _records(run_dir, kind):
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


def test_the_logged_lr_is_the_one_the_step_used(train_cli):
    """Warmup from lr/100 over 29 steps (one epoch of 30, the last step kept for the schedule's end):
    step 1 runs at lr/100, step 2 one increment above (logged before the schedule moves on)."""
    run_dir, code = train_cli(*tiny_args("--set", "train.log_every_steps=1", "--set", "debug.signal_at_step=3",
                                         "--lr", "1e-3"))
    assert code == 143
    rows = _records(run_dir, "train")
    assert rows[0]["train/images_per_second"] > 0 and 0 <= rows[0]["train/data_wait_fraction"] <= 1  # from step 1 on
    lrs = [r["train/lr"] for r in rows]
    assert lrs[0] == pytest.approx(1e-5) and lrs[1] == pytest.approx(1e-5 + (1e-3 - 1e-5) / 29)


def test_a_resume_says_what_its_micro_batch_changed_and_plan_json_follows(train_cli, caplog):
    caplog.set_level(logging.INFO, logger="vramfit")
    run_dir, code = train_cli(*tiny_args("--micro-batch", "8", "--set", "debug.signal_at_step=3"))
    assert code == 143 and json.loads((run_dir / "plan.json").read_text())["micro_batch"] == 8
    caplog.clear()
    run_dir, code = train_cli(*tiny_args("--micro-batch", "4"))
    assert code == 0
    assert "resumed with micro_batch 4 (the checkpoint's run used 8)" in caplog.text
    plan = json.loads((run_dir / "plan.json").read_text())
    assert (plan["micro_batch"], plan["grad_accum_steps"]) == (4, 4)
    # Throughput and wall time cover both segments of the run, not only the resumed one.
    from vramfit.store import checkpoint

    state = checkpoint.read_state(checkpoint.latest(run_dir / "checkpoints"))
    assert state["train_samples"] == 480 and state["train_seconds"] > 0
    assert json.loads((run_dir / "summary.json").read_text())["wall_seconds"] >= state["wall_seconds"] > 0


def test_a_micro_batch_larger_than_the_global_batch_says_what_is_used(train_cli, caplog):
    caplog.set_level(logging.INFO, logger="vramfit")
    run_dir, code = train_cli(*tiny_args("--micro-batch", "64", "--set", "debug.signal_at_step=1"))
    assert code == 143
    assert "micro-batch 64 is larger than this process's share of the global batch (16)" in caplog.text
    assert json.loads((run_dir / "plan.json").read_text())["micro_batch"] == 16


@pytest.fixture
def unreadable_val(tmp_path):
    root = tmp_path / "imgs"
    g = torch.Generator().manual_seed(0)
    for c in range(2):
        for split, n in (("train", 12), ("val", 3)):
            d = root / split / f"c{c}"
            d.mkdir(parents=True)
            for i in range(n):
                if split == "val":
                    (d / f"{i}.png").write_bytes(os.urandom(300))
                else:
                    Image.fromarray((torch.rand(24, 24, 3, generator=g) * 255).byte().numpy()).save(d / f"{i}.png")
    return root


def test_all_validation_images_unreadable_never_gives_nan_or_a_best_epoch(train_cli, unreadable_val, caplog):
    run_dir, code = train_cli("--data", str(unreadable_val), "--model", "test_resnet", "--image-size", "24",
                              "--global-batch", "8", "--epochs", "1", "--set", "data.num_workers=0")
    assert code == 0
    text = (run_dir / "summary.json").read_text()
    assert "NaN" not in text and "Infinity" not in text
    summary = json.loads(text)
    assert summary["best_accuracy"] is None and summary["final_accuracy"] is None
    assert not (run_dir / "model").exists()  # no epoch was "best" on 0 images
    assert "no validation image could be read (6 unreadable)" in caplog.text


def test_read_only_output_is_said_before_anything_loads(tmp_path):
    import sys

    out = tmp_path / "ro"
    out.mkdir()
    out.chmod(0o500)
    # Permission bits do not bind root: run as root without the override capabilities.
    drop = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--"] if os.geteuid() == 0 else []
    proc = subprocess.run([*drop, sys.executable, "-m", "vramfit.cli", "train", *tiny_args(), "--output", str(out),
                           "--run-name", "t"], capture_output=True, text=True, timeout=300)
    code, err = proc.returncode, " ".join(proc.stderr.split())
    assert code == 2
    assert f"Cannot write into --output {out}: permission denied." in err and "HINT:" in err, err[-2000:]
    assert "Traceback" not in err and "classes" not in err  # stopped before the data was loaded
    assert list(out.iterdir()) == []


def test_an_output_path_that_is_a_file_is_said_before_anything_loads(tmp_path, capsys):
    from vramfit.cli import main

    blocker = tmp_path / "runs"
    blocker.write_text("not a folder")
    with pytest.raises(SystemExit) as e:
        main(["train", *tiny_args(), "--output", str(blocker)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Cannot write into --output" in err and "in the way" in err
    assert "Traceback" not in err and "classes" not in err  # stopped before the data was loaded


@contextlib.contextmanager
def small_disk(path, size: str):
    """A real file system of `size` at `path` (a tmpfs: needs root and mount); None where the
    machine cannot mount one (the caller then uses a stand-in writer)."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                                                   capture_output=True).returncode == 0
    try:
        yield path if mounted else None
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_a_full_disk_mid_save_says_so_keeps_the_last_checkpoint_and_resumes_bitwise(train_cli, tmp_path,
                                                                                   monkeypatch, capsys):
    """A disk with room for one checkpoint and not two: torch's zip writer fails writing the
    optimizer state of the second (`unexpected pos`, not an OSError). Exit 2, the cause named, the
    half-written folder gone, the first checkpoint kept; moved to a disk with room, the run resumes
    from it and ends with the weights of the uninterrupted tiny run."""
    import errno
    import shutil

    from accelerate import Accelerator
    from safetensors.torch import load_file

    from _trained_runs import trained_run
    from vramfit.cli import main
    from vramfit.runtime.launch import forget
    from vramfit.store import checkpoint

    args = tiny_args("--set", "checkpoint.every_steps=10")
    with small_disk(tmp_path / "disk", "7m") as disk:
        if disk is None:  # stand-in: the second save fails as a full disk does
            real, calls = Accelerator.save_state, [0]

            def filling_disk(self, *a, **kw):
                calls[0] += 1
                if calls[0] == 2:
                    raise OSError(errno.ENOSPC, "No space left on device")
                return real(self, *a, **kw)

            monkeypatch.setattr(Accelerator, "save_state", filling_disk)
        out = disk or tmp_path / "runs"
        with pytest.raises(SystemExit) as e:
            main(["train", *args, "--output", str(out), "--run-name", "full"])
        err = " ".join(capsys.readouterr().err.split())
        assert e.value.code == 2 and "the disk is full" in err and "step-10 (kept)" in err and "Traceback" not in err
        ckpts = out / "full" / "checkpoints"
        assert [s for s, _ in checkpoint.list_steps(ckpts)] == [10] and not list(ckpts.glob(".tmp-*"))
        shutil.copytree(out / "full", tmp_path / "moved" / "full")
    monkeypatch.undo()
    forget()
    run_dir, code = train_cli(*args, run_name="full", output=tmp_path / "moved")
    assert code == 0 and json.loads((run_dir / "summary.json").read_text())["global_step"] == 30
    reference = trained_run("a")
    if reference.real:  # the same run uninterrupted (checkpoint.every_steps changes nothing)
        ours, theirs = (load_file(p / "model" / "model.safetensors") for p in (run_dir, reference.path))
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_a_file_size_limit_mid_save_says_so_and_leaves_no_half_checkpoint(tmp_path, capsys):
    """`ulimit -f`: the optimizer state (3 MB) is larger than the limit the weights (1.5 MB) fit
    in; torch's writer reports it as `unexpected pos`. Exit 2 naming the limit, nothing half-written."""
    import resource

    from vramfit.cli import main

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2_000_000, hard))
    try:
        with pytest.raises(SystemExit) as e:
            main(["train", *tiny_args("--set", "checkpoint.every_steps=10", "--set", "data.limit_train_samples=160"),
                  "--output", str(tmp_path), "--run-name", "limit"])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    err = " ".join(capsys.readouterr().err.split())
    assert e.value.code == 2 and "file size limit (ulimit -f: 2000000 bytes)" in err and "Traceback" not in err
    assert "Last complete checkpoint: none (kept)" in err
    assert not list((tmp_path / "limit" / "checkpoints").iterdir())


def test_the_data_identity_sees_new_files_under_the_same_path(tmp_path):
    from vramfit.store.resume import data_identity

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "1.png").write_bytes(b"x" * 10)
    first = data_identity(str(tmp_path))
    assert first == data_identity(str(tmp_path)) and first.startswith("1 files")
    (tmp_path / "a" / "2.png").write_bytes(b"y" * 10)
    assert data_identity(str(tmp_path)) != first and data_identity("digits") is None


def test_a_fixed_micro_batch_that_will_not_fit_is_said_at_start_with_one_that_does(monkeypatch):
    """On a (stand-in) 12 GB card, resnet50 at 224 and micro-batch 256: the start line says it will
    not fit and names the planner's fitting value; `auto` says its pick and predicted peak."""
    from types import SimpleNamespace

    from vramfit import batching
    from vramfit.config import Config
    from vramfit.runtime.precision import resolve
    from vramfit.train import build

    StandInCard(monkeypatch, 12 * 2**30)
    cfg = Config.model_validate({"model": {"name": "resnet50"}, "data": {"image_size": 224},
                                 "train": {"global_batch": 256, "micro_batch": 256, "precision": "bf16"}})
    L = SimpleNamespace(device_type="cuda", acc=SimpleNamespace(device="cuda:0"), world=1,
                        precision=resolve("bf16", "cuda", bf16_supported=True))
    mb = batching.resolve_micro_batch(256, 256)
    (note,) = build.fit_notes(cfg, L, 10, mb, 40 * 2**30)
    assert "micro-batch 256 is predicted to need 40.00 GiB" in note and "--micro-batch " in note
    fits = int(note.split("--micro-batch ")[1].split()[0])
    assert 16 <= fits < 256
    auto = batching.resolve_micro_batch("auto", 256, pick=lambda share: fits)
    (said,) = build.fit_notes(cfg, L, 10, auto, 9 * 2**30)
    assert f"micro-batch {fits} picked for this card: predicted peak 9.00 GiB" in said


@pytest.mark.parametrize("extra, code, said", [
    (["--global-batch", "1"], 2, "cannot train on fewer than 2 at once"),
    (["--micro-batch", "1"], 2, "use --micro-batch 2"),
    (["--set", "debug.simulate_oom_above=1"], 3, "Out of memory even at micro-batch 2 (train-mode BatchNorm"),
])
def test_a_batch_of_one_with_batchnorm_is_refused_or_stops_at_two(tmp_path, capsys, extra, code, said):
    """Train-mode BatchNorm cannot train on one sample: a share or micro-batch of 1 is refused at
    start with the fix, and the out-of-memory retry stops at 2 with exit 3 and the plan."""
    from vramfit.cli import main

    with pytest.raises(SystemExit) as e:
        main(["train", *tiny_args("--set", "data.limit_train_samples=32", *extra), "--output", str(tmp_path),
              "--run-name", "one"])
    err = " ".join(capsys.readouterr().err.split())
    assert e.value.code == code and said in err and "Traceback" not in err and "Expected more than 1" not in err
    if code == 2:
        assert "model.bn=freeze" in err and not (tmp_path / "one" / "checkpoints").exists()
    else:
        assert "micro-batch" in err and "GiB" in err  # the plan is printed with it


def test_a_micro_batch_of_one_trains_with_frozen_batchnorm(train_cli):
    run_dir, code = train_cli(*tiny_args("--micro-batch", "1", "--set", "model.bn=freeze",
                                         "--set", "data.limit_train_samples=32", "--set", "data.limit_val_samples=16"))
    assert code == 0 and json.loads((run_dir / "summary.json").read_text())["micro_batch"] == 1


def test_outside_a_terminal_progress_is_a_plain_line_every_log_every_steps(train_cli, caplog):
    """A job log or a pipe: a whole line every `train.log_every_steps` steps with the loss,
    images/s, memory and the run's ETA; an out-of-memory retry said when it happens; each epoch
    leaves a line with its training loss, validation accuracy, time and images/s."""
    import re

    with caplog.at_level(logging.INFO, logger="vramfit"):
        _, code = train_cli(*tiny_args("--set", "train.log_every_steps=4", "--set", "data.limit_train_samples=160",
                                       "--set", "data.limit_val_samples=16", "--set", "debug.simulate_oom_above=8"))
    assert code == 0
    lines = [r.getMessage() for r in caplog.records]
    steps = [int(m.group(1)) for line in lines if (m := re.match(r"epoch 1/1 step (\d+)/10 \| loss [\d.]+ \| \d+ img/s "
                                                                 r"\| host [\d.]+ GiB \| mb \d+ \| ETA [\d:?]+$", line))]
    assert steps == [1, 4, 8], lines
    assert any(line.startswith("out of memory at micro-batch 16: global step 1 ran again at micro-batch 8") for line in lines)
    assert any(re.match(r"epoch 1/1: train loss [\d.]+, val accuracy [\d.]+ .* \| \d+ s, \d+ img/s$", line)
               for line in lines), lines


def test_in_a_terminal_a_log_line_prints_once_above_the_bar(capsys):
    """Log lines during an epoch go through tqdm (above the bar, never into it), and only there:
    the console handler they would otherwise also reach is set aside for the epoch."""
    import sys

    from vramfit.train.progress import Progress

    root = logging.getLogger()
    console = logging.StreamHandler(sys.stderr)  # as logging.basicConfig makes it, on today's stderr
    root.addHandler(console)
    try:
        progress = Progress(True, 1, 10, 1, torch.device("cpu"), None, 0, terminal=True)
        with progress.epoch(0, 0):
            logging.getLogger("vramfit").warning("one line")
            assert console not in root.handlers
        assert console in root.handlers
    finally:
        root.removeHandler(console)
    assert capsys.readouterr().err.count("one line") == 1


def test_a_train_loss_rising_epoch_after_epoch_is_remarked_on_once(caplog):
    """RISING_EPOCHS rises in a row earn one warning that says what to try; noise does not."""
    from vramfit.train.progress import RISING_EPOCHS, Progress

    progress = Progress(True, 10, 5, 1, torch.device("cpu"), None, 0, terminal=False)
    rising = [1.0 + i for i in range(RISING_EPOCHS + 3)]
    cases = {"noise": ([1.0, 1.2, 0.9, 1.1, 1.0, 1.3], 0), "rising": (rising, 1),
             "too_few": (rising[:RISING_EPOCHS], 0)}
    for name, (losses, warnings) in cases.items():
        caplog.clear()
        with caplog.at_level("WARNING", logger="vramfit"):
            for n in range(1, len(losses) + 1):
                progress.rising_loss(losses[:n])
        said = [r.getMessage() for r in caplog.records if "rose" in r.getMessage()]
        assert len(said) == warnings, name
        assert all("lower --lr" in m and "labels" in m for m in said)
