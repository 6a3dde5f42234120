#!/usr/bin/env bash
# One command for a machine with an NVIDIA GPU (sized for one H200, < 8 minutes):
#   benchmarks/gpu_check.sh OUTDIR [--dry-run]
# Stages: deps (install only what is missing; works offline), build (fastdump._C with CUDA),
# pytest -m cuda (staging and CUDA-graph record mode), benchmarks/lane_bench.py (forward-thread us per
# staged CUDA tensor, lean vs checked path), benchmarks/d2h_bench.py (large tensors, then
# decode-size ones), benchmarks/decode_bench.py --preset 8b --cuda-graphs (graph replay with record
# mode vs without, target and draft), then --preset 8b eager (modes none, fastdump-process,
# sglang-style, both roles). A failing stage is reported and the others still run. Full log:
# OUTDIR/gpu_check.log; JSON results: OUTDIR/*.json; the summary table is printed last
# (OUTDIR/summary.txt, OUTDIR/summary.json).
# --dry-run: no GPU needed: checks deps, skips the CUDA build, runs the cuda tests (they skip), and
# runs both benchmarks in their CPU forms, to check this script's plumbing.
# Environment: PYTHON (default python3), CUDA_HOME (default: /usr/local/cuda or nvcc's), FASTDUMP_CUDA_ARCHS
# (default 90 here: one arch builds faster), GPU_CHECK_BUDGET_S (default 470: total wall-clock budget).
set -u -o pipefail

