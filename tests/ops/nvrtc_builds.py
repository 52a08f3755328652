"""The kernels built by an NVRTC library (one of the cupy wheels', or a
pinned CUDA version's), exactly as ``cupy.RawModule`` builds them: the
loader's options, cupy's ``-ftz=true`` and ``-arch=sm_XX``.

One program compiles every (source, arch) job of a library in a subprocess
of its own (two CUDA majors' NVRTC builtins do not share a process) and
keeps the cubins; :func:`build` runs it once per library and set of jobs in
a test run, for the checks that the kernels compile
(test_kernel_sources.py) and for the checks of their machine code
(test_kernel_machine_code.py).
"""
import json
import subprocess
import sys
import tempfile
from pathlib import Path

# argv: library, output folder, options (JSON), [[source path, arch], ...]
# (JSON; arch "80" for sm_80). Writes <stem>.sm_<arch>.cubin for each build
# that succeeds; prints JSON {"version": "M.m", "builds": {"<stem>.sm_<arch>":
# [status, log]}}, status "ok", "error <rc>" or "unsupported" (an arch this
# NVRTC does not list).
PROGRAM = r"""
import concurrent.futures, ctypes, glob, json, os, sys
lib_path, out_dir, options, jobs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
for b in glob.glob(os.path.join(os.path.dirname(lib_path), "libnvrtc-builtins.so*")):
    if ".alt." not in b:
        ctypes.CDLL(b, mode=ctypes.RTLD_GLOBAL)
lib = ctypes.CDLL(lib_path)
major, minor = ctypes.c_int(), ctypes.c_int()
lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
n = ctypes.c_int()
assert lib.nvrtcGetNumSupportedArchs(ctypes.byref(n)) == 0
supported = (ctypes.c_int * n.value)()
assert lib.nvrtcGetSupportedArchs(supported) == 0
supported = set(supported)

def build(job):
    source, arch = job
    key = "%s.sm_%s" % (os.path.basename(source).rsplit(".", 1)[0], arch)
    if int(arch) not in supported:
        return key, ["unsupported", ""]
    opts = options + ["-arch=sm_" + arch]
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), open(source, "rb").read(),
                                  os.path.basename(source).encode(), 0, None, None) == 0
    try:
        argv = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        rc = lib.nvrtcCompileProgram(prog, len(opts), argv)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        if rc != 0:
            return key, ["error %d" % rc, log.value.decode(errors="replace")]
        cubin = ctypes.c_size_t()
        assert lib.nvrtcGetCUBINSize(prog, ctypes.byref(cubin)) == 0
        if cubin.value == 0:
            return key, ["error: empty cubin", log.value.decode(errors="replace")]
        buf = ctypes.create_string_buffer(cubin.value)
        assert lib.nvrtcGetCUBIN(prog, buf) == 0
        with open(os.path.join(out_dir, key + ".cubin"), "wb") as f:
            f.write(buf.raw)
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return key, ["ok", log.value.decode(errors="replace")]

with concurrent.futures.ThreadPoolExecutor(2) as pool:
    result = dict(pool.map(build, jobs))
print(json.dumps({"version": "%d.%d" % (major.value, minor.value), "builds": result}))
"""

# (library, sources, archs) -> (report, folder of the cubins), for this test run
_BUILT = {}


def options():
    """What cupy.RawModule hands NVRTC for commlib's kernels, -arch aside."""
    from commlib.ops import _loader
    return [*_loader.module_options(), *_loader.CUPY_ADDED_OPTIONS]


def build(lib, sources, archs, out_dir=None):
    """Every ``sources`` x ``archs`` (``"80"``: sm_80) built by the NVRTC
    library at ``lib``, once per test run.

    Returns:
        ``(report, folder)``: report ``{"version": "M.m", "builds":
        {"<stem>.sm_<arch>": [status, log]}}`` and the folder holding
        ``<stem>.sm_<arch>.cubin`` of each build that succeeded.
    """
    key = (str(lib), tuple(map(str, sources)), tuple(archs))
    if key not in _BUILT:
        folder = Path(out_dir or tempfile.mkdtemp(prefix="commlib-nvrtc-"))
        jobs = [[str(s), a] for s in sources for a in archs]
        res = subprocess.run([sys.executable, "-c", PROGRAM, str(lib), str(folder),
                              json.dumps(options()), json.dumps(jobs)],
                             capture_output=True, text=True, timeout=900)
        assert res.returncode == 0, res.stdout + res.stderr
        _BUILT[key] = (json.loads(res.stdout), folder)
    return _BUILT[key]
