"""Machine code of the CUDA kernels, read from the cubins that NVRTC builds
for sm_80 and sm_90 with the options cupy.RawModule hands it for the loader's
kernels, for every NVRTC a cupy build ships with here (tests/ops/nvrtc_builds.py):

* the bandwidth-bound kernels move data with 128-bit global loads and stores
  (LDG.E.128 / STG.E.128 in the SASS);
* no kernel touches local memory (no local bytes, no LDL/STL, no stack: a
  spill would show as all three);
* the blocks per SM that the wrappers' grids are sized by
  (``_loader.resident_blocks``, from the kernel's registers and static shared
  memory) are what the occupancy rule gives for the cubin's numbers, and
  reach each kernel's design occupancy.

Run as a script to print the table: ``python tests/ops/test_kernel_machine_code.py``.
"""
import glob
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import nvrtc_builds

from commlib.ops import _loader, _pack_cuda, cast as cast_mod

KERNELS = _loader.kernel_dir()
SOURCES = ("cast.cu", "pack.cu", "threshold.cu", "topk.cu", "sparse.cu", "records.cu")
ARCHS = ("sm_80", "sm_90")
THREADS = 256  # every wrapper launches 256-thread blocks


def find_tool(name):
    """Path of a CUDA tool: PATH, beside the real nvcc, or a pip ``nvidia-*``
    wheel's bin/ folder; None when there is none."""
    found = shutil.which(name)
    if found:
        return found
    nvcc = shutil.which("nvcc")
    dirs = [os.path.dirname(os.path.realpath(nvcc))] if nvcc else []
    for entry in sys.path:
        dirs += sorted(glob.glob(os.path.join(entry, "nvidia", "*", "bin")))
    for d in dirs:
        path = os.path.join(d, name)
        if os.access(path, os.X_OK):
            return path
    return None


CUOBJDUMP = find_tool("cuobjdump")
NVDISASM = find_tool("nvdisasm")  # cuobjdump -sass runs it
# under pytest-xdist (--dist loadgroup) in the worker that runs
# test_kernel_sources's NVRTC builds, which these tests share
pytestmark = [pytest.mark.skipif(
    CUOBJDUMP is None or NVDISASM is None,
    reason="needs cuobjdump and nvdisasm "
           "(pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)"),
    pytest.mark.xdist_group("nvrtc")]

# kernels whose loads and stores must be 128-bit ("ld", "st" or both)
WIDE = dict({name: "ldst" for name in cast_mod.KERNEL_NAMES},
            **{name: "ldst" for name in _pack_cuda.KERNEL_NAMES},
            threshold_select="ld", topk_hist1="ld", topk_hist1_resid="ldst",
            topk_filter="ld", topk_refine="ld", topk_compact="ld")
# blocks of 256 threads per SM each kernel is designed to keep resident:
# streaming kernels a full SM (2048 threads, __launch_bounds__(256, 8)), the
# selection passes what their __launch_bounds__ asks (kMinBlocks)
DESIGN_BLOCKS = dict({name: 8 for name in WIDE if name.startswith(("cast_", "pack_", "unpack_"))},
                     scatter_add=8, accumulate_finite=8, split_records=8,
                     topk_sample=1)  # topk_sample runs as one block
SELECTION_BLOCKS = int(re.search(r"constexpr int kMinBlocks = (\d+);",
                                 (KERNELS / "select_common.cuh").read_text()).group(1))


ARCH_DESIGN_BLOCKS = {}  # (kernel, arch) -> blocks, where an arch differs


def _design_blocks(kernel, arch):
    return ARCH_DESIGN_BLOCKS.get((kernel, arch), DESIGN_BLOCKS.get(kernel, SELECTION_BLOCKS))


def _cuobjdump(*args):
    env = dict(os.environ, NVDISASM_PATH=os.path.dirname(NVDISASM or ""))
    return subprocess.run([CUOBJDUMP, *args], capture_output=True, text=True, timeout=120,
                          check=True, env=env).stdout


