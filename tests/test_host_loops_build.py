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
    from commlib.ops import _native
    assert _native.available(), _native.unavailable_reason()


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
