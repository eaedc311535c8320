"""Every shipped recipe trained end to end on the CPU with its own settings (precision,
channels_last, augmentation, mixup/cutmix, erasing, EMA, micro-batch, schedule), shrunk only in
size: a few digits at 32 px, one epoch (a staged recipe: one per phase, from a weight file), no
pretrained weights otherwise, and a tiny timm model of the same
family. It is stopped mid-epoch and resumed (bitwise against an uninterrupted run), then evaluated,
asked for predictions and exported; `model/` loads in plain timm. A recipe file added to
`src/vramfit/recipes/` is picked up here without editing this file.

`pytest -m slow tests/test_recipes.py` runs the same with each recipe's own model at 64 px."""
import json

import pytest
import torch
import yaml
from safetensors.torch import load_file

from vramfit.config import PACKAGE_RECIPES

RECIPES = sorted(PACKAGE_RECIPES.glob("*.yaml"))
# timm's tiny model of each family a recipe trains (same blocks, a few channels): a ResNet50 or a
# ViT-B step takes seconds on a CPU, these take milliseconds. A family without one trains its own.
TINY = {"resnet": "test_resnet", "efficientnet": "test_efficientnet", "vit": "test_vit"}
GLOBAL_BATCH, TRAIN, VAL = 8, 48, 16  # 6 steps of 8
# Mid-epoch, while fp16's loss scale is still coming down from 2**16 (the first 4 steps are skipped
# on these models): the resumed run applies its steps only if the scale was restored.
STOP_AT = 3


def recipe(path) -> dict:
    return yaml.safe_load(path.read_text())


def family(model_name: str) -> str:
    return model_name.split("_")[0].rstrip("0123456789")


def backbone_settings(tree: dict) -> list[str]:
    """What vramfit.models.backbones gives the recipe's own model (drop-path, the LR), as `--set`s that a
    tiny stand-in keeps; the image size is the test's."""
    from vramfit.models.backbones import fill_backbone_defaults

    filled = fill_backbone_defaults(tree)
    return [arg for section in ("model", "optim") for key, value in filled.get(section, {}).items()
            if key not in tree.get(section, {}) for arg in ("--set", f"{section}.{key}={value}")]


def shrunk(path, own_model: bool, image_size: int, weights_folder=None) -> list[str]:
    """The recipe as a user runs it, with only its size shrunk; a staged recipe starts from a weight
    file written into `weights_folder` (staging runs on trained weights only), the others from a
    random init (no network)."""
    from helpers import weight_file

    tree = recipe(path)
    name = tree["model"]["name"]
    model = name if own_model else TINY.get(family(name), name)
    staged = tree.get("train", {}).get("freeze_epochs", 0)
    epochs = 1 + staged  # a staged recipe: each phase one epoch
    weights = (["--set", f"model.pretrained_path={weight_file(weights_folder, model)}"]
               if staged and weights_folder else [])
    return [*backbone_settings(tree), "--recipe", str(path), "--data", "digits", "--model", model, "--epochs", str(epochs),
            "--global-batch", str(GLOBAL_BATCH), "--image-size", str(image_size),
            "--set", "model.pretrained=false", *weights, "--set", f"data.limit_train_samples={TRAIN}",
            "--set", f"data.limit_val_samples={VAL}", "--set", "data.val_fraction=0.2",
            "--set", "data.num_workers=0", "--set", "train.log_every_steps=1",
            # `micro_batch: auto` takes the whole share on a CPU; an out-of-memory error above half
            # of it splits every step in two, as on a card where the pick was too large:
            "--set", f"debug.simulate_oom_above={GLOBAL_BATCH // 2}",
            # a GPU recipe's fit measures its first candidate as on a card: a 6-step phase pays for
            # measuring (3 steps) from half its time on, where the recipe's 3% would skip it
            "--set", "train.fit_probe_fraction=0.5",
            # fp16 recipes run fp16 autocast with loss scaling, as on their card (not fp32):
            "--set", "debug.fp16_on_cpu=true",
            # a recipe written for a GPU refuses a machine without one unless told:
            "--set", "hardware.allow_cpu=true"]


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    from PIL import Image
    from sklearn.datasets import load_digits

    root = tmp_path_factory.mktemp("photos")
    digits = load_digits()
    paths = []
    for i in range(2):
        p = root / f"digit{digits.target[i]}.png"
        Image.fromarray((digits.images[i] * 15).astype("uint8")).convert("RGB").resize((40, 40)).save(p)
        paths.append(p)
    return paths


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _last_checkpoint(run_dir):
    return max((run_dir / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))


