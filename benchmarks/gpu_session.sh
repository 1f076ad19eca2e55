#!/usr/bin/env bash
# The GPU work of a session on a lent machine (H100 or H200; Python 3.12, torch 2.11+cu130, transformers,
# pytest-xdist; no torch_xla, no network; the repository copied to the working directory):
#
#     OUT=/tmp/r1 STEPS="env build pytest" GPU_SESSION_S=400 bash benchmarks/gpu_session.sh        # first call
#     OUT=/tmp/r2 STEPS="bert_base step_profile" GPU_SESSION_S=<seconds left> bash benchmarks/gpu_session.sh
#
# each followed, in the same device call, by `tar czf $OUT/r1.tgz -C /tmp/r1 .` (the tool brings back at most
# 8 files: give OUT a folder of your own and pack it into the tool's $OUT).
# A device call runs 10 minutes at most and a session has 15 minutes of device time, the machine's start
# (~30 s) included; a second call within 30 s finds the machine warm (the build is then a cache hit).
# 2026-11-26 on an H200: build 53 s, the tests ~250 s with -n 16, each compiled bert_base row ~35 s of
# compiling. 2026-11-27 on an H100: both trees' builds (16 at once) 123 s; the six changed ops' test files
# 246 s (before OMP_NUM_THREADS=1); kernels.py of 3 ops with peers ~100 s, ours only ~20 s an op. Its second
# run: 8 ops and 3 baseline ops built in 106 s; a compiled BERT-base row at 32x128 ~55-60 s (compile ~55 s);
# tests/compiler/test_cuda_step.py 63 s, tests/test_accelerate.py over 100 s (27 of 36 done) with -n 16.
# bert_base runs the headline rows first (peer and accel of every size) and stops starting rows when its
# budget is spent. BERT_ARGS replaces bert_base's workload arguments (default: --workload both
# --fixed-sizes 32x128,256x128,64x512; e.g. "--workload guide --modes peer,accel"), KERNELS_ARGS adds
# arguments to kernels.py; PROFILE_SIZE (default 32x128) is step_profile's size, PROFILE_MODES (default peer,accel)
# its modes (bert_base.py's, accel:FIELD=VALUE variants too).
# STEPS picks steps by name, in the order below; the default is all of them:
# env     environment (nvidia-smi, versions)              -> $OUT/env.log
# build   every kernel in csrc/ built, 7 in parallel       -> $OUT/build_<op>.log (cache: $ACCEL_EXT_DIR under /root)
#         (and $BASELINE_TREE's, when set, beside them     -> $OUT/build_base_<op>.log; $BASELINE_OPS, when
#         set, names the baseline's ops to build)
# crash_bt  $CRASH_TESTS (node ids) under cuda-gdb, only when named -> $OUT/crash_bt.log (native backtrace)
# pytest  the GPU-relevant tests, pytest -n 16 -v          -> $OUT/pytest.log ($TESTS_FIRST first: e.g. the tests
#         of the kernels changed since the last GPU run, so a run cut by its timeout has them; $PYTEST_PATHS,
#         when set, replaces the default folders (or node ids): a short call tests only what changed; $PYTEST_S caps
#         it, 300 s; $PYTEST_K selects by name, pytest's -k)
# bert_base     benchmarks/bert_base.py ($BERT_ARGS)       -> $OUT/bert_base.log, bert_base_cuda.json/png
# causal_lm     benchmarks/causal_lm.py ($CAUSAL_ARGS), only when named -> $OUT/causal_lm.log, causal_lm_cuda.json/png
#               (it, vit_base and decoder_classifier get --budget-s as bert_base does: no row starts in the last 100 s)
# vit_base      benchmarks/vit_base.py ($VIT_ARGS), only when named -> $OUT/vit_base.log, vit_base_cuda.json/png
# decoder_classifier  benchmarks/decoder_classifier.py ($CLASSIFIER_ARGS), only when named
#               -> $OUT/decoder_classifier.log, decoder_classifier_cuda[_fixed].json/png
# model_families  benchmarks/model_families.py ($FAMILIES_ARGS), only when named
#               -> $OUT/model_families.log, model_families_cuda.json/png
# step_profile  benchmarks/step_profile.py, peer vs accel   -> $OUT/step_profile.log, step_profile_cuda.json/png
#               and each mode's timeline, step_profile_cuda_<mode>.trace.json.gz (ui.perfetto.dev)
# multi_stream  benchmarks/multi_stream.py                 -> $OUT/multi_stream.log, multi_stream.json/png
# host_cost     benchmarks/host_cost.py --device cuda      -> $OUT/host_cost.log, host_cost_cuda.json/png
# kernels       benchmarks/kernels.py --device cuda        -> $OUT/kernels.log, kernels_cuda.json/png
# kernels_base  our ops alone (--ours-only) from $BASELINE_TREE, this tree with an earlier commit's csrc/ (made
#               before the call by `mkdir _baseline && git archive HEAD accel benchmarks/*.py
#               benchmarks/kernel_cases | tar -x -C _baseline && git archive REV csrc | tar -x -C _baseline`;
#               git ignores _baseline/, so name it in the device tool's `carry`): a kernel change and the code
#               it replaces measured by the same cases on one machine in one call, with no switch in the
#               library -> $OUT/kernels_base.log, base/kernels_cuda.json; with the kernels step's result
#               beside it, benchmarks/kernels_ab.py's table of the two -> $OUT/kernels_ab.log, kernels_ab_cuda.json/png
# The result files this session writes in benchmarks/results/ are copied to $OUT. A failing step does not
# stop the next; $OUT/exit_codes.txt has "<step> <exit status> <seconds>" per step (124: timed out) and
# the script exits 1 when any step failed. A call fits 10 minutes of wall clock (GPU_SESSION_S): each step's
# timeout is its own cap, cut so that the selected steps after it keep their reserve (RESERVE below); the
# benchmarks get a time budget of their own, so they end with their table and files instead of being killed.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder that receives the logs and results}"
mkdir -p "$OUT"
: > "$OUT/exit_codes.txt"
touch "$OUT/.started"  # results newer than this were written by this session

