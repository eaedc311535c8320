"""timm model creation: head sized to the data, weights, freezing, BatchNorm policy, checkpointing."""

from __future__ import annotations

import difflib
import json
from pathlib import Path

import timm
import torch
from torch import nn

from ..config import ModelConfig
from ..errors import VramfitError

_SOURCE_PREFIXES = ("hf-hub:", "local-dir:")


def check_model_name(name: str) -> None:
    if name.startswith(_SOURCE_PREFIXES):
        return
    arch = name.split(".", 1)[0]  # `resnet50.a1_in1k` names a weight tag of `resnet50`
    if timm.is_model(arch):
        return
    names = timm.list_models()
    # Lookalike characters first (efficientnet_bO -> efficientnet_b0), then edit similarity.
    same = [n for n in names if _norm(n) == _norm(arch)]
    close = same + [n for n in difflib.get_close_matches(arch, names, n=5, cutoff=0.6) if n not in same]
    if not close:
        close = [n for n in names if arch.lower() in n][:5]
    raise VramfitError(
        f"Unknown model `{name}`: timm {timm.__version__} has no architecture of that name.",
        hint=(f"close matches: {', '.join(close)}. " if close else "")
        + "List them with `python -c \"import timm; print(timm.list_models('*resnet*'))\"`.")


def _norm(name: str) -> str:
    return name.lower().translate(str.maketrans({"o": "0", "l": "1", "i": "1", "-": "_"}))


def create_model(cfg: ModelConfig, num_classes: int, load_weights: bool = True,
                 image_size: int | None = None, any_size: bool = False) -> nn.Module:
    """Build the model on CPU for `image_size` px inputs (`any_size`: and for other sizes too, as
    progressive resizing trains at: any_size_kwargs). `load_weights=False` skips any weight
    loading (memory planning)."""
    check_model_name(cfg.name)
    kwargs: dict = dict(num_classes=num_classes, drop_rate=cfg.drop_rate, **input_size_kwargs(cfg.name, image_size))
    if any_size:
        kwargs.update(any_size_kwargs(cfg.name))
    if cfg.drop_path_rate:
        kwargs["drop_path_rate"] = cfg.drop_path_rate
    pretrained = load_weights and cfg.loads_weights
    if load_weights and cfg.pretrained_path:
        path = Path(cfg.pretrained_path)
        if not path.is_file():
            raise VramfitError(f"model.pretrained_path `{path}` does not exist.",
                               hint="point it at a .safetensors / .pth / .bin weight file")
        try:  # safetensors says "No such file" for a file it may not read
            path.open("rb").close()
        except OSError as e:
            raise VramfitError(f"model.pretrained_path `{path}` cannot be read ({e.strerror}).",
                               hint="fix its permissions, or copy it somewhere this user can read") from None
        # Through timm's pretrained loader (not checkpoint_path) so a 1000-class head is dropped and
        # re-initialised for our classes instead of failing on a shape mismatch.
        kwargs["pretrained_cfg_overlay"] = dict(file=str(path.resolve()))
    offline = None
    if (pretrained and not cfg.pretrained_path) or cfg.name.startswith("hf-hub:"):
        from .hub import unreachable

        offline = unreachable()  # seconds, where huggingface_hub's own retries take minutes
    try:
        model = timm.create_model(cfg.name, pretrained=pretrained, **kwargs)
    except (OSError, ConnectionError, RuntimeError, ValueError) as e:
        raise _creation_error(cfg, e, pretrained, offline) from None

    if cfg.bn == "freeze":
        # Library conversion: BatchNorm2d -> FrozenBatchNorm2d (fixed statistics and affine). Every
        # batch split then gives identical maths, and small micro-batches do not corrupt statistics.
        model = timm.layers.freeze_batch_norm_2d(model)
    set_bn_momentum(model, cfg.bn_momentum)
    if cfg.freeze:
        from .freezing import freeze

        freeze(model, cfg.freeze)
    if cfg.grad_checkpointing:
        try:
            model.set_grad_checkpointing(True)
        except (AssertionError, NotImplementedError, AttributeError) as e:
            raise VramfitError(f"`{cfg.name}` does not support gradient checkpointing ({e}).",
                               hint="run with --no-grad-checkpointing") from None
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model


