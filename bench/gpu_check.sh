#!/usr/bin/env bash
# The GPU check: a runbook for one lent GPU machine (no network, one command of at most 10 minutes,
# 8 files back from $OUT). docs/benchmarks.md ("The GPU check") gives the exact device call.
#
#   bash bench/gpu_wheels.sh                            # here, first: the wheels it installs (.whl/)
#   OUT=/tmp/gc bash bench/gpu_check.sh                 # on the GPU machine, within BUDGET_S (480 s)
#   ONLY=fit,progressive BUDGET_S=240 bash bench/gpu_check.sh   # a rerun of some stages (setup always runs)
#   OUT=/tmp/gc BUDGET_S=300 bash bench/gpu_check.sh --rehearse # the same stages at toy sizes on a CPU
#   bash bench/gpu_check.sh --plan                      # the stages and their seconds, run nothing
#
# Stages, in the order of their value (each `timeout`-capped; GPU estimates for one H100):
#   setup        install .whl/*.whl (pip --no-index --no-deps --target, PYTHONPATH), versions, the
#                wheels' unmet needs, every vramfit module imported: stops the runbook if one fails (~25 s)
#   planner      bench/memory_check.py: predicted against measured peak, ResNet50 and EfficientNet-B0,
#                fp32 and bf16, micro 32 and 64; each one's pick under a 12 GiB cap against the
#                largest micro-batch that really fits (~90 s: 8 measured steps, 4 bisections)
#   recipe       bench/recipe_run.py: the rtx3060 recipe capped at 12 GiB, stopped, resumed, exported,
#                measured peak against the plan; then --staged, each phase against its own (~80 s)
#   throughput   bench/throughput.py: the step against a plain Accelerate loop, both models, fp32 and
#                bf16, channels_last, batch 256, best of 2 x 20 steps (~70 s)
#   fit          bench/fit_sweep.py: train.fit: fastest against its 7 candidates, ResNet50 capped at
#                12 GiB, sized to the seconds it is granted (bench/gpu_check.py size)
#   progressive  bench/progressive.py: fixed 224 px against progressive resizing, one seed, sized so too
# A stage needs MIN seconds and gets at most CAP: min(CAP, time left less the later stages' MIN),
# or, where that is under its MIN, min(CAP, time left) (an earlier stage is worth more); a stage
# that cannot get its MIN is skipped and says so. CAP_<stage>=MIN:CAP overrides one.
# Output ($OUT, 3 files): results.txt (appended after each stage: status, exit code, seconds, its
# figures; a stage cut short leaves what it printed), results.json (every figure), logs.tar.gz.
# Exit: 0 when every stage ran or was skipped or cut off (each one's verdicts are in results.txt),
# 1 when a stage crashed (exit >= 2 or a traceback), 3 when setup failed.
set -uo pipefail
cd "$(dirname "$0")/.."
SELF=bench/gpu_check.sh
MODE=gpu ACTION=run STAGE=
while [ $# -gt 0 ]; do
  case $1 in
    --rehearse) MODE=rehearse ;;
    --plan) ACTION=plan ;;
    --stage) ACTION=stage STAGE=$2; shift ;;
    *) echo "gpu_check.sh: unknown argument $1 (--rehearse, --plan, --stage NAME)" >&2; exit 2 ;;
  esac
  shift
done
MODE_FLAG=()
[ "$MODE" = rehearse ] && MODE_FLAG=(--rehearse)
OUT=${OUT:-bench-out} WORK=${WORK:-${TMPDIR:-/tmp}/vramfit-gpu-check} PY=${PY:-python3}
BUDGET_S=${BUDGET_S:-480}
# The wrap-up after the last stage (results.json, the tar) and timeout's grace: kept out of the stages.
RESERVE_S=10
export PYTHONPATH=$PWD/src:$WORK/site PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline

stage_table() {  # name MIN CAP, in the order of their value
  if [ "$MODE" = rehearse ]; then
    printf '%s\n' "setup 60 60" "planner 25 25" "recipe 90 90" "throughput 40 40" "fit 40 60" \
      "progressive 30 60"
  else
    printf '%s\n' "setup 40 40" "planner 110 110" "recipe 100 100" "throughput 80 80" "fit 80 120" \
      "progressive 60 120"
  fi
}

