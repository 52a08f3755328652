"""CUDA sources: they compile with nvcc, and with the NVRTC of CUDA 12 and of
CUDA 13 given the options the loader gives cupy, for every supported
architecture, stay NVRTC-friendly, export the kernels the wrappers launch, and (built as host code) compute exactly what
their numpy twins compute.

The host build runs each kernel's per-thread body (``NAME_thread``) for every
thread of a grid, one after another, with every load and store bounds- and
alignment-checked and every written byte counted; it needs nvcc but no GPU.
With a host stand-in for cupy on top of it, the ``gpu``-marked tests of the
wrappers and the benchmark's GPU branch run end to end on a CPU too.
"""
import ctypes
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
from test_ops_cast import STORE, adversarial

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "kernels"
SOURCES = sorted(KERNELS.glob("*.cu"))
ARCHS = ("75", "80", "90")
NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found on PATH")
# what cupy.RawModule adds (-ftz=true) plus what commlib passes (--std=c++17)
FLAGS = ["--std=c++17", "-Werror", "all-warnings", "-ftz=true", "-I", str(KERNELS)]


def _nvcc(args, timeout=300):
    return subprocess.run([NVCC] + args, capture_output=True, text=True, timeout=timeout)


@needs_nvcc
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("source", SOURCES, ids=[p.name for p in SOURCES])
def test_ptx_compiles(source, arch, tmp_path):
    out = tmp_path / (source.stem + ".ptx")
    res = _nvcc(["--ptx", "-arch=compute_" + arch, *FLAGS, str(source), "-o", str(out)])
    assert res.returncode == 0, res.stdout + res.stderr
    assert out.stat().st_size > 0


@needs_nvcc
@pytest.mark.parametrize("source,names", [("cast.cu", cast_mod.KERNEL_NAMES),
                                          ("pack.cu", _pack_cuda.KERNEL_NAMES)])
def test_wrappers_name_existing_kernels(source, names, tmp_path):
    out = tmp_path / "k.ptx"
    res = _nvcc(["--ptx", "-arch=compute_90", *FLAGS, str(KERNELS / source), "-o", str(out)])
    assert res.returncode == 0, res.stdout + res.stderr
    entries = set(re.findall(r"\.entry\s+(\w+)\s*\(", out.read_text()))
    assert set(names) <= entries, sorted(set(names) - entries)


NVRTC_MAJORS = (12, 13)               # the NVRTC of each cupy-cuda wheel (cupy-cuda12x, 13x)
NVRTC_ARCHS = ("75", "80", "86", "89", "90")


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


# Runs in a subprocess of its own per library (two majors' builtins do not
# share a process): argv = library, source, options (JSON), archs (JSON).
# Prints JSON {arch: [status, log]}; "unsupported" for an arch this NVRTC
# does not list.
_NVRTC_PROGRAM = r"""
import concurrent.futures, ctypes, glob, json, os, sys
lib_path, source, options, archs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
for b in glob.glob(os.path.join(os.path.dirname(lib_path), "libnvrtc-builtins.so*")):
    if ".alt." not in b:
        ctypes.CDLL(b, mode=ctypes.RTLD_GLOBAL)
lib = ctypes.CDLL(lib_path)
n = ctypes.c_int()
assert lib.nvrtcGetNumSupportedArchs(ctypes.byref(n)) == 0
supported = (ctypes.c_int * n.value)()
assert lib.nvrtcGetSupportedArchs(supported) == 0
supported = set(supported)
text = open(source, "rb").read()

def compile_for(arch):
    if int(arch) not in supported:
        return arch, ["unsupported", ""]
    opts = options + ["-arch=sm_" + arch]
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), text, os.path.basename(source).encode(),
                                  0, None, None) == 0
    try:
        argv = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        rc = lib.nvrtcCompileProgram(prog, len(opts), argv)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        cubin = ctypes.c_size_t()
        if rc == 0:
            assert lib.nvrtcGetCUBINSize(prog, ctypes.byref(cubin)) == 0
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
    status = "ok" if rc == 0 and cubin.value > 0 else "error %d" % rc
    return arch, [status, log.value.decode(errors="replace")]

with concurrent.futures.ThreadPoolExecutor(2) as pool:
    print(json.dumps(dict(pool.map(compile_for, archs))))
"""


NVRTC_LIBS = nvrtc_libraries()


