"""The compiled host loops are built by the package build (setup.py's
optional extension), and their absence is said, once, not hidden."""
import os
import subprocess
import sys

import pytest

from mpirun import ROOT

def _run(code, env):
    return subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **env,
                          PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=120)


def test_the_installed_package_has_its_host_loops():
    """Built by the package build wherever a C compiler exists (the
    extension is optional, so a failed build would otherwise pass unseen)."""
    import shutil
    import sysconfig
    if not (shutil.which(sysconfig.get_config_var("CC").split()[0]) or shutil.which("cc")):
        pytest.skip("no C compiler here")
    from commlib.ops import native
    assert native.available(), native.unavailable_reason()


def test_turned_off_or_missing_says_why_and_warns_once_when_missing():
    code = ("from commlib.ops import hostcopy; print(hostcopy.available()); "
            "print(hostcopy.unavailable_reason())")
    out = _run(code, {"COMMLIB_NATIVE": "0"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == "False" and "COMMLIB_NATIVE" in out.stdout
    assert "RuntimeWarning" not in out.stderr                  # turned off on purpose
    missing = ("import sys, warnings; sys.modules['commlib._hostloops'] = None\n"
               "warnings.simplefilter('always')\n"
               "import numpy as np\nfrom commlib.ops import hostcopy\n"
               "print(hostcopy.available(), hostcopy.available())\n"
               "out = np.zeros(5)\nhostcopy.gather_any([np.arange(5.0)], out)\n"
               "print(out.tolist())\n")
    out = _run(missing, {})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["False False", "[0.0, 1.0, 2.0, 3.0, 4.0]"], out.stdout
    assert out.stderr.count("RuntimeWarning") == 1, out.stderr
    assert "compiled host loops are not built" in out.stderr and "pip install" in out.stderr


def test_the_build_compiles_the_host_loops_without_warnings(tmp_path):
    """setup.py's extension, built with every warning an error."""
    env = dict(os.environ, CFLAGS="-Wall -Wextra -Werror -Wno-unused-parameter")
    proc = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-temp",
                           str(tmp_path / "tmp"), "--build-lib", str(tmp_path / "lib")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    built = list((tmp_path / "lib" / "commlib").glob("_hostloops*"))
    assert proc.returncode == 0 and built, proc.stdout + proc.stderr


def test_a_checkout_shadowing_an_installed_build_says_so_once_per_job(tmp_path):
    """A source checkout without its in-place build, run from its own folder,
    shadows the commlib that ``pip install .`` built: the warning names both
    folders and the fix, and only the job's first rank says it."""
    installed = tmp_path / "site" / "commlib"
    installed.mkdir(parents=True)
    (installed / "_hostloops.cpython-3x-x86_64-linux-gnu.so").write_bytes(b"")
    missing = ("import sys, warnings; sys.modules['commlib._hostloops'] = None\n"
               "sys.path.append(%r)\n"
               "from commlib.ops import hostcopy\nprint(hostcopy.available())\n"
               % str(tmp_path / "site"))
    out = _run(missing, {})
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr
    assert out.stderr.count("RuntimeWarning") == 1, out.stderr
    text = " ".join(out.stderr.split())
    assert "shadowed" in text and str(installed) in text and str(ROOT / "commlib") in text
    assert "pip install -e ." in text and "run from another folder" in text, text
    for rank_var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "COMMLIB_RANK"):
        out = _run(missing, {rank_var: "1"})
        assert out.returncode == 0 and "RuntimeWarning" not in out.stderr, (rank_var, out.stderr)
        out = _run(missing, {rank_var: "0"})
        assert out.stderr.count("RuntimeWarning") == 1, (rank_var, out.stderr)


def test_shadowed_build_looks_only_at_other_folders(tmp_path):
    from commlib.ops import native
    mine, other = tmp_path / "a", tmp_path / "b"
    for d in (mine, other):
        (d / "commlib").mkdir(parents=True)
    (mine / "commlib" / "_hostloops.so").write_bytes(b"")
    assert native.shadowed_build(str(mine / "commlib"), [str(mine), str(other)]) is None
    (other / "commlib" / "_hostloops.so").write_bytes(b"")
    assert native.shadowed_build(str(mine / "commlib"), [str(mine), str(other)]) == \
        str(other / "commlib")
