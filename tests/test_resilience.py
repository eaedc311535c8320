"""Nothing is lost: exact resume (and its negative control), atomic saves under SIGKILL, real signals,
non-finite losses, refused resumes, and secrets that never reach the run folder."""
import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from safetensors.torch import load_file

from helpers import last_weights, same_weights, tiny_args, wait_for_lines, wait_for_text
from vramfit.store import checkpoint


def _weights(run_dir):
    steps = checkpoint.list_steps(run_dir / "checkpoints")
    return load_file(steps[-1][1] / "model.safetensors")


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _losses(run_dir):
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["train/loss"] for r in rows if r["kind"] == "train"]


ARGS = tiny_args("--epochs", "2", "--set", "train.log_every_steps=1", "--set", "model.drop_rate=0.2")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run every resumed run must reproduce bit for bit."""
    from vramfit.cli import run

    out = tmp_path_factory.mktemp("ref")
    try:
        code = run(["train", *ARGS, "--output", str(out), "--run-name", "ref"])
    except SystemExit as e:
        code = e.code
    assert code == 0
    from vramfit.runtime.launch import forget

    forget()
    return out / "ref"


def test_two_interruptions_in_one_epoch(train_cli, reference):
    for stop in (8, 20):
        run_dir, code = train_cli(*ARGS, "--set", f"debug.signal_at_step={stop}", run_name="cut")
        assert code == 143
    run_dir, code = train_cli(*ARGS, run_name="cut")
    assert code == 0
    assert _same(_weights(reference), _weights(run_dir))
    assert _losses(run_dir) == _losses(reference)


def test_negative_control_detects_a_lost_data_position(train_cli, reference, monkeypatch):
    run_dir, code = train_cli(*ARGS, "--set", "debug.signal_at_step=12", run_name="lost")
    assert code == 143
    from vramfit import data

    original = data.StepBatchSampler.set_epoch
    monkeypatch.setattr(data.StepBatchSampler, "set_epoch",
                        lambda self, epoch, start_step=0: original(self, epoch, 0))  # forget the position
    run_dir, code = train_cli(*ARGS, run_name="lost")
    assert code == 0
    assert not _same(_weights(reference), _weights(run_dir))


def test_damaged_newest_checkpoint_is_skipped(train_cli, caplog):
    args = tiny_args("--set", "checkpoint.every_steps=5", "--set", "checkpoint.keep_last=3")
    run_dir, code = train_cli(*args, "--set", "debug.signal_at_step=15", run_name="dmg")
    assert code == 143
    steps = checkpoint.list_steps(run_dir / "checkpoints")
    assert [s for s, _ in steps] == [5, 10, 15]
    (steps[-1][1] / "model.safetensors").write_bytes(b"garbage")  # damaged after the fact
    (run_dir / "checkpoints" / ".tmp-step-20").mkdir()  # a save that never finished
    assert checkpoint.latest(run_dir / "checkpoints") == steps[-2][1]
    run_dir, code = train_cli(*args, run_name="dmg")
    assert code == 0
    assert not (run_dir / "checkpoints" / ".tmp-step-20").exists()
    assert "skipping damaged checkpoint" in caplog.text
    state = json.loads((run_dir / "summary.json").read_text())
    assert state["finished"]


def test_injected_nan_stops_before_the_update(train_cli, capsys):
    from vramfit.errors import VramfitError

    with pytest.raises(VramfitError) as e:
        train_cli(*tiny_args("--set", "checkpoint.every_steps=2", "--set", "debug.nan_at_step=3"), run_name="nan")
    msg = str(e.value)
    assert "Non-finite loss" in msg and "global step 3" in msg and "step-2" in msg and "Sample ids" in msg
    assert e.value.exit_code == 4


def test_structural_change_is_refused(train_cli):
    from vramfit.errors import VramfitError

    run_dir, code = train_cli(*tiny_args("--set", "debug.signal_at_step=5"), run_name="chg")
    assert code == 143
    with pytest.raises(VramfitError) as e:
        train_cli(*tiny_args("--lr", "0.5"), run_name="chg")
    assert "lr" in str(e.value) and "allow_resume_change" in str(e.value)
    run_dir, code = train_cli(*tiny_args("--lr", "0.5", "--set", "allow_resume_change=true"), run_name="chg")
    assert code == 0


KILL_DURING_SAVE = textwrap.dedent("""
    import os, signal, sys
    from vramfit.store import checkpoint
    real = checkpoint._sha256
    def killer(path):
        if ".tmp-step-20" in str(path):  # half-way through writing the second checkpoint
            os.kill(os.getpid(), signal.SIGKILL)
        return real(path)
    checkpoint._sha256 = killer
    from vramfit.cli import main
    main(sys.argv[1:])