@pytest.mark.parametrize("major", NVRTC_MAJORS)
@pytest.mark.parametrize("source", SOURCES, ids=[p.name for p in SOURCES])
def test_nvrtc_compiles_like_the_loader(source, major):
    # exactly what cupy.RawModule hands NVRTC for commlib's kernels: the
    # loader's options, cupy's -ftz=true, and -arch=sm_XX for the device
    from commlib.ops import _loader
    if major not in NVRTC_LIBS:
        pytest.skip("libnvrtc.so.%d not found (pip install %s)" % (
            major, "nvidia-cuda-nvrtc-cu12" if major == 12 else "nvidia-cuda-nvrtc"))
    options = list(_loader.module_options()) + list(_loader.CUPY_ADDED_OPTIONS)
    res = subprocess.run([sys.executable, "-c", _NVRTC_PROGRAM, NVRTC_LIBS[major], str(source),
                          json.dumps(options), json.dumps(NVRTC_ARCHS)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    results = json.loads(res.stdout)
    assert set(results) == set(NVRTC_ARCHS)
    for arch, (status, log) in sorted(results.items()):
        assert status == "ok", "NVRTC %d, sm_%s: %s\n%s" % (major, arch, status, log)
        assert "warning" not in log, "NVRTC %d, sm_%s:\n%s" % (major, arch, log)


@pytest.mark.parametrize("path", sorted(KERNELS.glob("*.cu*")), ids=lambda p: p.name)
def test_sources_need_no_host_headers(path):
    # NVRTC has no C/C++ standard library headers; cuda_*.h are fine
    text = path.read_text()
    for header in re.findall(r"^\s*#\s*include\s*<([^>]+)>", text, re.M):
        assert header.startswith("cuda_") or "__CUDACC_RTC__" in text, \
            "%s includes <%s>, which NVRTC cannot open" % (path.name, header)


# ---------------------------------------------------------------- host build

_HARNESS = r"""
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <vector>

namespace {
struct Range { unsigned long long lo, hi; std::vector<unsigned char> writes; };
std::vector<Range> reads, writes;
long long bad = 0;

void add(std::vector<Range>& v, unsigned long long lo, unsigned long long hi) {
  if (hi > lo) v.push_back(Range{lo, hi, {}});
}

void merge(std::vector<Range>& v, bool track) {
  std::sort(v.begin(), v.end(), [](const Range& a, const Range& b) { return a.lo < b.lo; });
  std::vector<Range> m;
  for (auto& r : v) {
    if (!m.empty() && r.lo <= m.back().hi) m.back().hi = std::max(m.back().hi, r.hi);
    else m.push_back(Range{r.lo, r.hi, {}});
  }
  if (track) for (auto& r : m) r.writes.assign(r.hi - r.lo, 0);
  v.swap(m);
}

Range* find(std::vector<Range>& v, unsigned long long p, unsigned long long n) {
  auto it = std::upper_bound(v.begin(), v.end(), p,
                             [](unsigned long long x, const Range& r) { return x < r.lo; });
  if (it == v.begin()) return nullptr;
  --it;
  return (p + n <= it->hi) ? &*it : nullptr;
}

void check(const void* ptr, unsigned long long n, bool is_write) {
  const unsigned long long p = (unsigned long long)ptr;
  if (p % n) {                                // the GPU faults on misaligned access
    if (bad++ < 5) std::fprintf(stderr, "misaligned %llu-byte access at %#llx\n", n, p);
    return;
  }
  if (reads.empty() && writes.empty()) return;  // no ranges given: alignment only
  if (is_write) {
    Range* r = find(writes, p, n);
    if (!r) {
      if (bad++ < 5) std::fprintf(stderr, "out-of-bounds %llu-byte store at %#llx\n", n, p);
      return;
    }
    for (unsigned long long i = 0; i < n; ++i) ++r->writes[p - r->lo + i];
  } else if (!find(reads, p, n) && !find(writes, p, n)) {
    if (bad++ < 5) std::fprintf(stderr, "out-of-bounds %llu-byte load at %#llx\n", n, p);
  }
}
}  // namespace

#ifndef __CUDA_ARCH__
#define CL_CHECK_ACCESS(p, n, w) check((const void*)(p), (n), (w))
#endif
#include "cast.cu"
#include "pack.cu"

extern "C" void emu_reset() { reads.clear(); writes.clear(); bad = 0; }
extern "C" void emu_allow(unsigned long long lo, unsigned long long hi, int write) {
  add(write ? writes : reads, lo, hi);
}
extern "C" void emu_seal() { merge(reads, false); merge(writes, true); }
extern "C" long long emu_bad() { return bad; }
// bytes of the write ranges written other than exactly once
extern "C" long long emu_miswritten() {
  long long m = 0;
  for (auto& r : writes) for (unsigned char c : r.writes) m += (c != 1);
  return m;
}

extern "C" int emu_cast(const char* name, const void* src, void* dst, long long n, float scale,
                        unsigned long long* counter, long long nt) {
#define X(NAME) if (!std::strcmp(name, #NAME)) { \
    for (long long t = 0; t < nt; ++t) NAME##_thread(src, dst, n, scale, counter, t, nt); \
    return 0; }
  CAST_NAMES
#undef X
  return -1;
}

extern "C" int emu_segments(const char* name, const long long* table, long long nseg,
                            long long chunk, const void* bucket, float scale,
                            unsigned long long* counter, long long nblocks, long long nt) {
#define X(NAME) if (!std::strcmp(name, #NAME)) { \
    for (long long b = 0; b < nblocks; ++b) for (long long t = 0; t < nt; ++t) \
      NAME##_thread(table, nseg, chunk, bucket, scale, counter, b, nblocks, t, nt); \
    return 0; }
  PACK_NAMES
#undef X
  return -1;
}
"""


class Emulator:
    """Runs kernels' per-thread bodies on the CPU over numpy arrays."""

    def __init__(self, lib, path):
        self.lib = lib
        self.path = path
        lib.emu_cast.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p,
                                 ctypes.c_longlong, ctypes.c_float, ctypes.c_void_p,
                                 ctypes.c_longlong]
        lib.emu_segments.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_longlong,
                                     ctypes.c_longlong, ctypes.c_void_p, ctypes.c_float,
                                     ctypes.c_void_p, ctypes.c_longlong, ctypes.c_longlong]
        lib.emu_allow.argtypes = [ctypes.c_ulonglong, ctypes.c_ulonglong, ctypes.c_int]
        lib.emu_bad.restype = ctypes.c_longlong
        lib.emu_miswritten.restype = ctypes.c_longlong

    def _allow(self, reads, writes):
        self.lib.emu_reset()
        for a in reads:
            self.lib.emu_allow(a.ctypes.data, a.ctypes.data + a.nbytes, 0)
        for a in writes:
            self.lib.emu_allow(a.ctypes.data, a.ctypes.data + a.nbytes, 1)
        self.lib.emu_seal()

    def _checks(self):
        assert self.lib.emu_bad() == 0, "out-of-bounds or misaligned accesses"
        assert self.lib.emu_miswritten() == 0, "bytes not written exactly once"

    def cast(self, x, out, scale, accumulate, threads):
        name = cast_mod.cast_kernel_name(cast_mod.format_of(x.dtype),
                                         cast_mod.format_of(out.dtype), accumulate)
        counter = np.zeros((), np.uint64)
        self._allow([x, out] if accumulate else [x], [out])
        rc = self.lib.emu_cast(name.encode(), x.ctypes.data, out.ctypes.data, x.size,
                               np.float32(scale), counter.ctypes.data, threads)
        assert rc == 0, name
        self._checks()
        return int(counter)

    def pack(self, direction, arrays, bucket, scale, accumulate, mode, blocks, threads=256):
        launches = _pack_cuda.plan(direction, [a.dtype for a in arrays],
                                   [a.size for a in arrays],
                                   [a.ctypes.data for a in arrays], bucket.dtype,
                                   bucket.ctypes.data, mode, accumulate)
        total = sum(a.size for a in arrays)
        live = [a for a in arrays if a.size]
        if direction == "pack":
            self._allow(live, [bucket[:total]])
        else:
            self._allow([bucket[:total]] + (live if accumulate else []), live)
        counter = np.zeros((), np.uint64)
        for launch in launches:
            table, nchunks = _pack_cuda.build_table(launch.segments, launch.chunk)
            rc = self.lib.emu_segments(launch.kernel.encode(), table.ctypes.data,
                                       len(launch.segments), launch.chunk, bucket.ctypes.data,
                                       np.float32(1 if scale is None else scale),
                                       counter.ctypes.data, min(blocks, nchunks), threads)
            assert rc == 0, launch.kernel
        self._checks()
        return int(counter), [launch.kernel for launch in launches]


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    if NVCC is None:
        pytest.skip("nvcc not found on PATH")
    d = tmp_path_factory.mktemp("hostbuild")
    src = d / "host.cu"

    def xs(names):
        return " ".join("X(%s)" % n for n in names)
    src.write_text("#define CAST_NAMES %s\n#define PACK_NAMES %s\n%s"
                   % (xs(cast_mod.KERNEL_NAMES), xs(_pack_cuda.KERNEL_NAMES), _HARNESS))
    lib = d / "host.so"
    res = _nvcc(["-shared", "-Xcompiler", "-fPIC,-ffp-contract=off", "-O2",
                 "-arch=compute_75", "--std=c++17", "-I", str(KERNELS), str(src),
                 "-o", str(lib)])
    assert res.returncode == 0, res.stdout + res.stderr
    return Emulator(ctypes.CDLL(str(lib)), str(lib))


