"""Cooperative host build of ``kernels/*.cu`` (see ``tests/ops/cuda_host/``).

``build()`` compiles every kernel source with g++ against
``tests/ops/cuda_host/coop_cuda.h`` into one ctypes library (objects cached per
session by content, so a patched copy of one source recompiles only what
changed) and returns a :class:`HostKernels`, which launches any kernel by
name with every CUDA thread a fiber. :class:`HostCupy` stands in for cupy
(arrays in host memory with red zones, ``RawKernel`` launches through the
host build) so the real wrappers in ``commlib.ops`` run end to end.
"""
import atexit
import collections
import concurrent.futures
import ctypes
import functools
import hashlib
import operator
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import types
from pathlib import Path

import numpy as np

from commlib.errors import ArgumentError, ArrayTypeError, BackendUnavailableError

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / "kernels"
HOST_DIR = Path(__file__).resolve().parent / "cuda_host"
GXX = shutil.which("g++")
OBJCOPY = shutil.which("objcopy")
# every load and store of a kernel unit calls the runtime (coop_runtime.cpp);
# at -O1 g++ sometimes instruments one store twice, so kernel units are -O0
INSTRUMENT = ["-O0", "-fsanitize=thread", "--param", "tsan-distinguish-volatile=1"]
CXXFLAGS = ["-std=c++17", "-O1", "-fPIC", "-ffp-contract=off", "-fno-strict-aliasing",
            "-fno-exceptions", "-Werror", "-I", str(HOST_DIR)]
# the runtime (uninstrumented: its checks run on every access of a kernel unit)
RUNTIME_FLAGS = CXXFLAGS + ["-O2"]

_session_dir = None
_libraries = {}


class KernelFault(AssertionError):
    """The host build reported errors (out-of-bounds or misaligned access,
    barrier or warp-collective misuse, deadlock, endless spin)."""


class Schedule(collections.namedtuple("Schedule", "name order resident policy p_yield seed")):
    """How a launch is run. order: blocks start ascending (0), descending (1)
    or in a seeded random order (2); resident: blocks running at once (1:
    one after another); policy: threads of a block run round robin (0), in
    reverse (1) or at random (2); p_yield: chance that a shared/global access,
    atomic or fence switches to another thread (1.0: every access, close to
    lockstep)."""
    __slots__ = ()


ALL = 1 << 20  # every block of the grid resident
SCHEDULES = (
    Schedule("ascending", 0, 1, 0, 0.0, 1),
    Schedule("descending", 1, 1, 1, 0.0, 2),
    Schedule("random", 2, 1, 2, 0.02, 3),
    Schedule("concurrent", 2, ALL, 2, 0.05, 4),
    Schedule("lockstep", 0, ALL, 0, 1.0, 5),
)


class _Region(ctypes.Structure):
    _fields_ = [("lo", ctypes.c_uint64), ("hi", ctypes.c_uint64), ("name", ctypes.c_char_p),
                ("writes", ctypes.c_void_p)]


class _Config(ctypes.Structure):
    _fields_ = [("order", ctypes.c_int), ("resident", ctypes.c_int), ("policy", ctypes.c_int),
                ("p_yield", ctypes.c_double), ("seed", ctypes.c_uint64),
                ("spin_limit", ctypes.c_longlong), ("op_limit", ctypes.c_longlong)]


def kernel_names(source, text):
    """Kernels of ``kernels/<source>``: the wrappers' lists for the macro-made
    cast and pack kernels, the ``extern "C" __global__`` definitions otherwise."""
    from commlib.ops import _pack_cuda, cast
    if source == "cast.cu":
        return cast.KERNEL_NAMES
    if source == "pack.cu":
        return _pack_cuda.KERNEL_NAMES
    return tuple(re.findall(r'extern "C" __global__ void(?: __launch_bounds__\([^)]*\))?\s+(\w+)\(',
                            text))


def _includes(name, texts):
    """``name`` and the kernels/ headers it includes, directly or not."""
    seen, todo = [], [name]
    while todo:
        n = todo.pop()
        if n in seen or n not in texts:
            continue
        seen.append(n)
        todo += re.findall(r'^\s*#\s*include\s*"([^"]+)"', texts[n], re.M)
    return sorted(seen)


def _work_dir():
    global _session_dir
    if _session_dir is None:
        _session_dir = Path(tempfile.mkdtemp(prefix="coop-cuda-"))
        atexit.register(shutil.rmtree, _session_dir, True)
    return _session_dir