""")


def test_sigkill_during_save_leaves_previous_checkpoint(tmp_path, train_cli, caplog):
    args = ["train", *tiny_args("--set", "checkpoint.every_steps=10"), "--output", str(tmp_path), "--run-name", "k"]
    proc = subprocess.run([sys.executable, "-c", KILL_DURING_SAVE, *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL
    ckpts = tmp_path / "k" / "checkpoints"
    assert (ckpts / ".tmp-step-20").exists()
    assert checkpoint.latest(ckpts) == ckpts / "step-10" and checkpoint.is_complete(ckpts / "step-10")
    with caplog.at_level("INFO"):
        _, code = train_cli(*args[1:-4], output=tmp_path, run_name="k")
    assert code == 0
    resumed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Resumed from")]
    assert resumed and "step-10" in resumed[0]
    assert "epoch 1/1 continues after its step 10/30" in resumed[0]  # the progress lines' numbering


# A loader worker learns that its trainer died only when it next checks (every 5 s; later under
# load): here it never does, so it outlives the trainer for as long as the test needs.
ORPHANED_WORKERS = textwrap.dedent("""
    import sys
    from torch.utils.data._utils import worker
    worker.ManagerWatchdog.is_alive = lambda self: True
    from vramfit.cli import main
    main(sys.argv[1:])
""")


def test_sigkill_rerun_at_once_resumes_while_its_orphaned_loader_worker_lives(tmp_path, train_cli):
    """SIGKILL mid-epoch, the same command rerun at once: a forked loader worker of the killed run is
    still alive, and it must not hold the run folder's lock (the rerun resumes, exit 0, and ends bitwise
    equal to an uninterrupted run)."""
    short = ("--set", "train.log_every_steps=1", "--set", "data.limit_train_samples=160",
             "--set", "data.limit_val_samples=32", "--set", "checkpoint.every_steps=2")
    ref, code = train_cli(*tiny_args(*short), run_name="ref", output=tmp_path)
    assert code == 0
    args = ["train", *tiny_args(*short, "--set", "data.num_workers=1"), "--output", str(tmp_path),
            "--run-name", "k"]
    proc = subprocess.Popen([sys.executable, "-c", ORPHANED_WORKERS, *args], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers = []
    try:
        wait_for_lines(tmp_path / "k" / "metrics.jsonl", 5)
        workers = [int(p) for p in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                                                  text=True).stdout.split()]
        proc.kill()  # mid-epoch (10 steps per epoch)
        proc.wait()
        assert workers and all(os.path.exists(f"/proc/{pid}") for pid in workers), "a worker outlives the run"
        assert checkpoint.latest(tmp_path / "k" / "checkpoints") is not None
        run_dir, code = train_cli(*args[1:-4], run_name="k", output=tmp_path)
        assert code == 0
    finally:
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert _same(_weights(ref), _weights(run_dir))
    assert _losses(run_dir)[-5:] == _losses(ref)[-5:]


def test_real_sigterm_with_workers_saves_and_resumes_exactly(tmp_path, train_cli):
    """A real SIGTERM to a run whose batches come from 2 loader workers: saved mid-epoch, resumed,
    and equal bit for bit to a run without workers (a sample's augmentation is seeded by the
    sample, not by the worker that made it)."""
    # 60 steps: the hangup lands mid-epoch even where 10 steps take a fraction of a second
    short = ("--set", "train.log_every_steps=1", "--set", "data.limit_train_samples=960")
    ref, code = train_cli(*tiny_args(*short), run_name="ref", output=tmp_path)
    assert code == 0
    args = ["train", *tiny_args(*short, "--set", "data.num_workers=2"), "--output", str(tmp_path)]
    cmd = [sys.executable, "-m", "vramfit.cli"]
    proc = subprocess.Popen(cmd + args + ["--run-name", "sig"], cwd=tmp_path, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    wait_for_lines(tmp_path / "sig" / "metrics.jsonl", 5)
    os.kill(proc.pid, signal.SIGTERM)  # mid-epoch (15 steps per epoch)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-2000:]
    saved = checkpoint.latest(tmp_path / "sig" / "checkpoints")
    assert saved is not None and 5 <= checkpoint.read_state(saved)["global_step"] < 60
    again = subprocess.run(cmd + args + ["--run-name", "sig"], cwd=tmp_path, capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert _same(_weights(tmp_path / "ref"), _weights(tmp_path / "sig"))


def _on_a_terminal(cmd: list[str], cwd) -> tuple[subprocess.Popen, int, "threading.Event"]:
    """`cmd` as a job in a terminal of its own (a pseudo-terminal that is its controlling terminal,
    as an ssh session's is); what it prints is read and dropped. Closing the returned master fd is
    closing the terminal's window: the kernel hangs the terminal up and sends SIGHUP to the job."""
    import fcntl
    import pty
    import select
    import termios
    import threading

    master, slave = pty.openpty()
    proc = subprocess.Popen(cmd, cwd=cwd, stdin=slave, stdout=slave, stderr=slave, start_new_session=True,
                            preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))
    os.close(slave)
    done = threading.Event()

    def drain():
        while not done.is_set():
            if select.select([master], [], [], 0.1)[0]:
                try:
                    os.read(master, 65536)
                except OSError:
                    return

    threading.Thread(target=drain, daemon=True).start()
    return proc, master, done


