#!/usr/bin/env bash
# The device check: the CUDA tests, a torch.profiler trace of the training loop, and
# benchmarks/gpu.py (saves, loads, the loop's time lost per checkpoint for K = 1 and 2, FSDP
# against FSDP2 interleaved, colocated sync against one device-to-device copy), writing
# everything into one folder. Each step has a time limit; the whole run fits in 8 minutes.
#
#   benchmarks/gpu_check.sh OUT_DIR             # on a host with a CUDA device
#   benchmarks/gpu_check.sh OUT_DIR --dry-run   # on CPU, tiny sizes (CI runs this)
#
# OUT_DIR receives: cuda_tests.xml and cuda_tests.log (pytest), gpu.json (the benchmark's
# results, BENCHMARKS.md's format), train_loop_trace.json (Chrome trace), gpu.log,
# memory_limit.json and .log (training near the memory limit, a checkpoint every step), and
# summary.txt (each step's exit status). The exit status is non-zero when a step failed.
# GPU_CHECK_PYTHON names the interpreter (default: the repository's .venv/bin/python).
set -uo pipefail

out=${1:?usage: benchmarks/gpu_check.sh OUT_DIR [--dry-run]}
shift
dry=""
if [[ "${1:-}" == "--dry-run" ]]; then
    dry="--dry-run"
fi
root=$(cd "$(dirname "$0")/.." && pwd)
python=${GPU_CHECK_PYTHON:-$root/.venv/bin/python}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$root"
export PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}"
status=0
: >"$out/summary.txt"

step() {  # step NAME SECONDS LOG COMMAND...: run with a time limit, record its status
    local name=$1 limit=$2 log=$3
    shift 3
    local started=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
    local rc=$?
    echo "$name: exit $rc in $((SECONDS - started)) s" | tee -a "$out/summary.txt"
    [[ $rc -eq 0 ]] || status=1
}

# The CUDA tests: every test file named after CUDA (they skip without a device).
mapfile -t cuda_tests < <(find tests -name 'test_*cuda*.py' | sort)
if [[ -n "$dry" ]]; then
    tests_limit=60
else
    tests_limit=150
fi
step "cuda tests" "$tests_limit" "$out/cuda_tests.log" \
    "$python" -m pytest -q -p no:cacheprovider --junitxml="$out/cuda_tests.xml" "${cuda_tests[@]}"

# The benchmark, the profiler trace of the training loop among its sections.
step "gpu.py" 300 "$out/gpu.log" \
    "$python" benchmarks/gpu.py $dry --out "$out/gpu.json" --trace-dir "$out"
# Training near the device's memory limit with a checkpoint every step: no out-of-memory.
step "memory limit" 120 "$out/memory_limit.log" \
    "$python" benchmarks/memory_limit.py $dry --out "$out/memory_limit.json"
exit $status
