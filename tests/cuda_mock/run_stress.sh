#!/usr/bin/env bash
# Build tests/cuda_mock/stress.cpp against the mock CUDA runtime, plain and with ThreadSanitizer,
# and run every mode. Usage: tests/cuda_mock/run_stress.sh [iterations_per_thread] [threads]
set -euo pipefail
cd "$(dirname "$0")/../.."
ITERS=${1:-300}
THREADS=${2:-6}
OUT=build/cuda_mock_stress_bin
mkdir -p "$OUT"
SRC=(-x c++ csrc/cuda_staging.cu -x none csrc/ring.cpp tests/cuda_mock/stress.cpp)
FLAGS=(-std=c++17 -g -Wall -Wextra -DFASTDUMP_CUDA_MOCK=1 -Itests/cuda_mock -Icsrc)
g++ "${FLAGS[@]}" -O2 "${SRC[@]}" -lrt -pthread -o "$OUT/stress"
g++ "${FLAGS[@]}" -O1 -fsanitize=thread "${SRC[@]}" -lrt -pthread -o "$OUT/stress_tsan"
for mode in "" nobatch fail; do
  echo "== plain ${mode:-normal}"
  "$OUT/stress" "$((ITERS * 4))" "$THREADS" $mode
  echo "== tsan ${mode:-normal}"
  # setarch -R: TSAN needs a non-randomized address space on some kernels
  setarch "$(uname -m)" -R "$OUT/stress_tsan" "$ITERS" "$THREADS" $mode
done
# The two-ring cycle, deterministic (tests/cuda_mock/ring_cycle.cpp)
g++ "${FLAGS[@]}" -O1 -x c++ csrc/cuda_staging.cu -x none csrc/ring.cpp tests/cuda_mock/ring_cycle.cpp -lrt -pthread \
  -o "$OUT/ring_cycle"
echo "== ring cycle"
"$OUT/ring_cycle"
# CUDA-graph record mode (csrc/cuda_graph_record.cu)
GSRC=(-x c++ csrc/cuda_staging.cu csrc/cuda_graph_record.cu -x none csrc/ring.cpp tests/cuda_mock/graph_stress.cpp)
g++ "${FLAGS[@]}" -O2 "${GSRC[@]}" -lrt -pthread -o "$OUT/graph_stress"
g++ "${FLAGS[@]}" -O1 -fsanitize=thread "${GSRC[@]}" -lrt -pthread -o "$OUT/graph_stress_tsan"
echo "== plain graphs"
"$OUT/graph_stress" "$((ITERS * 2))" 3
echo "== tsan graphs"
setarch "$(uname -m)" -R "$OUT/graph_stress_tsan" "$ITERS" 3
echo "all stress runs passed"
