#!/usr/bin/env bash
# One command for a lent GPU machine (H100; Python 3.12, torch 2.11+cu130, transformers, pytest-xdist; no
# torch_xla, no network; the repository copied to the working directory):
#
#     OUT=/path/to/out bash benchmarks/gpu_session.sh
#
# 1. environment (nvidia-smi, versions)        -> $OUT/env.log
# 2. every kernel in csrc/ built, 7 in parallel -> $OUT/build_<op>.log (cache: $ACCEL_EXT_DIR under /root)
# 3. the GPU-relevant tests, pytest -n 8        -> $OUT/pytest.log
# 4. benchmarks/bert_base.py --workload both    -> $OUT/bert_base.log, bert_base_cuda.json/png
# 5. benchmarks/multi_stream.py                -> $OUT/multi_stream.log, multi_stream.json/png
# 6. benchmarks/host_cost.py --device cuda      -> $OUT/host_cost.log, host_cost_cuda.json/png
# 7. benchmarks/kernels.py --device cuda        -> $OUT/kernels.log, kernels_cuda.json/png
# The result files this session writes in benchmarks/results/ are copied to $OUT. A failing step does not
# stop the next; $OUT/exit_codes.txt has "<step> <exit status> <seconds>" per step (124: timed out) and
# the script exits 1 when any step failed. The whole session fits 10 minutes of wall clock: each step's
# timeout is its own cap, cut so that the steps after it keep their reserve (budget below).
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder that receives the logs and results}"
mkdir -p "$OUT"
: > "$OUT/exit_codes.txt"
touch "$OUT/.started"  # results newer than this were written by this session

export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export ACCEL_EXT_DIR="${ACCEL_EXT_DIR:-/root/.cache/accel/ext}"
export PYTHONUNBUFFERED=1  # a step killed by its timeout still leaves its log
PY="${PYTHON:-python}"
SESSION_S="${GPU_SESSION_S:-570}"  # 10 minutes, less a margin for start-up, kills and copying
START=$SECONDS
FAILED=0

# budget CAP RESERVE: seconds for the next step: CAP, or less so that RESERVE seconds stay for later steps
budget() {
  local left=$(( SESSION_S - (SECONDS - START) - $2 ))
  if (( left < $1 )); then echo $(( left > 20 ? left : 20 )); else echo "$1"; fi
}

record() {  # record NAME STATUS SECONDS
  echo "$1 $2 $3s" >> "$OUT/exit_codes.txt"
  echo "   $1: exit $2 after $3s"
  (( $2 == 0 )) || FAILED=1
}

step() {  # step NAME TIMEOUT_S COMMAND...: run it under a timeout, output in $OUT/NAME.log
  local name=$1 limit=$2 t0=$SECONDS
  shift 2
  echo "== $name (timeout ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  record "$name" $? $(( SECONDS - t0 ))
}

build_kernels() {  # build_kernels TIMEOUT_S: one process per op, all at once (each op is its own extension)
  local limit=$1 t0=$SECONDS pids=() ops=() op i
  for src in csrc/cpu/*.cpp; do
    op=$(basename "$src" .cpp)
    ops+=("$op")
    timeout --kill-after=10 "$limit" "$PY" -c "from accel.runtime import _build; _build.load('$op')" \
      > "$OUT/build_$op.log" 2>&1 &
    pids+=($!)
  done
  echo "== build ${ops[*]} (timeout ${limit}s)"
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}"
    record "build_${ops[$i]}" $? $(( SECONDS - t0 ))
  done
}

existing_paths() {  # the arguments that exist; a missing test folder would make pytest run nothing
  local path
  for path in "$@"; do
    if [[ -e $path ]]; then echo "$path"; else echo "note: $path does not exist, not tested" >&2; fi
  done
}

collect_results() {
  find benchmarks/results -maxdepth 1 -type f -newer "$OUT/.started" -exec cp {} "$OUT"/ \;
}

# Reserves: what the later steps need at least (pytest 120 s, bert_base 200 s, kernels 60 s).
step env 30 bash -c "nvidia-smi; $PY -c 'import sys, torch, transformers; print(sys.version); \
print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, torch.cuda.get_device_name()); \
print(\"transformers\", transformers.__version__)'"
build_kernels "$(budget 150 380)"
mapfile -t TESTS < <(existing_paths tests/runtime tests/amp tests/data tests/compiler tests/test_checkpoint.py \
  tests/test_accelerate.py tests/test_config.py)
step pytest "$(budget 180 260)" "$PY" -m pytest -q -n 8 "${TESTS[@]}"
BERT_S=$(budget 330 60)
# --budget-s: rows that would start in the last 100 s are skipped (one row compiles for up to ~a minute),
# so the run ends with its table, JSON and PNG instead of being killed.
step bert_base "$BERT_S" "$PY" benchmarks/bert_base.py --workload both --fixed-sizes 32x128,256x128,64x512 \
  --budget-s $(( BERT_S > 160 ? BERT_S - 100 : 60 ))
collect_results
step multi_stream "$(budget 60 100)" "$PY" benchmarks/multi_stream.py
collect_results
step host_cost "$(budget 40 60)" "$PY" benchmarks/host_cost.py --device cuda --rounds 9
collect_results
step kernels "$(budget 90 0)" "$PY" benchmarks/kernels.py --device cuda
collect_results

echo "== done in $(( SECONDS - START ))s; exit codes:"
cat "$OUT/exit_codes.txt"
exit "$FAILED"