@pytest.mark.slow  # 60 steps twice and a resume: CI runs it with the slow tests
def test_a_closed_terminal_saves_and_the_same_command_resumes_exactly(tmp_path, train_cli):
    """The terminal of a run (and of its 2 loader workers) is closed mid-epoch: SIGHUP. The run saves
    the last completed step although nothing can be printed any more, exits 129, and the same
    command resumes it to the weights of a run never interrupted."""
    # 60 steps: the hangup lands mid-epoch even where 10 steps take a fraction of a second
    short = ("--set", "train.log_every_steps=1", "--set", "data.limit_train_samples=960")
    ref, code = train_cli(*tiny_args(*short), run_name="ref", output=tmp_path)
    assert code == 0
    args = ["train", *tiny_args(*short, "--set", "data.num_workers=2"), "--output", str(tmp_path),
            "--run-name", "hup"]
    cmd = [sys.executable, "-m", "vramfit.cli", *args]
    proc, master, reading = _on_a_terminal(cmd, tmp_path)
    wait_for_lines(tmp_path / "hup" / "metrics.jsonl", 5)
    reading.set()
    time.sleep(0.2)
    os.close(master)  # the window closes
    assert proc.wait(timeout=120) == 128 + signal.SIGHUP
    saved = checkpoint.latest(tmp_path / "hup" / "checkpoints")
    assert saved is not None and 5 <= checkpoint.read_state(saved)["global_step"] < 60
    again = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "Resumed from" in again.stderr
    assert _same(_weights(tmp_path / "ref"), _weights(tmp_path / "hup"))


