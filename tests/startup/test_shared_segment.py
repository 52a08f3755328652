"""Shared memory of the ranks of one node (/dev/shm): the segment the
forked NCCL workers open under a name derived from their NCCL ID is made
exclusively by the first, and a file another user planted under that name
(or a symlink, or a file others may write) is refused, never mapped,
followed or truncated; the ranks then go without it.

Files are planted by another user (``nobody``, through ``setpriv``) where
this process is root, else by this user with a mode that lets others in."""
import os
import shutil
import subprocess

import numpy as np
import pytest

from commlib import NcclId
from commlib.errors import BackendUnavailableError
from commlib.startup import bootstrap, shared_segment

pytestmark = pytest.mark.skipif(not shared_segment.available(),
                                reason="no writable %s here" % shared_segment.ROOT)
AS_NOBODY = os.geteuid() == 0 and shutil.which("setpriv") is not None


def plant(command):
    prefix = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if AS_NOBODY else []
    subprocess.run(prefix + ["sh", "-c", command], check=True, timeout=30)


@pytest.fixture
def segment_path():
    """The /dev/shm path of a fresh NCCL ID's segment (removed afterwards), and the ID."""
    nid = NcclId(os.urandom(128))
    path = os.path.join(shared_segment.ROOT, bootstrap.nccl_segment_name(nid, 2))
    yield path, nid
    if os.path.lexists(path):
        os.unlink(path)


def test_ranks_share_the_segment_in_any_order(segment_path):
    path, nid = segment_path
    first = bootstrap.nccl_segment(nid, 2, 4096)
    second = bootstrap.nccl_segment(nid, 2, 4096)
    assert first is not None and second is not None
    assert oct(os.stat(path).st_mode & 0o7777) == oct(0o600)
    first.array[:5] = np.arange(1, 6, dtype=np.uint8)
    assert second.array[:5].tolist() == [1, 2, 3, 4, 5]
    first.unlink()
    first.close()
    second.close()


@pytest.mark.parametrize("planted", ["file", "symlink"])
def test_a_planted_segment_is_refused(segment_path, tmp_path, planted):
    path, nid = segment_path
    victim = tmp_path / "victim"
    victim.write_bytes(b"x")
    if planted == "file":
        # another user's (as root) or one others may write (otherwise)
        plant("touch %s && chmod 666 %s" % (path, path))
    else:
        os.chmod(tmp_path, 0o755)
        plant("ln -s %s %s" % (victim, path))
    assert bootstrap.nccl_segment(nid, 2, 4096) is None
    assert os.path.getsize(path) == 0 if planted == "file" else os.path.islink(path)
    assert victim.read_bytes() == b"x"                     # not followed, not truncated
    with pytest.raises(BackendUnavailableError,
                       match="refused shared memory %s: " % path if planted == "file"
                       else "cannot open shared memory %s: " % path):
        shared_segment.SharedSegment(os.path.basename(path), 4096)