def _compile(unit, obj, flags, kernel_unit):
    """Compile ``unit``; a kernel unit's .bss (its __shared__ statics, nothing
    else) becomes section coop_shared_<kernel_unit>, the shared memory that
    the runtime swaps per block of that source's kernels."""
    if obj.exists():
        return None
    tmp = obj.with_suffix(".tmp.o")
    steps = [[GXX, *flags, "-c", str(unit), "-o", str(tmp)]]
    if kernel_unit:
        steps.append([OBJCOPY, "--rename-section", ".bss=coop_shared_" + kernel_unit, str(tmp)])
    for cmd in steps:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if res.returncode != 0:
            return "%s:\n%s" % (unit.name, res.stderr[-6000:])
    tmp.rename(obj)
    return None


def build(patches=None):
    """The host build of ``kernels/`` with ``patches`` applied to a copy:
    ``{file name: [(old, new), ...]}`` text substitutions (each ``old`` must
    occur). Cached per session and per patch set."""
    if GXX is None or OBJCOPY is None:
        raise BackendUnavailableError("the host build needs g++ and objcopy on PATH")
    key = repr(sorted((patches or {}).items()))
    if key in _libraries:
        return _libraries[key]
    work = _work_dir()
    texts = {p.name: p.read_text() for p in sorted(KERNELS.glob("*.cu*"))}
    for name, subs in (patches or {}).items():
        for old, new in subs:
            if old not in texts[name]:
                raise ArgumentError("patches[%r]: text %r not found" % (name, old))
            texts[name] = texts[name].replace(old, new)
    digest = hashlib.sha1(key.encode()).hexdigest()[:12]
    src = work / ("src-" + digest)
    src.mkdir(exist_ok=True)
    for name, text in texts.items():
        (src / name).write_text(text)
    header = (HOST_DIR / "coop_cuda.h").read_text()
    jobs = []
    runtime = HOST_DIR / "coop_runtime.cpp"
    runtime_key = hashlib.sha1((header + runtime.read_text() + repr(RUNTIME_FLAGS)).encode()
                               ).hexdigest()
    jobs.append((runtime, work / ("runtime-%s.o" % runtime_key[:16]), RUNTIME_FLAGS, None))
    for name in sorted(n for n in texts if n.endswith(".cu")):
        stem = Path(name).stem
        if not stem.isidentifier():
            raise ArgumentError("kernels/%s: the host build names a section after the file's "
                                "stem, which must be an identifier" % name)
        regs = "".join("COOP_REGISTER(%s)\n" % k for k in kernel_names(name, texts[name]))
        # CL_BLOCK_COLLECTIVES: whole blocks run here, so common.cuh's block-wide
        # helpers take their device path; the linker's bounds of the unit's
        # section are its kernels' shared memory
        unit_text = ('#include "coop_cuda.h"\n#define CL_BLOCK_COLLECTIVES 1\nnamespace {\n'
                     '#include "%s"\n}  // namespace\n'
                     'extern "C" char __start_coop_shared_%s[] __attribute__((weak));\n'
                     'extern "C" char __stop_coop_shared_%s[] __attribute__((weak));\n'
                     '#define COOP_UNIT_SHARED __start_coop_shared_%s, __stop_coop_shared_%s, "%s"\n'
                     '%s' % (src / name, stem, stem, stem, stem, stem, regs))
        flags = CXXFLAGS + INSTRUMENT
        h = hashlib.sha1((header + "".join(texts[n] for n in _includes(name, texts)) + repr(flags)
                          + unit_text.replace(str(src), "")).encode()).hexdigest()[:16]
        unit = work / ("%s-%s.cpp" % (stem, h))
        unit.write_text(unit_text)
        jobs.append((unit, work / ("%s-%s.o" % (stem, h)), flags, stem))
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        errors = [e for e in pool.map(lambda j: _compile(*j), jobs) if e]
    if errors:
        raise RuntimeError("host build failed:\n" + "\n".join(errors))
    lib = work / ("coop-%s.so" % digest)
    res = subprocess.run([GXX, "-shared", "-Wl,-Bsymbolic", "-Wl,--no-undefined", "-o", str(lib)]
                         + [str(job[1]) for job in jobs], capture_output=True, text=True,
                         timeout=600)
    if res.returncode != 0:
        raise RuntimeError("host link failed:\n" + res.stderr[-6000:])
    _libraries[key] = open_library(lib, src)
    return _libraries[key]


def open_library(path, source_dir):
    """:class:`HostKernels` of a library that :func:`build` made (for another
    process: a build lives as long as the process that made it)."""
    return HostKernels(ctypes.CDLL(str(path)), path, source_dir)


