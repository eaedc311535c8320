"""`vramfit export --run DIR --format onnx|torchscript|safetensors [--push-to-hub REPO]`: a run's
best model as deployable files with a model card, or pushed to the Hugging Face Hub in timm's format."""

from __future__ import annotations

import io
import sys
import warnings
from pathlib import Path

import torch

from ..errors import VramfitError
from ..runtime.storage import (atomic_files, atomic_path, make_folder, tensor_bytes, write_bytes, write_json,
                               write_text)
from .trained import TrainedModel

FORMATS = ("onnx", "torchscript", "safetensors")
FILES = {"onnx": "model.onnx", "torchscript": "model.torchscript.pt", "safetensors": "model.safetensors"}
# ONNX keeps weights inside the .onnx file up to its protobuf limit (2 GiB); above, next to it.
ONNX_INLINE_MAX_BYTES = 1_800_000_000
CHECK_TOLERANCE = 1e-4


def export_run(run_dir: str | Path, formats: list[str], output: str | Path | None = None,
               push_to_hub: str | None = None, private: bool = False, out=None) -> dict[str, Path]:
    out = out or sys.stdout
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise VramfitError(f"Unknown export format `{unknown[0]}`.", hint=f"one of: {', '.join(FORMATS)}")
    if not formats and not push_to_hub:
        raise VramfitError("Nothing to export.", hint="pass --format onnx|torchscript|safetensors and/or --push-to-hub REPO")
    tm = TrainedModel(run_dir, device="cpu")
    dest = Path(output) if output else tm.run_dir / "export"
    written = {}
    if formats:
        make_folder(dest)
        for fmt in dict.fromkeys(formats):
            written[fmt] = WRITERS[fmt](tm, dest)
            out.write(f"{fmt}: {written[fmt]}\n")
        write_sidecars(tm, dest, [p.name for p in written.values()])
        out.write(f"model card: {dest / 'README.md'}\n")
    if push_to_hub:
        url = push(tm, push_to_hub, private=private)
        out.write(f"pushed to the Hub: {url}\n")
    return written


def example_input(tm: TrainedModel, batch: int = 2) -> torch.Tensor:
    """A seeded input batch of the model's input size (what tracing and the export checks run on)."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch, *tm.data_config["input_size"], generator=g)


def write_onnx(tm: TrainedModel, dest: Path) -> Path:
    path = dest / FILES["onnx"]
    model = tm.model.cpu().eval()
    big = sum(p.numel() * p.element_size() for p in model.parameters()) > ONNX_INLINE_MAX_BYTES
    batch = torch.export.Dim("batch", min=1, max=65536)
    try:  # into a folder beside: a full disk leaves no truncated model.onnx (nor its external data)
        with atomic_files(dest, "the ONNX model", tensor_bytes(model)) as folder:
            # The torch.export-based exporter (the default since torch 2.9); dynamic batch dimension.
            torch.onnx.export(model, (example_input(tm),), str(folder / path.name), input_names=["image"],
                              output_names=["logits"], dynamic_shapes=({0: batch},), dynamo=True,
                              external_data=big, verbose=False)
    except VramfitError:  # the storage's fault, told by the writer
        raise
    except Exception as e:  # noqa: BLE001 - exporter failures come as many types; say which model
        raise VramfitError(f"ONNX export of {tm.architecture} failed: {type(e).__name__}: "
                           f"{str(e).splitlines()[0][:300] if str(e) else ''}",
                           hint="export --format torchscript or safetensors instead") from None
    diff = check_onnx(path, model, example_input(tm, 3))
    if diff > CHECK_TOLERANCE:
        raise VramfitError(f"The ONNX model's outputs differ from the torch model's by {diff:.2e} "
                           f"(tolerance {CHECK_TOLERANCE}).", hint="use --format torchscript or safetensors")
    return path


def check_onnx(path: Path, model: torch.nn.Module, images: torch.Tensor) -> float:
    """Largest absolute logit difference between onnxruntime (CPU) and the torch model on `images`."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = session.run(None, {session.get_inputs()[0].name: images.numpy()})[0]
    with torch.inference_mode():
        want = model.cpu().eval()(images).float()
    return float((torch.from_numpy(got) - want).abs().max())


