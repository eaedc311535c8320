import os
import sys
import tempfile
from pathlib import Path

import pytest

# Nothing may come from a hub during tests; the built-in dataset is written under a test cache.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")


def pytest_configure(config):
    """The suite runs on pytest-xdist workers (pyproject's addopts: `-n auto`, a test file per
    worker): each worker's torch gets its share of the cores, so two workers training at once do
    not fight over them. The controller sets nothing, or its workers would inherit it as if the
    user had set it."""
    if getattr(config, "workerinput", None) is None and config.getoption("numprocesses", default=None):
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, min(2, cores // workers))))
    # vramfit's own cache (the built-in data, the micro-batch and fit caches) is the worker's: a
    # measured choice cached by another session (another version of the code) or by a test on the
    # other worker (whose order is not fixed) must not decide a test.
    os.environ.setdefault("VRAMFIT_CACHE", tempfile.mkdtemp(prefix=f"vramfit-test-cache-{worker}-"))


@pytest.fixture(scope="session")
def test_resnet_weights(tmp_path_factory):
    """A test_resnet weight file (10 classes) for `model.pretrained_path`: what staged fine-tuning
    starts from (it runs only on trained weights)."""
    from helpers import weight_file

    return weight_file(tmp_path_factory.mktemp("weights"))


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
    from vramfit.runtime.launch import forget

    forget()


@pytest.fixture(autouse=True)
def _torch_threads_as_set():
    """Each test starts with the torch threads the worker was given: an in-process run that takes
    its environment for a launcher's (a test that sets ACCELERATE_* or LOCAL_RANK) gives itself the
    cores back, and a reference run after it would otherwise compute with another thread count
    than the subprocess it is compared with bit for bit."""
    yield
    torch = sys.modules.get("torch")
    if torch is not None and os.environ.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
