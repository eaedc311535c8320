"""A finished run's model, ready to use: loaded from `run/model/` with timm, with the run's own eval
transform and class names, and batched inference over any images `decode_image` reads."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
import yaml

from ..data.decode import BadImage, decode_image, describe
from ..errors import VramfitError, damaged_file


@dataclass
class Scores:
    """Logits of the readable images, in input order, and the unreadable ones with the reason."""

    logits: torch.Tensor  # [n_readable, C] float32 on CPU
    positions: list[int]  # input position of each row of `logits`
    unreadable: list[tuple[int, str]] = field(default_factory=list)  # (input position, "name: reason")


class TrainedModel:
    """`run/model/` loaded through timm's `local-dir:` source, exactly as a user of the folder would."""

    def __init__(self, run_dir: str | os.PathLike, device: str | torch.device | None = None):
        import timm
        import timm.data

        self.run_dir = Path(run_dir)
        self.model_dir = model_dir(self.run_dir)
        try:
            self.model = timm.create_model(f"local-dir:{self.model_dir.resolve()}", pretrained=True)
            self.class_names = _class_names(self.model_dir, self.model)
        except Exception as e:  # noqa: BLE001 - any unreadable file of model/ is a damaged folder, said as such
            raise damaged_file(_unreadable_file(self.model_dir), e) from None
        self.model.eval()
        # The eval preprocessing saved next to the weights (size, crop, interpolation, mean/std):
        # the same one timm users get from the folder.
        self.data_config = timm.data.resolve_model_data_config(self.model)
        self.transform = timm.data.create_transform(**self.data_config, is_training=False)
        self.device = torch.device(device) if device is not None else default_device()
        self.model.to(self.device)

    @property
    def architecture(self) -> str:
        return self.model.pretrained_cfg.get("architecture") or type(self.model).__name__

    def run_file(self, name: str):
        """A file of the run folder (runfolder.RunPaths names them: `config`, `summary`, `plan`,
        `env`), read; None if absent."""
        from ..store.runfolder import RunPaths

        path = getattr(RunPaths.at(self.run_dir), name)
        if not path.is_file():
            return None
        try:
            text = path.read_text()
            return yaml.safe_load(text) if path.suffix in (".yaml", ".yml") else json.loads(text)
        except (OSError, ValueError, yaml.YAMLError) as e:
            raise damaged_file(path, e) from None

    @torch.inference_mode()
    def scores(self, items: Sequence, batch_size: int = 64, workers: int | None = None) -> Scores:
        """Logits for a sequence of images, each anything `decode_image` reads (a path, bytes, a
        datasets image dict): a list of paths, or `ColumnItems` of a dataset. Unreadable images are
        left out and listed."""
        from ..data import draft_size

        ds = _Images(items, self.transform, draft_size(self.transform, self.data_config["input_size"][-1]))
        workers = default_workers(self.device) if workers is None else workers
        loader = torch.utils.data.DataLoader(ds, batch_size=batch_size, num_workers=workers,
                                             collate_fn=_collate, pin_memory=self.device.type == "cuda")
        logits, positions, bad = [], [], []
        for images, pos, failed in loader:
            bad.extend(failed)
            if len(pos):
                logits.append(self.model(images.to(self.device, non_blocking=True)).float().cpu())
                positions.extend(pos)
        num_classes = len(self.class_names)
        return Scores(torch.cat(logits) if logits else torch.empty(0, num_classes), positions, bad)


def model_dir(run_dir: Path) -> Path:
    """`run/model/`, checked: a clear error for a folder that holds no trained model."""
    from ..store.runfolder import RunPaths

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise VramfitError(f"{run_dir} is not a folder.", hint="pass a run folder such as runs/<run_name>")
    folder = RunPaths.at(run_dir).model
    missing = [n for n in ("config.json", "model.safetensors") if not (folder / n).is_file()]
    if missing:
        raise VramfitError(
            f"{run_dir} has no trained model ({folder} lacks {', '.join(missing)}).",
            hint="pass a run folder whose training finished at least one evaluation (it writes the best "
                 "weights to model/), e.g. runs/<run_name>")
    return folder


def _unreadable_file(folder: Path) -> Path:
    """The file of a model folder that does not parse (the folder itself when each one does)."""
    from safetensors import safe_open

    for f in sorted(folder.glob("*.json")):
        try:
            json.loads(f.read_text())
        except (OSError, ValueError):
            return f
    for f in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(f), "pt") as st:
                for key in st.keys():
                    st.get_slice(key)
        except Exception:  # noqa: BLE001 - safetensors raises its own error type for a cut file
            return f
    return folder


def _class_names(folder: Path, model) -> list[str]:
    names_file = folder / "class_names.json"
    if names_file.is_file():
        return list(json.loads(names_file.read_text()))
    names = json.loads((folder / "config.json").read_text()).get("label_names")
    return list(names) if names else [str(i) for i in range(model.num_classes)]


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def default_workers(device: torch.device) -> int:
    # On CPU the model's own threads use every core; decoding workers would only contend with them.
    if device.type == "cpu":
        return 0
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(0, min(8, cpus - 1))


class ColumnItems:
    """The image column of a `datasets.Dataset` as a sequence, read row by row (a whole column of
    encoded images would be loaded into memory at once); picklable for loader workers."""

    def __init__(self, ds, column: str):
        # tar shards (data.shards.IndexedSamples) read a row without a column choice
        self.ds = ds.select_columns([column]) if hasattr(ds, "select_columns") else ds
        self.column = column

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        return self.ds[int(i)][self.column]


class _Images(torch.utils.data.Dataset):
    def __init__(self, items: Sequence, transform, draft: int):
        self.items, self.transform, self.draft = items, transform, draft

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        raw = self.items[i]
        try:
            return self.transform(decode_image(raw, self.draft)), i, None
        except BadImage as e:
            return None, i, f"{describe(raw)}: {e.reason}"


def _collate(items):
    ok = [(x, i) for x, i, why in items if why is None]
    images = torch.stack([x for x, _ in ok]) if ok else None
    return images, [i for _, i in ok], [(i, why) for _, i, why in items if why is not None]
