import os
import sys
from pathlib import Path

import pytest

# Nothing may come from a hub during tests; the built-in dataset is written under a test cache.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("OMP_NUM_THREADS", "2")

REPO = Path(__file__).resolve().parents[1]

# The tensor methods that read a value back to the host: on a GPU each one waits for the device.
HOST_READS = ("item", "tolist", "__float__", "__int__", "__bool__")


class HostReads:
    """Records, while `on`, every call of the given tensor methods (`seen`); counted on a CPU, they
    are the waits a GPU would have (`torch.cuda.set_sync_debug_mode` shows the same there)."""

    def __init__(self, monkeypatch, names=HOST_READS, on: bool = False):
        import torch

        self.seen: list[str] = []
        self.on = on
        for name in names:
            monkeypatch.setattr(torch.Tensor, name, self._watch(getattr(torch.Tensor, name), name))

    def _watch(self, real, name):
        def watched(tensor, *args, **kwargs):
            if self.on:
                self.seen.append(name)
            return real(tensor, *args, **kwargs)
        return watched


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


TINY_STEPS_PER_EPOCH = 30  # 480 training images / global batch 16


def tiny_args(*extra):
    """A seeded tiny run on a 480/120 subset of the built-in digits: test_resnet at 32 px, no workers."""
    return ["--data", "digits", "--model", "test_resnet", "--image-size", "32", "--global-batch", "16",
            "--epochs", "1", "--set", "data.num_workers=0", "--set", "data.hflip=0",
            "--set", "data.val_fraction=0.2", "--set", "data.limit_train_samples=480",
            "--set", "data.limit_val_samples=120", *extra]


def python_cmd():
    return [sys.executable]


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """Each in-process run builds its own Accelerator (precision, cpu) as a new process would."""
    yield
    from vramfit.launch import forget

    forget()