def test_secrets_never_reach_the_run_folder(tmp_path):
    pytest.importorskip("wandb")
    sentinel = "sentinel-3f9a1c7e5b2d4a6f8e0c1b3d5f7a9c2e4b6d8f0a"
    env = {**os.environ, "WANDB_API_KEY": sentinel, "WANDB_MODE": "offline", "HF_TOKEN": sentinel + "hf"}
    args = ["train", *tiny_args("--tracker", "wandb"), "--output", str(tmp_path), "--run-name", "w"]
    proc = subprocess.run([sys.executable, "-m", "vramfit.cli", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = [p for p in (tmp_path / "w").rglob("*") if p.is_file()]
    assert any("wandb" in str(p) for p in files), "the offline W&B run is inside the run folder"
    for p in files:
        assert sentinel.encode() not in p.read_bytes(), p
    assert sentinel not in proc.stderr and sentinel not in proc.stdout
    # The run's final figures reach the W&B run summary (`best_accuracy` is never a logged metric,
    # so its name in the offline run file comes from the summary).
    (run_file,) = (tmp_path / "w").rglob("run-*.wandb")
    assert b"best_accuracy" in run_file.read_bytes() and b"wall_seconds" in run_file.read_bytes()


def test_signal_between_micro_batches_undoes_the_step_and_resumes_exactly(train_cli):
    """Accumulation 4 with dropout and drop-path: a signal before the second micro-batch of step 7
    abandons that step on the spot (gradients and RNG put back), saves step 6, exits 143; the resumed
    run redoes step 7 and ends bitwise equal to an uninterrupted run."""
    args = tiny_args("--micro-batch", "4", "--set", "model.drop_rate=0.2", "--set", "model.drop_path_rate=0.1",
                     "--set", "train.log_every_steps=1")
    ref, code = train_cli(*args, run_name="ref")
    assert code == 0
    run_dir, code = train_cli(*args, "--set", "debug.signal_in_step=7", run_name="cut")
    assert code == 143
    (step, path), = checkpoint.list_steps(run_dir / "checkpoints")
    assert step == 6 and checkpoint.read_state(path)["global_step"] == 6
    assert len(_losses(run_dir)) == 6  # step 7 was never logged: it did not happen
    run_dir, code = train_cli(*args, run_name="cut")
    assert code == 0
    assert _losses(run_dir) == _losses(ref)
    assert _same(_weights(ref), _weights(run_dir))


def test_a_written_but_unrenamed_checkpoint_is_completed_not_discarded(train_cli):
    run_dir, code = train_cli(*tiny_args("--set", "debug.signal_at_step=3"), run_name="r")
    assert code == 143
    ckpts = run_dir / "checkpoints"
    os.rename(ckpts / "step-3", ckpts / ".tmp-step-3")  # killed between the old copy's removal and the rename
    assert checkpoint.latest(ckpts, cleanup=True) == ckpts / "step-3"
    assert checkpoint.is_complete(ckpts / "step-3") and not (ckpts / ".tmp-step-3").exists()


class _Evil:
    """A pickle that would create a folder if it were ever unpickled with weights_only=False."""

    def __init__(self, target):
        self.target = target

    def __reduce__(self):
        return (os.makedirs, (self.target,))


def test_checkpoints_load_with_weights_only(train_cli, tmp_path):
    run_dir, code = train_cli(*tiny_args("--set", "debug.signal_at_step=3"), run_name="w")
    assert code == 143
    ckpt = run_dir / "checkpoints" / "step-3"
    target = tmp_path / "pwned"
    torch.save({"state": _Evil(str(target)), "param_groups": []}, ckpt / "optimizer.bin")
    # Re-vouch for the swapped file, as a program writing into the folder could.
    marker = json.loads((ckpt / checkpoint.MARKER).read_text())
    marker["files"]["optimizer.bin"] = checkpoint._sha256(ckpt / "optimizer.bin")
    (ckpt / checkpoint.MARKER).write_text(json.dumps(marker))
    from vramfit.errors import VramfitError

    with pytest.raises(VramfitError, match="Could not load checkpoint") as e:
        train_cli(*tiny_args(), run_name="w")
    assert "Unpickl" in e.value.message and not target.exists()  # refused, not executed
    assert "--resume never" not in e.value.hint and "--run-name NEW" in e.value.hint  # (never would refuse)
    run_dir, code = train_cli(*tiny_args(), run_name="w-new")  # the hint, followed
    assert code == 0


def _fake_scaler_skips(monkeypatch, pattern):
    """Make the optimizer report GradScaler skips (fp16 needs CUDA; the counting does not)."""
    from accelerate.optimizer import AcceleratedOptimizer

    calls = [0]

    def skipped(self):
        calls[0] += 1
        return pattern(calls[0])
    monkeypatch.setattr(AcceleratedOptimizer, "step_was_skipped", property(skipped))


def test_scaler_skips_are_counted(train_cli, monkeypatch):
    _fake_scaler_skips(monkeypatch, lambda n: n % 3 == 0)  # every third step skipped
    run_dir, code = train_cli(*tiny_args(), run_name="skips")
    assert code == 0
    assert json.loads((run_dir / "summary.json").read_text())["skipped_steps"] == 10  # of 30


def test_consecutive_scaler_skips_stop_the_run(train_cli, monkeypatch):
    from vramfit.errors import VramfitError

    _fake_scaler_skips(monkeypatch, lambda n: n >= 4)  # diverges from step 4 on
    with pytest.raises(VramfitError, match="5 optimizer steps in a row were skipped") as e:
        train_cli(*tiny_args("--set", "train.max_consecutive_skipped_steps=5"), run_name="div")
    assert e.value.exit_code == 4 and "bf16" in e.value.hint


def test_signal_during_evaluation_saves_the_trained_epoch(train_cli, reference):
    """A long evaluation is no reason to lose an epoch: the signal is agreed between evaluation
    batches, the epoch's trained state is saved, and the resumed run evaluates and goes on exactly."""
    run_dir, code = train_cli(*ARGS, "--set", "debug.signal_in_eval=1", run_name="evalcut")
    assert code == 143
    (step, path), = checkpoint.list_steps(run_dir / "checkpoints")
    state = checkpoint.read_state(path)
    assert step == 30 and (state["epoch"], state["step_in_epoch"]) == (0, 30)
    assert _evals(run_dir) == []
    run_dir, code = train_cli(*ARGS, run_name="evalcut")
    assert code == 0
    assert _same(_weights(reference), _weights(run_dir))
    assert _losses(run_dir) == _losses(reference)
    assert _evals(run_dir) == _evals(reference)


@pytest.mark.slow  # over 15 s; CI runs the slow selection as well
def test_a_stop_signal_while_the_run_is_set_up_says_so_and_the_saved_checkpoint_resumes(train_cli, reference,
                                                                                         tmp_path):
    """A stop signal before the first step (torch loading, the data read, the model built) has no
    step to save: the command ends at once with a line saying so, 128 + signal, no traceback, and
    the run's checkpoint from before is untouched: the same command then resumes it bitwise."""
    run_dir, code = train_cli(*ARGS, "--set", "debug.signal_at_step=12", run_name="setup", output=tmp_path)
    assert code == 143
    cmd = [sys.executable, "-m", "vramfit.cli", "train", *ARGS, "--output", str(tmp_path),
           "--run-name", "setup"]
    # HUP's stderr is a file: after a hangup, output into a terminal or a pipe is dropped.
    for signum, stage in ((signal.SIGTERM, "starting (importing torch"), (signal.SIGHUP, "reading the data"),
                          (signal.SIGINT, "building test_resnet")):
        err_file = tmp_path / f"err-{signum}.txt"
        with open(err_file, "w") as err:
            proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=err)
            try:
                wait_for_text(err_file, stage)
                os.kill(proc.pid, signum)
                assert proc.wait(timeout=60) == 128 + signum
            finally:
                if proc.poll() is None:
                    proc.kill()
        text = " ".join(err_file.read_text().split())
        said = f"vramfit: stopped by {signal.Signals(signum).name} before training began"
        assert said in text, text[-2000:]
        assert "nothing to save" in text and "Traceback" not in text and "step 13/" not in text
        assert [s for s, _ in checkpoint.list_steps(run_dir / "checkpoints")] == [12]
    run_dir, code = train_cli(*ARGS, run_name="setup", output=tmp_path)
    assert code == 0
    assert same_weights(last_weights(reference), last_weights(run_dir))
    assert _losses(run_dir) == _losses(reference)


def _evals(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["epoch"], r["val/accuracy"]) for r in rows if r["kind"] == "eval"]