def resources(cubin):
    """{kernel: {"REG", "STACK", "SHARED", "LOCAL", ...}} from ``cuobjdump -res-usage``."""
    text = _cuobjdump("-res-usage", str(cubin))
    table = {}
    for name, fields in re.findall(r"Function (\w+):\s*\n\s*(.*)", text):
        table[name] = {k: int(v) for k, v in re.findall(r"(\w+)(?:\[\d+\])?:(\d+)", fields)}
    return table


def memory_ops(cubin):
    """{kernel: set of memory instruction mnemonics}, e.g. ``LDG.E.128.CONSTANT``."""
    text = _cuobjdump("-sass", str(cubin))
    ops = {}
    for name, body in re.findall(r"Function : (\w+)\n(.*?)(?=\n\s*\.{6,}|\n\s*Function : |\Z)",
                                 text, re.S):
        ops[name] = set(re.findall(r"\b(?:LDG|STG|LDL|STL|LD|ST)\.[\w.]+|\b(?:LDL|STL)\b", body))
    return ops


def wide(ops, kind):
    """Whether ``ops`` hold a 128-bit global ``kind`` ("LDG" or "STG")."""
    return any(op.startswith(kind + ".E.128") for op in ops)


def local_ops(ops):
    return sorted(op for op in ops if op.split(".")[0] in ("LDL", "STL"))


def sm_limits(arch):
    return _loader.SM_LIMITS[arch]


@pytest.fixture(scope="module")
def rows(nvrtc_rows):
    """The rows of the newest NVRTC's cubins (see :func:`nvrtc_analyse`)."""
    return _nvrtc_rows(nvrtc_rows, NEWEST)[1]


def _by(rows, pred):
    picked = [r for r in rows if pred(r)]
    assert picked
    return picked


def test_every_wrapper_kernel_is_in_the_cubins(rows):
    names = {r["kernel"] for r in rows}
    want = set(WIDE) | {"topk_sample", "topk_hist1_resid_scalar", "scatter_add",
                        "accumulate_finite", "split_records"}
    assert want <= names, sorted(want - names)
    assert {r["arch"] for r in rows} == set(ARCHS)


# ------------------------------------------------------- NVRTC's machine code
# cupy builds the kernels with the NVRTC of its CUDA wheel, and ptxas
# versions allocate registers differently: the cubins that NVRTC itself
# produces are checked, for every NVRTC a cupy build ships with here.
# CUDA 13.0's is pinned (it kept 8 bytes of threshold_select on the stack on
# sm_90 where 12.9 and 13.5 did not); pip cannot install two versions of one
# package, so its wheel is downloaded into a cache folder (PyPI) and the
# library taken from it. A test that cannot get it fails.

PINNED_NVRTC = {"13.0": "nvidia-cuda-nvrtc==13.0.88"}
NVRTC_ARCHS = ("sm_80", "sm_90")


def nvrtc_cache_dir():
    base = os.environ.get("COMMLIB_NVRTC_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "commlib", "nvrtc")
    return Path(base)


def pinned_nvrtc(version):
    """Path of libnvrtc of the pinned CUDA ``version`` ("13.0"): from
    COMMLIB_NVRTC_<major>_<minor>, the cache folder, or its wheel downloaded
    into the cache folder with pip. Raises RuntimeError when none can be had."""
    env = os.environ.get("COMMLIB_NVRTC_" + version.replace(".", "_"))
    if env:
        return env
    requirement = PINNED_NVRTC[version]
    dest = nvrtc_cache_dir() / requirement.split("==")[1]
    found = sorted(p for p in dest.glob("nvidia/*/lib/libnvrtc.so.*") if ".alt." not in p.name)
    if found:
        return str(found[0])
    import tempfile
    import zipfile
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        res = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                              "--only-binary=:all:", "--platform", "manylinux_2_17_x86_64",
                              "--platform", "manylinux_2_12_x86_64", "--dest", tmp, requirement],
                             capture_output=True, text=True, timeout=900)
        wheels = glob.glob(os.path.join(tmp, "*.whl"))
        if res.returncode != 0 or not wheels:
            raise RuntimeError("cannot download %s: %s" % (requirement, res.stderr[-2000:]))
        unpacked = Path(tmp) / "unpacked"
        with zipfile.ZipFile(wheels[0]) as zf:
            for name in zf.namelist():
                if re.search(r"nvidia/\w+/lib/libnvrtc[-.]", name):
                    zf.extract(name, unpacked)
        os.replace(unpacked, dest)  # complete or absent, also with two test runs at once
    found = sorted(p for p in dest.glob("nvidia/*/lib/libnvrtc.so.*") if ".alt." not in p.name)
    if not found:
        raise RuntimeError("%s holds no libnvrtc.so" % requirement)
    return str(found[0])