def _train_cut_and_resume(train_cli, args):
    ref, code = train_cli(*args, run_name="ref")
    assert code == 0, "the recipe's uninterrupted run failed"
    cut, code = train_cli(*args, "--set", f"debug.signal_at_step={STOP_AT}", run_name="cut")
    assert code == 143 and (cut / "checkpoints" / f"step-{STOP_AT}").is_dir()
    cut, code = train_cli(*args, run_name="cut")  # the same command resumes
    assert code == 0, "resuming the recipe failed"
    return ref, cut


def _check_resumed_exactly(ref, cut, uses_ema: bool):
    names = ["model.safetensors"] + (["ema.safetensors"] if uses_ema else [])
    for name in names:
        a, b = load_file(_last_checkpoint(ref) / name), load_file(_last_checkpoint(cut) / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    losses = [[m["train/loss"] for m in _metrics(d) if m["kind"] == "train"] for d in (ref, cut)]
    assert losses[0] == losses[1] and len(losses[0]) == json.loads((ref / "summary.json").read_text())["global_step"]


def _check_model_folder(run_dir, uses_ema: bool):
    """`model/` is the best weights (the EMA's where the recipe keeps one), in the default memory
    format, loaded by plain timm."""
    import timm

    model = timm.create_model(f"local-dir:{run_dir / 'model'}", pretrained=True).eval()
    best_step = json.loads((_last_checkpoint(run_dir) / "trainer_state.json").read_text())["best_step"]
    best = run_dir / "checkpoints" / f"step-{best_step}"
    want = load_file(best / ("ema.safetensors" if uses_ema else "model.safetensors"))
    got = load_file(run_dir / "model" / "model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert all(t.is_contiguous() for t in got.values())
    assert model.num_classes == 10 and json.loads((run_dir / "model" / "class_names.json").read_text())[0] == "0"
    return model


def _check_predictions(run_dir, model, photos, capsys):
    """`vramfit predict` gives what plain timm gives with the folder's own preprocessing."""
    import timm.data
    from PIL import Image

    from vramfit.cli import run

    capsys.readouterr()
    assert run(["predict", "--run", str(run_dir), *map(str, photos), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    transform = timm.data.create_transform(**timm.data.resolve_model_data_config(model), is_training=False)
    with torch.no_grad():
        x = torch.stack([transform(Image.open(p).convert("RGB")) for p in photos])
        probs = model(x).softmax(-1)
    for row, p in zip(rows, probs):
        top = row["predictions"][0]
        assert top["probability"] == pytest.approx(float(p.max()), abs=1e-5)
        assert top["label"] == str(int(p.argmax()))


def _check_commands(run_dir, tmp_path, image_size: int):
    from vramfit.cli import run

    assert run(["eval", "--run", str(run_dir)]) == 0
    assert (run_dir / "eval-val.json").is_file()
    out = tmp_path / "export"
    assert run(["export", "--run", str(run_dir), "--format", "torchscript", "--format", "safetensors",
                "--output", str(out)]) == 0
    traced = torch.jit.load(str(out / "model.torchscript.pt"))
    assert traced(torch.zeros(1, 3, image_size, image_size)).shape == (1, 10)
    assert {"model.safetensors", "config.json", "README.md", "preprocessing.json"} <= {p.name for p in out.iterdir()}


def _end_to_end(path, train_cli, tmp_path, photos, capsys, own_model: bool, image_size: int):
    raw = recipe(path)
    uses_ema = raw.get("model", {}).get("ema_decay") is not None
    ref, cut = _train_cut_and_resume(train_cli, shrunk(path, own_model, image_size, tmp_path / "weights"))
    _check_resumed_exactly(ref, cut, uses_ema)
    summary = json.loads((cut / "summary.json").read_text())
    precision = raw.get("train", {}).get("precision", "auto")
    staged = raw.get("train", {}).get("freeze_epochs", 0)
    assert summary["finished"] and summary["global_step"] == (1 + staged) * TRAIN // GLOBAL_BATCH
    assert [p["name"] for p in summary["phases"]] == (["head", "all"] if staged else ["all"])
    assert summary["precision"] == {"auto": "fp32"}.get(precision, precision)
    # GPU recipes choose the fastest fit: the settings as written run out of memory in its probe
    # (above half the share), so it trains split in two from the start, and so does a staged
    # recipe's second phase, probed as it begins; the others split on the out-of-memory retry.
    fit = json.loads((ref / "summary.json").read_text())["fit"]
    assert fit["mode"] == summary["fit"]["mode"] == raw.get("train", {}).get("fit", "largest")
    fastest = fit["mode"] == "fastest"
    if fastest:
        assert fit["candidates"][0]["outcome"] == "out of memory"
        later = [(r["phase"], r["candidates"][0]["outcome"]) for r in fit.get("later_phases", [])]
        assert later == ([("all", "out of memory")] if staged else [])
    if raw.get("train", {}).get("compile") == "auto":  # measured only where the budget pays for compiling
        compiled = [c for c in fit["candidates"] if c["settings"]["compile"]]
        assert len(compiled) == 1 and compiled[0]["outcome"].startswith("not probed")
        assert not fit["chosen"]["compile"]
    assert (summary["micro_batch"], summary["grad_accum_steps"], summary["oom_retries"]) == (
        GLOBAL_BATCH // 2, 2, 0 if fastest else 1)
    assert summary["skipped_steps"] < summary["global_step"]  # fp16: the loss scale let steps through
    model = _check_model_folder(cut, uses_ema)
    _check_predictions(cut, model, photos, capsys)
    _check_commands(cut, tmp_path, image_size)


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_trains_resumes_evaluates_predicts_and_exports(path, train_cli, tmp_path, photos, capsys):
    _end_to_end(path, train_cli, tmp_path, photos, capsys, own_model=False, image_size=32)


@pytest.mark.slow
@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_with_its_own_model(path, train_cli, tmp_path, photos, capsys):
    _end_to_end(path, train_cli, tmp_path, photos, capsys, own_model=True, image_size=64)


def test_channels_last_quickstart_resumes_bitwise_and_exports(train_cli, tmp_path):
    """The quickstart (its own ResNet18) with `model.channels_last=true`: stopped mid-epoch and
    resumed, bitwise equal to an uninterrupted run; model/ holds contiguous weights that plain timm
    loads, and it evaluates and exports. (test_train launches the quickstart through `accelerate
    launch --config_file accel_configs/cpu.yaml`.)"""
    args = ["--recipe", "quickstart", "--epochs", "1", "--global-batch", "16", "--set", "model.channels_last=true",
            "--set", "data.limit_train_samples=64", "--set", "data.limit_val_samples=32",
            "--set", "data.num_workers=0", "--set", "train.log_every_steps=1"]
    ref, cut = _train_cut_and_resume(train_cli, args)
    _check_resumed_exactly(ref, cut, uses_ema=False)
    _check_model_folder(cut, uses_ema=False)
    _check_commands(cut, tmp_path, image_size=32)  # eval, export (every writer reads model/)
