"""CUDA sources: they compile with nvcc, and with the NVRTC of CUDA 12 and of
CUDA 13 given the options the loader gives cupy, for every supported
architecture, stay NVRTC-friendly, export the kernels the wrappers launch, and (built as host code) compute exactly what
their numpy twins compute.

The host build (tests/ops/cuda_host_build.py, the cooperative one that
tests/ops/test_kernels_cooperative.py runs every kernel through) launches the
kernels with every thread a fiber, every load and store bounds- and
alignment-checked and every written byte counted; it needs g++ but no GPU.
With its host stand-in for cupy, the ``gpu``-marked tests of the cast and
pack wrappers and the benchmark's GPU branch run end to end on a CPU too.
"""
import glob
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from commlib.ops import _pack_cuda, cast as cast_mod
from commlib.ops.cast import numpy_cast_into
from commlib.ops.pack import copy_mode, pack, unpack
import cuda_host_build
import nvrtc_builds
from test_ops_cast import STORE, adversarial

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / "kernels"
SOURCES = sorted(KERNELS.glob("*.cu"))
ARCHS = ("75", "86", "90")   # one arch of each branch of common.cuh's CL_FULL_SM_BLOCKS
NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found on PATH")
# what cupy.RawModule adds (-ftz=true) plus what commlib passes (--std=c++17)
FLAGS = ["--std=c++17", "-Werror", "all-warnings", "-ftz=true", "-I", str(KERNELS)]


def _nvcc(args, timeout=300):
    return subprocess.run([NVCC] + args, capture_output=True, text=True, timeout=timeout)


_PTX = {}   # (source, arch) -> PTX text, for this test process


def ptx(source, arch, tmp_path):
    """PTX of kernels/``source`` for compute_``arch`` with FLAGS: nvcc runs
    once per source and arch in a test process."""
    if (source.name, arch) not in _PTX:
        out = tmp_path / (source.stem + ".ptx")
        res = _nvcc(["--ptx", "-arch=compute_" + arch, *FLAGS, str(source), "-o", str(out)])
        assert res.returncode == 0, res.stdout + res.stderr
        _PTX[source.name, arch] = out.read_text()
    return _PTX[source.name, arch]


@needs_nvcc
@pytest.mark.xdist_group("ptx")        # one worker: the wrappers' check reads these PTX
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("source", SOURCES, ids=[p.name for p in SOURCES])
def test_ptx_compiles(source, arch, tmp_path):
    assert ".entry" in ptx(source, arch, tmp_path)


@needs_nvcc
@pytest.mark.xdist_group("ptx")
@pytest.mark.parametrize("source,names", [("cast.cu", cast_mod.KERNEL_NAMES),
                                          ("pack.cu", _pack_cuda.KERNEL_NAMES)])
def test_wrappers_name_existing_kernels(source, names, tmp_path):
    entries = set(re.findall(r"\.entry\s+(\w+)\s*\(", ptx(KERNELS / source, "90", tmp_path)))
    assert set(names) <= entries, sorted(set(names) - entries)


NVRTC_MAJORS = (12, 13)               # the NVRTC of each cupy-cuda wheel (cupy-cuda12x, 13x)
NVRTC_ARCHS = ("80", "90")


def nvrtc_archs(major):
    """The archs built with every NVRTC (``major``: 12, 13, "13.0", or
    test_kernel_machine_code's label, "12 (pip)"): the data-centre GPUs,
    A100 (sm_80) and H100/H200 (sm_90), whose machine code
    test_kernel_machine_code.py reads. The sources' other branches (sm_86/89,
    and sm_75, where cuda_bf16.hpp also emulates bf16 arithmetic) are
    compiled by nvcc (test_ptx_compiles)."""
    return NVRTC_ARCHS


