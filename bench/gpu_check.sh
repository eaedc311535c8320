#!/usr/bin/env bash
# The checks for a machine with a CUDA GPU (several minutes on one H200; not yet timed there).
#
#   OUT=results bash bench/gpu_check.sh
#
# bench/throughput.py for resnet50 and efficientnet_b0 at 224 px, fp32 and bf16, channels_last:
# the vramfit step against a plain Accelerate + timm loop in the same process. Targets: every
# ratio >= 0.98x; ResNet50 bf16 >= 3,000 images/s on one H200 (NVIDIA's reference code measures
# ~3,079 there). Writes into $OUT (default bench-out/): env.txt, throughput.txt (the table
# docs/benchmarks.md records), throughput.json, throughput.log (the runs' own log lines); then
# loader_memory.txt (the device memory a pinned loader with workers takes: docs/faq.md) and
# data_throughput.txt (the loader against torchvision's, and the device stage's ms per batch);
# empty_cache.txt (step time and memory with torch.cuda.empty_cache() after every step: docs/faq.md);
# recipe_rtx3060.txt/.json (the rtx3060 recipe for one short epoch with the allocator capped at its
# 12 GB card, stopped and resumed, then exported: the measured peak against the plan);
# recipe_rtx3060_staged.txt/.json (the same with train.freeze_epochs=1 over two epochs: ResNet50 at
# 224 px head-only, then whole, each phase's measured peak against its own plan);
# fit_sweep_resnet50.txt / fit_sweep_efficientnet_b0.txt (train.fit: fastest's pick and probe cost
# beside every candidate trained directly, capped at 12 GiB; ResNet50's in bf16 and fp16 each, the
# chooser under train.precision: auto, which runs bf16: the sweep says what that rule costs);
# progressive_resnet50.txt / progressive_efficientnet_b0.txt (fixed 224 px against progressive
# resizing over three seeds, the same cap: accuracy and wall).
# Runs from a checkout without installing it (PYTHONPATH=src); uses .venv when there is one.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline

{
  date -u
  git rev-parse HEAD 2>/dev/null
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1
  $PY -c "import torch, timm, accelerate; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'cudnn', torch.backends.cudnn.version(), '| timm', timm.__version__, '| accelerate', accelerate.__version__)"
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

$PY bench/throughput.py --models resnet50,efficientnet_b0 --image-size 224 --precision fp32,bf16 \
  --channels-last --json "$OUT/throughput.json" 2>"$OUT/throughput.log" | tee "$OUT/throughput.txt"
status=${PIPESTATUS[0]}

# The absolute target holds for one H200 only; other cards print their figure for the record.
$PY - "$OUT/throughput.json" <<'EOF' | tee -a "$OUT/throughput.txt"
import json, sys
results = json.load(open(sys.argv[1]))["results"]
for r in results:
    if r["model"] == "resnet50" and r["precision"] == "bf16":
        target = 3000 if "H200" in r["device"] else None
        verdict = "" if target is None else (" ok" if r["vramfit"] >= target else " MISSED")
        print(f"resnet50 bf16 channels_last on {r['device']}: {r['vramfit']:.0f} images/s"
              + (f" (target >= {target} on one H200){verdict}" if target else ""))
EOF
$PY bench/loader_memory.py --workers 0 2 2>&1 | tee "$OUT/loader_memory.txt"
$PY bench/data_throughput.py --cases a --repeats 1 2>&1 | tee "$OUT/data_throughput.txt"
$PY bench/memory_check.py --empty-cache 2>&1 | tee "$OUT/empty_cache.txt"
OUT="$OUT" $PY bench/recipe_run.py --recipe rtx3060 2>"$OUT/recipe_rtx3060.log" | tee "$OUT/recipe_rtx3060.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
OUT="$OUT" $PY bench/recipe_run.py --recipe rtx3060 --staged --train-samples 512 \
  2>"$OUT/recipe_rtx3060_staged.log" | tee "$OUT/recipe_rtx3060_staged.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
# train.fit: fastest against every candidate, ResNet50 and EfficientNet-B0 at 224 px with the
# allocator capped at the rtx3060 recipe's 12 GB card (one round each, to fit the time).
for m in resnet50 efficientnet_b0; do
  precisions=()
  [ "$m" = resnet50 ] && precisions=(--precisions bf16,fp16)
  $PY bench/fit_sweep.py --recipe rtx3060 --model "$m" --image-size 224 --train-samples 1024 --rounds 1 \
    "${precisions[@]}" --json "$OUT/fit_sweep_$m.json" 2>"$OUT/fit_sweep_$m.log" | tee "$OUT/fit_sweep_$m.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done
# Progressive resizing against the fixed size, the same models and cap (three seeds, short runs).
for m in resnet50 efficientnet_b0; do
  $PY bench/progressive.py --recipe rtx3060 --model "$m" --image-size 224 --train-samples 1024 --epochs 4 \
    --json "$OUT/progressive_$m.json" 2>"$OUT/progressive_$m.log" | tee "$OUT/progressive_$m.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done
exit "$status"
