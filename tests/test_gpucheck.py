"""A recipe written for a GPU on a machine whose torch sees none stops at once, saying which of
the usual reasons it is and the fix; `hardware.allow_cpu` trains anyway."""
import pytest
import torch

from vramfit.runtime.gpucheck import driver_too_old, no_gpu_reason


@pytest.mark.parametrize("cuda, visible, driver, said", [
    (None, None, "550.54.14", "built without CUDA"),
    ("12.6", "", "550.54.14", "CUDA_VISIBLE_DEVICES='' hides every GPU"),
    ("12.6", "-1", None, "hides every GPU"),
    ("12.6", None, "470.82.01", "driver 470.82.01 is older than this torch's CUDA 12.6 needs (>= 525.60.13)"),
    ("12.6", None, None, "no NVIDIA driver answers"),
    ("12.6", "0", "550.54.14", "cannot use the GPU"),
])
def test_why_torch_sees_no_gpu(cuda, visible, driver, said):
    assert said in no_gpu_reason(cuda, visible, driver)


def test_a_new_enough_driver_is_not_too_old():
    assert driver_too_old("550.54.14", "12.6") is None and driver_too_old("525.60.13", "12.1") is None
    assert driver_too_old(None, "12.6") is None and driver_too_old("550.54.14", None) is None
    assert "older" in driver_too_old("450.80.02", "12.4")


def test_a_gpu_recipe_without_a_gpu_stops_before_anything_loads(tmp_path, capsys, monkeypatch):
    """Here torch has no CUDA device at all (this machine): exit 2 with the reason and the fix,
    before data or model; the quickstart (written for no card) is not affected."""
    from vramfit.cli import main

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(SystemExit) as e:
        main(["train", "--recipe", "rtx3060", "--data", str(tmp_path / "not-read"), "--output", str(tmp_path / "r")])
    err = " ".join(capsys.readouterr().err.split())
    assert e.value.code == 2 and "This recipe is written for NVIDIA GeForce RTX 3060, but torch sees no GPU" in err
    reason = "built without CUDA" if torch.version.cuda is None else "CUDA_VISIBLE_DEVICES='' hides every GPU"
    assert reason in err and "hardware.allow_cpu=true" in err and "Traceback" not in err
    assert not (tmp_path / "r").exists()  # nothing loaded, nothing written


def test_allow_cpu_trains_a_gpu_recipe_anyway(train_cli):
    from helpers import tiny_args

    run_dir, code = train_cli("--recipe", "rtx3060", *tiny_args(
        "--set", "hardware.allow_cpu=true", "--set", "model.pretrained=false", "--set", "data.limit_train_samples=32",
        "--set", "data.limit_val_samples=16", "--micro-batch", "16",
        "--set", "train.freeze_epochs=0"))  # one epoch: the recipe's staged head-only epoch would be all of it
    assert code == 0


@pytest.mark.parametrize("argv, prefix", [
    (["train.py", "--recipe", "rtx3060", "--data", "photos"], "accelerate launch -q train.py"),
    (["/venv/bin/vramfit", "train", "--recipe", "rtx3060", "--data", "photos"], "vramfit train"),
    (["pytest", "-q"], "vramfit train"),  # started some other way: the recipe and data from the config
], ids=["launcher", "script", "in-process"])
def test_the_stop_gives_one_complete_command_for_a_short_trial_here(monkeypatch, argv, prefix):
    """The HINT holds one command: the one that was run, plus what shrinks the recipe to a few
    minutes here; it parses into the same recipe (model, augmentation, precision, fit, staging) at
    64 px on a few hundred images, and that config passes the check."""
    import shlex

    from vramfit.cli import train_config
    from vramfit.errors import VramfitError
    from vramfit.runtime.gpucheck import check_gpu_recipe

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    cfg = train_config(["--recipe", "rtx3060", "--data", "photos"])
    with pytest.raises(VramfitError) as e:
        check_gpu_recipe(cfg, False, argv=argv)
    assert "--recipe quickstart" in e.value.message and "in a few minutes" in e.value.message
    command = e.value.hint.split("To try the recipe here first: ", 1)[1]
    words = shlex.split(command)
    assert " ".join(words).startswith(prefix + " ")
    trial = train_config(words[len(prefix.split()):])
    assert (trial.recipe, trial.data.source, trial.model.name) == ("rtx3060", "photos", "resnet50")
    for same in ("data.auto_augment", "train.precision", "train.fit", "train.compile", "model.pretrained",
                 "model.channels_last", "train.freeze_epochs"):
        section, key = same.split(".")
        assert getattr(getattr(trial, section), key) == getattr(getattr(cfg, section), key), same
    assert trial.hardware.allow_cpu and trial.data.image_size == 64
    assert (trial.train.epochs, trial.staged_epochs) == (2, 1)  # each phase one epoch
    assert trial.train.global_batch == 64 and trial.data.limit_train_samples == 4 * 64
    check_gpu_recipe(trial, False)  # the trial runs


def test_an_unreachable_hub_is_known_in_seconds(tmp_path):
    """Without network huggingface_hub retries every weight file for minutes; one short request says
    at once that the Hub does not answer, and the stop names the fixes. Real environment variables,
    a real closed port, offline mode not set."""
    import os
    import subprocess
    import sys

    script = """
import time
from vramfit.config import ModelConfig
from vramfit.errors import VramfitError
from vramfit.models.create import create_model
t = time.perf_counter()
try:
    create_model(ModelConfig(name="resnet18", pretrained=True), 10)
except VramfitError as e:
    print(f"{time.perf_counter() - t:.2f}")
    print(e)
"""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path / "hf"))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    seconds, said = out.stdout.split("\n", 1)
    assert float(seconds) < 10, out.stdout + out.stderr
    assert "Hugging Face Hub (http://127.0.0.1:9) does not answer" in said and "not in the local cache" in said
    assert "--set model.pretrained=false" in said and "model.pretrained_path" in said
    assert "Retrying in" not in out.stderr