def nvrtc_libraries():
    """{major: path} of the libnvrtc libraries found: COMMLIB_NVRTC, pip
    ``nvidia-cuda-nvrtc-cu12`` / ``nvidia-cuda-nvrtc`` wheels, the CUDA toolkit."""
    candidates = [os.environ.get("COMMLIB_NVRTC", "")]
    for entry in sys.path:
        candidates += sorted(glob.glob(os.path.join(entry, "nvidia", "*", "lib", "libnvrtc.so.*")))
    for root in (os.environ.get("CUDA_PATH", ""), "/usr/local/cuda"):
        candidates += sorted(glob.glob(os.path.join(root, "lib64", "libnvrtc.so.*")))
    found = {}
    for path in candidates:
        m = re.search(r"libnvrtc\.so\.(\d+)", os.path.basename(path))
        if m and ".alt." not in path and os.path.exists(path):
            found.setdefault(int(m.group(1)), path)
    return found


NVRTC_LIBS = nvrtc_libraries()


@pytest.mark.xdist_group("nvrtc")      # shares the NVRTC builds of test_kernel_machine_code
@pytest.mark.parametrize("major", NVRTC_MAJORS + ("13.0",))
@pytest.mark.parametrize("source", SOURCES, ids=[p.name for p in SOURCES])
def test_nvrtc_compiles_like_the_loader(source, major):
    # exactly what cupy.RawModule hands NVRTC for commlib's kernels: the
    # loader's options, cupy's -ftz=true, and -arch=sm_XX for the device;
    # "13.0": CUDA 13.0's NVRTC, pinned (test_kernel_machine_code.pinned_nvrtc)
    if major == "13.0":
        import test_kernel_machine_code
        try:
            lib = test_kernel_machine_code.pinned_nvrtc(major)
        except RuntimeError as exc:
            pytest.fail("NVRTC 13.0 not available: %s" % exc)
    elif major not in NVRTC_LIBS:
        pytest.skip("libnvrtc.so.%d not found (pip install %s)" % (
            major, "nvidia-cuda-nvrtc-cu12" if major == 12 else "nvidia-cuda-nvrtc"))
    else:
        lib = NVRTC_LIBS[major]
    report, _ = nvrtc_builds.build(lib, SOURCES, nvrtc_archs(major))   # every source, once per lib
    for arch in nvrtc_archs(major):
        status, log = report["builds"]["%s.sm_%s" % (source.stem, arch)]
        assert status == "ok", "NVRTC %s, sm_%s: %s\n%s" % (major, arch, status, log)
        assert "warning" not in log, "NVRTC %s, sm_%s:\n%s" % (major, arch, log)


@pytest.mark.parametrize("path", sorted(KERNELS.glob("*.cu*")), ids=lambda p: p.name)
def test_sources_need_no_host_headers(path):
    # NVRTC has no C/C++ standard library headers; cuda_*.h are fine
    text = path.read_text()
    for header in re.findall(r"^\s*#\s*include\s*<([^>]+)>", text, re.M):
        assert header.startswith("cuda_") or "__CUDACC_RTC__" in text, \
            "%s includes <%s>, which NVRTC cannot open" % (path.name, header)


# ---------------------------------------------------------------- host build
# The cooperative host build of kernels/ (tests/ops/cuda_host_build.py): every
# thread of a launch is a fiber, every load and store is checked, and each
# stored byte can be counted.

needs_host_build = pytest.mark.skipif(
    cuda_host_build.GXX is None or cuda_host_build.OBJCOPY is None,
    reason="g++ or objcopy not found on PATH")


def _span(a, name, counts=None):
    lo = a.__array_interface__["data"][0]
    return (lo, lo + a.nbytes, name) + (() if counts is None else (counts,))