def test_the_record_after_a_crash_and_resume_is_the_uninterrupted_runs(train_cli, reference):
    """A run that dies between saves (here a NaN stop, exit 4, at step 14; the last save was step
    10) leaves lines for steps its checkpoint does not hold. The resumed run drops them first, so
    metrics.jsonl records each step once, with the uninterrupted run's figures."""
    from vramfit.errors import VramfitError

    args = (*ARGS, "--set", "checkpoint.every_steps=10")
    with pytest.raises(VramfitError):
        train_cli(*args, "--set", "debug.nan_at_step=14", run_name="crash")
    run_dir, code = train_cli(*args, run_name="crash")
    assert code == 0

    def record(d):
        rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
        return [(r["kind"], r["step"], r.get("train/loss"), r.get("val/accuracy")) for r in rows]

    assert record(run_dir) == record(reference)


def test_a_second_run_into_a_held_run_folder_stops_naming_the_first(tmp_path, train_cli, capsys):
    """The same command started twice: the second exits 2 at once, naming the run that holds the
    folder, and writes nothing into it; once the first ends (here: killed) the folder is free."""
    from vramfit.cli import main
    from vramfit.store.runfolder import RunPaths

    lock = RunPaths.at(tmp_path / "runs" / "twice").lock
    lock.parent.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, time
        f = open({str(lock)!r}, "a+")
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write("pid 4242 on elsewhere, since earlier"); f.flush()
        print("held", flush=True)
        time.sleep(120)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(SystemExit) as e:
            main(["train", *tiny_args(), "--output", str(tmp_path / "runs"), "--run-name", "twice"])
        err = " ".join(capsys.readouterr().err.split())
        assert e.value.code == 2 and "is in use by another run (pid 4242 on elsewhere" in err
        assert sorted(p.name for p in lock.parent.iterdir()) == [".vramfit.lock"]
    finally:
        holder.kill()  # SIGKILL: the OS drops its lock
        holder.wait()
    run_dir, code = train_cli(*tiny_args("--set", "data.limit_train_samples=32", "--set", "data.limit_val_samples=16"),
                              run_name="twice")
    assert code == 0 and "pid " in lock.read_text()


