"""The 12 GB RTX 3060 questions (docs/faq.md), answered by the memory planner. CPU only, ~1 minute.

ResNet50 (and EfficientNet-B0) fine-tuning at 224 px with AdamW, 10 classes; "batch" is the number of
images per forward/backward. Prints a markdown table of predicted peaks (what nvidia-smi would show)
and the micro-batch the planner picks for a 512-image batch on a 12 GB card (11.75 GiB as reported,
less the 5% safety margin).

    python bench/forum_answers.py
    python bench/forum_answers.py --measure     # + the validation forward measured on this CPU (~1 min)
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import torch

from vramfit.config import Config
from vramfit.planner import budget_bytes_for, estimate, pick_micro_batch

GiB = 2**30
STAGES = ["conv1", "bn1", "layer1", "layer2"]


def cfg(model="resnet50", size=224, ckpt=False, freeze=(), bn="train") -> Config:
    return Config.model_validate({
        "model": {"name": model, "grad_checkpointing": ckpt, "freeze": list(freeze), "bn": bn},
        "data": {"image_size": size}, "hardware": {"memory_gib": 12}})


def eval_forward_bytes(c: Config, batch: int, grad: bool) -> int:
    """Peak bytes PyTorch holds during one evaluation forward (weights included), traced on fake
    tensors as the planner traces a training step. With grad enabled (a validation loop without
    `torch.no_grad()`), every activation the backward would need stays alive with the logits."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from vramfit.planner.tracing import PARAM, Recorder, build_fake

    fake = FakeTensorMode(allow_non_fake_inputs=True)
    model, _, _ = build_fake(c, 10, fake, on_meta=True)
    model.eval()
    rec = Recorder({id(p) for p in model.parameters()})
    for t in [*model.parameters(), *model.buffers()]:
        rec.register(t, PARAM)
    size = c.data.image_size
    with fake, rec, torch.set_grad_enabled(grad):
        logits = model(torch.empty(batch, 3, size, size))
    live = peak = 0
    for e in rec.events:
        n = -(-rec.sizes[e if e >= 0 else ~e] // 512) * 512
        live += n if e >= 0 else -n
        peak = max(peak, live)
    del logits
    return peak


# One validation forward of ResNet50 (fp32, 224 px, random weights) on this CPU, in a fresh process:
# the growth of its peak resident memory during the forward, with or without gradients.
MEASURE_FORWARD = """
import resource, sys, torch, timm
torch.manual_seed(0)
model = timm.create_model("resnet50", num_classes=10).eval()
x = torch.randn(int(sys.argv[2]), 3, 224, 224)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
with torch.set_grad_enabled(sys.argv[1] == "grad"):
    logits = model(x)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


# ResNet50 with 10 classes from a local 1000-class weight file (vramfit's `model.pretrained_path`, i.e.
# timm's pretrained loader) or with random weights, in a fresh process: what it holds afterwards.
MEASURE_PRETRAINED = """
import gc, resource, sys, torch, timm
from vramfit.config import ModelConfig
from vramfit.models.create import create_model
path = sys.argv[1]
if path != "none":
    torch.save(timm.create_model("resnet50").state_dict(), path)  # a stand-in for downloaded weights
    gc.collect()
before = int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()
cfg = ModelConfig(name="resnet50", pretrained=path != "none", pretrained_path=None if path == "none" else path)
model = create_model(cfg, num_classes=10, load_weights=path != "none")
gc.collect()
after = int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()
params = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
storages = {}
for o in gc.get_objects():  # every tensor still alive, each storage once
    if isinstance(o, torch.Tensor):
        storages[o.untyped_storage().data_ptr()] = o.untyped_storage().nbytes()
print(after - before, params, sum(storages.values()))
"""


def measured_model_bytes(weights_file: str | None) -> tuple[int, int, int]:
    """(resident memory the model creation left, the model's own tensor bytes, the bytes of every
    tensor still alive), from local weights or random ones."""
    proc = subprocess.run([sys.executable, "-c", MEASURE_PRETRAINED, weights_file or "none"],
                          capture_output=True, text=True, timeout=600, check=True)
    added, params, alive = proc.stdout.strip().splitlines()[-1].split()
    return int(added), int(params), int(alive)


def measured_eval_forward_bytes(batch: int, grad: bool) -> int:
    """Peak host memory one evaluation forward adds on this CPU (the same tensors a GPU would hold,
    without the allocator's rounding)."""
    proc = subprocess.run([sys.executable, "-c", MEASURE_FORWARD, "grad" if grad else "nograd", str(batch)],
                          capture_output=True, text=True, timeout=600, check=True)
    return int(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--memory-gib", type=float, default=12.0)
    ap.add_argument("--measure", action="store_true", help="also measure the validation forward on this CPU")
    args = ap.parse_args()
    t0 = time.time()
    rows = [
        ("ResNet50, fp32, batch 8", cfg(), 8, "no"),
        ("ResNet50, fp32, batch 16", cfg(), 16, "no"),
        ("ResNet50, fp32, batch 32", cfg(), 32, "no"),
        ("ResNet50, fp32, batch 64", cfg(), 64, "no"),
        ("ResNet50, fp16 autocast, batch 32", cfg(), 32, "fp16"),
        ("ResNet50, bf16 autocast, batch 32", cfg(), 32, "bf16"),
        ("ResNet50, fp32, batch 32, gradient checkpointing", cfg(ckpt=True), 32, "no"),
        ("ResNet50, fp32, batch 32, conv1..layer2 frozen", cfg(freeze=STAGES, bn="freeze"), 32, "no"),
        ("ResNet50, fp32, batch 32, at 448 px", cfg(size=448), 32, "no"),
        ("ResNet50, fp32, batch 32, at 1024 px (resize not applied)", cfg(size=1024), 32, "no"),
        ("EfficientNet-B0, fp32, batch 32", cfg("efficientnet_b0"), 32, "no"),
        ("EfficientNet-B0, bf16 autocast, batch 32", cfg("efficientnet_b0"), 32, "bf16"),
    ]
    print("| configuration | predicted peak | of which activations |")
    print("|---|---|---|")
    for name, c, batch, prec in rows:
        e = estimate(c, 10, batch, prec, per_process_batch=batch)
        print(f"| {name} | {e.peak_bytes / GiB:.2f} GiB | {e.activations_bytes / GiB:.2f} GiB |")
    budget = budget_bytes_for(cfg(), args.memory_gib)
    print(f"\nMicro-batch picked for a 512-image batch on a {args.memory_gib:g} GB card (budget {budget / GiB:.2f} GiB):")
    for name, c, prec in (("ResNet50 fp32", cfg(), "no"), ("ResNet50 fp16", cfg(), "fp16"),
                          ("ResNet50 bf16", cfg(), "bf16"),
                          ("EfficientNet-B0 fp32", cfg("efficientnet_b0"), "no")):
        pick, table = pick_micro_batch(c, 10, 512, budget, precision=prec)
        peak = next(e.peak_bytes for e in table if e.micro_batch == pick) if pick else None
        print(f"- {name}: {pick}" + (f" ({peak / GiB:.2f} GiB)" if peak else ""))
    print("\nOne validation forward, ResNet50 fp32 at 224 px, batch 64 (tensors only, weights included):")
    with_grad, no_grad = (eval_forward_bytes(cfg(), 64, g) for g in (True, False))
    print(f"- without torch.no_grad(): {with_grad / GiB:.2f} GiB (the graph stays alive with the logits)")
    print(f"- under torch.no_grad():   {no_grad / GiB:.2f} GiB")
    if args.measure:
        with_grad, no_grad = (measured_eval_forward_bytes(64, g) for g in (True, False))
        print("  measured on this CPU (peak resident memory the forward adds, weights excluded):")
        print(f"- without torch.no_grad(): {with_grad / GiB:.2f} GiB")
        print(f"- under torch.no_grad():   {no_grad / GiB:.2f} GiB")
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            (warm, params, warm_alive), (cold, _, cold_alive) = (
                measured_model_bytes(f) for f in (f"{tmp}/resnet50.pth", None))
        print("\nResNet50 (10 classes) on this CPU, after creating it (gc run): tensors alive / resident memory added")
        print(f"- from a local pretrained weight file: {warm_alive / 2**20:.0f} MiB / {warm / 2**20:.0f} MiB")
        print(f"- with random weights:                 {cold_alive / 2**20:.0f} MiB / {cold / 2**20:.0f} MiB")
        print(f"  (the model's own tensors: {params / 2**20:.0f} MiB; resident memory also keeps what the "
              "allocator has not handed back)")
    print(f"\n({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