class Emulator:
    """Launches the cast and pack kernels of the host build over numpy
    arrays. A launch may touch only the arrays named as read or written (and
    its counter and segment table), and over one call every byte of the
    written arrays is stored exactly once and no byte of the read ones."""

    def __init__(self, kernels):
        self.kernels = kernels

    def _run(self, launches, reads, writes):
        """launches: (kernel, grid, block, args, extra regions)."""
        arrays = list(writes) + list(reads)
        counts = [np.zeros(a.nbytes, np.uint8) for a in arrays]
        regions = [_span(a, "%s array %d" % ("written" if i < len(writes) else "read", i), c)
                   for i, (a, c) in enumerate(zip(arrays, counts))]
        for name, grid, block, args, extra in launches:
            self.kernels.launch(name, grid, block, args, regions=regions + extra,
                                args_are_regions=False)
        assert all(np.all(c == 1) for c in counts[:len(writes)]), \
            "bytes not stored exactly once"
        assert not any(c.any() for c in counts[len(writes):]), "stores into an array only read"

    def cast(self, x, out, scale, accumulate, threads):
        name = cast_mod.cast_kernel_name(cast_mod.format_of(x.dtype),
                                         cast_mod.format_of(out.dtype), accumulate)
        counter = np.zeros((), np.uint64)
        args = [x, out, np.int64(x.size), np.float32(scale), counter]
        self._run([(name, 1, threads, args, [_span(counter, "counter")])], [x], [out])
        return int(counter)

    def pack(self, direction, arrays, bucket, scale, accumulate, mode, blocks, threads=256):
        plan = _pack_cuda.plan(direction, [a.dtype for a in arrays], [a.size for a in arrays],
                               [a.ctypes.data for a in arrays], bucket.dtype,
                               bucket.ctypes.data, mode, accumulate)
        total = sum(a.size for a in arrays)
        live = [a for a in arrays if a.size]
        counter = np.zeros((), np.uint64)
        skip = np.zeros((), np.int64)                  # 0: the copy goes ahead
        launches = []
        for launch in plan:
            table, nchunks = _pack_cuda.build_table(launch.segments, launch.chunk)
            args = [table, np.int64(len(launch.segments)), np.int64(launch.chunk), bucket,
                    np.float32(1 if scale is None else scale), counter, skip]
            launches.append((launch.kernel, min(blocks, nchunks), threads, args,
                             [_span(table, "table"), _span(counter, "counter"),
                              _span(skip, "skip")]))
        if direction == "pack":
            self._run(launches, live, [bucket[:total]])
        else:
            self._run(launches, [bucket[:total]], live)
        return int(counter), [launch.kernel for launch in plan]


@pytest.fixture(scope="module")
def emu():
    if cuda_host_build.GXX is None or cuda_host_build.OBJCOPY is None:
        pytest.skip("g++ or objcopy not found on PATH")
    return Emulator(cuda_host_build.build())


@pytest.fixture(scope="module")
def host_cupy(emu, tmp_path_factory):
    """Environment that makes ``import cupy`` load the host stand-in."""
    d = tmp_path_factory.mktemp("hostcupy")
    cuda_host_build.write_cupy_package(d, emu.kernels)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(d), str(ROOT)]))
    env.pop("COMMLIB_HOST_KERNELS_LENIENT", None)
    return env


@needs_host_build
def test_gpu_tests_pass_on_the_host_build(host_cupy):
    # the @pytest.mark.gpu tests of the cast and pack wrappers, end to end
    # (wrappers, launch arguments, caches), on the host build of the kernels,
    # but the whole-ResNet-50 packs (30 s each emulated): the kernel bodies
    # run on ResNet-50's shapes in test_pack_kernel_body_resnet50_mixed_dtypes,
    # the wrappers on the pack benchmark's ResNet-50 list (at 1/100 of its
    # sizes) in test_benchmark_gpu_branch_on_the_host_build
    # two of the four large misaligned casts: one each way, one of each half format
    skipped = []
    for case in ("float16-float32-True", "float32-bfloat16-False"):
        skipped += ["--deselect", "tests/ops/test_ops_cast.py::test_gpu_large_misaligned[%s]" % case]
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-x",
                          "-p", "no:cacheprovider", "tests/ops/test_ops_cast.py",
                          "tests/ops/test_ops_pack.py", "-k", "not resnet50_one_launch",
                          *skipped],
                         cwd=ROOT, env=host_cupy, capture_output=True, text=True, timeout=600)
    tail = res.stdout[-3000:] + res.stderr[-3000:]
    assert res.returncode == 0, tail
    assert "skipped" not in res.stdout.splitlines()[-1], tail