export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export ACCEL_EXT_DIR="${ACCEL_EXT_DIR:-/root/.cache/accel/ext}"
BASE_EXT_DIR="$ACCEL_EXT_DIR/baseline"  # $BASELINE_TREE's kernels
export PYTHONUNBUFFERED=1  # a step killed by its timeout still leaves its log
PY="${PYTHON:-python}"
SESSION_S="${GPU_SESSION_S:-570}"  # 10 minutes, less a margin for start-up, kills and copying
START=$SECONDS
FAILED=0

# The least each step needs when it runs after others (seconds).
declare -A RESERVE=([env]=0 [build]=60 [crash_bt]=60 [pytest]=120 [bert_base]=260 [causal_lm]=180 [vit_base]=150
                    [decoder_classifier]=150 [model_families]=240
                    [step_profile]=100 [multi_stream]=40 [host_cost]=30 [kernels]=60 [kernels_base]=90)
ORDER=(env build crash_bt pytest bert_base causal_lm vit_base decoder_classifier model_families step_profile multi_stream
       host_cost kernels kernels_base)
DEFAULT_STEPS=" ${ORDER[*]} "
DEFAULT_STEPS=${DEFAULT_STEPS/ crash_bt / }
DEFAULT_STEPS=${DEFAULT_STEPS/ causal_lm / }
DEFAULT_STEPS=${DEFAULT_STEPS/ vit_base / }
DEFAULT_STEPS=${DEFAULT_STEPS/ decoder_classifier / }
DEFAULT_STEPS=${DEFAULT_STEPS/ model_families / }
DEFAULT_STEPS=${DEFAULT_STEPS/ kernels_base / }
STEPS="${STEPS:-$DEFAULT_STEPS}"  # crash_bt, causal_lm, vit_base, decoder_classifier, model_families, kernels_base:
                                  # only when named
for name in $STEPS; do
  [[ -v "RESERVE[$name]" ]] || { echo "STEPS: unknown step '$name' (known: ${ORDER[*]})" >&2; exit 2; }
done

want() {  # want NAME: whether STEPS selects it
  [[ " $STEPS " == *" $1 "* ]]
}

reserve_after() {  # reserve_after NAME: what the selected steps after NAME need
  local total=0 seen=0 name
  for name in "${ORDER[@]}"; do
    if (( seen )) && want "$name"; then total=$(( total + RESERVE[$name] )); fi
    [[ $name == "$1" ]] && seen=1
  done
  echo "$total"
}