def write_torchscript(tm: TrainedModel, dest: Path) -> Path:
    path = dest / FILES["torchscript"]
    model = tm.model.cpu().eval()
    with warnings.catch_warnings():
        # torch marks TorchScript deprecated in favour of torch.export, but it is still what C++
        # (libtorch), TorchServe and mobile runtimes load; tracing is exact for these feed-forward nets.
        warnings.simplefilter("ignore", FutureWarning)
        with torch.inference_mode(False), torch.no_grad():
            traced = torch.jit.trace(model, example_input(tm))
        # Into memory first: torch's C++ file writer aborts the whole process on a full disk (its
        # destructor throws); a Python write fails with an errno that storage tells.
        buffer = io.BytesIO()
        torch.jit.save(traced, buffer)
    write_bytes(path, buffer.getvalue(), "the TorchScript model")
    return path


def write_safetensors(tm: TrainedModel, dest: Path) -> Path:
    from ..models.create import export

    # timm's format, as run/model/
    with atomic_files(dest, "the safetensors model", tensor_bytes(tm.model)) as folder:
        export(tm.model.cpu(), folder, tm.class_names, tm.data_config)
    return dest / FILES["safetensors"]


WRITERS = {"onnx": write_onnx, "torchscript": write_torchscript, "safetensors": write_safetensors}


def write_sidecars(tm: TrainedModel, dest: Path, files: list[str]) -> None:
    """What every export needs besides the weights: classes in output order, the preprocessing and
    the model card."""
    from .model_card import readme

    write_json(dest / "class_names.json", tm.class_names, "the class names")
    write_json(dest / "preprocessing.json", _preprocessing(tm), "the preprocessing")
    present = sorted({*files, *(p.name for p in dest.iterdir() if not p.name.startswith("."))})
    write_text(dest / "README.md", readme(tm, present), "the model card")


def _preprocessing(tm: TrainedModel) -> dict:
    d = tm.data_config
    return {"input_size": list(d["input_size"]), "interpolation": d.get("interpolation"),
            "crop_pct": d.get("crop_pct"), "crop_mode": d.get("crop_mode"), "mean": list(d["mean"]),
            "std": list(d["std"]), "input_name": "image", "output_name": "logits", "pixel_range": [0, 1]}


def push(tm: TrainedModel, repo_id: str, private: bool = False) -> str:
    """timm's own Hub push (weights as safetensors, config.json with the label names and the
    preprocessing, README.md from the model card when the repository has none yet)."""
    from timm.models import push_to_hf_hub

    from ..store.checkpoint import portable_state_dict
    from .model_card import TAGS, body

    card = {"description": body(tm, ["model.safetensors"], repo_id), "tags": TAGS, "license": "other"}
    try:
        with portable_state_dict(tm.model.cpu()) as model:
            result = push_to_hf_hub(model, repo_id, commit_message=f"Add {tm.run_dir.name} (vramfit)",
                                    private=private, model_card=card, safe_serialization=True,
                                    model_config={"label_names": tm.class_names,
                                                  "num_classes": len(tm.class_names)},
                                    data_config=_hub_data_config(tm))
    except Exception as e:  # noqa: BLE001 - network, auth and repo errors come as many types
        raise VramfitError(f"Could not push to the Hugging Face Hub repository `{repo_id}`: {type(e).__name__}: "
                           f"{str(e).splitlines()[0][:300] if str(e) else ''}",
                           hint="check the network, log in with `hf auth login` (or set HF_TOKEN) and that "
                                "the repository name is yours (user/name)") from None
    return str(getattr(result, "commit_url", None) or f"https://huggingface.co/{repo_id}")


def _hub_data_config(tm: TrainedModel) -> dict:
    keys = ("input_size", "interpolation", "mean", "std", "crop_pct", "crop_mode")
    return {k: v for k, v in tm.data_config.items() if k in keys}
