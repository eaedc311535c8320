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