#: gpu-marked tests past the kernels' wrappers that the host build runs, and
#: how many test items they are: every kernel path small, the MPI transport
#: with cupy arrays at 2 ranks, asynchronous calls on a side stream, the
#: compression faults, the optimizer, the MNIST example. NCCL, torch's CUDA,
#: several streams at once and the 25M-element sizes need a real GPU.
HOST_BUILD_GPU_TESTS = (
    ["tests/gpu/test_gpu.py::test_every_kernel_path_small_against_the_twins",
     "tests/gpu/test_gpu.py::test_mpi_transport_with_cupy_arrays_world_size_2",
     "tests/progress/test_async.py::test_gpu_async_stream_order_and_reducer",
     "tests/compression/test_compression_faults.py::test_faults_cupy_world_size_1",
     "tests/optim/test_optimizer.py::test_cupy_parameters_follow_the_numpy_rules",
     "tests/test_examples.py::test_mnist_on_gpu"], 9)


@needs_host_build
def test_gpu_integration_tests_pass_on_the_host_build(host_cupy):
    # the parts that a GPU run reaches through more than one wrapper (the
    # transports, the progress thread's streams and events, the example),
    # each item run, none skipped
    tests, items = HOST_BUILD_GPU_TESTS
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu",
                          "-p", "no:cacheprovider", *tests],
                         cwd=ROOT, env=host_cupy, capture_output=True, text=True, timeout=600)
    tail = res.stdout[-3000:] + res.stderr[-3000:]
    assert res.returncode == 0, tail
    assert re.match(r"%d passed in " % items, res.stdout.splitlines()[-1]), tail


