#!/usr/bin/env bash
# The wheels the lent GPU machine lacks and bench/gpu_check.sh imports, into .whl/ (ignored by git),
# to travel with the working tree (the device tool's `carry: [".whl"]`): that machine has no network.
#
#   bash bench/gpu_wheels.sh                    # cp312 manylinux x86-64 wheels, for the GPU machine
#   PY_VERSION=3.11 bash bench/gpu_wheels.sh    # the same set for a Python 3.11 (the CPU rehearsal)
#   EXTRA="pyarrow fsspec" bash bench/gpu_wheels.sh  # and these, where the check's setup stage printed
#                                               # that the machine's version does not meet a wheel's need
#
# Its image already holds torch, timm, accelerate, numpy, pandas, pyarrow, fsspec, xxhash, requests,
# huggingface-hub, ... (docs/benchmarks.md, "The GPU check"); missing are vramfit's config (pydantic
# and its three dependencies) and its metrics and data sources (datasets, evaluate, and their dill and
# multiprocess). typing_extensions is there, but pydantic 2.14 and pydantic-core need >= 4.16, a
# version the image may predate. wandb and torch-lr-finder stay behind: vramfit imports them only
# for `tracker: wandb` and `lr-find`, which the check never runs. One version each (two stop
# the install), at constraints.txt's versions; the total stays far under the tree's 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
PY_VERSION=${PY_VERSION:-3.12}
PACKAGES=(pydantic pydantic_core annotated-types typing-inspection typing_extensions
          datasets dill multiprocess evaluate)
read -r -a extra <<<"${EXTRA:-}"
PACKAGES+=("${extra[@]}")

pin() {  # NAME -> NAME==VERSION from constraints.txt (names compared as pip normalises them)
  local want line norm
  want=$(echo "$1" | tr 'A-Z_.' 'a-z--')
  while IFS= read -r line; do
    norm=$(echo "${line%%==*}" | tr 'A-Z_.' 'a-z--')
    [ "$norm" = "$want" ] && { echo "$line"; return; }
  done < <(grep -v '^#' constraints.txt)
  echo "gpu_wheels: $1 is not pinned in constraints.txt" >&2
  return 1
}

rm -rf .whl
mkdir -p .whl
for name in "${PACKAGES[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "$(pin "$name")" 2> >(grep -v "is ignored" >&2)
done
ls -1 .whl
count=$(ls .whl/*.whl | wc -l)
[ "$count" -eq "${#PACKAGES[@]}" ] || { echo "gpu_wheels: $count wheels for ${#PACKAGES[@]} packages" >&2; exit 1; }
total=$(du -cb .whl/*.whl | tail -1 | cut -f1)
echo "gpu_wheels: ${#PACKAGES[@]} wheels for Python $PY_VERSION, $((total / 1024)) KiB in .whl/"
