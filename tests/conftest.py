import os
import tempfile
from pathlib import Path

import pytest

# Nothing may come from a hub during tests; the built-in dataset is written under a test cache.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("OMP_NUM_THREADS", "2")
# vramfit's own cache (the built-in data, the micro-batch and fit caches) is the session's: a
# measured choice cached by another session (another version of the code) must not decide a test.
os.environ.setdefault("VRAMFIT_CACHE", tempfile.mkdtemp(prefix="vramfit-test-cache-"))


@pytest.fixture
def train_cli(tmp_path):
    """Run `vramfit train` in-process; returns (run_dir, exit_code)."""
    from vramfit.cli import run

    def _run(*args, run_name="t", output=None):
        out = Path(output or tmp_path / "runs")
        argv = ["train", "--output", str(out), "--run-name", run_name, *args]
        try:
            code = run(argv)
        except SystemExit as e:
            code = e.code
        return out / run_name, code

    return _run


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """Each in-process run builds its own Accelerator (precision, cpu) as a new process would."""
    yield
    from vramfit.launch import forget

    forget()