_HOST_CUPY = r'''
"""Host stand-in for cupy, for machines without a GPU: arrays are a numpy
subclass in host memory, and RawModule kernels run their per-thread bodies
from the host build of kernels/*.cu named by COMMLIB_HOST_KERNELS. Unknown
kernels raise NotImplementedError (or do nothing when
COMMLIB_HOST_KERNELS_LENIENT is set)."""
import ctypes
import os
import time
import types

import numpy as np

__version__ = "host"
_lib = ctypes.CDLL(os.environ["COMMLIB_HOST_KERNELS"])
_lib.emu_cast.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_longlong,
                          ctypes.c_float, ctypes.c_void_p, ctypes.c_longlong]
_lib.emu_segments.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_longlong,
                              ctypes.c_longlong, ctypes.c_void_p, ctypes.c_float,
                              ctypes.c_void_p, ctypes.c_longlong, ctypes.c_longlong]
_lib.emu_bad.restype = ctypes.c_longlong


class _Memory:
    def __init__(self, ptr):
        self.ptr = ptr

    def copy_from_device_async(self, src, size, stream=None):
        ctypes.memmove(self.ptr, src.ptr, size)


class _Device:
    def __init__(self, id=0):
        self.id = int(id)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def synchronize(self):
        pass


class ndarray(np.ndarray):
    @property
    def data(self):
        return _Memory(self.ctypes.data)

    @property
    def device(self):
        return _Device(0)

    def get(self):
        return np.array(self)


ndarray.__module__ = "cupy"


def _wrap(r):
    if isinstance(r, np.ndarray) and not isinstance(r, ndarray):
        return r.view(ndarray)
    if isinstance(r, tuple):
        return tuple(_wrap(x) for x in r)
    return r


class _Wrapped:
    def __init__(self, obj):
        self._obj = obj

    def __getattr__(self, name):
        f = getattr(self._obj, name)
        if isinstance(f, type) or not callable(f):
            return f
        return lambda *a, **k: _wrap(f(*a, **k))


def __getattr__(name):
    f = getattr(np, name)
    if isinstance(f, type) or not callable(f):
        return f
    return lambda *a, **k: _wrap(f(*a, **k))


def get_default_memory_pool():
    return types.SimpleNamespace(free_all_blocks=lambda: None)


def asarray(a, dtype=None):
    if isinstance(a, ndarray) and (dtype is None or np.dtype(dtype) == a.dtype):
        return a
    return np.array(a, dtype=dtype).view(ndarray)


def asnumpy(a):
    return np.array(a)


random = _Wrapped(types.SimpleNamespace(default_rng=lambda seed=None: _Wrapped(
    np.random.default_rng(seed))))


class RawKernel:
    def __init__(self, code=None, name=None, options=(), **kwargs):
        self.name = name

    def __call__(self, grid, block, args, **kwargs):
        argv = [a.ctypes.data if isinstance(a, np.ndarray) else a for a in args]
        name = self.name.encode()
        if self.name.startswith("cast_"):
            src, dst, n, scale, counter = argv
            rc = _lib.emu_cast(name, src, dst, int(n), float(scale), counter, grid[0] * block[0])
        elif self.name.startswith(("pack_", "unpack_")):
            table, nseg, chunk, bucket, scale, counter = argv
            rc = _lib.emu_segments(name, table, int(nseg), int(chunk), bucket, float(scale),
                                   counter, grid[0], block[0])
        elif os.environ.get("COMMLIB_HOST_KERNELS_LENIENT"):
            rc = 0
        else:
            raise NotImplementedError("no host build of kernel " + self.name)
        if rc != 0 or _lib.emu_bad() != 0:
            raise RuntimeError("kernel %s failed on the host build" % self.name)


class RawModule:
    def __init__(self, code=None, options=(), name_expressions=None, **kwargs):
        pass

    def get_function(self, name):
        return RawKernel(None, name)


class _Event:
    def __init__(self, *args, **kwargs):
        self.t = 0.0

    def record(self, stream=None):
        self.t = time.perf_counter()

    def synchronize(self):
        pass


class _Stream:
    def synchronize(self):
        pass


_PROPS = {"multiProcessorCount": 2, "maxThreadsPerMultiProcessor": 1024,
          "l2CacheSize": 1 << 20, "name": b"host build", "totalGlobalMem": 1 << 33,
          "major": 0, "minor": 0}
cuda = types.SimpleNamespace(
    Device=_Device, Event=_Event, Stream=types.SimpleNamespace(null=_Stream()),
    get_current_stream=lambda: _Stream(),
    get_elapsed_time=lambda a, b: (b.t - a.t) * 1e3,
    runtime=types.SimpleNamespace(getDevice=lambda: 0, getDeviceCount=lambda: 1,
                                  getDeviceProperties=lambda i: dict(_PROPS),
                                  runtimeGetVersion=lambda: 0, driverGetVersion=lambda: 0))
'''