def input_size_kwargs(name: str, image_size: int | None) -> dict:
    """A model built for one input size (ViT's position embeddings, Swin's windows) is built for the
    run's size instead; timm resamples pretrained position embeddings to it as it loads them. Models
    that take any size (CNNs) need nothing."""
    if image_size is None or name.startswith(_SOURCE_PREFIXES):
        return {}
    pretrained_cfg = timm.models.get_pretrained_cfg(name)
    if pretrained_cfg is None or not pretrained_cfg.fixed_input_size or pretrained_cfg.input_size[-1] == image_size:
        return {}
    return {"img_size": image_size}


# timm's arguments that let a model built for one input size take others: position embeddings
# resampled to each input (`dynamic_img_size`), an input that is not a whole number of patches
# padded (`dynamic_img_pad`). Tried in this order; ViTs take both, Swin the first.
ANY_SIZE_KWARGS = ({"dynamic_img_size": True, "dynamic_img_pad": True}, {"dynamic_img_size": True})


def any_size_kwargs(name: str) -> dict:
    """What a model needs to take any input size: nothing for a CNN; for a model built for one
    size (pretrained_cfg.fixed_input_size), the first of ANY_SIZE_KWARGS its constructor accepts
    (tried on the meta device: nothing is allocated). {} when none is accepted: the forward at
    another size then fails, which data.progressive.check_backbone says."""
    if name.startswith(_SOURCE_PREFIXES):
        return {}
    pretrained_cfg = timm.models.get_pretrained_cfg(name)
    if pretrained_cfg is None or not pretrained_cfg.fixed_input_size:
        return {}
    for kwargs in ANY_SIZE_KWARGS:
        try:
            with torch.device("meta"):
                timm.create_model(name, pretrained=False, num_classes=2, **kwargs)
        except TypeError:
            continue
        return kwargs
    return {}


def _creation_error(cfg: ModelConfig, e: Exception, pretrained: bool,
                    offline: str | None = None) -> VramfitError:
    """What to say when timm cannot build the model: a Hub cache that cannot be written, no
    network for weights or an hf-hub architecture (`offline`: why the Hub did not answer), or the
    error itself."""
    cache = _unwritable_path(e)
    if cache is not None:
        return VramfitError(
            f"Could not save what `{cfg.name}` needs from the Hugging Face Hub: {cache} cannot be written.",
            hint="point the Hub cache at a writable folder (HF_HUB_CACHE=/path, or HF_HOME=/path for every "
                 "Hugging Face cache), or download the weights once elsewhere and pass `--set "
                 "model.pretrained_path=/path/to/model.safetensors`")
    text = str(e)
    if pretrained and not cfg.pretrained_path and (offline or _looks_offline(e)):
        return VramfitError(
            f"Could not download pretrained weights for `{cfg.name}`: {offline}, and they are not in the "
            "local cache." if offline else
            f"Could not download pretrained weights for `{cfg.name}` ({type(e).__name__}: "
            f"{text.splitlines()[0][:200] if text else 'no detail'}).",
            hint="this machine cannot reach the Hugging Face Hub. Either run with "
                 "`--set model.pretrained=false` (random init), or download the weights once on a "
                 "machine with network and pass `--set model.pretrained_path=/path/to/model.safetensors`.",
        )
    if cfg.name.startswith("hf-hub:") and (offline or _looks_offline(e)):
        # timm reads an hf-hub model's architecture from its config.json on the Hub, even for
        # a random init or a memory plan.
        return VramfitError(
            f"Could not fetch the configuration of `{cfg.name}` from the Hugging Face Hub "
            f"({type(e).__name__}).",
            hint="this machine cannot reach the Hub. Use the timm architecture name instead (e.g. "
                 "`resnet50.a1_in1k`; `vramfit plan` needs nothing else), or download the model once "
                 "and pass its folder as `--model local-dir:/path/to/folder`.")
    return VramfitError(f"Could not create model `{cfg.name}`: {type(e).__name__}: {text[:500]}",
                       hint="check the model name and model.* settings")


