#!/bin/bash
# The GPU tests in groups, a few at a time (GPU_SUITE_JOBS) and then the direct group alone, each under its own
# time limit and with its own log, so that one hang costs one group's limit and a killed pytest still leaves the groups
# that finished.
# Usage: tests/run_gpu_suite.sh LOG_DIR [python]. Exit status: 0 only if every group passed.
set -u
logs=${1:?log directory}
py=${2:-python3}
# On two H200s, with the NCCL cases that one shared GPU skips, the longest groups took 243 s (mistakes) and 284 s
# (exit_threads, two groups at once) and ran past 260 s five at once.
limit=${GPU_SUITE_GROUP_TIMEOUT_S:-480}
mkdir -p "$logs"
# name|files|-k expression (empty: every test of the file). Longest first, so that the last groups to start are short.
groups=(
  "mistakes|tests/test_user_mistakes_cuda.py|"
  "exit_threads|tests/test_exit_in_flight_cuda.py tests/test_first_calls_from_threads_cuda.py|"
  "capture_exchange|tests/test_capture_exchange_cuda.py|"
  "p2p|tests/test_p2p_cuda.py|"
  "p2p_faults|tests/test_p2p_faults_cuda.py|"
  "async_error|tests/test_async_error_handling_cuda.py|"
  "capture_p2p|tests/test_capture_p2p_cuda.py|"
  "release|tests/test_fault_release_cuda.py|"
  "capture|tests/test_capture_cuda.py|"
  "exchange|tests/test_exchange_cuda.py|"
  "allgather|tests/test_allgather_cuda.py|not peer_never_calls"
  "failure|tests/test_allgather_cuda.py|peer_never_calls"
  "conformance|tests/test_conformance_cuda.py|"
  "delegation|tests/test_delegation_cuda.py|every_collective"
  "split_mesh|tests/test_delegation_cuda.py|split_group or default_backend"
  "frameworks|tests/test_frameworks_gpu.py|"
  "hierarchical|tests/test_hierarchical_cuda.py|"
  "direct|tests/test_direct_cuda.py|"
)
names=() files=() exprs=() skip=()
for g in "${groups[@]}"; do
  IFS='|' read -r n f e <<< "$g"
  names+=("$n") files+=("$f") exprs+=("$e")
done
# The direct group checks that freed device memory comes back by reading the GPU's free memory, which every other
# process on the GPU moves: it runs alone, after the rest.
alone=${GPU_SUITE_ALONE-direct}  # GPU_SUITE_ALONE= runs every group at once
run_group() {
  # shellcheck disable=SC2086  (a group may name several files)
  timeout "$limit" "$py" -m pytest ${files[$1]} -k "${exprs[$1]}" -v -rA --durations=10 \
    > "$logs/gpu_${names[$1]}.log" 2>&1
}
report() {
  [ $2 -eq 124 ] && echo "gpu_${names[$1]}: killed after ${limit}s" >> "$logs/gpu_${names[$1]}.log"
  echo "== ${names[$1]} (rc=$2): $(grep -E '^=+ .* in [0-9.]+s' "$logs/gpu_${names[$1]}.log" | tail -1)"
  grep -E '^(FAILED|ERROR) ' "$logs/gpu_${names[$1]}.log" || true
}
# At most GPU_SUITE_JOBS groups at once: every group is two or three processes on the GPU, and under MPS each is a
# client with its own share of the server's connections and memory (with 2, 6 or 15 groups at once under MPS, ranks
# failed at their first CUDA call with "CUDA-capable device(s) is/are busy or unavailable" or out of memory, and the
# same groups passed one at a time; without MPS, 15 groups at once ran past their limit). So one at a time where an
# MPS server runs, 5 otherwise.
if pgrep -f nvidia-cuda-mps-control > /dev/null 2>&1; then jobs_default=1; else jobs_default=5; fi
jobs_max=${GPU_SUITE_JOBS:-$jobs_default}
# GPU_SUITE_ONLY="mistakes direct" runs only the groups it names.
only=" ${GPU_SUITE_ONLY:-${names[*]}} "
for i in "${!names[@]}"; do
  [[ "$only" == *" ${names[$i]} "* ]] || skip[$i]=1
done
for i in "${!names[@]}"; do
  [ "${names[$i]}" = "$alone" ] || [ -n "${skip[$i]:-}" ] && continue
  while [ "$(jobs -rp | wc -l)" -ge "$jobs_max" ]; do wait -n; done
  ( run_group "$i"; echo $? > "$logs/.rc_$i" ) &
done
wait
status=0
for i in "${!names[@]}"; do
  [ "${names[$i]}" = "$alone" ] || [ -n "${skip[$i]:-}" ] && continue
  rc=$(cat "$logs/.rc_$i" 2>/dev/null || echo 1); rm -f "$logs/.rc_$i"
  [ "$rc" -ne 0 ] && status=1
  report "$i" "$rc"
done
for i in "${!names[@]}"; do
  [ "${names[$i]}" = "$alone" ] && [ -z "${skip[$i]:-}" ] || continue
  run_group "$i"; rc=$?
  [ $rc -ne 0 ] && status=1
  report "$i" $rc
done
exit $status
