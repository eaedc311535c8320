"""timm model creation: weights from a local file, offline hub failures, freezing, BN policy."""
import pytest
import timm
import torch
from safetensors.torch import save_file

from vramfit.config import ModelConfig
from vramfit.errors import VramfitError
from vramfit.models.create import create_model


def test_pretrained_path_loads_backbone_and_resizes_head(tmp_path):
    src = timm.create_model("resnet18", pretrained=False, num_classes=1000)
    f = tmp_path / "resnet18.safetensors"
    save_file(src.state_dict(), f)
    model = create_model(ModelConfig(name="resnet18", pretrained_path=str(f)), num_classes=7)
    assert torch.equal(model.conv1.weight, src.conv1.weight)  # backbone from the file
    assert model.fc.weight.shape == (7, 512)  # head sized for our classes, not the file's 1000


def test_offline_hub_download_says_how_to_run_without_it(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(VramfitError) as e:
        create_model(ModelConfig(name="resnet18", pretrained=True), num_classes=3)
    assert "pretrained=false" in str(e.value) and "pretrained_path" in str(e.value)


def test_offline_hf_hub_name_says_what_works_offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # nothing cached
    with pytest.raises(VramfitError) as e:  # the architecture itself lives on the Hub: even a plan needs it
        create_model(ModelConfig(name="hf-hub:timm/resnet18.a1_in1k", pretrained=False), 3, load_weights=False)
    assert "Hugging Face Hub" in e.value.message and "local-dir:" in e.value.hint


def test_a_hub_cache_that_cannot_be_written_says_where_to_point_it(monkeypatch):
    # Stand-in for a download into a read-only HF cache (the real one needs the network): what
    # huggingface_hub raises when it cannot create the file it downloads into.
    def download_into_read_only_cache(*a, **k):
        raise PermissionError(13, "Permission denied", "/ro/hub/models--timm--resnet18.a1_in1k/blobs/1a2b.incomplete")

    monkeypatch.setattr(timm, "create_model", download_into_read_only_cache)
    with pytest.raises(VramfitError) as e:
        create_model(ModelConfig(name="resnet18", pretrained=True), num_classes=3)
    assert "/ro/hub/models--timm--resnet18.a1_in1k" in e.value.message and "cannot be written" in e.value.message
    assert "HF_HUB_CACHE" in e.value.hint and "HF_HOME" in e.value.hint and "pretrained_path" in e.value.hint


def test_an_unreadable_weight_file_is_named(tmp_path):
    f = tmp_path / "w.safetensors"
    save_file(timm.create_model("test_resnet", num_classes=3).state_dict(), f)
    f.chmod(0)
    cfg = ModelConfig(name="test_resnet", pretrained_path=str(f))
    import subprocess
    import sys

    # Permission bits do not bind root: read it as a user without the override capabilities.
    code = ("from vramfit.config import ModelConfig\nfrom vramfit.errors import VramfitError\n"
            "from vramfit.models.create import create_model\n"
            f"try:\n    create_model(ModelConfig(name='test_resnet', pretrained_path={str(f)!r}), 3)\n"
            "except VramfitError as e:\n    print(e.message)\n")
    proc = subprocess.run(["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--", sys.executable,
                           "-c", code], capture_output=True, text=True, timeout=120)
    assert f"model.pretrained_path `{cfg.pretrained_path}` cannot be read" in proc.stdout, proc.stderr[-2000:]


def test_local_dir_model_builds_offline(tmp_path):
    from vramfit.models.create import data_config, export

    src = create_model(ModelConfig(name="resnet18", pretrained=False), num_classes=4, load_weights=False)
    export(src, tmp_path / "m", ["a", "b", "c", "d"], data_config(src, 64))
    model = create_model(ModelConfig(name=f"local-dir:{tmp_path / 'm'}", pretrained=True), num_classes=4)
    assert torch.equal(model.conv1.weight, src.conv1.weight)


def test_missing_weight_file():
    with pytest.raises(VramfitError, match="does not exist"):
        create_model(ModelConfig(name="resnet18", pretrained_path="/nope.safetensors"), num_classes=3)


def test_freeze_bn_checkpointing_channels_last():
    cfg = ModelConfig(name="resnet18", freeze=["conv1", "bn1", "layer1"], bn="freeze",
                      grad_checkpointing=True, channels_last=True)
    model = create_model(cfg, num_classes=4, load_weights=False)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen and all(n.startswith(("conv1", "bn1", "layer1")) for n in frozen)
    assert model.layer2[0].conv1.weight.requires_grad
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())
    assert model.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    assert model.grad_checkpointing


def test_freeze_unknown_prefix_lists_modules():
    with pytest.raises(VramfitError) as e:
        create_model(ModelConfig(name="resnet18", freeze=["stem"]), num_classes=4, load_weights=False)
    assert "layer1" in str(e.value)


def test_unknown_model_suggests():
    with pytest.raises(VramfitError) as e:
        create_model(ModelConfig(name="efficientnet_bO"), num_classes=4)
    assert "efficientnet_b0" in str(e.value)


def test_channels_last_and_non_contiguous_weights_export_in_the_default_layout(tmp_path):
    """A channels_last model (and any strided tensor) is written as
    contiguous weights that plain timm loads in the default layout; the model itself stays as it
    trains. Strided: a transposed-in-memory classifier weight."""
    from safetensors.torch import load_file

    from vramfit.models.create import data_config, export

    model = create_model(ModelConfig(name="test_resnet", channels_last=True), num_classes=4, load_weights=False)
    model.fc.weight = torch.nn.Parameter(model.fc.weight.detach().t().contiguous().t())
    export(model, tmp_path / "m", list("abcd"), data_config(model, 32))
    name, conv = next((n, p) for n, p in model.named_parameters() if p.dim() == 4)
    assert conv.is_contiguous(memory_format=torch.channels_last)
    assert not conv.is_contiguous() and not model.fc.weight.is_contiguous()
    saved = load_file(tmp_path / "m" / "model.safetensors")
    assert all(t.is_contiguous() for t in saved.values())
    assert torch.equal(saved["fc.weight"], model.fc.weight)
    loaded = timm.create_model(f"local-dir:{tmp_path / 'm'}", pretrained=True).eval()
    loaded_conv = loaded.get_parameter(name)
    assert loaded_conv.is_contiguous() and torch.equal(loaded_conv, conv)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(loaded(x), model.eval()(x), atol=1e-5)


def test_fixed_size_models_are_built_for_the_run_image_size():
    """A ViT's position embeddings are built for the run's size (timm resamples pretrained ones as
    it loads them); a CNN takes any size and is built as it is."""
    vit = create_model(ModelConfig(name="test_vit"), num_classes=3, load_weights=False, image_size=64)
    assert vit.patch_embed.img_size == (64, 64)
    assert vit(torch.randn(1, 3, 64, 64)).shape == (1, 3)
    cnn = create_model(ModelConfig(name="test_resnet"), num_classes=3, load_weights=False, image_size=64)
    assert cnn(torch.randn(1, 3, 48, 48)).shape == (1, 3)