selected() {  # the table less what ONLY leaves out (setup always), CAP_<name> applied
  local name min cap var
  while read -r name min cap; do
    [ -n "${ONLY:-}" ] && [ "$name" != setup ] && [[ ",$ONLY," != *",$name,"* ]] && continue
    var=CAP_$name
    if [ -n "${!var:-}" ]; then min=${!var%%:*} cap=${!var##*:}; fi
    echo "$name $min $cap"
  done < <(stage_table)
}

# ------------------------------------------------------------------------------------------ stages
# Each runs as `bash bench/gpu_check.sh --stage NAME` under timeout, with STAGE_S (its seconds) and
# FIG (the folder for its JSON figures); its stdout is what results.txt shows, its stderr the log.

stage_setup() {
  compgen -G ".whl/*.whl" >/dev/null || { echo "no wheels in .whl/: run bash bench/gpu_wheels.sh first" \
    "(on the device call, carry .whl)"; return 1; }
  $PY -m pip install -q --isolated --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$WORK/site" .whl/*.whl || return 1
  date -u
  git rev-parse HEAD 2>/dev/null || echo "(no git history in this copy)"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm \
    --format=csv,noheader
  $PY bench/gpu_check.py setup .whl
}

stage_planner() {
  local args=(--quick --models resnet50,efficientnet_b0 --precisions no,bf16 --micros 32,64 --picks
              --cap-gib 12 --time-limit $((STAGE_S - 30)) --out "$FIG")
  if [ "$MODE" = rehearse ]; then
    echo "on a GPU: $PY bench/memory_check.py ${args[*]}"
    echo "here (no CUDA): the planner's side only, at a toy size"
    args=(--dry-run --quick --models test_resnet --precisions no,bf16 --micros 8,16 --picks --image-size 32
          --cap-gib 3 --out "$FIG")
  fi
  $PY bench/memory_check.py "${args[@]}"
}

stage_recipe() {
  local toy=()
  [ "$MODE" = rehearse ] && toy=(--cpu --model test_resnet --image-size 32 --train-samples 64
                                 --set train.global_batch=16 --set train.precision=auto
                                 --set data.limit_val_samples=64)
  OUT=$FIG $PY bench/recipe_run.py --recipe rtx3060 "${toy[@]}" || return
  # The plain run's figures are printed by now: a cap that cuts the staged one leaves them.
  OUT=$FIG $PY bench/recipe_run.py --recipe rtx3060 --staged --train-samples 512 "${toy[@]}"
}

stage_throughput() {
  local args=(--models resnet50,efficientnet_b0 --image-size 224 --precision fp32,bf16 --channels-last
              --batch 256 --steps 20 --warmup 5 --repeats 2)
  [ "$MODE" = rehearse ] && args=(--quick --steps 2 --repeats 1 --num-classes 10)
  $PY bench/throughput.py "${args[@]}" --json "$FIG/throughput.json"
  local code=$?
  [ -f "$FIG/throughput.json" ] && $PY bench/gpu_check.py target "$FIG/throughput.json"
  return $code
}

stage_fit() {
  local n e args
  n=$($PY bench/gpu_check.py size fit "$STAGE_S")
  e=$($PY bench/gpu_check.py chooser-epochs "$n")  # a chooser's run long enough to measure
  args=(--recipe rtx3060 --model resnet50 --image-size 224 --train-samples "$n" --chooser-epochs "$e")
  if [ "$MODE" = rehearse ]; then
    echo "on a GPU with ${STAGE_S} s: $PY bench/fit_sweep.py ${args[*]} --rounds 1"
    args=(--recipe quickstart --model test_resnet --train-samples 64 --chooser-epochs 1)
  fi
  $PY bench/fit_sweep.py "${args[@]}" --rounds 1 --out "$WORK/runs/fit" \
    --json "$FIG/fit_sweep.json"
}

stage_progressive() {
  local n args
  n=$($PY bench/gpu_check.py size progressive "$STAGE_S")
  args=(--recipe rtx3060 --model resnet50 --image-size 224 --train-samples "$n" --epochs 4)
  if [ "$MODE" = rehearse ]; then
    echo "on a GPU with ${STAGE_S} s: $PY bench/progressive.py ${args[*]} --seeds 0"
    args=(--recipe quickstart --model test_resnet --train-samples 64 --epochs 2)
  fi
  $PY bench/progressive.py "${args[@]}" --seeds 0 --out "$WORK/runs/progressive" --json "$FIG/progressive.json"
}

if [ "$ACTION" = stage ]; then
  mkdir -p "$FIG"
  "stage_$STAGE"
  exit $?
fi

# ------------------------------------------------------------------------------------------ runner

if [ "$ACTION" = plan ]; then
  total=0
  echo "mode $MODE, BUDGET_S $BUDGET_S (less $RESERVE_S s for the wrap-up)"
  while read -r name min cap; do
    echo "stage $name min $min cap $cap"
    total=$((total + min))
  done < <(selected)
  echo "sum of min $total of $((BUDGET_S - RESERVE_S)): $([ $total -le $((BUDGET_S - RESERVE_S)) ] && echo fits || echo 'does not fit')"
  exit 0
fi

mkdir -p "$OUT"
rm -f "$OUT/results.txt" "$OUT/results.json" "$OUT/logs.tar.gz"  # a run's files are its own
rm -rf "$WORK/logs" "$WORK/figures" "$WORK/runs" "$WORK/stages.tsv"
mkdir -p "$WORK/logs" "$WORK/figures"
: >"$WORK/stages.tsv"
printf '{"mode": "%s", "budget_s": %s, "only": "%s", "started": "%s"}\n' "$MODE" "$BUDGET_S" "${ONLY:-}" \
  "$(date -u +%FT%TZ)" >"$WORK/meta.json"
start=$(date +%s)
mapfile -t STAGES < <(selected)

report() {  # name status code seconds granted: one entry of results.txt, then results.json and the tar
  local name=$1 status=$2 code=$3 seconds=$4 granted=$5
  printf '%s\t%s\t%s\t%s\t%s\n' "$@" >>"$WORK/stages.tsv"
  {
    echo "== $name: $status${code:+ (exit $code)}${seconds:+ in $seconds s}${granted:+ of its $granted s}"
    [ -f "$WORK/logs/$name.txt" ] && head -n 80 "$WORK/logs/$name.txt"
    if [ -n "$code" ] && [ "$code" != 0 ] && [ -f "$WORK/logs/$name.log" ]; then
      echo "-- the end of its log:"
      tail -n 15 "$WORK/logs/$name.log"
    fi
  } | tee -a "$OUT/results.txt"
  $PY bench/gpu_check.py collect "$WORK" "$OUT" || echo "gpu_check.sh: results.json not written" >&2
  tar -czf "$OUT/logs.tar.gz" -C "$WORK" logs stages.tsv
}

failed=0
for i in "${!STAGES[@]}"; do
  read -r name min cap <<<"${STAGES[$i]}"
  left=$((BUDGET_S - RESERVE_S - ($(date +%s) - start)))
  later=0
  for rest in "${STAGES[@]:$((i + 1))}"; do read -r _ m _ <<<"$rest"; later=$((later + m)); done
  grant=$((cap < left - later ? cap : left - later))
  [ "$grant" -lt "$min" ] && grant=$((cap < left ? cap : left))
  if [ "$grant" -lt "$min" ]; then
    report "$name" "skipped: needs $min s, $left s left of BUDGET_S" "" "" ""
    continue
  fi
  t0=$(date +%s)
  cmd_var=STAGE_CMD_$name  # a stand-in command in place of the stage (the runbook's own tests)
  if [ -n "${!cmd_var:-}" ]; then
    STAGE_S=$grant FIG=$WORK/figures/$name timeout -k 5 "$grant" bash -c "${!cmd_var}" \
      >"$WORK/logs/$name.txt" 2>"$WORK/logs/$name.log"
  else
    STAGE_S=$grant FIG=$WORK/figures/$name PY=$PY WORK=$WORK timeout -k 5 "$grant" bash "$SELF" --stage "$name" "${MODE_FLAG[@]}" \
      >"$WORK/logs/$name.txt" 2>"$WORK/logs/$name.log"
  fi
  code=$?
  case $code in
    0) status=ok ;;
    1) status="ran, a target missed or a step failed" ;;
    124 | 137) status="cut off by its cap" ;;
    *) status=failed ;;
  esac
  if grep -q "^Traceback" "$WORK/logs/$name.txt" "$WORK/logs/$name.log" 2>/dev/null; then
    status="failed (a traceback)"
  fi
  [[ $status == failed* ]] && failed=1
  report "$name" "$status" "$code" "$(($(date +%s) - t0))" "$grant"
  if [ "$name" = setup ] && [ "$code" != 0 ]; then
    echo "gpu_check.sh: setup failed; nothing else runs (results.txt says why)" | tee -a "$OUT/results.txt"
    exit 3
  fi
done
echo "== done in $(($(date +%s) - start)) s of BUDGET_S $BUDGET_S; $OUT: $(ls "$OUT" | tr '\n' ' ')" \
  | tee -a "$OUT/results.txt"
exit "$failed"
