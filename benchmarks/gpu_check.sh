#!/usr/bin/env bash
# One command for a machine with an NVIDIA GPU (sized for one H200; ends within GPU_CHECK_BUDGET_S,
# default 470 s, so under 8 minutes):
#   benchmarks/gpu_check.sh OUTDIR [--dry-run]
# Stages, in this order (each under a timeout; a failing stage is reported and the others still run):
#   deps           check the Python packages; install only missing ones (and what they need) from wheels
#                  in .whl/ (offline; .whl/ is git-ignored: carry it); fails unless all import then
#   build          fastdump._C with CUDA
#   decode-bench   decode_bench.py --preset 8b eager: modes none, fastdump-process, sglang-style, both roles
#   decode-graphs  decode_bench.py --preset 8b --cuda-graphs: graph replay with record mode vs without
#   pytest-cuda    pytest -m cuda (staging and CUDA-graph record mode), with a per-test timeout
#   lane-bench     lane_bench.py: forward-thread us per staged CUDA tensor, lean vs checked path
#   d2h-bench      d2h_bench.py: large tensors, fastdump's drain vs the pinned-copy peak
#   d2h-decode     d2h_bench.py: decode-size tensors (8 KiB hidden row, 32 KiB, 256 KiB logits row)
# Time: a stage gets at most its own maximum, and never the floors kept for the stages after it
# (decode-bench 120 s, decode-graphs 60 s, pytest-cuda 45 s; scaled down when the budget cannot hold
# them): a slow build cannot starve the two main measurements, nor they the tests. The benchmarks
# rewrite their JSON after every finished piece: a stage killed by its timeout still reports what it
# measured, marked partial. The script ends within the budget plus a few seconds: give the call that
# runs it a timeout of 500 s or more.
# OUTDIR gets three files (the GPU machine's tool returns at most 8): gpu_check.log (every stage's
# output), summary.json (each stage's status, seconds, rc, limit and results) and results.tar.gz (the
# benchmark JSON files, the pytest junit XML, stages.tsv). stdout gets a line per stage, the last 40
# lines of each failed or timed-out stage's output (the log may not come back; at most 5,000
# characters in all) and the summary table last: under 10,000 characters, within the 12,000 kept.
# --dry-run: no GPU needed: checks deps, skips the CUDA build, runs the cuda tests (they skip), and
# runs the benchmarks in their CPU or mock forms, to check this script's plumbing.
# Without --dry-run (and with a stage but deps wanted) the script first asks torch for a GPU (60 s
# at most: a hung driver must not hang the run). Without one it says why on stdout, marks every
# stage but deps "skipped (no GPU)" (their CPU fallbacks would read as measurements), prints the
# table and exits 3. pytest-cuda fails when every cuda test skipped (a GPU run that tested nothing).
# Environment: PYTHON (default python3), CUDA_HOME (default: /usr/local/cuda or nvcc's), FASTDUMP_CUDA_ARCHS
# (default 90 here: one arch builds faster), GPU_CHECK_BUDGET_S (default 470: total wall-clock budget),
# STAGES (comma-separated stage names, default all, e.g. STAGES=decode-bench,pytest-cuda to rerun what
# failed; build is added when fastdump._C is missing or lacks CUDA), GPU_CHECK_MAX_S (per-stage maximum
# seconds overridden, e.g. GPU_CHECK_MAX_S=decode-bench=300).
set -u -o pipefail
# The GPU machine is offline: pip must not look for an index (nor for its own newer version).
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1