@pytest.fixture(scope="module")
def host_cupy(emu, tmp_path_factory):
    """Environment that makes ``import cupy`` load the host stand-in."""
    d = tmp_path_factory.mktemp("hostcupy")
    (d / "cupy").mkdir()
    (d / "cupy" / "__init__.py").write_text(_HOST_CUPY)
    (d / "cupyx").mkdir()
    (d / "cupyx" / "__init__.py").write_text(
        "import numpy as np\n\n\ndef scatter_add(a, slices, value):\n"
        "    np.add.at(a, slices, value)\n")
    env = dict(os.environ, COMMLIB_HOST_KERNELS=emu.path,
               PYTHONPATH=os.pathsep.join([str(d), str(ROOT)]))
    env.pop("COMMLIB_HOST_KERNELS_LENIENT", None)
    return env


@needs_nvcc
def test_gpu_tests_pass_on_the_host_build(host_cupy):
    # the @pytest.mark.gpu tests of the cast and pack wrappers, end to end
    # (wrappers, launch arguments, caches), on the host build of the kernels
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-x",
                          "-p", "no:cacheprovider", "tests/test_ops_cast.py",
                          "tests/test_ops_pack.py"],
                         cwd=ROOT, env=host_cupy, capture_output=True, text=True, timeout=600)
    tail = res.stdout[-3000:] + res.stderr[-3000:]
    assert res.returncode == 0, tail
    assert "skipped" not in res.stdout.splitlines()[-1], tail


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


@needs_nvcc
def test_benchmark_gpu_branch_on_the_host_build(host_cupy, tmp_path):
    # kernels without a host build (top-K, threshold, sparse) do nothing here,
    # so only commlib's cast and pack rows are expected to check out
    env = dict(host_cupy, COMMLIB_HOST_KERNELS_LENIENT="1")
    res, rows = _benchmark(["--device", "gpu", "--sizes", "20K", "--repeats", "2"], env,
                           tmp_path)
    mine = [r for r in rows if r["name"].startswith(("cast", "pack", "unpack"))]
    assert len(mine) == 6 and all(r["check"] == "ok" for r in mine), mine
    assert all(r["ms"] > 0 and r["copy_fraction"] > 0 for r in mine)
    # only kernels without a host build may fail their checks, and a failed
    # check is what makes the exit status 1
    failed = {r["name"] for r in rows if str(r["check"]).startswith(("FAIL", "error"))}
    assert not any(name.startswith(("cast", "pack", "unpack")) for name in failed), failed
    assert res.returncode == (1 if failed else 0), res.stdout + res.stderr


FMTS = ("float32", "float16", "bfloat16")


@needs_nvcc
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


@needs_nvcc
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


@needs_nvcc
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


@needs_nvcc
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