# budget NAME CAP: seconds for step NAME: CAP, or less so that the selected steps after it keep their reserve
budget() {
  local left=$(( SESSION_S - (SECONDS - START) - $(reserve_after "$1") ))
  if (( left < $2 )); then echo $(( left > 20 ? left : 20 )); else echo "$2"; fi
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

build_kernels() {  # build_kernels TIMEOUT_S: one process per op, all at once (each op is its own extension),
  # and those of $BASELINE_TREE too when it is set (for kernels_base, a later call on the warm machine)
  local limit=$1 t0=$SECONDS pids=() names=() op i tree prefix ext
  for tree in . ${BASELINE_TREE:+"$BASELINE_TREE"}; do
    prefix=build_ ext=$ACCEL_EXT_DIR
    # the baseline's builds in a folder of their own: one op's two trees in one folder would race here
    # and rebuild each other at every switch (an H100 call spent its kernels_base time so)
    [[ $tree == . ]] || prefix=build_base_ ext=$BASE_EXT_DIR
    for src in "$tree"/csrc/cpu/*.cpp; do
      op=$(basename "$src" .cpp)
      # BASELINE_OPS (names): the baseline's ops to build, those of KERNELS_ARGS' --ops (a build is ~a minute)
      [[ $tree == . || -z ${BASELINE_OPS:-} || " $BASELINE_OPS " == *" $op "* ]] || continue
      names+=("$prefix$op")
      # run from the tree: `python -c` puts the working directory ahead of PYTHONPATH on sys.path
      (cd "$tree" && ACCEL_EXT_DIR=$ext exec timeout --kill-after=10 "$limit" \
        "$PY" -c "from accel.runtime import _build; _build.load('$op')") > "$OUT/$prefix$op.log" 2>&1 &
      pids+=($!)
    done
  done
  echo "== build ${names[*]} (timeout ${limit}s)"
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}"
    record "${names[$i]}" $? $(( SECONDS - t0 ))
  done
}

existing_paths() {  # the arguments that exist (a node id, file::test[param], by its file); a missing test folder
  # would make pytest run nothing
  local path
  for path in "$@"; do
    if [[ -e ${path%%::*} ]]; then echo "$path"; else echo "note: $path does not exist, not tested" >&2; fi
  done
}

collect_results() {
  find benchmarks/results -maxdepth 1 -type f -newer "$OUT/.started" -exec cp {} "$OUT"/ \;
}

if want env; then
  step env 30 bash -c "nvidia-smi; $PY -c 'import sys, torch, transformers; print(sys.version); \
print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, torch.cuda.get_device_name()); \
print(\"transformers\", transformers.__version__)'"
fi
if want build; then build_kernels "$(budget build 150)"; fi
if want crash_bt; then
  # the native backtrace of tests that kill their process (SIGSEGV): cuda-gdb debugs host code too
  : "${CRASH_TESTS:?crash_bt: set CRASH_TESTS to the pytest node ids to run under the debugger}"
  GDB=$(command -v cuda-gdb || command -v gdb)
  # shellcheck disable=SC2086  # CRASH_TESTS is a list of node ids
  step crash_bt "$(budget crash_bt 90)" "$GDB" -q -batch -ex "set pagination off" -ex run -ex "bt 60" \
    -ex "info sharedlibrary" --args "$PY" -m pytest -x -q -p no:cacheprovider $CRASH_TESTS
fi
if want pytest; then
  # TESTS_FIRST (paths): collected, so run, first; pytest drops them where the folders name them again
  # shellcheck disable=SC2086  # TESTS_FIRST and PYTEST_PATHS are lists of paths
  mapfile -t TESTS < <(existing_paths ${TESTS_FIRST:-} ${PYTEST_PATHS:-tests/runtime tests/amp tests/data \
    tests/compiler tests/test_checkpoint.py tests/test_accelerate.py tests/test_config.py})
  # -v: one line per test as it ends, so a run stopped by its timeout still shows what failed
  # --durations: which tests take the call's time, for choosing what to run when time is short
  # --deselect: the CPU kernels' portable loops, a subprocess rerun of four test files (CPU only; CI runs it);
  # with it the 2026-11-26 runs did not finish in 240 and 300 s
  # OMP_NUM_THREADS=1: 16 workers each running OpenMP over 16 cores made the CPU cases of fused_adam 70-100 s
  # apiece on an H100 machine (six test files took 246 s); tests that need threads set their own count
  # PYTEST_K: pytest's -k, e.g. "cuda" for the CUDA cases alone (their CPU twins compile for minutes on one thread)
  OMP_NUM_THREADS=1 step pytest "$(budget pytest "${PYTEST_S:-300}")" "$PY" -m pytest -v -n 16 --durations=30 -p no:cacheprovider \
    ${PYTEST_K:+-k "$PYTEST_K"} \
    --deselect tests/runtime/test_portable_paths.py::test_kernel_tests_pass_on_the_portable_loops "${TESTS[@]}"
fi
if want bert_base; then
  BERT_S=$(budget bert_base 330)
  # --budget-s: rows that would start in the last 100 s are skipped (one row compiles for up to ~a minute),
  # so the run ends with its table, JSON and PNG instead of being killed.
  # TORCH_LOGS=perf_hints: where Inductor runs a graph without the CUDA graphs asked for, the log says why
  # (the row's "graph skips" counts it)
  # shellcheck disable=SC2086  # BERT_ARGS is a list of words
  TORCH_LOGS="${TORCH_LOGS:-perf_hints}" step bert_base "$BERT_S" "$PY" benchmarks/bert_base.py ${BERT_ARGS:---workload both --fixed-sizes 32x128,256x128,64x512} \
    --budget-s $(( BERT_S > 160 ? BERT_S - 100 : 60 ))
  collect_results
fi
# One workload's benchmark, only when named: benchmarks/<name>.py with the words of its *_ARGS variable
benchmark_step() {  # name, default budget in seconds, the benchmark's arguments
  local name=$1 seconds
  seconds=$(budget "$name" "$2")
  shift 2
  # --budget-s as bert_base's: rows that would start in the last 100 s are skipped, so the run ends with its
  # table and files instead of being killed (model_families keeps its own pacing)
  local paced=()
  [[ $name == model_families ]] || paced=(--budget-s $(( seconds > 160 ? seconds - 100 : 60 )))
  step "$name" "$seconds" "$PY" "benchmarks/$name.py" "${paced[@]}" "$@"
  collect_results
}
# shellcheck disable=SC2086  # each *_ARGS is a list of words
{
  if want causal_lm; then benchmark_step causal_lm 420 ${CAUSAL_ARGS:-}; fi
  if want vit_base; then benchmark_step vit_base 200 ${VIT_ARGS:-}; fi
  if want decoder_classifier; then benchmark_step decoder_classifier 200 ${CLASSIFIER_ARGS:-}; fi
  if want model_families; then benchmark_step model_families 300 ${FAMILIES_ARGS:-}; fi
}
if want step_profile; then
  # where the step's time goes, peer against accel, at the size where accel leads least (a compile per mode)
  TORCH_LOGS="${TORCH_LOGS:-perf_hints}" step step_profile "$(budget step_profile 200)" "$PY" benchmarks/step_profile.py --size "${PROFILE_SIZE:-32x128}" \
    --modes "${PROFILE_MODES:-peer,accel}" --trace
  collect_results
fi
if want multi_stream; then
  step multi_stream "$(budget multi_stream 60)" "$PY" benchmarks/multi_stream.py
  collect_results
fi
if want host_cost; then
  step host_cost "$(budget host_cost 40)" "$PY" benchmarks/host_cost.py --device cuda --rounds 9
  collect_results
fi
if want kernels; then
  KERNELS_S=$(budget kernels 420)
  # cases that would start in the last 40 s are skipped (a case with compiled peers compiles first)
  # shellcheck disable=SC2086  # KERNELS_ARGS is a list of words
  step kernels "$KERNELS_S" "$PY" benchmarks/kernels.py --device cuda \
    --budget-s $(( KERNELS_S > 80 ? KERNELS_S - 40 : 40 )) ${KERNELS_ARGS:-}
  collect_results
fi
if want kernels_base; then
  : "${BASELINE_TREE:?kernels_base: set BASELINE_TREE to a folder holding an earlier tree (accel, csrc, benchmarks)}"
  KERNELS_S=$(budget kernels_base 300)
  mkdir -p "$OUT/base"
  # the baseline's kernels.py puts its own tree first on sys.path; its kernels build under their own fingerprint;
  # the peers are the kernels step's (same cases, same machine)
  # shellcheck disable=SC2086  # KERNELS_ARGS is a list of words
  PYTHONPATH="$BASELINE_TREE:$PYTHONPATH" ACCEL_EXT_DIR=$BASE_EXT_DIR step kernels_base "$KERNELS_S" "$PY" "$BASELINE_TREE/benchmarks/kernels.py" --device cuda \
    --budget-s $(( KERNELS_S > 120 ? KERNELS_S - 60 : 60 )) --results-dir "$OUT/base" --ours-only ${KERNELS_ARGS:-}
  if [[ -f benchmarks/results/kernels_cuda.json && -f $OUT/base/kernels_cuda.json ]]; then  # the A/B table
    "$PY" benchmarks/kernels_ab.py benchmarks/results/kernels_cuda.json "$OUT/base/kernels_cuda.json" \
      --results-dir "$OUT" > "$OUT/kernels_ab.log" 2>&1
  fi
fi

echo "== done in $(( SECONDS - START ))s; exit codes:"
cat "$OUT/exit_codes.txt"
exit "$FAILED"