@pytest.mark.slow
def test_sigkill_at_random_points_of_twenty_saves_never_loses_the_run(tmp_path, train_cli):
    """A save every step and a SIGKILL at a random moment of one, twenty times over: every restart
    with `--resume auto` continues, and the run ends with the weights and the metrics record of a
    run that was never killed."""
    import random

    args = tiny_args("--set", "checkpoint.every_steps=1", "--set", "train.log_every_steps=1",
                     "--set", "data.limit_train_samples=960")
    ref, code = train_cli(*args, run_name="ref", output=tmp_path)
    assert code == 0
    rng, run_dir = random.Random(0), tmp_path / "killed"
    cmd = [sys.executable, "-m", "vramfit.cli", "train", *args, "--output", str(tmp_path), "--run-name", "killed"]
    kills = 0
    while kills < 20:
        proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        ckpts, start = run_dir / "checkpoints", checkpoint.list_steps(run_dir / "checkpoints")
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None and checkpoint.list_steps(ckpts) == start:
            time.sleep(0.01)  # until this launch has trained and saved once
        if proc.poll() is not None:
            break  # it finished before it could be killed again
        # One step and its save, timed on this machine as it is now (a fixed delay let a fast
        # machine run many steps between kills, and the run ended before twenty of them).
        saved, t0 = checkpoint.list_steps(ckpts), time.time()
        while time.time() < deadline and proc.poll() is None and checkpoint.list_steps(ckpts) == saved:
            time.sleep(0.005)
        if proc.poll() is not None:
            break
        time.sleep(rng.uniform(0.0, time.time() - t0))  # somewhere in the next step or its save
        proc.kill()
        proc.wait()
        kills += 1
        assert checkpoint.latest(ckpts) is not None  # always a complete checkpoint to go on from
    assert kills >= 10
    final = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert final.returncode == 0, final.stderr[-2000:]
    assert _same(load_file(ref / "model" / "model.safetensors"), load_file(run_dir / "model" / "model.safetensors"))

    def record(d):
        rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
        return [(r["kind"], r["step"], r.get("train/loss")) for r in rows]

    assert record(run_dir) == record(ref)
