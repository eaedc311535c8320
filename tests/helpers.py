"""What the tests share: the tiny run's arguments, generated data, the timm data config of a 32 px
run, and the host-read counter. Fixtures live in conftest.py; everything else a second test
module needs lives here (no test module imports another)."""

from __future__ import annotations

import io
import json
import zlib
from pathlib import Path

import numpy as np
from PIL import Image

REPO = Path(__file__).resolve().parents[1]

# ImageNet's mean and std, as a timm data config gives them.
MEAN_STD = {"mean": (0.485, 0.456, 0.406), "std": (0.229, 0.224, 0.225)}
# timm's data config of a 32 px run (what models.create.data_config gives the tiny models).
DATA_CFG_32 = {"input_size": (3, 32, 32), "interpolation": "bilinear", **MEAN_STD, "crop_pct": 0.875}


def transforms_32(device_type: str = "cpu"):
    """The (train, val) loader transforms of a 32 px run."""
    from vramfit import data as D
    from vramfit.config import DataConfig

    return D.build_transforms(DataConfig(image_size=32), DATA_CFG_32, device_type)


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


class StandInCard:
    """A CUDA card for code that asks torch.cuda about memory, on a machine without one (a CUDA
    build without a driver raises on every such call): `total` bytes, `others` held by other
    processes, the allocator capped at `fraction`. Change the attributes to change the card."""

    def __init__(self, monkeypatch, total: int, *, others: int = 0, fraction: float = 1.0, name: str = "Stand-in"):
        import torch
        from types import SimpleNamespace

        from vramfit.planner import CUDA_CONTEXT_BYTES

        self.total, self.others, self.fraction, self.name = total, others, fraction, name
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=self.total))
        monkeypatch.setattr(cuda, "get_device_name", lambda d=None: self.name)
        monkeypatch.setattr(cuda, "get_per_process_memory_fraction", lambda d=None: self.fraction)
        monkeypatch.setattr(cuda, "memory_reserved", lambda d=None: 0)
        # what this process sees free: the card less its own CUDA context and what others hold
        monkeypatch.setattr(cuda, "mem_get_info",
                            lambda d=None: (self.total - CUDA_CONTEXT_BYTES - self.others, self.total))


TINY_STEPS_PER_EPOCH = 30  # 480 training images / global batch 16


def tiny_args(*extra):
    """A seeded tiny run on a 480/120 subset of the built-in digits: test_resnet at 32 px, no workers."""
    return ["--data", "digits", "--model", "test_resnet", "--image-size", "32", "--global-batch", "16",
            "--epochs", "1", "--set", "data.num_workers=0", "--set", "data.hflip=0",
            "--set", "data.val_fraction=0.2", "--set", "data.limit_train_samples=480",
            "--set", "data.limit_val_samples=120", *extra]


# The tiny run's subset, written into a prepared dataset (shards, parquet): a run on it reads it all.
PREPARED_SUBSET = ("--set", "data.val_fraction=0.2", "--set", "data.limit_train_samples=160",
                   "--set", "data.limit_val_samples=40")


def source_args(source, *extra):
    """tiny_args on another `--data` (a prepared dataset holding its own subset: no limits)."""
    args = tiny_args(*extra)
    args[args.index("digits")] = str(source)
    for key in ("data.limit_train_samples=480", "data.limit_val_samples=120"):
        at = args.index(key)
        del args[at - 1:at + 1]
    return args


def weight_file(folder: Path, model_name: str = "test_resnet", num_classes: int = 10, seed: int = 0) -> Path:
    """A seeded weight file of `model_name` for `model.pretrained_path` (written once per folder):
    staged fine-tuning (train.freeze_epochs) runs only on trained weights, never on a random init."""
    path = Path(folder) / f"{model_name}-{num_classes}-{seed}.safetensors"
    if not path.exists():
        import timm
        import torch
        from safetensors.torch import save_file

        torch.manual_seed(seed)
        model = timm.create_model(model_name, num_classes=num_classes)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return path


# ---- generated data ---------------------------------------------------------------------------