def _short(symbol):
    """``f<T>(args)::var`` of a demangled static local, without the argument
    list and the anonymous namespaces."""
    symbol = symbol.replace("(anonymous namespace)::", "")
    func, sep, var = symbol.rpartition("::")
    if func.endswith(")"):
        depth = 0
        for i in range(len(func) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(func[i], 0)
            if depth == 0:
                func = func[:i]
                break
    return func + sep + var


def _address(a):
    return a.__array_interface__["data"][0]


class HostKernels:
    """Kernels of one host build (library ``path``, sources copied to
    ``source_dir``), launched by name."""

    def __init__(self, lib, path, source_dir):
        self.lib = lib
        self.path = Path(path)
        self.source_dir = Path(source_dir)
        self._shared_symbols = None
        lib.coop_launch.argtypes = [ctypes.c_char_p, ctypes.c_uint, ctypes.c_uint,
                                    ctypes.POINTER(ctypes.c_uint64), ctypes.c_int,
                                    ctypes.POINTER(_Region), ctypes.c_int,
                                    ctypes.POINTER(_Config)]
        lib.coop_errors.restype = ctypes.c_char_p
        lib.coop_signature.restype = ctypes.c_char_p
        lib.coop_signature.argtypes = [ctypes.c_char_p]
        lib.coop_kernels.restype = ctypes.c_char_p
        lib.coop_unit.restype = ctypes.c_char_p
        lib.coop_unit.argtypes = [ctypes.c_char_p]
        lib.coop_spins.restype = ctypes.c_longlong
        self.spins = 0  # __nanosleep calls (spins on another block's flag) of all launches
        self.names = frozenset(lib.coop_kernels().decode().split())
        # the host build runs one launch at a time (its blocks, errors and
        # counts are the library's globals): threads (ranks of the threads
        # transport) take turns
        self._one_at_a_time = threading.Lock()

    def signature(self, name):
        sig = self.lib.coop_signature(name.encode())
        if sig is None:
            raise ArgumentError("name: no kernel %r in the host build" % name)
        return sig.decode()

    def launch(self, name, grid, block, args, schedule=SCHEDULES[0], regions=(),
               args_are_regions=True, spin_limit=2_000_000, op_limit=400_000_000):
        """Run kernel ``name`` over ``grid`` blocks of ``block`` threads (ints
        or 1-tuples). Array arguments (numpy arrays or their subclasses) pass
        their address and (with ``args_are_regions``) become regions the
        kernel may touch, after the ``regions``: (lo, hi, name) byte ranges,
        or (lo, hi, name, counts) where ``counts`` (uint8, hi - lo entries)
        receives the number of stores to each byte (saturating at 255).
        Raises KernelFault with the host build's messages."""
        grid = int(grid[0] if isinstance(grid, tuple) else grid)
        block = int(block[0] if isinstance(block, tuple) else block)
        sig = self.signature(name)
        if len(args) != len(sig):
            raise ArgumentError("args: %s takes %d arguments, got %d"
                                % (name, len(sig), len(args)))
        slots = (ctypes.c_uint64 * max(1, len(sig)))()
        spans = list(regions)
        for i, (kind, a) in enumerate(zip(sig, args)):
            if kind == "p":
                if not isinstance(a, np.ndarray):
                    raise ArrayTypeError("args[%d] of %s: expected an array, got %r"
                                         % (i, name, a))
                slots[i] = _address(a)
                if args_are_regions:
                    spans.append((_address(a), _address(a) + a.nbytes, "argument %d" % i))
            elif kind == "f":
                if not isinstance(a, np.float32):
                    raise ArgumentError("args[%d] of %s: expected np.float32, got %r"
                                        % (i, name, a))
                slots[i] = int(np.asarray(a).view(np.uint32))
            else:
                if isinstance(a, (np.ndarray, float, np.floating)):
                    raise ArgumentError("args[%d] of %s: expected an integer, got %r"
                                        % (i, name, a))
                slots[i] = int(a) & 0xFFFFFFFFFFFFFFFF
        names = [s[2].encode() for s in spans]
        for s in spans:
            if len(s) == 4 and (s[3].dtype != np.uint8 or s[3].size != s[1] - s[0]):
                raise ArgumentError("regions: counts of %r must be %d uint8" % (s[2], s[1] - s[0]))
        table = (_Region * max(1, len(spans)))(
            *[_Region(s[0], s[1], n, _address(s[3]) if len(s) == 4 else None)
              for s, n in zip(spans, names)])
        cfg = _Config(schedule.order, min(schedule.resident, 1 << 20), schedule.policy,
                      schedule.p_yield, schedule.seed, spin_limit, op_limit)
        with self._one_at_a_time:
            rc = self.lib.coop_launch(name.encode(), grid, block, slots, len(sig), table,
                                      len(spans), ctypes.byref(cfg))
            self.spins += self.lib.coop_spins()
            errors = self.lib.coop_errors().decode(errors="replace") if rc != 0 else ""
        if rc != 0:
            raise KernelFault("%s [%s schedule, grid %d x %d]: %s"
                              % (name, schedule.name, grid, block,
                                 self._explain(errors, name) or rc))

    def _explain(self, text, kernel):
        """Messages with source paths relative to kernels/ and shared-memory
        offsets named by variable (of ``kernel``'s shared memory)."""
        text = text.replace(str(self.source_dir) + "/", "")
        unit = self.lib.coop_unit(kernel.encode()).decode()

        def name(m):
            off = int(m.group(1))
            for lo, size, sym in self.shared_symbols(unit):
                if lo <= off < lo + size:
                    return "%s (%s + %d)" % (m.group(0), sym, off - lo)
            return m.group(0)
        return re.sub(r"byte (\d+) of shared memory", name, text)

    def shared_symbols(self, unit):
        """(offset, size, name) of the __shared__ variables of kernel source
        ``unit`` ("topk": section coop_shared_topk)."""
        if self._shared_symbols is None:
            out = subprocess.run(["nm", "-C", "-S", "--defined-only", str(self.path)],
                                 capture_output=True, text=True, timeout=60).stdout
            self._shared_symbols = [line.split(None, 3) for line in out.splitlines()]
        rows = self._shared_symbols
        start = next((int(r[0], 16) for r in rows if r[-1] == "__start_coop_shared_" + unit), None)
        stop = next((int(r[0], 16) for r in rows if r[-1] == "__stop_coop_shared_" + unit), None)
        syms = []
        if start is not None and stop is not None:
            for r in rows:
                if len(r) == 4 and start <= int(r[0], 16) < stop:
                    syms.append((int(r[0], 16) - start, int(r[1], 16), _short(r[3])))
        return sorted(syms)


# ---------------------------------------------------------------- cupy stand-in

RED_ZONE = 512  # bytes of padding on each side of an allocation


def _pack_segments(kernel, table, nseg):
    """(lo, hi, name) byte ranges of the arrays a pack.cu segment table names."""
    m = re.match(r"(un)?pack_(?:raw(\d)|(\w+?)_(\w+?)(?:_acc)?)$", kernel)
    if m.group(2):
        unit = int(m.group(2))
    else:
        fmt = m.group(4) if m.group(1) else m.group(3)
        unit = 4 if fmt == "f32" else 2
    t = np.asarray(table).view(np.int64)
    return [(int(t[s]), int(t[s]) + unit * int(t[2 * nseg + s]), "segment %d" % s)
            for s in range(nseg)]


class HostCupy:
    """A ``cupy`` module for the wrappers: ``ndarray`` (numpy subclass in host
    memory, allocations 256-byte aligned between red zones), ``empty``,
    ``zeros``, ``asarray`` and every other numpy function (results copied
    into such allocations), ``random``, ``cuda`` (one device, ``sm_count``
    SMs; events time on the host clock), and ``RawModule``/``RawKernel``
    launching through ``kernels`` under ``schedule``. Kernels the build does
    not have raise NotImplementedError when called, or do nothing with
    ``lenient``. Each launch is logged in ``launches`` as (name, grid,
    block, args), and each host read of an array (``get``, ``int``,
    ``float``, ``bool``, ``item``, ``tolist``, use as an index: what makes
    real cupy wait for the GPU) in ``reads`` as (file, line) of the code
    that read.

    Streams other than the null one capture (``begin_capture`` /
    ``end_capture``, as cupy's): while one captures (per thread, as in
    cupy's relaxed capture mode), kernel launches and
    memsets issued on it are recorded, not run, and any other device work
    (an allocation, an operation run by numpy, a copy, a host read, a
    synchronisation) raises RuntimeError: it has no node to become here
    (and allocations and reads would be wrong in a real capture). The
    graph's ``launch`` runs the recorded work in order, each kernel logged
    in ``launches`` when it runs; ``graph_launches`` counts the graphs
    launched, ``replayed`` the kernels they ran.

    ``devices``: how many GPUs ``cuda.runtime.getDeviceCount()`` reports;
    ``cuda.Device(i)`` makes device i current for the thread and arrays
    remember the device current when they were allocated (``a.device``),
    all in host memory. Work that runs apart from the caller (the NCCL
    stand-in's collectives, tests/ops/nccl_standin.py) is registered on its
    stream (:meth:`enqueue`): a stream's ``synchronize``, an event recorded
    after it, and any device work or host read issued on that stream (or on
    the legacy null stream) wait until it has finished (:meth:`settle`),
    as stream order has it; ``wait_event`` carries an event's work over to
    another stream. ``nccl=True`` adds ``cuda.nccl``, the NCCL stand-in."""

    def __init__(self, kernels, schedule=SCHEDULES[0], sm_count=2, lenient=False, devices=1,
                 nccl=False):
        self.kernels = kernels
        self.schedule = schedule
        self.sm_count = sm_count
        self.lenient = lenient
        self.devices = int(devices)
        self._device = threading.local()   # the thread's current device
        # stream ptr -> work items not known to have finished (see enqueue)
        self._pending = {}
        self._pending_lock = threading.Lock()
        self._non_blocking = set()          # ptrs of streams made with non_blocking=True
        self.launches = []
        self.reads = []           # (file, line) of every host read of a device array
        self.after_launch = None  # called as after_launch(name, args) after each launch
        self.graph_launches = 0
        self.replayed = 0         # of the launches logged, those run by graph launches
        # (stream, recorded nodes) while a stream of the thread captures
        self._thread = threading.local()
        self.module = self._make_module()
        self.nccl = None
        if nccl:
            import nccl_standin
            self.nccl = self.module.cuda.nccl = nccl_standin.make_module(self)

    # -- the current device and work that runs apart from the caller
    def current_device(self):
        return getattr(self._device, "id", 0)

    def use_device(self, device):
        if not 0 <= int(device) < self.devices:
            raise RuntimeError("stand-in cupy: cudaErrorInvalidDevice: device %d of %d"
                               % (device, self.devices))
        self._device.id = int(device)

    def enqueue(self, stream_ptr, item):
        """Register ``item`` (``finished``: a threading.Event, ``what``: text)
        as work on stream ``stream_ptr`` that has not run yet."""
        with self._pending_lock:
            self._pending.setdefault(stream_ptr, []).append(item)

    def _unfinished(self, stream_ptr):
        """The registered work that work on ``stream_ptr`` comes after: the
        stream's own, the legacy null stream's (for a blocking stream), and
        every blocking stream's (for the null stream)."""
        with self._pending_lock:
            for ptr in list(self._pending):
                left = [i for i in self._pending[ptr] if not i.finished.is_set()]
                if left:
                    self._pending[ptr] = left
                else:
                    del self._pending[ptr]
            if not self._pending:
                return []
            if stream_ptr == 0:
                ptrs = [p for p in self._pending if p not in self._non_blocking]
            else:
                ptrs = [stream_ptr] + ([0] if stream_ptr not in self._non_blocking else [])
            return [i for p in ptrs for i in self._pending.get(p, ())]

    def settle(self, stream_ptr=None, limit=None):
        """Wait until the registered work that ``stream_ptr`` (default: the
        thread's current stream) comes after has finished; bounded by
        ``limit`` seconds (default COMMLIB_NCCL_STANDIN_LIMIT_S, 120)."""
        if not self._pending:
            return
        if stream_ptr is None:
            stream_ptr = self.module.cuda.get_current_stream().ptr
        wait_all(self._unfinished(stream_ptr), limit)

    def settle_all(self, limit=None):
        """Wait for all registered work (a device synchronisation)."""
        if not self._pending:
            return
        with self._pending_lock:
            items = [i for v in self._pending.values() for i in v]
        wait_all(items, limit)

    @property
    def capture(self):
        """The capture of the calling thread: cupy captures in relaxed
        mode, so another thread's work goes on while one captures."""
        return getattr(self._thread, "capture", None)

    @capture.setter
    def capture(self, value):
        self._thread.capture = value

    def forbid_in_capture(self, what):
        """Raise when a stream captures: ``what`` has no graph node here."""
        if self.capture is not None:
            raise RuntimeError("stand-in cupy: %s while a stream captures a graph" % what)

    def _capturing(self, stream_ptr):
        """The node list to record into when ``stream_ptr`` is capturing."""
        if self.capture is not None and self.capture[0].ptr == stream_ptr:
            return self.capture[1]
        return None

    def read(self):
        """Log a host read of a device array: the file and line of the
        caller of the stand-in's method (commlib's code, for its reads)."""
        frame = sys._getframe(2)
        self.reads.append((frame.f_code.co_filename, frame.f_lineno))

    def _make_module(self):
        host = self

        class ndarray(np.ndarray):
            def __array_finalize__(self, obj):
                self._device_id = getattr(obj, "_device_id", None)
                if self._device_id is None:
                    self._device_id = host.current_device()

            @property
            def data(self):
                return _Memory(_address(self), host)

            @property
            def device(self):
                return _Device(self._device_id, host)

            def get(self, stream=None, out=None):
                host.forbid_in_capture("a host read (get)")
                host.settle(None if stream is None else stream.ptr)
                host.read()
                if out is not None:
                    out[...] = self.view(np.ndarray)
                    return out
                return np.array(self)

            def set(self, arr):
                host.forbid_in_capture("a copy from the host (set)")
                host.settle()
                self[...] = np.asarray(arr).reshape(self.shape)

            def copy(self, order="C"):
                host.settle()
                return super().copy(order)

            def astype(self, *args, **kwargs):
                host.settle()
                return super().astype(*args, **kwargs)

            def fill(self, value):
                host.settle()
                return super().fill(value)

            def __array_function__(self, func, types, args, kwargs):
                host.settle()
                return super().__array_function__(func, types, args, kwargs)

            def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
                host.forbid_in_capture("the operation %s.%s" % (ufunc.__name__, method))
                host.settle()
                inputs = tuple(i.view(np.ndarray) if isinstance(i, ndarray) else i
                               for i in inputs)
                outs = kwargs.get("out")
                if outs:
                    kwargs["out"] = tuple(o.view(np.ndarray) if isinstance(o, ndarray) else o
                                          for o in outs)
                r = getattr(ufunc, method)(*inputs, **kwargs)
                if outs:
                    return outs[0] if len(outs) == 1 else outs
                if isinstance(r, tuple):
                    return tuple(x.view(ndarray) if isinstance(x, np.ndarray) else x for x in r)
                return r.view(ndarray) if isinstance(r, np.ndarray) else r

            def __setitem__(self, key, value):
                host.forbid_in_capture("a copy into an array")
                host.settle()
                # a device value goes device to device, as in cupy: not a read
                if isinstance(value, ndarray):
                    value = value.view(np.ndarray)
                super().__setitem__(key, value)

        # what reads a GPU array on the host (a synchronisation), logged
        def reading(convert):
            def method(self, *args):
                host.forbid_in_capture("a host read")
                host.settle()
                host.read()
                return convert(np.asarray(self), *args)
            return method
        for name, convert in (("__int__", int), ("__float__", float), ("__bool__", bool),
                              ("__index__", operator.index), ("item", np.ndarray.item),
                              ("tolist", np.ndarray.tolist)):
            setattr(ndarray, name, reading(convert))
        ndarray.__module__ = "cupy"

        def empty(shape, dtype=np.float32):
            host.forbid_in_capture("an allocation")
            dtype = np.dtype(dtype)
            n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            raw = np.full(n + 2 * RED_ZONE + 256, 0xFB, np.uint8)
            start = RED_ZONE + (-(_address(raw) + RED_ZONE)) % 256
            return raw[start:start + n].view(dtype).reshape(shape).view(ndarray)

        def zeros(shape, dtype=np.float32):
            a = empty(shape, dtype)
            a[...] = 0
            return a

        def asarray(a, dtype=None):
            if isinstance(a, ndarray) and (dtype is None or np.dtype(dtype) == a.dtype):
                return a
            src = np.asarray(a, dtype=dtype)
            out = empty(src.shape, src.dtype)
            out[...] = src
            return out

        def on_device(r):
            if isinstance(r, np.ndarray):
                return asarray(r)
            if isinstance(r, tuple):
                return tuple(on_device(x) for x in r)
            return r

        def device_functions(obj):
            """obj's callables with their array results on the device."""
            def attr(name):
                f = getattr(obj, name)
                if isinstance(f, type) or not callable(f):
                    return f
                return lambda *a, **k: on_device(f(*a, **k))
            return attr

        class RawKernel:
            def __init__(self, code=None, name=None, **kwargs):
                self.name = name

            def __call__(self, grid, block, args, shared_mem=0, **kwargs):
                if self.name not in host.kernels.names:
                    if host.lenient:
                        return
                    raise NotImplementedError("no host build of kernel %r" % self.name)
                if shared_mem:
                    raise NotImplementedError("dynamic shared memory is not modelled")
                nodes = host._capturing(cuda.get_current_stream().ptr)
                if nodes is not None:
                    nodes.append((True, functools.partial(self._run, grid, block, tuple(args))))
                    return
                host.settle()
                self._run(grid, block, args)

            def _run(self, grid, block, args):
                regions = []
                if re.match(r"(un)?pack_", self.name):
                    regions = _pack_segments(self.name, args[0], int(args[1]))
                host.launches.append((self.name, grid, block, args))
                host.kernels.launch(self.name, grid, block, args, host.schedule, regions)
                if host.after_launch is not None:
                    host.after_launch(self.name, args)

        class RawModule:
            def __init__(self, code=None, options=(), name_expressions=None, **kwargs):
                pass

            def get_function(self, name):
                return RawKernel(None, name)

        current = threading.local()     # the stream a thread made current

        class _Stream:
            """A stream: work runs on the host when launched, so every
            stream is always done and events only order what is already
            ordered; ``with stream:`` makes it the thread's current one."""

            def __init__(self, null=False, non_blocking=False):
                self.ptr = 0 if null else id(self)
                if non_blocking and not null:
                    host._non_blocking.add(self.ptr)

            def synchronize(self):
                host.forbid_in_capture("a stream synchronisation")
                host.settle(self.ptr)

            def begin_capture(self, mode=None):
                if self.ptr == 0:
                    raise RuntimeError("cannot capture on the default (legacy) stream")
                if host.capture is not None:
                    raise RuntimeError("stand-in cupy: one capture at a time")
                host.capture = (self, [])

            def is_capturing(self):
                return host.capture is not None and host.capture[0] is self

            def end_capture(self):
                if not self.is_capturing():
                    raise RuntimeError("stand-in cupy: the stream is not capturing")
                nodes = host.capture[1]
                host.capture = None
                return _Graph(nodes)

            def record(self, event=None):
                event = _Event() if event is None else event
                event.record(self)
                return event

            def wait_event(self, event):
                for item in event.items:
                    if not item.finished.is_set():
                        host.enqueue(self.ptr, item)

            def use(self):
                current.stream = self
                return self

            def __enter__(self):
                self._previous = getattr(current, "stream", None)
                current.stream = self
                return self

            def __exit__(self, *exc):
                current.stream = self._previous
                return False

        null_stream = _Stream(null=True)
        _Stream.null = null_stream

        def memset_async(ptr, value, size, stream=0):
            nodes = host._capturing(stream)
            if nodes is not None:
                nodes.append((False, functools.partial(ctypes.memset, ptr, value, size)))
                return
            host.forbid_in_capture("a memset on another stream")
            host.settle(stream)
            ctypes.memset(ptr, value, size)

        class _Graph:
            """A captured graph: its nodes run in order when launched."""

            def __init__(self, nodes):
                self.nodes = nodes

            def launch(self, stream=None):
                host.forbid_in_capture("a graph launch")
                host.settle(None if stream is None else stream.ptr)
                host.graph_launches += 1
                for kernel, node in self.nodes:
                    host.replayed += kernel
                    node()

            def upload(self, stream=None):
                pass

        class _Event:
            def __init__(self, *args, **kwargs):
                self.t = 0.0
                self.items = ()     # registered work recorded before the event

            def record(self, stream=None):
                stream = cuda.get_current_stream() if stream is None else stream
                self.items = tuple(host._unfinished(stream.ptr)) if host._pending else ()
                self.t = time.perf_counter()

            def synchronize(self):
                wait_all(self.items)

            def query(self):
                return all(i.finished.is_set() for i in self.items)

            done = property(query)

        props = {"multiProcessorCount": self.sm_count, "maxThreadsPerMultiProcessor": 2048,
                 "name": b"cooperative host build", "l2CacheSize": 1 << 20,
                 "totalGlobalMem": 1 << 33, "major": 0, "minor": 0}
        cuda = types.SimpleNamespace(
            Device=functools.partial(_Device, host=self), Event=_Event, Stream=_Stream, Graph=_Graph,
            get_current_stream=lambda: getattr(current, "stream", None) or null_stream,
            get_elapsed_time=lambda a, b: (b.t - a.t) * 1e3,
            runtime=types.SimpleNamespace(getDevice=self.current_device,
                                          getDeviceCount=lambda: self.devices,
                                          getDeviceProperties=lambda i: dict(props),
                                          runtimeGetVersion=lambda: 0,
                                          memsetAsync=memset_async,
                                          driverGetVersion=lambda: 0,
                                          deviceSynchronize=self.settle_all))
        rng = device_functions(np.random)
        mod = types.ModuleType("cupy")
        mod.__dict__.update(
            ndarray=ndarray, empty=empty, zeros=zeros, asarray=asarray,
            asnumpy=lambda a, stream=None, **kwargs: (
                host.settle(None if stream is None else stream.ptr) or np.array(a, **kwargs)),
            RawKernel=RawKernel, RawModule=RawModule, cuda=cuda, __version__="coop-host",
            random=types.SimpleNamespace(default_rng=lambda seed=None: types.SimpleNamespace(
                **{n: device_functions(np.random.default_rng(seed))(n)
                   for n in ("random", "standard_normal", "integers", "normal", "uniform",
                             "permutation", "choice")}), **{n: rng(n) for n in
                                                              ("rand", "randn", "randint")}),
            get_default_memory_pool=lambda: types.SimpleNamespace(free_all_blocks=lambda: None),
            # a 0-d device array, as cupy's (numpy's is an int: no read to see)
            count_nonzero=lambda a, axis=None: asarray(np.asarray(np.count_nonzero(a, axis=axis))),
            get_array_module=lambda *arrays: mod if any(isinstance(a, ndarray) for a in arrays)
            else np,
            __getattr__=device_functions(np))
        self.props = props
        return mod

    def set_device(self, sm_count, threads_per_sm=2048):
        """Device shape the wrappers size their grids from (fewer, larger
        persistent blocks with fewer SMs or threads per SM)."""
        from commlib.ops import _launch
        self.props["multiProcessorCount"] = sm_count
        self.props["maxThreadsPerMultiProcessor"] = threads_per_sm
        _launch.clear()  # grids and workspaces of the old shape

    def get_function(self, source, name, options=()):
        if name not in self.kernels.names:
            raise ArgumentError("kernel_name: no kernel %r of %s in the host build"
                                % (name, source))
        return self.module.RawKernel(None, name)

    def install(self, monkeypatch):
        """Make ``import cupy`` and commlib's kernel loader use this stand-in
        for the rest of the test (``monkeypatch`` undoes it)."""
        from commlib.ops import _launch, _loader, _pack_cuda
        monkeypatch.setitem(sys.modules, "cupy", self.module)
        # launch plans and workspaces of the wrappers: per stand-in
        monkeypatch.setattr(_launch, "_plans", collections.OrderedDict())
        monkeypatch.setattr(_launch, "_workspaces", collections.OrderedDict())
        from commlib.ops import topk as topk_mod
        monkeypatch.setattr(topk_mod, "_candidate_views", {})
        monkeypatch.setattr(_loader, "get_function", self.get_function)
        monkeypatch.setattr(_loader, "_device_props", lambda device_id: self.props)
        # the pack wrapper caches device tables and launch plans by address
        monkeypatch.setattr(_pack_cuda, "_tables", collections.OrderedDict())
        monkeypatch.setattr(_pack_cuda, "_prepared", type(_pack_cuda._prepared)(
            _pack_cuda.TABLE_CACHE_SIZE))
        monkeypatch.setattr(_pack_cuda, "_dummies", {})
        # the private capture streams of commlib.ops.graphs are the stand-in's
        from commlib.ops import graphs
        monkeypatch.setattr(graphs, "_side_streams", {})
        return self.module


def wait_all(items, limit=None):
    """Wait until every item's ``finished`` event is set, for at most
    ``limit`` seconds in all (default COMMLIB_NCCL_STANDIN_LIMIT_S or 120);
    RuntimeError naming the first unfinished item after that."""
    if not items:
        return
    import os
    if limit is None:
        limit = float(os.environ.get("COMMLIB_NCCL_STANDIN_LIMIT_S", 120))
    end = time.monotonic() + limit
    for item in items:
        if not item.finished.wait(max(0.0, end - time.monotonic())):
            raise RuntimeError("stand-in cupy: %s did not finish within %g s"
                               % (item.what, limit))


class _Memory:
    def __init__(self, ptr, host=None):
        self.ptr = ptr
        self.host = host

    def copy_from_device_async(self, src, size, stream=None):
        if self.host is not None:
            self.host.settle(None if stream is None else stream.ptr)
        ctypes.memmove(self.ptr, src.ptr, size)


class _Device:
    """``cupy.cuda.Device(id)``: ``with`` makes it the thread's current
    device (restoring the one before), ``use()`` makes it current."""

    def __init__(self, id=None, host=None):
        self.host = host
        self.id = (0 if host is None else host.current_device()) if id is None else int(id)

    def __enter__(self):
        if self.host is not None:
            self._previous = self.host.current_device()
            self.host.use_device(self.id)
        return self

    def __exit__(self, *exc):
        if self.host is not None:
            self.host.use_device(self._previous)
        return False

    def use(self):
        if self.host is not None:
            self.host.use_device(self.id)

    def synchronize(self):
        if self.host is not None:
            self.host.settle_all()


def write_cupy_package(directory, kernels, nccl=False, devices=1):
    """Write ``cupy`` and ``cupyx`` packages into ``directory`` that make
    ``import cupy`` in another process a :class:`HostCupy` of ``kernels``
    (lenient when COMMLIB_HOST_KERNELS_LENIENT is set there) with
    ``devices`` GPUs; ``nccl``: ``from cupy.cuda import nccl`` gives the
    NCCL stand-in (tests/ops/nccl_standin.py), else it fails to import."""
    directory = Path(directory)
    (directory / "cupy").mkdir(exist_ok=True)
    (directory / "cupy" / "__init__.py").write_text(
        '"""cupy stand-in: the cooperative host build of kernels/ (tests/ops/cuda_host_build.py)."""\n'
        "import os\nimport sys\n\nsys.path.insert(0, %r)\nimport cuda_host_build as _build  # noqa\n\n"
        "_host = _build.HostCupy(_build.open_library(%r, %r),\n"
        "                        lenient=bool(os.environ.get('COMMLIB_HOST_KERNELS_LENIENT')),\n"
        "                        devices=%d, nccl=%r)\n"
        "globals().update({k: v for k, v in vars(_host.module).items() if not k.startswith('__')"
        " or k in ('__getattr__', '__version__')})\n"
        "if _host.nccl is not None:\n"
        "    sys.modules['cupy.cuda'] = cuda\n"
        "    sys.modules['cupy.cuda.nccl'] = cuda.nccl\n"
        % (str(Path(__file__).resolve().parent), str(kernels.path), str(kernels.source_dir),
           int(devices), bool(nccl)))
    (directory / "cupyx").mkdir(exist_ok=True)
    (directory / "cupyx" / "__init__.py").write_text(
        "import numpy as np\n\n\ndef scatter_add(a, slices, value):\n"
        "    np.add.at(a, slices, value)\n")