def _unwritable_path(e: BaseException) -> str | None:
    """The path of a permission or read-only or full-disk error in `e`'s chain (None: none)."""
    import errno

    from ..runtime.storage import exception_chain

    for x in exception_chain(e):
        if isinstance(x, OSError) and x.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT):
            return str(x.filename or x.filename2 or "the Hugging Face cache")
    return None


def _looks_offline(e: Exception) -> bool:
    from ..runtime.storage import exception_chain

    chain = exception_chain(e)
    names = {type(x).__name__ for x in chain}
    text = " ".join(str(x) for x in chain).lower()
    return bool(names & {"LocalEntryNotFoundError", "ConnectionError", "OfflineModeIsEnabled",
                         "MaxRetryError", "NameResolutionError", "ConnectTimeout"}) or any(
        w in text for w in ("offline", "connection", "resolve", "network", "hf_hub_offline",
                            "cannot find the requested files"))


def set_bn_momentum(model: nn.Module, momentum: float | None) -> None:
    """`model.bn_momentum`: the running-statistics momentum of every BatchNorm (None: the model's)."""
    from .freezing import BATCH_STATISTICS_NORMS

    if momentum is not None:
        for m in model.modules():
            if isinstance(m, BATCH_STATISTICS_NORMS):
                m.momentum = momentum


def sync_batchnorm(model: nn.Module) -> nn.Module:
    """`model.bn: sync`: every BatchNorm computes its statistics over the micro-batches of all
    processes (timm's conversion: it keeps BatchNormAct2d's activation, torch's would drop it).
    Frozen norms stay as they are: they use no batch statistics."""
    from timm.layers import convert_sync_batchnorm

    from .freezing import holds_statistics

    held = {name for name, m in model.named_modules() if holds_statistics(m)}
    converted = convert_sync_batchnorm(model)
    if held:
        from .freezing import freeze

        freeze(converted, sorted(held))  # conversion makes new modules: hold them again
    return converted


def compile_in_place(model: nn.Module, on: bool = True) -> None:
    """torch.compile `model` in place (`nn.Module.compile`), or undo it (`on` False). In place rather
    than a wrapper: parameter and state-dict names, checkpoints and the EMA copy stay as they are.
    nn.Module.compile keeps the compiled callable in `_compiled_call_impl` and offers no undo;
    clearing it makes the module call its own forward again (train.fit: fastest measures compiled
    and eager candidates on one model)."""
    if on and getattr(model, "_compiled_call_impl", None) is None:
        model.compile()
    elif not on and getattr(model, "_compiled_call_impl", None) is not None:
        model._compiled_call_impl = None


def data_config(model: nn.Module, image_size: int, crop_pct: float | None = None) -> dict:
    """Mean/std/interpolation/crop from the model's pretrained config, at our image size."""
    cfg = timm.data.resolve_data_config({}, model=model)
    cfg["input_size"] = (3, image_size, image_size)
    if crop_pct is not None:
        cfg["crop_pct"] = crop_pct
    return cfg


def export(model: nn.Module, out_dir: Path, class_names: list[str], data_cfg: dict) -> None:
    """Write `model/`: safetensors weights + timm config.json (loadable with `local-dir:`), in the
    default memory format whatever layout the model trains in. `out_dir` is the new folder the
    caller swaps in whole (runtime.storage.atomic_folder / atomic_files): never the live one."""
    from ..store.checkpoint import portable_state_dict

    out_dir.mkdir(parents=True, exist_ok=True)
    with portable_state_dict(model):
        timm.models.save_for_hf(
            model, str(out_dir), safe_serialization=True,
            model_config={"label_names": list(class_names), "num_classes": len(class_names)},
            data_config={k: v for k, v in data_cfg.items() if k in ("input_size", "interpolation", "mean", "std", "crop_pct", "crop_mode")},
        )
    (out_dir / "class_names.json").write_text(json.dumps(list(class_names), indent=1))
