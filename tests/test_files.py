"""Files commlib writes (checkpoints, traces, merged traces) cannot be taken
over by another user of a shared folder such as /tmp, and a failed write
(an exception, a file size limit) leaves the previous file whole and no
temporary behind.

Planted files are made by another user (``nobody``, through ``setpriv``)
where this process is root and setpriv exists, else by this user (the
symlink and the world-writable file then still show the difference)."""
import errno
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile

import numpy as np
import pytest

import commlib
from commlib.files import write_atomically
from commlib.optim import SGD
from mpirun import python_path, run_mpi

NOBODY = 65534


def can_plant_as_nobody():
    return os.geteuid() == 0 and shutil.which("setpriv") is not None


def plant(*cmd):
    """Run the shell command ``cmd`` as another user where possible (see the
    module docstring)."""
    prefix = (["setpriv", "--reuid=%d" % NOBODY, "--regid=%d" % NOBODY, "--clear-groups"]
              if can_plant_as_nobody() else [])
    subprocess.run(prefix + ["sh", "-c", *cmd], check=True, timeout=30)


@pytest.fixture
def shared():
    """A world-writable folder with the sticky bit in the shared temporary
    folder, like /tmp itself."""
    folder = tempfile.mkdtemp(prefix="commlib-shared-", dir="/tmp" if os.path.isdir("/tmp")
                              else None)
    os.chmod(folder, 0o1777)
    yield folder
    shutil.rmtree(folder)


def optimizer(values):
    comm = commlib.Communicator.single()
    return commlib.DistributedOptimizer(comm, [np.array(values, np.float32)], SGD(0.1))


def saved_params(path):
    with np.load(path) as f:
        return f["params.0"]


def own_private_file(path):
    info = os.lstat(path)
    return (stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid()
            and stat.S_IMODE(info.st_mode) == 0o600)


def test_write_atomically_all_or_nothing(tmp_path):
    target = tmp_path / "out.txt"
    assert write_atomically(target, lambda f: f.write("first")) == str(target)
    assert target.read_text() == "first" and own_private_file(target)

    def breaks(f):
        f.write("half of the second")
        raise RuntimeError("stopped midway")
    with pytest.raises(RuntimeError, match="stopped midway"):
        write_atomically(target, breaks)
    assert target.read_text() == "first"
    assert os.listdir(tmp_path) == ["out.txt"]             # no temporary left
    write_atomically(target, lambda f: f.write(b"\x00\x01"), binary=True)
    assert target.read_bytes() == b"\x00\x01"
    assert os.listdir(tmp_path) == ["out.txt"]


def test_checkpoint_save_never_writes_through_a_planted_name(shared):
    """The names a writer used to take (``path + ".tmp"``, the trace's
    ``path.<pid>.tmp``), planted as a symlink to the victim's own file or
    as an empty world-writable file of another user: neither is written
    through, and the checkpoint is this user's, mode 0600."""
    victim = os.path.join(shared, "victim.txt")
    with open(victim, "w") as f:
        f.write("the victim's own data")
    ckpt = os.path.join(shared, "ckpt.npz")
    plant("ln -s %s %s.tmp" % (victim, ckpt))
    commlib.optim.save(ckpt, optimizer([1, 2, 3]))
    with open(victim) as f:
        assert f.read() == "the victim's own data"
    assert own_private_file(ckpt) and saved_params(ckpt).tolist() == [1, 2, 3]
    assert os.path.islink(ckpt + ".tmp")                   # left alone

    other = os.path.join(shared, "other.npz")
    plant("touch %s.tmp && chmod 666 %s.tmp" % (other, other))
    commlib.optim.save(other, optimizer([4, 5]))
    assert own_private_file(other) and saved_params(other).tolist() == [4, 5]
    assert os.path.getsize(other + ".tmp") == 0            # untouched


def test_trace_and_merge_never_write_through_a_planted_name(shared):
    victim = os.path.join(shared, "victim.txt")
    with open(victim, "w") as f:
        f.write("the victim's own data")
    template = os.path.join(shared, "run", "trace.json")   # its folder is made
    rank0 = commlib.trace.path_for(template, 0)
    merged = os.path.join(shared, "merged.json")
    os.mkdir(os.path.dirname(rank0), 0o1777)
    os.chmod(os.path.dirname(rank0), 0o1777)
    plant("ln -s %s %s.%d.tmp && ln -s %s %s" % (victim, rank0, os.getpid(), victim, merged))
    comm = commlib.Communicator.single()
    with commlib.trace(template):
        comm.all_reduce([np.ones(4, np.float32)])
    comm.close()
    with open(victim) as f:
        assert f.read() == "the victim's own data"
    assert own_private_file(rank0)
    with open(rank0) as f:
        assert json.load(f)["otherData"]["rank"] == 0
    assert commlib.trace.merge(merged, [rank0]) == [0]
    assert own_private_file(merged)                        # the symlink was replaced
    with open(victim) as f:
        assert f.read() == "the victim's own data"


def test_trace_makes_its_missing_folder(tmp_path):
    template = tmp_path / "new" / "deeper" / "trace.json"
    comm = commlib.Communicator.single()
    with commlib.trace(template):
        comm.all_reduce([np.ones(4, np.float32)])
    comm.close()
    assert own_private_file(tmp_path / "new" / "deeper" / "trace.rank0.json")


# the file size limit cuts the second, bigger checkpoint short
SIZE_LIMITED = """
import os, resource, signal, sys
import numpy as np
import commlib
from commlib.optim import SGD
path = sys.argv[1]
comm = commlib.Communicator.single()
small = commlib.DistributedOptimizer(comm, [np.arange(1000, dtype=np.float32)], SGD(0.1))
commlib.optim.save(path, small)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))
big = commlib.DistributedOptimizer(comm, [np.ones(1 << 18, np.float32)], SGD(0.1))
try:
    commlib.optim.save(path, big)
except OSError as exc:
    print("OSError", exc.errno)
"""


def test_a_checkpoint_cut_short_by_a_file_size_limit_leaves_the_previous_one(tmp_path):
    ckpt = tmp_path / "ckpt.npz"
    proc = subprocess.run([sys.executable, "-c", SIZE_LIMITED, str(ckpt)], capture_output=True,
                          text=True, timeout=60, env=dict(os.environ, PYTHONPATH=python_path()))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["OSError", str(errno.EFBIG)], proc.stdout
    assert os.listdir(tmp_path) == ["ckpt.npz"]            # no partial temporary
    np.testing.assert_array_equal(saved_params(ckpt), np.arange(1000, dtype=np.float32))


def test_the_test_harness_writes_no_planted_name(shared, monkeypatch):
    """run_mpi's rank program used to be written to the fixed name
    ``commlib_mpi_<pid>_<hash of the code>.py`` in the shared temporary
    folder, following a symlink planted there."""
    monkeypatch.setenv("PYTEST_TMPDIR", shared)
    code = "print('the rank program ran')\n"
    victim = os.path.join(shared, "victim.txt")
    with open(victim, "w") as f:
        f.write("the victim's own data")
    plant("ln -s %s %s/commlib_mpi_%d_%d.py" % (victim, shared, os.getpid(), abs(hash(code))))
    assert "the rank program ran" in run_mpi(1, code, timeout=60).stdout
    with open(victim) as f:
        assert f.read() == "the victim's own data"
