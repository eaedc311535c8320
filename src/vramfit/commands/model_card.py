"""The model card (README.md) of an exported run: what the model is, what it was trained on and how,
how well it does, the memory it needed, and how to load each exported file."""

from __future__ import annotations

import json

from .trained import TrainedModel

CLASSES_LISTED = 30
TAGS = ["image-classification", "timm", "vramfit"]
# The planner's breakdown (plan.json `estimate`), in the order a step fills memory.
PLAN_PARTS = [("params", "weights"), ("grads", "gradients"), ("optimizer", "optimizer state"),
              ("activations", "activations"), ("temporaries", "workspace"), ("cuda_context", "CUDA context"),
              ("allocator_overhead", "allocator overhead"), ("peak", "peak")]


def front_matter() -> str:
    """Hub metadata. The license of a model trained on the user's own data is theirs to state."""
    return "---\n" + "".join(f"- {t}\n" if i else f"tags:\n- {t}\n" for i, t in enumerate(TAGS)) + \
        "library_name: timm\npipeline_tag: image-classification\nlicense: other\n---\n"


def readme(tm: TrainedModel, files: list[str], repo_id: str | None = None) -> str:
    return f"{front_matter()}# {title(tm)}\n\n{body(tm, files, repo_id)}"


def title(tm: TrainedModel) -> str:
    return f"Model card for {tm.run_dir.name}"


def body(tm: TrainedModel, files: list[str], repo_id: str | None = None) -> str:
    """Everything below the title (the Hub push puts its own front matter and title above it)."""
    cfg = tm.run_file("config") or {}
    summary = tm.run_file("summary") or {}
    parts = [_model(tm, cfg), _training(cfg, summary), _results(tm, summary), _memory(tm, summary),
             _usage(tm, files, repo_id)]
    return "\n".join(p for p in parts if p)


def _model(tm: TrainedModel, cfg: dict) -> str:
    names = tm.class_names
    shown = ", ".join(names[:CLASSES_LISTED]) + (f", ... ({len(names)} in all)" if len(names) > CLASSES_LISTED else "")
    d = tm.data_config
    params = sum(p.numel() for p in tm.model.parameters()) / 1e6
    data = cfg.get("data", {})
    return "\n".join([
        f"`{tm.architecture}` (timm, {params:.1f} M parameters) classifying {len(names)} classes, trained "
        f"with vramfit on `{data.get('source', '?')}`.\n",
        "## Model",
        f"- **Architecture:** {tm.architecture} (timm model `{cfg.get('model', {}).get('name', tm.architecture)}`, "
        f"{'from pretrained weights' if _pretrained(cfg) else 'trained from random initialisation'})",
        f"- **Classes ({len(names)}):** {shown}",
        f"- **Input:** {d['input_size'][0]}×{d['input_size'][1]}×{d['input_size'][2]}, "
        f"{d.get('interpolation')} resize, crop_pct {d.get('crop_pct')}, mean {list(d['mean'])}, std {list(d['std'])}",
        ""])


def _training(cfg: dict, s: dict) -> str:
    m, data, t, o = (cfg.get(k, {}) for k in ("model", "data", "train", "optim"))
    lines = ["## Training",
             f"- **Data:** `{data.get('source', '?')}` at {data.get('image_size', '?')} px"
             + (f", validation: {data.get('val_split')}" if data.get("val_split") else
                f", validation: {data.get('val_fraction', 0):.0%} held out of train"),
             f"- **Recipe:** {cfg.get('recipe') or 'none (flags only)'}; {s.get('epochs', t.get('epochs'))} epoch(s), "
             f"{s.get('global_step', '?')} optimizer steps",
             f"- **Batch:** global {s.get('global_batch', t.get('global_batch'))} = micro {s.get('micro_batch', '?')} × "
             f"accumulation {s.get('grad_accum_steps', '?')} × {s.get('num_processes', '?')} process(es)",
             f"- **Precision:** {s.get('precision', t.get('precision'))}; gradient checkpointing "
             f"{'on' if m.get('grad_checkpointing') else 'off'}; BatchNorm {m.get('bn', 'train')}",
             f"- **Optimizer:** {o.get('name')} lr {o.get('lr')} weight decay {o.get('weight_decay')}, "
             f"{o.get('schedule')} schedule, {o.get('warmup_epochs')} warm-up epoch(s); label smoothing "
             f"{t.get('label_smoothing')}; seed {t.get('seed')}"]
    if s.get("wall_seconds"):
        ips = s.get("images_per_second")
        lines.append(f"- **Time:** {s['wall_seconds'] / 60:.1f} min" + (f", {ips:.0f} training images/s" if ips else ""))
    return "\n".join(lines) + "\n"


