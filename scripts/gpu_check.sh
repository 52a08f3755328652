#!/usr/bin/env bash
# One-shot GPU check: environment report, the gpu-marked tests, the kernel
# benchmark. Every step is bounded by `timeout` (about 5 minutes in all).
#
#   scripts/gpu_check.sh OUTDIR
#
# Writes into OUTDIR: env.txt, pytest-gpu.xml (JUnit), pytest-gpu.log,
# kernels.json, bench.log, summary.txt. Exit status: 0 when the tests and the
# benchmark's result checks passed, 1 when a test failed (or none ran), 2 when
# only the benchmark failed (a wrong result, a crash or its time limit).
set -u
if [ $# -ne 1 ]; then
    echo "usage: $0 OUTDIR" >&2
    exit 64
fi
mkdir -p "$1"
OUT=$(cd "$1" && pwd)
cd "$(dirname "$0")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-$(command -v python3 || command -v python)}
# Wheels carried in .whl/ (e.g. MPICH, for the multi-rank tests where the
# image has mpi4py but no MPI library) are installed into a scratch folder.
if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/commlib-site .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/commlib-site" PATH="/tmp/commlib-site/bin:$PATH"
fi

step() { echo; echo "== $*"; }

{
    step "nvidia-smi"
    timeout -k 5 20 nvidia-smi || echo "nvidia-smi: not available (status $?)"
    step "versions"
    timeout -k 5 40 "$PY" - <<'EOF'
import platform, sys
print("python", sys.version.split()[0], platform.platform())
import numpy
print("numpy", numpy.__version__)
try:
    import cupy
    rt = cupy.cuda.runtime
    print("cupy", cupy.__version__, "| CUDA runtime", rt.runtimeGetVersion(),
          "| driver", rt.driverGetVersion())
    props = rt.getDeviceProperties(0)
    print("device 0:", props["name"].decode() if isinstance(props["name"], bytes)
          else props["name"], "| SMs", props["multiProcessorCount"],
          "| L2", props.get("l2CacheSize"), "bytes")
    from cupy.cuda import nccl
    print("nccl", nccl.get_version())
except Exception as exc:
    print("cupy / nccl:", type(exc).__name__, exc)
try:
    import torch
    print("torch", torch.__version__, "| cuda", torch.version.cuda,
          "| available", torch.cuda.is_available())
except Exception as exc:
    print("torch:", type(exc).__name__, exc)
try:
    import mpi4py
    print("mpi4py", mpi4py.__version__)
except Exception as exc:
    print("mpi4py:", type(exc).__name__, exc)
EOF
} 2>&1 | tee "$OUT/env.txt"

step "pytest -m gpu (limit 150 s)" | tee "$OUT/pytest-gpu.log"
timeout -k 10 150 "$PY" -m pytest -m gpu -q -p no:cacheprovider \
    --junitxml="$OUT/pytest-gpu.xml" tests/ 2>&1 | tee -a "$OUT/pytest-gpu.log"
TESTS=${PIPESTATUS[0]}
# all skipped (no GPU seen) or no report at all counts as a failure
RAN=$("$PY" - "$OUT/pytest-gpu.xml" 2>/dev/null <<'EOF' || echo 0
import sys, xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else list(root)
print(sum(int(s.get("tests", 0)) - int(s.get("skipped", 0)) for s in suites))
EOF
)
if [ "$TESTS" -eq 0 ] && [ "${RAN:-0}" -le 0 ]; then
    echo "no gpu test ran (all skipped or none collected)" | tee -a "$OUT/pytest-gpu.log"
    TESTS=5
fi

step "benchmarks/kernels.py (limit 100 s)" | tee "$OUT/bench.log"
timeout -k 10 100 "$PY" benchmarks/kernels.py --out "$OUT" 2>&1 | tee -a "$OUT/bench.log"
BENCH=${PIPESTATUS[0]}

{
    step "summary"
    echo "pytest -m gpu: exit $TESTS$([ "$TESTS" = 124 ] && echo ' (time limit)'), ${RAN:-0} run"
    echo "benchmark:     exit $BENCH$([ "$BENCH" = 124 ] && echo ' (time limit)')"
} | tee "$OUT/summary.txt"

if [ "$TESTS" -ne 0 ]; then exit 1; fi
if [ "$BENCH" -ne 0 ]; then exit 2; fi
exit 0