if [[ $# -lt 1 || "$1" == -* ]]; then
  echo "usage: $0 OUTDIR [--dry-run]" >&2
  exit 2
fi
OUT=$1
DRY=0
[[ "${2:-}" == "--dry-run" ]] && DRY=1
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LOG="$OUT/gpu_check.log"
STATUS="$OUT/stages.tsv"
: >"$LOG"
: >"$STATUS"
cd "$(dirname "$0")/.." || exit 2
REPO=$(pwd)
PY=${PYTHON:-python3}
command -v "$PY" >/dev/null 2>&1 || PY=python
export PYTHONUNBUFFERED=1
BUDGET=${GPU_CHECK_BUDGET_S:-470}
START=$(date +%s)

log() { echo "$*" | tee -a "$LOG"; }

# run_stage NAME MAX_SECONDS COMMAND...: runs with a timeout (never past the overall budget),
# logs everything, records "name<TAB>status<TAB>seconds<TAB>rc".
run_stage() {
  local name=$1 max=$2
  shift 2
  local now left limit t0 rc status
  now=$(date +%s)
  left=$((BUDGET - (now - START)))
  limit=$max
  ((left < limit)) && limit=$left
  if ((limit < 5)); then
    log "=== $name: skipped (time budget of ${BUDGET}s used up)"
    printf '%s\tskipped (budget)\t0\t-\n' "$name" >>"$STATUS"
    return 0
  fi
  log "=== $name (limit ${limit}s): $*"
  t0=$(date +%s)
  # bash -c: the command may be one of this script's functions (exported below).
  timeout --kill-after=10 "$limit" bash -c '"$@"' _ "$@" >>"$LOG" 2>&1
  rc=$?
  if ((rc == 0)); then
    status=ok
  elif ((rc == 124 || rc == 137)); then
    status="timeout after ${limit}s"
  else
    status="FAILED (rc $rc)"
  fi
  log "=== $name: $status in $(($(date +%s) - t0))s"
  printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$(($(date +%s) - t0))" "$rc" >>"$STATUS"
  return 0
}

# ---- deps ---------------------------------------------------------------------------------------
deps() {
  local missing=()
  for mod in h5py pybind11 pytest numpy torch setuptools; do
    "$PY" -c "import $mod" 2>/dev/null || missing+=("$mod")
  done
  if ((${#missing[@]} == 0)); then
    echo "all present: $("$PY" -c 'import torch, h5py, numpy; print("torch", torch.__version__, "cuda", torch.version.cuda, "h5py", h5py.__version__, "numpy", numpy.__version__)')"
    return 0
  fi
  echo "missing: ${missing[*]}"
  if [[ " ${missing[*]} " == *" torch "* ]]; then
    echo "torch is missing: it must be preinstalled on a GPU machine" >&2
  fi
  local pkgs=("${missing[@]/torch/}")
  if ((DRY)); then
    echo "dry run: not installing ${pkgs[*]}"
    return 1
  fi
  if [[ -d .whl ]] && compgen -G ".whl/*.whl" >/dev/null; then  # carried wheels (offline machines)
    "$PY" -m pip install -q --no-index --no-deps --find-links .whl "${pkgs[@]}" && return 0
  fi
  "$PY" -m pip install -q --retries 0 --timeout 15 "${pkgs[@]}"
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

# ---- stages ------------------------------------------------------------------------------------
export PY DRY
export -f deps find_cuda_home build check_import
log "gpu_check: $(date -u +%FT%TZ) repo=$REPO out=$OUT dry_run=$DRY python=$("$PY" --version 2>&1)"
if command -v nvidia-smi >/dev/null 2>&1; then
  log "$(nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current \
    --format=csv,noheader 2>&1 | head -8)"
else
  log "nvidia-smi: not found"
fi
log "$(df -h /dev/shm 2>&1 | tail -1); $(free -g 2>/dev/null | awk '/Mem:/ {print "memory total " $2 " GiB, available " $7 " GiB"}')"

run_stage deps 90 deps
if ((DRY)); then
  run_stage build 30 check_import
else
  run_stage build 180 build
fi
run_stage pytest-cuda 120 "$PY" -m pytest -m cuda -q -rs -p no:cacheprovider --junitxml="$OUT/pytest-cuda.xml" tests
if ((DRY)); then
  run_stage d2h-bench 60 "$PY" benchmarks/d2h_bench.py --dry-run --json "$OUT/d2h.json"
  # The lean path's forward-thread cost against the mock runtime (call counts; times are the mock's).
  run_stage lane-bench 180 "$PY" benchmarks/lane_bench.py --mock --tensors 100 --passes 3 --json "$OUT/lane.json"
  run_stage decode-graphs 30 "$PY" benchmarks/decode_bench.py --preset tiny --device cpu --cuda-graphs \
    --json "$OUT/graphs.json"
  run_stage decode-bench 120 "$PY" benchmarks/decode_bench.py --preset tiny --device cpu \
    --modes none,fastdump-process,sglang-style --json "$OUT/decode.json"
else
  run_stage d2h-bench 60 "$PY" benchmarks/d2h_bench.py --total-gb 4 --reps 3 --json "$OUT/d2h.json"
  # Decode-size tensors (8 KiB hidden row, 32 KiB, 256 KiB logits row): the per-tensor cost regime.
  run_stage d2h-decode 45 "$PY" benchmarks/d2h_bench.py --sizes-mb 0.0078125,0.03125,0.25 --total-gb 0.25 \
    --reps 2 --peak-mb 256 --no-memcpy-variant --json "$OUT/d2h-decode.json"
  # Forward-thread us per staged CUDA tensor: the lean path (the Dumper's) against the checked one.
  run_stage lane-bench 60 "$PY" benchmarks/lane_bench.py --tensors 400 --passes 30 --json "$OUT/lane.json"
  run_stage decode-graphs 90 "$PY" benchmarks/decode_bench.py --preset 8b --device cuda --dtype bfloat16 \
    --cuda-graphs --json "$OUT/graphs.json"
  run_stage decode-bench 240 "$PY" benchmarks/decode_bench.py --preset 8b --device cuda --dtype bfloat16 \
    --modes none,fastdump-process,sglang-style --json "$OUT/decode.json"
fi

# ---- summary (last) ----------------------------------------------------------------------------
"$PY" - "$OUT" <<'EOF' 2>>"$LOG" | tee "$OUT/summary.txt"
import json, re, sys
from pathlib import Path
out = Path(sys.argv[1])
log = (out / "gpu_check.log").read_text(errors="replace")
rows, summary = [], {"stages": {}}

def load(name):
    try:
        return json.loads((out / name).read_text())
    except Exception:
        return None

for line in (out / "stages.tsv").read_text().splitlines():
    name, status, secs, rc = line.split("\t")
    summary["stages"][name] = {"status": status, "seconds": int(secs)}
    detail = ""
    if name == "pytest-cuda":
        m = re.findall(r"^=*\s*((?:\d+ \w+(?:, )?)+) in [\d.]+s", log, re.M)
        detail = m[-1] if m else ""
    elif name == "build":
        m = re.findall(r'"name": "([^"]+)"', log)
        detail = ", ".join(sorted(set(m))) if m else ""
    elif name in ("d2h-bench", "d2h-decode"):
        d = load("d2h.json" if name == "d2h-bench" else "d2h-decode.json") or {}
        if d.get("status") == "ok":
            detail = f"peak {d['peak']['peak_GBps']:.1f} GB/s, fastdump worst {d['min_ratio_to_peak']:.0%} of peak"
            sc = d.get("stage_cost", {})
            if "stage_us" in sc:
                detail += f", stage() {sc['stage_us']:.1f} us"
        elif d:
            detail = d.get("status", "")
        summary[name] = d
    elif name == "lane-bench":
        d = load("lane.json") or {}
        if d.get("status") == "ok":
            le, ch = d["lean"], d["checked"]
            detail = (f"{'MOCK ' if d['args'].get('mock') else ''}forward thread per tensor: lean "
                      f"{le['us_per_tensor_wall']:.2f} us wall / {le['us_per_tensor_cpu']:.2f} us CPU, checked "
                      f"{ch['us_per_tensor_wall']:.2f} / {ch['us_per_tensor_cpu']:.2f}; "
                      f"{le['events_per_pass']:.1f} events/pass")
            pc = d.get("python_calls")
            if pc:
                detail += (f"; of it, Python calls: get_device {pc['get_device_us']:.2f}, raw stream "
                           f"{pc['raw_stream_us']:.2f}, record_stream {pc['record_stream_us']:.2f} us")
        elif d:
            detail = d.get("status", "")
        summary["lane"] = d
    elif name == "decode-graphs":
        d = load("graphs.json") or {}
        parts = []
        for role, r in (d.get("roles") or {}).items():
            if r.get("status") != "ok":
                parts.append(f"{role}: {r.get('status')}")
                continue
            parts.append(f"{role} {r['ratio']:.3f}x ({r['replay_s_plain'] * 1e3:.2f} ms, "
                         f"{r['tensors_per_pass']} t/pass, dropped {r['dropped_passes']})"
                         + ("" if r.get("bit_exact") else " NOT bit-exact"))
        detail = "; ".join(parts) or str(d.get("status", ""))
        summary["graphs"] = d
    elif name == "decode-bench":
        d = load("decode.json") or {}
        parts = []
        for mode, e in (d.get("modes") or {}).items():
            if mode == "none":
                continue
            if e.get("status") != "ok":
                parts.append(f"{mode}: {e.get('status')}")
                continue
            r = [f"{role} {v['ratio_to_none']:.3f}x" for role, v in e["roles"].items() if v.get("ratio_to_none")]
            parts.append(f"{mode}: " + " ".join(r) + ("" if e.get("bit_exact_vs_none") else " NOT bit-exact"))
        detail = "; ".join(parts)
        summary["decode"] = {k: v for k, v in (d.get("modes") or {}).items()}
    rows.append((name, status, f"{secs}s", detail))
(out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
w = [max(len(r[i]) for r in rows + [("stage", "status", "time", "result")]) for i in range(4)]
fmt = lambda r: "| " + " | ".join(c.ljust(w[i]) for i, c in enumerate(r)) + " |"
print(fmt(("stage", "status", "time", "result")))
print("|" + "|".join("-" * (x + 2) for x in w) + "|")
for r in rows:
    print(fmt(r))
print(f"full log: {out / 'gpu_check.log'}")
EOF
exit 0