def _results(tm: TrainedModel, s: dict) -> str:
    rows = [("validation (best epoch, during training)", s.get("best_accuracy"), None, None)]
    for f in sorted(tm.run_dir.glob("eval-*.json")):
        e = json.loads(f.read_text())
        rows.append((f"`vramfit eval`, split {e.get('split')}", e.get("top1"), e.get("top5"), e.get("samples")))
    lines = ["## Results", "| evaluation | top-1 | top-5 | images |", "|---|---|---|---|"]
    lines += [f"| {name} | {_num(a)} | {_num(b)} | {n if n is not None else '-'} |" for name, a, b, n in rows]
    return "\n".join(lines) + "\n"


def _memory(tm: TrainedModel, s: dict) -> str:
    plan = tm.run_file("plan") or {}
    env = tm.run_file("env") or {}
    est = plan.get("estimate") or {}
    lines = ["## Memory"]
    devices = env.get("device_names") or []
    if devices:
        lines.append(f"- **Device:** {env.get('num_processes', 1)} process(es) on {', '.join(dict.fromkeys(devices))}")
    if s.get("predicted_peak_memory_bytes") or s.get("peak_memory_bytes"):
        lines.append(f"- **Peak device memory:** planned {_gib(s.get('predicted_peak_memory_bytes'))}, measured "
                     f"{_gib(s.get('peak_memory_bytes'))}")
    parts = [(name, est.get(f"{key}_bytes")) for key, name in PLAN_PARTS if isinstance(est.get(f"{key}_bytes"), (int, float))]
    if parts:
        lines.append(f"- **Plan at micro-batch {est.get('micro_batch', plan.get('micro_batch'))}:** "
                     + ", ".join(f"{k} {_gib(v)}" for k, v in parts)
                     + (f" (peak during the {est['peak_phase']})" if est.get("peak_phase") else ""))
    return "\n".join(lines) + "\n" if len(lines) > 1 else ""


def _usage(tm: TrainedModel, files: list[str], repo_id: str | None) -> str:
    source = f"hf-hub:{repo_id}" if repo_id else "local-dir:PATH/TO/THIS/FOLDER"
    out = ["## How to use", "With timm (`model.safetensors` + `config.json`):", "```python",
           "import timm, torch", "from PIL import Image", "",
           f'model = timm.create_model("{source}", pretrained=True).eval()',
           "transform = timm.data.create_transform(**timm.data.resolve_model_data_config(model), is_training=False)",
           'labels = model.pretrained_cfg["label_names"]',
           "with torch.inference_mode():",
           '    probs = model(transform(Image.open("photo.jpg").convert("RGB")).unsqueeze(0)).softmax(-1)[0]',
           "print(labels[int(probs.argmax())], float(probs.max()))", "```",
           "Or from the run folder: `vramfit predict --run RUN_DIR photo.jpg folder/`."]
    if "model.onnx" in files:
        out += ["", "ONNX (`model.onnx`, input `image`: float32 N×3×H×W normalised as above, output `logits`):",
                "```python", "import onnxruntime as ort",
                'session = ort.InferenceSession("model.onnx", providers=["CPUExecutionProvider"])',
                'image = transform(Image.open("photo.jpg").convert("RGB")).unsqueeze(0).numpy()',
                'logits = session.run(None, {"image": image})[0]', "```"]
    if "model.torchscript.pt" in files:
        out += ["", "TorchScript (`model.torchscript.pt`, same input):", "```python",
                'model = torch.jit.load("model.torchscript.pt").eval()', "```"]
    out += ["", "`class_names.json` lists the classes in output order; `preprocessing.json` holds the input "
            "size, resize and normalisation."]
    return "\n".join(out) + "\n"


def _pretrained(cfg: dict) -> bool:
    m = cfg.get("model", {})
    return bool(m.get("pretrained") or m.get("pretrained_path"))


def _gib(v) -> str:
    from ..planner import bytes_text  # the one way a memory figure reads (the run's start line too)

    return bytes_text(v)


def _num(v) -> str:
    return f"{v:.4f}" if isinstance(v, (int, float)) else "-"