def nvrtc_versions():
    """{label: libnvrtc path}: the pip wheels of the test extras (CUDA 12 and
    the newest 13) and the pinned ones; a pinned one that cannot be had maps
    to the RuntimeError's text."""
    import test_kernel_sources
    libs = {"%d (pip)" % major: path for major, path in test_kernel_sources.NVRTC_LIBS.items()}
    for version in PINNED_NVRTC:
        try:
            libs[version] = pinned_nvrtc(version)
        except RuntimeError as exc:
            libs[version] = exc
    return libs


def nvrtc_analyse(lib, archs=NVRTC_ARCHS, sources=SOURCES, label=None):
    """(NVRTC version, rows) of the cubins NVRTC ``lib``
    (of ``label``, see :func:`nvrtc_versions`) builds with the options
    cupy.RawModule hands it (the builds of :func:`nvrtc_builds.build`,
    shared with test_kernel_sources.py)."""
    import test_kernel_sources
    report, out_dir = nvrtc_builds.build(lib, test_kernel_sources.SOURCES,
                                         test_kernel_sources.nvrtc_archs(label))
    wanted = {"%s.%s" % (Path(s).stem, a) for s in sources for a in archs}
    bad = {k: v for k, v in report["builds"].items()
           if k in wanted and (v[0] != "ok" or "warning" in v[1])}
    assert not bad, bad
    assert wanted <= set(report["builds"]), sorted(wanted - set(report["builds"]))
    rows = []
    for source in sources:
        for arch in archs:
            cubin = Path(out_dir) / ("%s.%s.cubin" % (Path(source).stem, arch))
            res_, ops = resources(cubin), memory_ops(cubin)
            for name in sorted(res_):
                r = res_[name]
                rows.append(dict(
                    source=source, kernel=name, arch=arch, regs=r["REG"], shared=r["SHARED"],
                    local=r["LOCAL"], stack=r["STACK"],
                    local_ops=local_ops(ops.get(name, ())),
                    ld128=wide(ops.get(name, ()), "LDG"), st128=wide(ops.get(name, ()), "STG"),
                    resident=_loader.occupancy(r["REG"], THREADS, r["SHARED"], sm_limits(arch)),
                    design=_design_blocks(name, arch)))
    return report["version"], rows


@pytest.fixture(scope="module")
def nvrtc_rows():
    return {}  # label -> (version, rows), filled on first use


def _nvrtc_rows(cache, label):
    if label not in cache:
        lib = nvrtc_versions()[label]
        if isinstance(lib, Exception):
            pytest.fail("NVRTC %s not available: %s" % (label, lib))
        cache[label] = nvrtc_analyse(lib, label=label)
    return cache[label]


NVRTC_LABELS = ("12 (pip)", "13.0", "13 (pip)")
NEWEST = "13 (pip)"


@pytest.mark.parametrize("label", NVRTC_LABELS)
def test_nvrtc_cubins_use_no_local_memory(nvrtc_rows, label):
    version, rows = _nvrtc_rows(nvrtc_rows, label)
    if label == "13.0":
        assert version == "13.0", version
    names = {r["kernel"] for r in rows}
    assert set(WIDE) | {"topk_sample", "scatter_add"} <= names
    bad = [(r["kernel"], r["arch"], r["regs"], r["local"], r["stack"], r["local_ops"])
           for r in rows if r["local"] or r["stack"] or r["local_ops"]]
    assert not bad, (version, bad)


