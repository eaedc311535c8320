"""The process a run lives in: torch threads under launchers, and what a launcher does to errors."""
import os
import subprocess
import sys

import pytest

from helpers import REPO

PROBE = "import torch\nfrom vramfit.launch import set_threads\nprint('THREADS', set_threads(1), torch.get_num_threads())\n"


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
    args = [str(REPO / "train.py"), "--data", str(tmp_path / "missing"), "--output", str(tmp_path / "runs")]
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "-q", "--num_processes", "1",
                           "--cpu", *args], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.count("vramfit: error:") == 1 and "HINT:" in proc.stderr
    # The same mistake without the launcher exits 2 with the message alone:
    # tests/test_train.py::test_bad_input_is_one_paragraph_not_a_traceback[missing-...].
