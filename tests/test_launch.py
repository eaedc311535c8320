"""The process a run lives in: torch threads under launchers, and what a launcher does to errors."""
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from helpers import REPO, readme_launch, wait_for_lines

PROBE = ("import torch\nfrom vramfit.runtime.launch import set_threads\n"
         "print('THREADS', set_threads(1), torch.get_num_threads())\n")


def _launch(tmp_path, env, *args):
    script = tmp_path / "threads.py"
    script.write_text(PROBE)
    return subprocess.run([sys.executable, "-m", "accelerate.commands.launch", *args, str(script)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs a machine with more than one core")
def test_accelerate_launch_trains_on_the_cores_unless_the_user_chose(tmp_path):
    """`accelerate launch` (no config) sets OMP_NUM_THREADS=1 for the script; vramfit gives the
    process its share of the cores again. A value the user set is kept."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    proc = _launch(tmp_path, env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert int(proc.stdout.split()[-1]) > 1, proc.stdout
    proc = _launch(tmp_path, {**env, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0 and int(proc.stdout.split()[-1]) == 1, proc.stdout


def test_a_user_error_under_accelerate_launch_quiet_is_only_the_message(tmp_path):
    """`accelerate launch` turns any non-zero exit of the script into its own traceback (exit 1);
    with `-q` it exits 1 quietly, so the user sees vramfit's message alone (docs/distributed.md)."""
    launch = readme_launch()  # the README's own flags
    accelerate = [sys.executable, "-c", "from accelerate.commands.accelerate_cli import main; main()"]
    proc = subprocess.run([*accelerate, launch[0], "--num_processes", "1", "--cpu", *launch[1:], "--data",
                           str(tmp_path / "missing"), "--output", str(tmp_path / "runs")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.count("vramfit: error:") == 1 and "HINT:" in proc.stderr
    # The same mistake without the launcher exits 2 with the message alone:
    # tests/test_train.py::test_bad_input_is_one_paragraph_not_a_traceback[missing-...].


def test_killing_the_launcher_saves_and_the_rerun_resumes_bitwise(tmp_path, train_cli):
    """`kill <accelerate launch pid>` (what `docker stop` and a preemption do): the launcher dies
    without passing the signal on; the trainer still hears it (the parent-death signal), saves the
    last completed step and stops with its own message (exit 143, which only the dead launcher could
    have read), and the same command then resumes to the weights of a run that was never stopped."""
    import json
    import signal

    import psutil
    from safetensors.torch import load_file

    from helpers import tiny_args
    from vramfit.store import checkpoint

    args = [*tiny_args("--set", "train.log_every_steps=1", "--set", "data.limit_train_samples=240"),
            "--output", str(tmp_path / "runs"), "--run-name", "k"]
    ref, code = train_cli(*args[:-4], run_name="ref", output=tmp_path / "ref")
    assert code == 0
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "-q", "--cpu", "--num_processes", "1",
           str(REPO / "train.py"), *args]
    launcher = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_for_lines(tmp_path / "runs" / "k" / "metrics.jsonl", 4)
    trainers = psutil.Process(launcher.pid).children(recursive=True)
    launcher.send_signal(signal.SIGTERM)
    launcher.wait(timeout=60)
    gone, alive = psutil.wait_procs(trainers, timeout=120)
    said = launcher.stderr.read()  # the trainer writes into the pipe the launcher left it
    codes = [p.returncode for p in gone]  # psutil's: the exit status, or -N for death by signal N
    assert not alive and len(gone) == 1 and "Stopped by signal 15 at global step" in said, (codes, said[-2000:])
    saved = checkpoint.latest(tmp_path / "runs" / "k" / "checkpoints")
    assert saved is not None and 4 <= checkpoint.read_state(saved)["global_step"] < 15
    assert not json.loads((tmp_path / "runs" / "k" / "summary.json").read_text())["finished"]
    again = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    ours, theirs = (load_file(d / "model" / "model.safetensors") for d in (tmp_path / "runs" / "k", ref))
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


@pytest.mark.slow  # three 2-process runs
def test_sigterm_to_torchrun_saves_on_every_process_and_the_rerun_resumes_bitwise(tmp_path):
    """`kill <torchrun pid>`: torchrun's agent passes SIGTERM on to its workers, which save the last
    completed step together and stop with their own message; torchrun itself then exits 1 with
    its SignalException (its own behaviour, out of the workers' reach). The same command resumes
    to the weights of a run that was never stopped."""
    import signal

    import psutil
    from safetensors.torch import load_file

    from helpers import tiny_args
    from vramfit.store import checkpoint

    def cmd(name):
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                str(REPO / "train.py"), *tiny_args("--set", "train.log_every_steps=1", "--set",
                                                   "data.limit_train_samples=240", "--set", "model.bn=freeze"),
                "--output", str(tmp_path / "runs"), "--run-name", name]

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ref = subprocess.run(cmd("ref"), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert ref.returncode == 0, ref.stderr[-2000:]
    launcher = subprocess.Popen(cmd("k"), cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True)
    wait_for_lines(tmp_path / "runs" / "k" / "metrics.jsonl", 4)
    trainers = psutil.Process(launcher.pid).children(recursive=True)
    launcher.send_signal(signal.SIGTERM)
    said = launcher.communicate(timeout=120)[1]
    gone, alive = psutil.wait_procs(trainers, timeout=60)
    assert not alive and len(gone) == 2 and "Stopped by signal 15 at global step" in said, said[-2000:]
    saved = checkpoint.latest(tmp_path / "runs" / "k" / "checkpoints")
    assert saved is not None and 4 <= checkpoint.read_state(saved)["global_step"] < 15
    again = subprocess.run(cmd("k"), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "Resumed from" in again.stderr, again.stderr[-2000:]
    ours, theirs = (load_file(tmp_path / "runs" / d / "model" / "model.safetensors") for d in ("k", "ref"))
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_python_dash_m_vramfit_and_its_version():
    import vramfit

    proc = subprocess.run([sys.executable, "-m", "vramfit", "--version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == f"vramfit {vramfit.__version__}"


def _gomp(env_extra: dict, code: str):
    """libgomp's own account of its settings (OMP_DISPLAY_ENV prints them when it loads)."""
    from vramfit.runtime.openmp import USER_KEYS

    env = {k: v for k, v in os.environ.items() if k not in USER_KEYS}
    proc = subprocess.run([sys.executable, "-c", code], env={**env, "OMP_DISPLAY_ENV": "VERBOSE", **env_extra},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    spin = [line.split("=")[1].strip(" '") for line in (proc.stdout + proc.stderr).splitlines()
            if line.strip().startswith("GOMP_SPINCOUNT")]
    return spin, proc.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="libgomp: torch's OpenMP on Linux")
def test_openmp_spins_briefly_unless_the_user_chose_a_wait():
    """The shared-CPU rule (bench/shared_cpu.py): libgomp, as it loads with torch, spins 10000
    times instead of 300000; a user's OMP_WAIT_POLICY or GOMP_SPINCOUNT is theirs; torch imported
    before the rule is applied keeps libgomp's default and says so."""
    code = "from vramfit.runtime import openmp; print(openmp.shorten_spin()); import torch; torch.ones(2)"
    spin, out = _gomp({}, code)
    assert spin == ["10000"] and "GOMP_SPINCOUNT" in out, (spin, out)
    spin, out = _gomp({"GOMP_SPINCOUNT": "5"}, code)
    assert spin == ["5"] and "as set (GOMP_SPINCOUNT=5)" in out, out
    spin, out = _gomp({"OMP_WAIT_POLICY": "ACTIVE"}, code)
    assert spin != ["10000"] and "OMP_WAIT_POLICY=ACTIVE" in out, (spin, out)
    spin, out = _gomp({}, "import torch; from vramfit.runtime import openmp; print(openmp.shorten_spin()); torch.ones(2)")
    assert spin == ["300000"] and "torch was imported before vramfit" in out, (spin, out)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="libgomp: torch's OpenMP on Linux")
def test_the_command_line_sets_the_wait_and_an_import_sets_nothing():
    """The rule is the entry's (cli.main: `vramfit`, `python -m vramfit`, train.py), before torch
    loads; a script that imports vramfit keeps its environment as it was."""
    code = ("import os; before = dict(os.environ)\n"
            "import vramfit, vramfit.cli, vramfit.runtime.openmp\n"
            "assert dict(os.environ) == before, set(os.environ.items()) ^ set(before.items())\n"
            "try:\n    vramfit.cli.main(['--version'])\nexcept SystemExit:\n    pass\n"
            "import torch; torch.ones(2)")
    spin, out = _gomp({}, code)
    assert spin == ["10000"] and out.startswith("vramfit "), (spin, out)


class _BusyItems(torch.utils.data.Dataset):
    """Samples that keep a worker's main thread in one long C call each (no Python code runs)."""

    def __len__(self):
        return 2

    def __getitem__(self, i):
        import hashlib

        hashlib.pbkdf2_hmac("sha256", b"x", b"salt", 8_000_000)  # about 2 s
        return i


@pytest.mark.skipif(not hasattr(signal, "SIGTSTP"), reason="POSIX job control")
def test_a_loader_worker_stopped_mid_sample_and_continued_keeps_loading():
    """Ctrl-Z reaches the trainer's group (its loader workers with it), and runtime/terminal.py stops the
    whole job and continues it on `fg`/`bg`. A worker that was in a long C call then must go on
    loading: with the trainer's Python Ctrl-Z handler inherited through fork, it would run that
    handler once continued, stop itself for good, and the trainer would wait on it forever."""
    import time

    import psutil

    from vramfit.data.workers import init_worker

    parent = os.getpid()

    def ctrl_z(_signum, _frame):  # as terminal.Foreground.stop_job treats a process forked from it
        if os.getpid() != parent:
            os.kill(os.getpid(), signal.SIGSTOP)

    old = signal.signal(signal.SIGTSTP, ctrl_z)
    worker = batches = None
    try:
        loader = torch.utils.data.DataLoader(_BusyItems(), num_workers=1, worker_init_fn=init_worker,
                                             prefetch_factor=1, timeout=30)
        before = {c.pid for c in psutil.Process().children()}  # an earlier test's workers may linger
        batches = iter(loader)
        (worker,) = [c for c in psutil.Process().children() if c.pid not in before]
        time.sleep(0.5)
        assert worker.status() == psutil.STATUS_RUNNING, "the worker should be in its first sample's hash"
        os.kill(worker.pid, signal.SIGTSTP)  # the terminal's Ctrl-Z (the kernel delivers it at once) ...
        time.sleep(0.1)
        os.kill(worker.pid, signal.SIGSTOP)  # ... and the trainer stopping its job before the worker ran Python
        time.sleep(0.2)
        os.kill(worker.pid, signal.SIGCONT)  # `fg`
        try:
            got = [int(b) for b in batches]
        except RuntimeError as e:  # the loader's timeout
            raise AssertionError(f"the worker is {worker.status()} after it was continued: {e}") from e
        assert got == [0, 1]
    finally:
        signal.signal(signal.SIGTSTP, old)
        if worker is not None and worker.is_running():  # a stopped worker would never see the loader end
            os.kill(worker.pid, signal.SIGCONT)
        del batches


def _shell_in_a_terminal(cwd):
    """An interactive bash (job control on) on a fresh pty, as a terminal window has it. Returns
    bash's process, the pty's master side and a list that fills with what the terminal shows."""
    import threading

    master, slave = os.openpty()
    env = {**{k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}, "PS1": "PROMPT$ ", "TERM": "dumb"}
    shell = subprocess.Popen(["bash", "--norc", "--noprofile", "-i"], cwd=cwd, env=env, stdin=slave, stdout=slave,
                             stderr=slave, start_new_session=True)  # bash takes the pty as its terminal
    os.close(slave)
    shown = []

    def read():
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: every process holding the terminal has ended
                return
            if not chunk:
                return
            shown.append(chunk.decode(errors="replace"))

    threading.Thread(target=read, daemon=True).start()
    return shell, master, shown


@pytest.mark.skipif(not shutil.which("bash"), reason="needs bash")
@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_ctrl_c_and_ctrl_z_under_accelerate_launch_in_a_terminal(tmp_path, workers):
    """The README's `accelerate launch -q` typed into an interactive shell: Ctrl-Z stops the whole
    job (the shell says Stopped and gives its prompt back), `fg` goes on training, and so do `bg`
    and `fg` after a second Ctrl-Z; Ctrl-C then
    reaches the trainer alone, which says so at once, saves, and has said "Stopped by signal 2"
    before the shell's prompt returns; no traceback. The checkpoint holds the last completed step."""
    import shlex
    import signal
    import time

    import psutil

    from helpers import tiny_args
    from vramfit.store import checkpoint

    run = tmp_path / "runs" / "k"
    launch = readme_launch()
    argv = [sys.executable, "-c", "from accelerate.commands.accelerate_cli import main; main()", launch[0],
            "--cpu", "--num_processes", "1", *launch[1:],
            *tiny_args("--set", "train.log_every_steps=1", "--set", "data.limit_train_samples=1437",
                       "--set", f"data.num_workers={workers}", "--epochs", "3"),
            "--output", str(tmp_path / "runs"), "--run-name", "k"]
    shell, master, shown = _shell_in_a_terminal(tmp_path)

    def rows():
        return len((run / "metrics.jsonl").read_text().splitlines()) if (run / "metrics.jsonl").exists() else 0

    def wait_for(cond, what, timeout=120):
        deadline = time.time() + timeout
        while time.time() < deadline and not cond():
            time.sleep(0.05)
        assert cond(), f"{what}\n{''.join(shown)[-3000:]}"

    try:
        wait_for(lambda: "PROMPT$ " in "".join(shown), "no prompt", 30)
        os.write(master, (shlex.join(argv) + "\n").encode())
        wait_for(lambda: rows() >= 3, "training did not start")
        (launcher,) = psutil.Process(shell.pid).children()
        (trainer,) = launcher.children()
        assert len(trainer.children()) == workers
        os.write(master, b"\x1a")  # Ctrl-Z
        wait_for(lambda: "Stopped" in "".join(shown), "the shell did not see the job stop", 20)
        job = [launcher, trainer, *trainer.children()]
        wait_for(lambda: all(p.status() == psutil.STATUS_STOPPED for p in job), "not all of the job stopped", 10)
        stopped_at = rows()
        time.sleep(1.0)
        assert rows() == stopped_at
        os.write(master, b"fg\n")
        wait_for(lambda: rows() >= stopped_at + 2, "training did not go on after `fg`")
        os.write(master, b"\x1a")  # stopped again, then on in the background, then in front again
        wait_for(lambda: "".join(shown).count("Stopped") >= 2, "the shell did not see the job stop again", 20)
        os.write(master, b"bg\n")
        at = rows()
        wait_for(lambda: rows() >= at + 2, "training did not go on after `bg`")
        os.write(master, b"fg\n")
        time.sleep(1.5)  # bash's `fg` of a running job sends no signal: the trainer looks twice a second
        at = rows()
        wait_for(lambda: rows() >= at + 1, "training did not go on after the last `fg`")
        mark = len("".join(shown))
        os.write(master, b"\x03")  # Ctrl-C
        wait_for(lambda: "PROMPT$ " in "".join(shown)[mark:], "the prompt did not come back")
        os.write(master, b"echo EXIT=$?; exit\n")
        shell.wait(timeout=30)
    finally:
        if shell.poll() is None:
            os.killpg(shell.pid, signal.SIGKILL)
    time.sleep(0.2)
    said = "".join(shown)
    after = said[mark:]
    assert "Traceback" not in said and "KeyboardInterrupt" not in said, said[-3000:]
    assert "signal 2 received" in after and "EXIT=1" in after, after[-3000:]
    assert after.index("Stopped by signal 2 at global step") < after.index("PROMPT$ "), after[-3000:]
    assert "[1]+  Stopped" in said[:mark]  # bash's own word for a stopped job
    saved = checkpoint.latest(run / "checkpoints")
    assert saved is not None and checkpoint.read_state(saved)["global_step"] >= stopped_at


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("rank, said", [(0, "waiting for 1 of 2 processes at 127.0.0.1:{port} (rank 0 here)"),
                                        (1, "waiting for rank 0 at 127.0.0.1:{port} (rank 1 here)")])
def test_a_process_whose_others_never_start_says_so_and_ends(rank, said, tmp_path):
    """Launched by hand with every variable set, but the other process never starts: the wait is
    said while it lasts (for whom, where) and ends with exit 2 (the wait set short here)."""
    import subprocess
    import sys

    from helpers import tiny_args

    port = _free_port()
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "VRAMFIT_RENDEZVOUS_SECONDS": "4"}
    cmd = [sys.executable, "-m", "vramfit.cli", "train", *tiny_args(), "--output", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert said.format(port=port) in proc.stderr and "HINT: start ranks 0 to 1" in proc.stderr
    assert "Traceback" not in proc.stderr and not any(tmp_path.iterdir())