@needs_host_build
def test_gpu_step_gpu_branch_on_the_host_build(host_cupy, tmp_path):
    # benchmarks/gpu_step.py with cupy arrays (the host build's; no NCCL
    # there, so Communicator.single(device=0), and no torch): every commlib
    # variant measured, synchronously and with async_op=True, and checked
    res = subprocess.run([sys.executable, "benchmarks/gpu_step.py", "--device", "gpu",
                          "--workload", "mnist_cnn", "--repeats", "1", "--warmup", "1",
                          "--no-init-probe", "--no-torch", "--time-limit", "250",
                          "--out", str(tmp_path)],
                         cwd=ROOT, env=host_cupy, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    data = json.loads((tmp_path / "gpu_step.json").read_text())
    assert data["env"]["device"] == "gpu", data["env"]
    assert [e["where"] for e in data["errors"]] == ["commlib: from_nccl_id"], data["errors"]
    for row in data["rows"]:
        assert row["commlib"]["check"] == "ok", row
        assert row["commlib"]["device_ms"] > 0 and row["commlib"]["issue_ms"] > 0, row
    assert set(data["host_target"]["issue_us"]) == {r["variant"] for r in data["rows"]}


def run_on_the_host_build(host_cupy, n, code, args=()):
    """``run_mpi(n, code, args)`` with ``import cupy`` giving the host build's
    stand-in in every rank (the ``host_cupy`` fixture's)."""
    from mpirun import python_path, run_mpi
    stand_in = host_cupy["PYTHONPATH"].split(os.pathsep)[0]
    return run_mpi(n, code, args=args, timeout=240,
                   env={"PYTHONPATH": stand_in + os.pathsep + python_path()})


#: what every rank of the compression runs below must have launched: the
#: casting and raw packs (fp16/bf16 with the count of the reduced result's
#: NaN and inf, and top-K's gather and scatter of a
#: bucket of several arrays), every top-K pass, threshold and scatter-add
HALF_KERNELS = {"pack_f32_f16", "unpack_f16_f32", "pack_f32_bf16", "unpack_bf16_f32",
                "cast_f16_f16", "cast_bf16_bf16"}    # the last two count NaN and inf
SPARSE_KERNELS = {"pack_raw4", "unpack_raw4", "topk_sample", "topk_hist1", "topk_filter",
                  "topk_refine", "topk_compact", "threshold_select", "scatter_add",
                  "accumulate_finite", "split_records"}


@needs_host_build
@pytest.mark.parametrize("n,program,args,kernels", [
    (3, "compression_checks", ["cupy"], HALF_KERNELS | SPARSE_KERNELS),
    (3, "compression_fault_checks", ["nonfinite", "cupy"], HALF_KERNELS | SPARSE_KERNELS),
    (3, "compression_fault_checks", ["tampered", "cupy"], SPARSE_KERNELS - {"unpack_raw4"}),
], ids=["checks-3", "nonfinite-3", "tampered-3"])
def test_compression_with_cupy_arrays_on_the_host_build(host_cupy, n, program, args, kernels):
    # the compression strategies' cupy paths (commlib/compression over the
    # kernels of kernels/) at n real MPI ranks, the arrays and kernels those
    # of the host build: results against numpy, and non-finite values and
    # tampered payloads raising alike on every rank with nothing written
    # (tests/compression's programs, which a GPU runs at one rank)
    from mpirun import assert_each_rank
    code = ("import sys, cupy, %s\nfrom mpi4py import MPI\n"
            "%s.main(*sys.argv[1:])\n"
            "print('rank %%d launched: %%s.' %% (MPI.COMM_WORLD.rank, ' '.join(sorted("
            "{launch[0] for launch in cupy._host.launches}))))\n" % (program, program))
    proc = run_on_the_host_build(host_cupy, n, code, args)
    assert_each_rank(proc.stdout, r"(compression|faults \w+) rank (?P<rank>\d+) ok", n)
    launched = {int(m.group(1)): set(m.group(2).split())
                for m in re.finditer(r"rank (\d+) launched: ([\w ]*)\.", proc.stdout)}
    assert sorted(launched) == list(range(n)), proc.stdout[-2000:]
    for rank, names in launched.items():
        assert kernels <= names, (rank, sorted(kernels - names))


# every rank: the host reads that the compression strategies' own code
# (commlib/compression, commlib/ops) makes in one steady-state call, per unit
# (bucket or array reduced in place) of the list, with where they are
READS_CODE = """
import os
import numpy as np
import cupy
import commlib
from commlib.collective import bucketing
from commlib.compression import FP16, TopK, Threshold
from mpi4py import MPI
rank = MPI.COMM_WORLD.rank
comm = commlib.Communicator.from_mpi(backend="mpi", bucket_bytes=4096)
rng = np.random.default_rng(rank)
arrays = [cupy.asarray(rng.standard_normal(n).astype(np.float32))
          for n in (700, 900, 300, 2000, 500, 301)]
plan = bucketing.plan_for(arrays, 4096)
units = len(plan.buckets) + len(plan.direct)
own = tuple(os.path.join(os.path.dirname(commlib.__file__), d) + os.sep
            for d in ("compression", "ops"))
for strategy in (FP16(), TopK(0.05), Threshold(1.5)):
    for _ in range(2):
        comm.all_reduce(arrays, compression=strategy)
    del cupy._host.reads[:]
    comm.all_reduce(arrays, compression=strategy)
    mine = [(os.path.basename(f), line) for f, line in cupy._host.reads if f.startswith(own)]
    print("rank %d %s: %d units, %d reads at %s." % (
        rank, strategy.name.split("(")[0], units, len(mine), sorted(set(mine))))
comm.close()
"""

#: host reads of a steady-state call, per unit and per call (each one makes
#: the call wait for the GPU): fp16 and top-K read their checks (the reduced
#: result's non-finite count; the gathered headers with the entries' check)
#: with every other unit's, once per call; threshold reads its count while
#: selecting and its entries' check per unit, its headers once per call
READS = {"fp16": (0, 1), "topk": (0, 1), "threshold": (2, 1)}


@needs_host_build
def test_compressed_calls_read_the_gpu_once(host_cupy):
    proc = run_on_the_host_build(host_cupy, 2, READS_CODE)
    found = {(int(m.group(1)), m.group(2)): (int(m.group(3)), int(m.group(4)), m.group(5))
             for m in re.finditer(r"rank (\d) (\w+): (\d+) units, (\d+) reads at (\[.*?\])\.",
                                  proc.stdout)}
    assert sorted(found) == [(r, s) for r in (0, 1) for s in sorted(READS)], \
        proc.stdout[-3000:]
    for (rank, name), (units, reads, where) in found.items():
        per_unit, per_call = READS[name]
        assert units >= 4, (rank, name, units)
        assert reads == per_unit * units + per_call, (rank, name, units, reads, where)


def _benchmark(args, env, tmp_path):
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernels.py"), *args,
                          "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    rows = json.loads((tmp_path / "kernels.json").read_text())["rows"]
    return res, rows


def test_benchmark_runs_on_the_cpu(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    res, rows = _benchmark(["--device", "cpu", "--sizes", "20K", "--repeats", "1", "--no-pack"],
                           env, tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "| name | N | k | ms |" in res.stdout
    names = {r["name"] for r in rows}
    assert {"cast f32->f16", "topk", "threshold"} <= names
    assert all(r["check"] in ("ok", "-", "n/a") for r in rows), rows


@needs_host_build
def test_benchmark_gpu_branch_on_the_host_build(host_cupy, tmp_path):
    # every commlib kernel runs on the host build; the benchmark's own timing
    # kernel has none and does nothing here (lenient)
    env = dict(host_cupy, COMMLIB_HOST_KERNELS_LENIENT="1")
    # (the pack cases on ResNet-50's arrays at 1/100 of their sizes: the
    # whole list takes seconds per emulated pack)
    res, rows = _benchmark(["--device", "gpu", "--sizes", "20K", "--repeats", "2",
                            "--pack-scale", "100"], env, tmp_path)
    mine = [r for r in rows if r["name"].startswith(("cast", "pack", "unpack"))]
    assert len(mine) == 6 and all(r["check"] == "ok" for r in mine), mine
    assert all(r["ms"] > 0 and r["copy_fraction"] > 0 for r in mine)
    failed = {r["name"] for r in rows if str(r["check"]).startswith(("FAIL", "error"))}
    assert not failed, rows
    assert {"topk", "threshold"} <= {r["name"] for r in rows}, rows
    assert res.returncode == 0, res.stdout + res.stderr


FMTS = ("float32", "float16", "bfloat16")


@needs_host_build
@pytest.mark.parametrize("src", FMTS)
@pytest.mark.parametrize("dst", FMTS)
@pytest.mark.parametrize("accumulate", [False, True], ids=["set", "acc"])
def test_cast_kernel_body_matches_twin(emu, src, dst, accumulate):
    # every pair of start offsets (mod 8 elements) of x and out: aligned,
    # misaligned but vectorisable after a head, and never vectorisable
    lengths = (0, 1, 7, 37, 100, 1001)
    xbase = adversarial(src, 1100, 1)
    obase = adversarial(dst, 1100, 2)
    for k, scale in enumerate((1.0, 0.375, 3e5)):
        for xo in range(8):
            for oo in range(8):
                n = lengths[(xo * 8 + oo + k) % len(lengths)]
                x = xbase[xo:xo + n]
                o_kernel = obase.copy()[oo:oo + n]
                o_twin = o_kernel.copy()
                count = emu.cast(x, o_kernel, scale, accumulate, threads=96)
                want = numpy_cast_into(x, o_twin, np.float32(scale), accumulate)
                assert count == want, (xo, oo, n, scale)
                np.testing.assert_array_equal(o_kernel.view(np.uint8), o_twin.view(np.uint8))


def _resnet_shapes():
    return [tuple(s) for s in json.loads((ROOT / "tests/data/resnet50.json").read_text())["shapes"]]


def _arrays(shapes, dtype, seed, fmt=None):
    rng = np.random.default_rng(seed)
    out = []
    for s in shapes:
        a = rng.standard_normal(s).astype(np.float32)
        if fmt == "bfloat16":
            a = (a.view(np.uint32) >> 16).astype(np.uint16)
        out.append(a.astype(dtype, copy=False))
    return out


SMALL_SHAPES = [(3, 5), (0,), (64,), (1,), (7, 3, 3), (1000,), (17,), (2, 0), (8200,), (5,)]


@needs_host_build
@pytest.mark.parametrize("afmt", FMTS)
@pytest.mark.parametrize("bfmt", FMTS)
def test_pack_kernel_bodies_match_twin(emu, afmt, bfmt):
    total = sum(int(np.prod(s)) for s in SMALL_SHAPES)
    for layout in ("separate", "flat+0", "flat+1", "flat+3"):
        if layout == "separate":
            arrays = _arrays(SMALL_SHAPES, STORE[afmt], 3, afmt)
        else:       # views into one flat buffer, as a gradient buffer would be
            flat = np.concatenate([a.ravel() for a in _arrays(SMALL_SHAPES, STORE[afmt], 3, afmt)]
                                  + [np.zeros(8, STORE[afmt])])[int(layout[-1]):]
            arrays = _views(flat, SMALL_SHAPES)
        arrays[2].reshape(-1)[:8] = adversarial(afmt, 8, 9)
        for bucket_offset in (0, 1, 3):
            for scale in (None, 0.5):
                _check_pack_roundtrip(emu, arrays, total, afmt, bfmt, bucket_offset, scale)


def _views(flat, shapes):
    out, lo = [], 0
    for s in shapes:
        n = int(np.prod(s))
        out.append(flat[lo:lo + n].reshape(s))
        lo += n
    return out


def _check_pack_roundtrip(emu, arrays, total, afmt, bfmt, bucket_offset, scale):
    base_k = np.full(total + 10, 7, STORE[bfmt])
    base_t = base_k.copy()
    bk, bt = base_k[bucket_offset:], base_t[bucket_offset:]
    mode = copy_mode([a.dtype for a in arrays], bk.dtype, scale, counting=True)
    count, _ = emu.pack("pack", arrays, bk, scale, False, mode, blocks=3)
    want = np.zeros((), np.int64)
    pack(arrays, bt, scale, nonfinite=want)
    assert count == int(want)
    np.testing.assert_array_equal(base_k.view(np.uint8), base_t.view(np.uint8))
    for accumulate in (False, True):
        flat = np.concatenate([a.ravel() for a in _arrays(SMALL_SHAPES, STORE[afmt], 4, afmt)]
                              + [np.zeros(4, STORE[afmt])])
        flat_t = flat.copy()
        shift = (arrays[0].ctypes.data // arrays[0].itemsize) % 4
        outs_k = _views(flat[shift:], SMALL_SHAPES)
        outs_t = _views(flat_t[shift:], SMALL_SHAPES)
        mode = copy_mode([a.dtype for a in outs_k], bk.dtype, scale, accumulate, True)
        count, _ = emu.pack("unpack", outs_k, bk, scale, accumulate, mode, blocks=2)
        want = np.zeros((), np.int64)
        unpack(bt, outs_t, scale, accumulate, nonfinite=want)
        assert count == int(want)
        np.testing.assert_array_equal(flat.view(np.uint8), flat_t.view(np.uint8))


@needs_host_build
@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.float32, np.float64, np.complex128])
def test_raw_pack_kernel_bodies_copy_bits(emu, dtype):
    rng = np.random.default_rng(5)
    arrays = [rng.integers(0, 100, s).astype(dtype) for s in SMALL_SHAPES]
    total = sum(a.size for a in arrays)
    for bucket_offset in (0, 1):
        base = np.zeros(total + 3, dtype)
        bucket = base[bucket_offset:]
        _, kernels = emu.pack("pack", arrays, bucket, None, False, "raw", blocks=5)
        assert len(kernels) == 1 and "raw" in kernels[0]
        np.testing.assert_array_equal(bucket[:total], np.concatenate([a.ravel() for a in arrays]))
        outs = [np.zeros_like(a) for a in arrays]
        emu.pack("unpack", outs, bucket, None, False, "raw", blocks=4)
        for a, o in zip(arrays, outs):
            np.testing.assert_array_equal(a, o)


@needs_host_build
def test_pack_kernel_body_resnet50_mixed_dtypes(emu):
    shapes = _resnet_shapes()
    assert len(shapes) == 161
    # float32 weights with float16 batch-norm parameters: two launches
    arrays = [a if a.ndim > 1 else a.astype(np.float16)
              for a in _arrays(shapes, np.float32, 6)]
    total = sum(a.size for a in arrays)
    bucket_k = np.empty(total, np.uint16)
    bucket_t = np.empty(total, np.uint16)
    count, kernels = emu.pack("pack", arrays, bucket_k, 0.25, False, "cast", blocks=500)
    assert sorted(kernels) == ["pack_f16_bf16", "pack_f32_bf16"]
    pack(arrays, bucket_t, 0.25)
    assert count == 0
    np.testing.assert_array_equal(bucket_k, bucket_t)


#: operations of a steady-state call that the host issues to the GPU
#: (benchmarks/gpu_ops.py: launches, CUDA graph launches, other cupy
#: operations, copies, allocations, memsets, reads), at most: per unit
#: (bucket) for the strategies issued bucket by bucket, per call for those
#: that issue every bucket of the call together (Compression.reduce_all)
OPS_PER_UNIT = {"threshold": 28.0}
OPS_PER_CALL = {"dense": 2, "fp16": 3, "topk 1%": 5}


@needs_host_build
def test_gpu_operations_per_call(host_cupy, tmp_path):
    out = tmp_path / "ops.json"
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_ops.py"), "--json",
                          str(out), "--time-repeats", "1", "--time-scale", "20000"], cwd=ROOT,
                         env=host_cupy, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "| strategy | units | launches |" in res.stdout
    data = json.loads(out.read_text())
    rows = {r["strategy"]: r for r in data["operations"]}
    # the Python timing ran for every strategy, graphs on and off (its
    # figures are the table's, not judged here)
    assert [r["strategy"] for r in data["python"]] == ["dense", "fp16", "topk 1%"] * 2, data
    assert [r["units"] for r in data["python"]][2:4] == [5, 17], data   # 25 MiB; about 16
    assert all(r["graphs"] > 0 and r["no graphs"] > 0 for r in data["python"]), data
    assert sorted(rows) == sorted(list(OPS_PER_UNIT) + list(OPS_PER_CALL)), rows
    for name, budget in OPS_PER_UNIT.items():
        r = rows[name]
        assert r["units"] >= 5 and r["total"] <= budget * r["units"], (name, r)
    for name, budget in OPS_PER_CALL.items():
        r = rows[name]
        assert r["units"] >= 5 and r["total"] <= budget, (name, r)
    # top-K: the selection and the entries' check are kernels, not cupy
    # operations; one read per call
    topk = rows["topk 1%"]
    assert topk["cupy ops"] == 0 and topk["reads"] == 1, topk
    assert {"accumulate_finite", "split_records", "topk_compact"} <= set(topk["kernels"]), topk
    # dense, fp16 and top-K replay the fixed launch sequences of all their
    # buckets as CUDA graphs (commlib.ops.graphs), launching no kernel
    # themselves: dense the packs before the all-reduces and the unpacks
    # after, fp16 one before and one after the all-reduce, top-K one before
    # the all-gather, one for the entries' check, one for the sums
    for name, per_call in (("dense", 2), ("fp16", 2), ("topk 1%", 3)):
        r = rows[name]
        assert r["graphs"] == per_call and r["launches"] == 0, r
        assert r["allocations"] == 0 and r["memsets"] == 0, r


@needs_host_build
def test_call_path_of_cupy_arrays_on_the_host_build(host_cupy):
    # a steady all-reduce of cupy arrays (the stand-in) reaches the MPI
    # transport's wire in as few frames as numpy arrays do (see
    # tests/collective/test_call_path.py, whose limits and checks hold here)
    from test_call_path import check_call_path
    code = "import call_path_program\ncall_path_program.main('cupy')\n"
    check_call_path(run_on_the_host_build(host_cupy, 2, code).stdout, ("mpi",))