@pytest.mark.parametrize("label", NVRTC_LABELS)
def test_nvrtc_cubins_reach_the_design_occupancy(nvrtc_rows, label):
    version, rows = _nvrtc_rows(nvrtc_rows, label)
    bad = [(r["kernel"], r["arch"], r["regs"], r["resident"], r["design"]) for r in rows
           if r["resident"] < r["design"]]
    assert not bad, (version, bad)
    bad = [(r["kernel"], r["arch"]) for r in rows if r["kernel"] in WIDE and
           ("ld" in WIDE[r["kernel"]] and not r["ld128"] or
            "st" in WIDE[r["kernel"]] and not r["st128"])]
    assert not bad, (version, bad)


class _Kernel:
    def __init__(self, regs, shared):
        self.attributes = {"num_regs": regs, "shared_size_bytes": shared}


def _props(arch, sms=132):
    lim = sm_limits(arch)
    return {"multiProcessorCount": sms, "regsPerMultiprocessor": lim["regs"],
            "maxThreadsPerMultiProcessor": lim["threads"],
            "maxBlocksPerMultiProcessor": lim["blocks"],
            "sharedMemPerMultiprocessor": lim["shared"], "reservedSharedMemPerBlock": 1024}


@pytest.mark.parametrize("arch", ARCHS)
def test_launch_grids_follow_the_cubin_attributes(rows, arch, monkeypatch):
    # the wrappers' grids: resident_blocks() on the kernel's attributes (what
    # cupy reports for this cubin) and the device's limits
    import types
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(Device=lambda: types.SimpleNamespace(id=0)))
    monkeypatch.setattr(_loader, "_cupy", lambda: fake)
    monkeypatch.setattr(_loader, "_device_props", lambda i: _props(arch))
    monkeypatch.setattr(_loader, "_resident", {})
    for r in _by(rows, lambda r: r["arch"] == arch):
        k = _Kernel(r["regs"], r["shared"])
        assert _loader.resident_blocks(k, THREADS) == r["resident"], r
        assert _loader.persistent_grid(10 ** 6, k, THREADS) == (132 * r["resident"],)
        grid, block = _loader.launch_config(10 ** 9, k, THREADS, waves=4)
        assert grid == (4 * 132 * r["resident"],) and block == (THREADS,)
        assert _loader.persistent_grid(3, k, THREADS) == (3,)


@pytest.mark.parametrize("regs,threads,shared,arch,want", [
    (80, 256, 9412, "sm_80", 3),    # 2560 regs a warp: 6 warps per scheduler, 24 per SM
    (64, 256, 9412, "sm_80", 4),
    (32, 256, 0, "sm_80", 8),       # thread limit
    (33, 256, 0, "sm_90", 6),       # 1280 regs a warp: 12 per scheduler
    (16, 64, 0, "sm_90", 32),       # block limit
    (24, 256, 100000, "sm_80", 1),  # shared: 101120 bytes a block of 167936
    (24, 256, 100000, "sm_90", 2),  # of 233472
    (255, 1024, 0, "sm_80", 0),     # 261120 registers: does not fit
    (40, 96, 0, "sm_86", 16),       # 3 warps, 1536 threads, 16 blocks
])
def test_occupancy_rule(regs, threads, shared, arch, want):
    assert _loader.occupancy(regs, threads, shared, sm_limits(arch)) == want


def format_table(rows):
    lines = ["| kernel | arch | regs | shared B | stack/local B | local ops | 128-bit ld | "
             "128-bit st | resident blocks | design |", "|" + "---|" * 10]
    for r in rows:
        lines.append("| %s | %s | %d | %d | %s | %s | %s | %s | %d | %d |" % (
            r["kernel"], r["arch"], r["regs"], r["shared"],
            "%d/%d" % (r["stack"], r["local"]), ",".join(r["local_ops"]) or "-",
            "yes" if r["ld128"] else "no", "yes" if r["st128"] else "no",
            r["resident"], r["design"]))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    for label, lib in nvrtc_versions().items():
        if isinstance(lib, Exception):
            print("\nNVRTC %s: %s" % (label, lib))
            continue
        version, rows_ = nvrtc_analyse(lib, label=label)
        print("\nNVRTC %s\n%s" % (version, format_table(rows_)))
