#!/usr/bin/env bash
# One-shot GPU check, at most about 9.5 minutes: environment, the MPI that
# mpi4py loads and a 2-rank world started with its mpiexec, NVRTC compile of
# every kernel module, the gpu-marked tests, the kernel benchmark with its
# targets, compute-sanitizer runs, concurrent streams, the largest N, the
# point-to-point, rooted and all-to-all calls on cupy arrays over NCCL, and
# the MNIST example trained at 2 ranks on the GPU.
#
#   scripts/gpu_check.sh [--dry-run] [OUTDIR]      (OUTDIR defaults to $OUT)
#
# Every stage has its own time limit and the script goes on after a failed
# stage. Without a GPU (or with --dry-run) the stages that need one report
# "SKIPPED: no GPU". Writes into OUTDIR: one log per stage, pytest-gpu.xml,
# kernels.json, example.json, summary.txt (PASS/FAIL/SKIPPED per stage and
# per benchmark target) and summary.json. Exit status: 0 when no stage
# failed, 1 otherwise (a missed benchmark target is reported as FAIL in the
# summary but does not change the exit status).
#
# Multi-rank stages start ranks with the mpiexec of the MPI library mpi4py
# loads (commlib.startup.mpi_library.choose_mpiexec: Open MPI's mpirun gets
# --oversubscribe and, as root, --allow-run-as-root); the mpi-world stage
# fails unless 2 ranks form one world of 2, and so does every multi-rank test.
set -u
SELF=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")

# -- stage bodies: run as `bash gpu_check.sh --_stage NAME` so that `timeout`
# can run them (it cannot run shell functions) -----------------------------------------

stage_pytest_gpu() {
    "$PY" -m pytest -m gpu -q -p no:cacheprovider --junitxml="$DEST/pytest-gpu.xml" tests/ \
        || return $?
    # all skipped or nothing collected is a failure on a GPU machine
    "$PY" - "$DEST/pytest-gpu.xml" <<'EOF'
import sys, xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else list(root)
ran = sum(int(s.get("tests", 0)) - int(s.get("skipped", 0)) for s in suites)
print(ran, "gpu tests ran")
sys.exit(0 if ran > 0 else 5)
EOF
}

stage_sanitizer() {
    local tool
    tool=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null \
           || ls "$("$PY" -c 'import sys; print(sys.prefix)')"/lib/python3*/site-packages/nvidia/*/bin/compute-sanitizer 2>/dev/null | head -n 1)
    if [ -z "$tool" ]; then
        echo "compute-sanitizer: not available"
        return 0
    fi
    local rc=0 t
    for t in memcheck racecheck synccheck; do
        echo "-- $t"
        timeout -k 2 23 "$tool" --tool "$t" --error-exitcode 3 "$PY" tests/gpu/gpu_checks.py \
            small-quick || { echo "$t: FAIL (exit $?)"; rc=1; }
    done
    return $rc
}

stage_example() {
    # the MNIST example at 2 ranks on the GPU (one GPU: the MPI transport
    # carries cupy arrays); it must see 2 workers and end with identical
    # parameters on both
    rm -f "$DEST/example.json"
    "$PY" -m commlib.launch -n 2 --timeout 85 examples/mnist_train.py --device gpu \
        --epochs 2 --json "$DEST/example.json" || return $?
    "$PY" - "$DEST/example.json" <<'EOF'
import json, sys
log = json.load(open(sys.argv[1]))
print("workers", log["workers"], "identical", log["identical"], "device", log.get("device"))
sys.exit(0 if log["workers"] == 2 and log["identical"] is True else 6)
EOF
}

if [ "${1:-}" = "--_stage" ]; then
    "stage_${2//-/_}"
    exit $?
fi

DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
DEST=${1:-${OUT:-}}
if [ -z "$DEST" ] || [ $# -gt 1 ]; then
    echo "usage: $0 [--dry-run] OUTDIR   (or set OUT)" >&2
    exit 64
fi
mkdir -p "$DEST"
DEST=$(cd "$DEST" && pwd)
cd "$(dirname "$0")/.."
paths=".:tests"
for d in tests/*/; do paths="$paths:${d%/}"; done   # each test folder's rank programs
export PYTHONPATH="$paths${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-$(command -v python3 || command -v python)}
export PY DEST

: > "$DEST/stages.tsv"
FAILED=0
NO_GPU=""
if [ "$DRY" = 1 ]; then
    NO_GPU="dry run"
else
    NO_GPU=$("$PY" -c "from commlib.core import gpu; print(gpu.unavailable_reason() or '')" \
             2>&1) || NO_GPU="commlib does not import: $NO_GPU"
fi

# stage NAME LIMIT_S NEEDS_GPU(0/1) COMMAND...: runs COMMAND under timeout,
# logs to NAME.log, records status and seconds in stages.tsv. COMMAND "-"
# runs this script's own stage_NAME.
stage() {
    local name=$1 limit=$2 gpu=$3
    shift 3
    local log="$DEST/$name.log" status rc t0 t1
    echo "== $name (limit ${limit} s)" | tee "$log"
    if [ "$gpu" = 1 ] && [ -n "$NO_GPU" ]; then
        status="SKIPPED: no GPU ($NO_GPU)"
        echo "$status" | tee -a "$log"
        printf '%s\t%s\t0\n' "$name" "$status" >> "$DEST/stages.tsv"
        return 0
    fi
    if [ "$1" = "-" ]; then
        set -- bash "$SELF" --_stage "$name"
    fi
    t0=$(date +%s.%N)
    timeout -k 3 "$limit" "$@" >> "$log" 2>&1
    rc=$?
    t1=$(date +%s.%N)
    case $rc in
        0) status=PASS ;;
        124|137) status="FAIL (time limit ${limit} s)" ; FAILED=1 ;;
        *) status="FAIL (exit $rc)" ; FAILED=1 ;;
    esac
    tail -n 5 "$log"
    echo "-> $status"
    printf '%s\t%s\t%s\n' "$name" "$status" "$(awk "BEGIN { printf \"%.1f\", $t1 - $t0 }")" >> "$DEST/stages.tsv"
}