if [[ $# -lt 1 || "$1" == -* ]]; then
  echo "usage: $0 OUTDIR [--dry-run]" >&2
  exit 2
fi
OUT=$1
DRY=0
[[ "${2:-}" == "--dry-run" ]] && DRY=1
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || exit 2
cd "$(dirname "$0")/.." || exit 2
REPO=$(pwd)
PY=${PYTHON:-python3}
command -v "$PY" >/dev/null 2>&1 || PY=python
export PYTHONUNBUFFERED=1
BUDGET=${GPU_CHECK_BUDGET_S:-470}
START=$(date +%s)
END_RESERVE=10        # the summary and packing after the last stage
KILL_GRACE=10         # timeout --kill-after: a stage may run this long past its limit
TEST_TIMEOUT=45       # seconds per test in pytest-cuda: one hang must not cost the other tests
TAIL_LINES=40
TAIL_STAGE_CHARS=2500 # of one failed stage's output on stdout
TAIL_LEFT=5000        # of all of them: the device tool keeps only stdout's last 12,000 characters

ALL_STAGES=(deps build decode-bench decode-graphs pytest-cuda lane-bench d2h-bench d2h-decode)
declare -A MAX=([deps]=60 [build]=180 [decode-bench]=240 [decode-graphs]=120 [pytest-cuda]=120
  [lane-bench]=60 [d2h-bench]=60 [d2h-decode]=40)
((DRY)) && MAX[lane-bench]=180  # the mock runtime's build (about a minute on 2 cores, cached after)
# Floors: seconds a stage keeps whatever the stages before it took. Sized so that the build still
# gets its 180 s (the full CUDA build took 107 s on a 2-core VM) within the default budget.
declare -A FLOOR=([decode-bench]=120 [decode-graphs]=60 [pytest-cuda]=45)

say() { echo "$*" | tee -a "$LOG"; }
die() { echo "gpu_check: $*" >&2; exit 2; }

IFS=, read -ra overrides <<<"${GPU_CHECK_MAX_S:-}"
for o in "${overrides[@]}"; do
  [[ "$o" =~ ^([a-z0-9-]+)=([0-9]+)$ && -n "${MAX[${BASH_REMATCH[1]}]+x}" ]] ||
    die "GPU_CHECK_MAX_S: '$o' is not STAGE=SECONDS (stages: ${ALL_STAGES[*]})"
  MAX[${BASH_REMATCH[1]}]=${BASH_REMATCH[2]}
done
declare -A WANT=()
if [[ -z "${STAGES:-}" || "${STAGES}" == all ]]; then
  for s in "${ALL_STAGES[@]}"; do WANT[$s]=1; done
else
  IFS=, read -ra wanted <<<"$STAGES"
  for s in "${wanted[@]}"; do
    [[ -n "${MAX[$s]+x}" ]] || die "STAGES: unknown stage '$s' (stages: ${ALL_STAGES[*]})"
    WANT[$s]=1
  done
fi

# Only three files go to OUTDIR; everything else is written here and packed into results.tar.gz.
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX") || exit 2
LOG="$OUT/gpu_check.log"
STATUS="$WORK/stages.tsv"
: >"$LOG"
: >"$STATUS"

# ---- deps ---------------------------------------------------------------------------------------
deps() {
  local missing=() pkgs=() mod
  for mod in h5py pybind11 pytest numpy torch setuptools; do
    "$PY" -c "import $mod" 2>/dev/null || missing+=("$mod")
  done
  if ((${#missing[@]} == 0)); then
    echo "all present: $("$PY" -c 'import torch, h5py, numpy; print("torch", torch.__version__, "cuda", torch.version.cuda, "h5py", h5py.__version__, "numpy", numpy.__version__)')"
    return 0
  fi
  echo "missing: ${missing[*]}"
  for mod in "${missing[@]}"; do
    if [[ $mod == torch ]]; then
      echo "torch is missing: it must be preinstalled on a GPU machine" >&2
    else
      pkgs+=("$mod")
    fi
  done
  ((${#pkgs[@]})) || return 1
  if ((DRY)); then
    echo "dry run: not installing ${pkgs[*]}"
    return 1
  fi
  if [[ -d .whl ]] && compgen -G ".whl/*.whl" >/dev/null; then  # carried wheels (offline machines)
    # With their dependencies (pytest needs pluggy and iniconfig), found in .whl/ too: PIP_NO_INDEX
    # keeps pip offline, and what is installed already satisfies the rest.
    "$PY" -m pip install -q --find-links .whl "${pkgs[@]}" ||
      echo "pip could not install ${pkgs[*]} from .whl/ (their dependencies must be there too)" >&2
  else
    echo "no wheels for ${pkgs[*]} in .whl/ (pip does not use an index here: the machine is offline)" >&2
  fi
  # The stage is ok only if every module imports now (torch included).
  local still=()
  for mod in "${missing[@]}"; do
    "$PY" -c "import $mod" 2>/dev/null || still+=("$mod")
  done
  ((${#still[@]} == 0)) && return 0
  echo "still missing: ${still[*]}" >&2
  return 1
}

# ---- build --------------------------------------------------------------------------------------
find_cuda_home() {
  if [[ -n "${CUDA_HOME:-}" && -x "$CUDA_HOME/bin/nvcc" ]]; then echo "$CUDA_HOME"; return; fi
  if [[ -x /usr/local/cuda/bin/nvcc ]]; then echo /usr/local/cuda; return; fi
  local nvcc
  nvcc=$(command -v nvcc 2>/dev/null) || return 1
  dirname "$(dirname "$(readlink -f "$nvcc")")"
}

build() {
  local home
  home=$(find_cuda_home) || { echo "no CUDA toolkit (nvcc) found; set CUDA_HOME" >&2; return 1; }
  echo "CUDA_HOME=$home ($("$home/bin/nvcc" --version | tail -1))"
  export CUDA_HOME=$home FASTDUMP_CUDA=1 FASTDUMP_CUDA_ARCHS=${FASTDUMP_CUDA_ARCHS:-90}
  rm -rf build/temp.* 2>/dev/null
  if ! "$PY" -m pip install -q -e . --no-build-isolation --no-deps; then
    echo "pip install -e failed; trying setup.py build_ext --inplace" >&2
    "$PY" setup.py -q build_ext --inplace || return 1
  fi
  "$PY" - <<'EOF'
import json
import fastdump._C as c
info = c.cuda_info()
print(json.dumps(info, indent=1))
assert c.cuda_compiled(), "fastdump._C was built without CUDA"
assert info.get("device_count", 0) > 0, f"no usable GPU: {info.get('reason')}"
EOF
}

check_import() {
  "$PY" -c "import fastdump._C as c, json; print('cuda_compiled', c.cuda_compiled()); print(json.dumps(c.cuda_info()))"
}

# The cuda tests, then (on a GPU) a failure when none of them ran: every one skipped means no GPU
# or a fastdump._C without CUDA, which must not read as "ok".
pytest_cuda() {
  "$@"
  local rc=$?
  ((rc == 0 && !DRY)) || return $rc
  "$PY" - "$WORK/pytest-cuda.xml" <<'EOF'
import sys
import xml.etree.ElementTree as ET

root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else list(root)
tests = sum(int(s.get("tests", 0)) for s in suites)
skipped = sum(int(s.get("skipped", 0)) for s in suites)
if tests == skipped:
    print(f"pytest-cuda: every one of the {tests} cuda tests skipped (no GPU, or fastdump._C without CUDA: "
          "see the skip reasons above)")
    sys.exit(1)
EOF
}

# ---- stage commands -----------------------------------------------------------------------------
stage_command() {  # NAME: sets CMD
  local name=$1
  case "$name" in
    deps) CMD=(deps) ;;
    build) if ((DRY)); then CMD=(check_import); else CMD=(build); fi ;;
    pytest-cuda)
      CMD=(pytest_cuda "$PY" -m pytest -m cuda -v -rfEs --tb=short -p no:cacheprovider --junitxml="$WORK/pytest-cuda.xml")
      if "$PY" -c "import pytest_timeout" 2>/dev/null; then
        CMD+=(--timeout "$TEST_TIMEOUT")  # fails the hung test and goes on
      else
        CMD+=(-o "faulthandler_timeout=$TEST_TIMEOUT")  # only dumps the hung test's stacks to the log
      fi
      CMD+=(tests) ;;
    decode-bench)
      if ((DRY)); then
        CMD=("$PY" benchmarks/decode_bench.py --preset tiny --device cpu)
      else
        CMD=("$PY" benchmarks/decode_bench.py --preset 8b --device cuda --dtype bfloat16)
      fi
      CMD+=(--modes none,fastdump-process,sglang-style --json "$WORK/decode.json") ;;
    decode-graphs)
      if ((DRY)); then
        CMD=("$PY" benchmarks/decode_bench.py --preset tiny --device cpu)
      else
        CMD=("$PY" benchmarks/decode_bench.py --preset 8b --device cuda --dtype bfloat16)
      fi
      CMD+=(--cuda-graphs --json "$WORK/graphs.json") ;;
    lane-bench)
      if ((DRY)); then  # against the mock runtime: call counts; its times are the mock's
        CMD=("$PY" benchmarks/lane_bench.py --mock --tensors 100 --passes 3)
      else
        CMD=("$PY" benchmarks/lane_bench.py --tensors 400 --passes 30)
      fi
      CMD+=(--json "$WORK/lane.json") ;;
    d2h-bench)
      if ((DRY)); then
        CMD=("$PY" benchmarks/d2h_bench.py --dry-run)
      else
        CMD=("$PY" benchmarks/d2h_bench.py --total-gb 4 --reps 3)
      fi
      CMD+=(--json "$WORK/d2h.json") ;;
    d2h-decode)
      CMD=("$PY" benchmarks/d2h_bench.py --sizes-mb 0.0078125,0.03125,0.25 --total-gb 0.25)
      if ((DRY)); then
        CMD+=(--dry-run)
      else
        CMD+=(--reps 2 --peak-mb 256 --no-memcpy-variant)
      fi
      CMD+=(--json "$WORK/d2h-decode.json") ;;
  esac
}

# ---- running a stage ----------------------------------------------------------------------------
# Seconds kept for the floored stages after stage NAME (each with its kill grace and 2 s of slack).
reserved_after() {
  local name=$1 after=0 sum=0 s
  for s in "${SELECTED[@]}"; do
    if ((after)); then
      ((${FLOOR[$s]:-0} > 0)) && sum=$((sum + FLOOR[$s] + KILL_GRACE + 2))
    fi
    [[ $s == "$name" ]] && after=1
  done
  echo "$sum"
}

# The failed stage's last lines, to stdout: the one output that comes back even when files do not.
print_tail() {  # NAME START END (byte range of the stage's output in the log)
  local name=$1 start=$2 end=$3 text chars
  if ((TAIL_LEFT < 200)); then
    echo "--- $name: see gpu_check.log (stdout's budget for failed stages' output is used up)"
    return
  fi
  text=$(tail -c +"$((start + 1))" "$LOG" | head -c "$((end - start))" | tail -n "$TAIL_LINES" | cut -c1-200)
  chars=$TAIL_STAGE_CHARS
  ((chars > TAIL_LEFT)) && chars=$TAIL_LEFT
  ((${#text} > chars)) && text="[...]${text: -chars}"
  TAIL_LEFT=$((TAIL_LEFT - ${#text}))
  echo "--- last $TAIL_LINES lines of $name's output:"
  echo "$text"
  echo "--- end of $name's output"
}

# Runs with a timeout that leaves the floors of the later stages, logs everything, records
# "name status seconds rc limit log_start log_end" in stages.tsv.
run_stage() {  # NAME COMMAND...
  local name=$1
  shift
  local now left limit t0 rc status secs start end
  now=$(date +%s)
  left=$((BUDGET - END_RESERVE - (now - START) - $(reserved_after "$name") - KILL_GRACE))
  limit=${MAX[$name]}
  ((left < limit)) && limit=$left
  ((limit < 1)) && limit=1  # timeout 0 would mean no limit
  if ((left < 5)); then
    say "=== $name: skipped (time budget of ${BUDGET}s used up)"
    printf '%s\tskipped (budget)\t0\t-\t0\t0\t0\n' "$name" >>"$STATUS"
    return 0
  fi
  say "=== $name (limit ${limit}s)"
  echo "command: $*" >>"$LOG"
  start=$(stat -c %s "$LOG")
  t0=$(date +%s)
  RUNNING="$name	$t0	$limit	$start"  # for finish() if this script is stopped mid-stage
  # bash -c: the command may be one of this script's functions (exported below).
  timeout --kill-after="$KILL_GRACE" "$limit" bash -c '"$@"' _ "$@" >>"$LOG" 2>&1
  rc=$?
  RUNNING=""
  secs=$(($(date +%s) - t0))
  end=$(stat -c %s "$LOG")
  if ((rc == 0)); then
    status=ok
  elif ((rc == 124 || rc == 137)); then
    status="timeout after ${limit}s"
  else
    status="FAILED (rc $rc)"
  fi
  say "=== $name: $status in ${secs}s"
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$secs" "$rc" "$limit" "$start" "$end" >>"$STATUS"
  ((rc == 0)) || print_tail "$name" "$start" "$end"
  pack  # after every stage: a run killed later still leaves what it had
}

pack() {
  tar -czf "$OUT/.results.tar.gz.tmp" -C "$WORK" --exclude='.*.tmp' . 2>>"$LOG" &&
    mv -f "$OUT/.results.tar.gz.tmp" "$OUT/results.tar.gz"
}

RUNNING=""
SUMMARIZED=0
finish() {
  ((SUMMARIZED)) && return
  SUMMARIZED=1
  if [[ -n "$RUNNING" ]]; then  # stopped (SIGTERM, Ctrl-C) while this stage ran
    local name t0 limit start
    IFS=$'\t' read -r name t0 limit start <<<"$RUNNING"
    printf '%s\tinterrupted\t%s\t-\t%s\t%s\t%s\n' "$name" "$(($(date +%s) - t0))" "$limit" "$start" \
      "$(stat -c %s "$LOG")" >>"$STATUS"
    print_tail "$name" "$start" "$(stat -c %s "$LOG")"
  fi
  if ! "$PY" benchmarks/gpu_check_summary.py "$OUT" "$WORK" "$BUDGET" "$DRY" 2>>"$LOG"; then
    echo "summary failed (see gpu_check.log); stages (name, status, seconds, rc, limit):"
    cut -f1-5 "$STATUS"
  fi
  pack
  # The device tool returns files up to 16 MiB: keep a runaway log's head and tail.
  if (($(stat -c %s "$LOG") > 15 << 20)); then
    {
      head -c $((4 << 20)) "$LOG"
      printf '\n[... gpu_check.log cut to its first 4 and last 10 MiB ...]\n'
      tail -c $((10 << 20)) "$LOG"
    } >"$WORK/log.cut" && mv -f "$WORK/log.cut" "$LOG"
  fi
  rm -rf "$WORK"
}
trap finish EXIT
trap 'exit 143' TERM INT HUP

# ---- stages ------------------------------------------------------------------------------------
export PY DRY WORK
export -f deps find_cuda_home build check_import pytest_cuda
say "gpu_check: $(date -u +%FT%TZ) repo=$REPO out=$OUT dry_run=$DRY budget=${BUDGET}s python=$("$PY" --version 2>&1)"
if command -v nvidia-smi >/dev/null 2>&1; then
  say "$(nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current \
    --format=csv,noheader 2>&1 | head -8)"
else
  say "nvidia-smi: not found"
fi
say "$(df -h /dev/shm 2>&1 | tail -1); $(free -g 2>/dev/null | awk '/Mem:/ {print "memory total " $2 " GiB, available " $7 " GiB"}')"
others=$(find "$OUT" -mindepth 1 -maxdepth 1 ! -name gpu_check.log ! -name summary.json ! -name results.tar.gz | wc -l)
((others)) && say "note: OUTDIR already holds $others other entries (the device tool returns at most 8 files)"

# Is there a GPU at all? Asked once, with a timeout, when a stage but deps is wanted; without one
# the GPU stages do not run.
NO_GPU=""
if ((!DRY && ${#WANT[@]} > ${WANT[deps]:-0})); then
  NO_GPU=$(timeout --kill-after=5 60 "$PY" -c '
import torch
if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no usable CUDA device")
' 2>"$WORK/gpu_probe.err")
  rc=$?
  cat "$WORK/gpu_probe.err" >>"$LOG"  # (torch's warnings: the log, never the verdict)
  if ((rc == 124 || rc == 137)); then
    NO_GPU="torch.cuda.is_available() did not answer within 60 s (a hung driver?)"
  elif ((rc != 0)); then
    NO_GPU="cannot ask torch for a GPU (rc $rc): $(tail -1 "$WORK/gpu_probe.err" | cut -c1-300)"
  fi
  [[ -n "$NO_GPU" ]] && say "no usable GPU: $NO_GPU; every stage but deps is skipped (--dry-run checks the plumbing on a CPU machine)"
fi

# A rerun of some stages on a fresh machine needs the build first.
if ((!DRY)) && [[ -z "$NO_GPU" ]] && [[ -z "${WANT[build]+x}" ]] && ((${#WANT[@]} > ${WANT[deps]:-0})) &&
  ! "$PY" -c 'import sys, fastdump._C as c; sys.exit(not c.cuda_compiled())' >/dev/null 2>&1; then
  say "note: fastdump._C is missing or built without CUDA: stage build added"
  WANT[build]=1
fi
SELECTED=()
for s in "${ALL_STAGES[@]}"; do
  [[ -n "${WANT[$s]+x}" ]] && SELECTED+=("$s")
done

# Floors that cannot all fit in 3/4 of the budget shrink in proportion.
floor_sum=0 floored=0
for s in "${SELECTED[@]}"; do
  ((${FLOOR[$s]:-0} > 0)) && floor_sum=$((floor_sum + FLOOR[$s])) floored=$((floored + 1))
done
room=$(((BUDGET - END_RESERVE) * 3 / 4 - floored * (KILL_GRACE + 2)))
((room < 0)) && room=0
if ((floor_sum > room)); then
  for s in "${SELECTED[@]}"; do
    ((${FLOOR[$s]:-0} > 0)) && FLOOR[$s]=$((FLOOR[$s] * room / floor_sum))
  done
  say "note: budget ${BUDGET}s: stage floors scaled to $room/$floor_sum"
fi

for name in "${SELECTED[@]}"; do
  if [[ -n "$NO_GPU" && $name != deps ]]; then
    say "=== $name: skipped (no GPU)"
    printf '%s\tskipped (no GPU)\t0\t-\t0\t0\t0\n' "$name" >>"$STATUS"
    continue
  fi
  stage_command "$name"
  run_stage "$name" "${CMD[@]}"
done
finish
[[ -n "$NO_GPU" ]] && exit 3
exit 0