def encode(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def picture(w: int, h: int, seed: int, mode: str = "RGB") -> Image.Image:
    """A gradient in a class-ish colour plus noise: compresses like a photo, not like flat colour."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, 3)
    ramp = np.linspace(0, 80, w)[None, :, None]
    a = np.clip(base[None, None, :] + ramp + rng.normal(0, 12, (h, w, 3)), 0, 255).astype(np.uint8)
    img = Image.fromarray(a)
    return img if mode == "RGB" else img.convert(mode)


def save(path: Path, img: Image.Image, fmt: str | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path, fmt) if fmt else img.save(path)
    return path


def write_bytes(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def class_tree(root: Path, counts: dict[str, int], size=(24, 20), seed=0, ext=".png") -> Path:
    # crc32, not hash(): str hashes change with every process (PYTHONHASHSEED), and so did the
    # pictures, so a test could meet a near-white class in one run only.
    for c, n in counts.items():
        for i in range(n):
            save(root / c / f"{i:03d}{ext}", picture(*size, seed=seed * 1000 + zlib.crc32(c.encode()) % 997 + i))
    return root


BAD_KINDS = ("zero-byte", "truncated-jpeg", "random-bytes", "truncated-png")


def bad_file(path_dir: Path, kind: str) -> Path:
    if kind == "zero-byte":
        return write_bytes(path_dir / "zero.jpg", b"")
    if kind == "truncated-jpeg":
        return write_bytes(path_dir / "cut.jpg", encode(picture(64, 48, 1), "JPEG")[:600])
    if kind == "random-bytes":
        return write_bytes(path_dir / "noise.jpg", np.random.default_rng(2).bytes(3000))
    if kind == "truncated-png":
        return write_bytes(path_dir / "cut.png", encode(picture(64, 48, 3), "PNG")[:400])
    raise ValueError(kind)


def cfg(source, **kw):
    """A DataConfig reading `source`."""
    from vramfit.config import DataConfig

    return DataConfig(source=str(source), **kw)


def train_args(data, out, *extra):
    return ["--data", str(data), "--model", "test_resnet", "--image-size", "32", "--epochs", "1",
            "--global-batch", "8", "--set", "data.num_workers=0", *extra]


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def remove_tree(path: Path, tries: int = 50) -> None:
    """`rm -rf` of a folder a running process still writes: a file it makes between the listing and
    the rmdir makes one pass fail (ENOTEMPTY), as a cleanup script would then run it again."""
    import shutil

    for _ in range(tries):
        shutil.rmtree(path, ignore_errors=True)
        if not Path(path).exists():
            return
    raise AssertionError(f"{path} could not be removed in {tries} passes")


def wait_for_lines(path: Path, lines: int, timeout: float = 120.0) -> None:
    """Until a run in another process has written `lines` lines into `path` (its metrics.jsonl):
    the moment a test may signal it mid-run."""
    import time

    deadline = time.time() + timeout
    while time.time() < deadline and not (path.exists() and len(path.read_text().splitlines()) >= lines):
        time.sleep(0.05)
    assert path.exists() and len(path.read_text().splitlines()) >= lines, f"{path}: not {lines} lines in {timeout} s"


def wait_for_text(path: Path, text: str, timeout: float = 120.0) -> None:
    """Until a command in another process has written `text` into `path` (its stderr, as a file):
    the moment a test may signal it in a given stage."""
    import time

    deadline = time.time() + timeout
    while time.time() < deadline and not (path.exists() and text in path.read_text(errors="replace")):
        time.sleep(0.02)
    assert path.exists() and text in path.read_text(errors="replace"), f"{path}: no {text!r} in {timeout} s"


def bench_module(name: str):
    """bench/NAME.py, loaded as the module `bench_NAME` (the benches import each other by name, and
    a dataclass looks its module up in sys.modules)."""
    import importlib.util
    import sys

    folder = str(REPO / "bench")
    sys.path.insert(0, folder)
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(folder)
    return module


def readme_launch() -> list[str]:
    """`launch -q train.py` (the flags before the script) from the README's first command."""
    first = (REPO / "README.md").read_text().split("```bash\n", 1)[1].splitlines()[0]
    launch = first.split("accelerate launch ", 1)[1].split(" --recipe")[0].split()
    assert launch[-1] == "train.py"
    return ["launch", *launch[:-1], str(REPO / "train.py")]


def last_weights(run_dir: Path) -> dict:
    """The weights in a run folder's newest checkpoint."""
    from safetensors.torch import load_file

    from vramfit.store import checkpoint

    return load_file(checkpoint.list_steps(run_dir / "checkpoints")[-1][1] / "model.safetensors")


def same_weights(a: dict, b: dict) -> bool:
    """Bitwise: the same tensors under the same names."""
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