# limits: 40 + 30 + 60 + 60 + 150 + 90 + 60 + 45 + 75 + 25 + 40 + 30 + 90 = 795 s;
# with 3 s to kill each stage that overruns and 10 s of nvidia-smi, 844 s at worst
# (most stages take a fraction of their limit: the build takes seconds where
# it is not needed, gpu-step about 30 s; run the script with a command limit
# of 600 s)
# env imports torch, a few seconds idle; 15 s ran out on a busy 2-core machine
stage env 40 0 "$PY" -c "
import platform, sys; print('python', sys.version.split()[0], platform.platform())
import numpy; print('numpy', numpy.__version__)
for m in ('cupy', 'torch', 'mpi4py'):
    try:
        print(m, __import__(m).__version__)
    except Exception as exc:
        print(m + ':', type(exc).__name__, exc)
from commlib.core import gpu; print('gpu:', gpu.unavailable_reason() or 'available')
"
[ -z "$NO_GPU" ] && { timeout -k 2 10 nvidia-smi >> "$DEST/env.log" 2>&1 || true; }
stage mpi-world 30 0 "$PY" -m commlib.info --run 2
stage build 60 1 "$PY" setup.py -q build_ext --inplace
stage nvrtc 60 1 "$PY" tests/gpu/gpu_checks.py compile
stage pytest-gpu 150 1 -
stage benchmark 90 1 "$PY" benchmarks/kernels.py --sizes 1M,25M --repeats 10 --out "$DEST"
stage gpu-step 60 1 "$PY" benchmarks/gpu_step.py --repeats 20 --time-limit 50 --out "$DEST"
# the same list in about 16 buckets (6.25 MiB), where the host time per call
# of a compressed all-reduce has its goal of 150 us
mkdir -p "$DEST/buckets16"
stage gpu-step-16 45 1 "$PY" benchmarks/gpu_step.py --repeats 10 --time-limit 35 \
    --bucket-bytes 6553600 --out "$DEST/buckets16"
stage sanitizer 75 1 -
stage streams 25 1 "$PY" tests/gpu/gpu_checks.py streams
stage large-n 40 1 "$PY" tests/gpu/gpu_checks.py large
# send/recv, scatter, gather, all-to-all, objects and split with cupy arrays
# at NCCL world size 1 (at 2 ranks over MPI they run in pytest-gpu's
# test_mpi_transport_with_cupy_arrays_world_size_2)
stage p2p 30 1 "$PY" tests/gpu/gpu_checks.py p2p
stage example 90 1 -

"$PY" - "$DEST" "$FAILED" <<'EOF' | tee "$DEST/summary.txt"
import json, os, sys
dest, failed = sys.argv[1], sys.argv[2] == "1"
stages = []
for line in open(os.path.join(dest, "stages.tsv")):
    name, status, secs = line.rstrip("\n").split("\t")
    stages.append({"stage": name, "status": status, "seconds": float(secs)})
targets = []
try:
    rows = json.load(open(os.path.join(dest, "kernels.json")))["rows"]
    targets = [{"name": r["name"], "N": r["N"], "k": r.get("k"), "baseline": r.get("baseline"),
                "target": r["target"], "status": r["status"], "ms": r.get("ms"),
                "copy_fraction": r.get("copy_fraction"), "speedup": r.get("speedup")}
               for r in rows if r.get("target")]
except (OSError, ValueError, KeyError):
    pass
for where, label in (("", "gpu_step "), ("buckets16", "gpu_step 16 buckets ")):
    try:
        goals = json.load(open(os.path.join(dest, where, "gpu_step.json")))["goals"]
        targets += [{"name": label + g["name"], "N": "-", "k": None, "baseline": None,
                     "target": g["target"], "status": g["status"], "value": g["value"]}
                    for g in goals]
    except (OSError, ValueError, KeyError):
        pass
for s in stages:
    print("%-12s %-40s %6.1f s" % (s["stage"], s["status"], s["seconds"]))
for t in targets:
    print("target %-40s N=%-9s %-18s %-10s %s" % (t["name"], t["N"], t["baseline"] or "",
                                                  t["target"], t["status"]))
print("overall: %s" % ("FAIL" if failed else "PASS"))
json.dump({"stages": stages, "targets": targets, "failed": failed},
          open(os.path.join(dest, "summary.json"), "w"), indent=1)
EOF
exit "$FAILED"
