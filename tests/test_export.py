"""`vramfit export`: ONNX equal to the torch model on real images, TorchScript and safetensors that load
back, the model card, and the Hub push in timm's format (against a stand-in for the Hub)."""
import json
import shutil
from pathlib import Path

import pytest
import torch

from _trained_runs import trained_run


@pytest.fixture(scope="module")
def run():
    return trained_run("a")


@pytest.fixture(scope="module")
def model(run):
    from vramfit.commands.trained import TrainedModel

    return TrainedModel(run.path, device="cpu")


@pytest.fixture(scope="module")
def real_images(model):
    """32 validation images of the run, through the run's own eval transform."""
    from vramfit.commands.eval import run_data_config
    from vramfit.commands.trained import ColumnItems
    from vramfit.data import load_splits
    from vramfit.data.decode import decode_image

    splits = load_splits(run_data_config(model))
    items = ColumnItems(splits.val.select(range(32)), splits.image_column)
    return torch.stack([model.transform(decode_image(item)) for item in items])


def test_onnx_matches_torch_on_real_images(run, model, real_images, tmp_path):
    from vramfit.commands.export import check_onnx, export_run

    written = export_run(run.path, ["onnx"], output=tmp_path)
    assert written["onnx"] == tmp_path / "model.onnx"
    assert check_onnx(written["onnx"], model.model, real_images) <= 1e-4  # batch 32: the batch dim is dynamic
    card = (tmp_path / "README.md").read_text()
    assert "## Results" in card and "## Memory" in card and "onnxruntime" in card and "library_name: timm" in card
    assert json.loads((tmp_path / "class_names.json").read_text()) == model.class_names
    assert json.loads((tmp_path / "preprocessing.json").read_text())["input_size"] == [3, 32, 32]


@pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated:FutureWarning")
def test_torchscript_and_safetensors_load_back(run, model, real_images, tmp_path):
    import timm

    from vramfit.commands.export import export_run

    export_run(run.path, ["torchscript", "safetensors"], output=tmp_path)
    with torch.inference_mode():
        want = model.model(real_images)
        scripted = torch.jit.load(str(tmp_path / "model.torchscript.pt")).eval()
        assert torch.allclose(scripted(real_images), want, atol=1e-5)
        again = timm.create_model(f"local-dir:{tmp_path}", pretrained=True).eval()
        assert torch.equal(again(real_images), want)
    assert again.pretrained_cfg["label_names"] == model.class_names
    assert "TorchScript" in (tmp_path / "README.md").read_text()


def test_unknown_format_and_nothing_to_export(run, capsys):
    from vramfit.cli import main
    from vramfit.commands.export import export_run
    from vramfit.errors import VramfitError

    with pytest.raises(SystemExit) as e:
        main(["export", "--run", str(run.path), "--format", "tflite"])
    assert e.value.code == 2 and "invalid choice: 'tflite'" in capsys.readouterr().err
    with pytest.raises(VramfitError, match="Unknown export format `tflite`"):
        export_run(run.path, ["tflite"])
    with pytest.raises(VramfitError, match="Nothing to export"):
        export_run(run.path, [])


class FakeHub:
    """Stands in for the Hub API timm's push uses: records what would be uploaded."""

    def __init__(self, tmp_path: Path):
        self.uploaded = tmp_path / "uploaded"
        self.calls = []

    def install(self, monkeypatch):
        from huggingface_hub import HfApi, RepoUrl

        def create_repo(api, repo_id, private=False, exist_ok=False, **kw):
            self.calls.append(("create_repo", repo_id, private))
            return RepoUrl(f"https://huggingface.co/{repo_id}")

        def upload_folder(api, repo_id, folder_path, commit_message=None, **kw):
            self.calls.append(("upload_folder", repo_id, commit_message))
            shutil.copytree(folder_path, self.uploaded)
            return f"https://huggingface.co/{repo_id}/commit/0"

        monkeypatch.setattr(HfApi, "create_repo", create_repo)
        monkeypatch.setattr(HfApi, "file_exists", lambda api, repo_id, filename, **kw: False)
        monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
        return self


def test_push_to_hub_in_timm_format(run, model, tmp_path, monkeypatch, capsys):
    from vramfit.cli import run as cli

    hub = FakeHub(tmp_path).install(monkeypatch)
    assert cli(["export", "--run", str(run.path), "--push-to-hub", "someone/digits-test", "--private"]) == 0
    assert ("create_repo", "someone/digits-test", True) in hub.calls
    files = {p.name for p in hub.uploaded.iterdir()}
    assert {"model.safetensors", "config.json", "README.md"} <= files
    config = json.loads((hub.uploaded / "config.json").read_text())
    assert config["label_names"] == model.class_names and config["pretrained_cfg"]["input_size"] == [3, 32, 32]
    card = (hub.uploaded / "README.md").read_text()
    assert "hf-hub:someone/digits-test" in card and "## Training" in card and "vramfit" in card
    assert "pushed to the Hub" in capsys.readouterr().out


def test_push_failure_is_a_clear_error(run, monkeypatch):
    from huggingface_hub import HfApi

    from vramfit.commands.export import export_run
    from vramfit.errors import VramfitError

    def offline(*a, **kw):
        raise ConnectionError("no route to huggingface.co")

    monkeypatch.setattr(HfApi, "create_repo", offline)
    with pytest.raises(VramfitError, match="Could not push") as e:
        export_run(run.path, [], push_to_hub="someone/x")
    assert "hf auth login" in e.value.hint
