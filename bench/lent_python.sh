#!/usr/bin/env bash
# A Python like the lent GPU machine's, for `gpu_check.sh --rehearse` on a CPU: its packages
# (the device tool's KINDS.md list, the ones the check touches) and none of those it lacks
# (pydantic, datasets, evaluate, wandb, torch-lr-finder), so the rehearsal proves that the wheels of
# bench/gpu_wheels.sh are all the check needs. torch and torchvision come from pip's local files
# where the machine has them (the versions pyproject admits).
#
#   bash bench/lent_python.sh [DIR]     # default /tmp/lent-python; then PY=DIR/bin/python
set -euo pipefail
DIR=${1:-/tmp/lent-python}
python3 -m venv "$DIR"
"$DIR/bin/python" -m pip install -q --upgrade pip
"$DIR/bin/python" -m pip install -q "torch==2.14.1" "torchvision==0.29.1" -c constraints.txt
"$DIR/bin/python" -m pip install -q -c constraints.txt timm accelerate safetensors numpy pillow pyyaml psutil \
  tqdm matplotlib scikit-learn pandas pyarrow fsspec tensorboard onnx onnxruntime onnxscript \
  huggingface_hub requests xxhash
for missing in pydantic datasets evaluate wandb torch_lr_finder; do
  if "$DIR/bin/python" -c "import $missing" 2>/dev/null; then
    echo "lent_python: $missing came in as a dependency; removing it (the GPU machine lacks it)"
    "$DIR/bin/python" -m pip uninstall -q -y "${missing//_/-}"
  fi
done
echo "lent_python: $DIR/bin/python ($("$DIR/bin/python" --version)); without pydantic, datasets, evaluate, wandb"
