"""Several machines on this one: an MPI job whose ranks sit on separate
nodes joined by a network, made of Linux namespaces.

:func:`run_nodes` runs a Python snippet on ``layout = (nodes, ranks per
node)`` ranks. Every node is a network namespace of its own, with one
interface ``eth0`` at 10.250.0.<node + 1>/24 plugged (a veth pair) into a
bridge in one more namespace, the switch; its ranks also share a UTS
namespace (host name ``node<i>``) and an IPC namespace of their own, so
MPICH and UCX see ranks of different nodes as different hosts and talk
over TCP on ``eth0`` (shared memory only within a node), and
``MPI_Comm_split_type(SHARED)`` -- commlib's ``local_size`` -- groups the
ranks of one node. The addresses exist only inside the namespaces.

Hydra (MPICH's ``mpiexec``) starts inside node 0 and reaches the other
nodes through ``-launcher ssh -launcher-exec <fake ssh>``: a script,
written with mode 0700 into a private folder, that maps a node's address
to ``ip netns exec <its namespace> unshare --uts --ipc --mount``; on every
node but node 0 it also mounts an empty tmpfs over the run's ``TMPDIR``
folder, so that what a process of node 0 makes there (the launcher's
status directory) is not seen on the other nodes, as without a shared file
system. :func:`run_nodes` runs one mpiexec job, or (``jobs``, made by
:func:`launcher`) several commands one after the other in one network:
the launcher with ``--hosts``, bare mpiexec, ``commlib.info``. The namespaces
are named ``commlib-<pid>-<random>-<node>`` (and ``...-sw``), after the
process that runs :func:`run_nodes`, so that a later run removes the ones a
killed run left (:func:`remove_stale`: those whose process is dead).

Two ways to make namespaces, tried in this order:

- as root (or with CAP_NET_ADMIN and CAP_SYS_ADMIN): in the machine's
  ``ip netns`` list, deleted on every exit -- the job's end, an error, a
  timeout, Ctrl-C, SIGTERM (a handler turns it into an exception while a
  job runs), the interpreter's exit (``atexit``) -- after the processes
  left in them are killed;
- elsewhere, in an unprivileged user namespace (``unshare -r -n -m``) with
  ``/run`` a private tmpfs: nothing is visible outside, and everything goes
  with the job's last process.

Where neither works :func:`unavailable_reason` says why, and the tests
that need nodes skip with it.

The per-rank records (rank, size, host name, namespaces) prove that ranks
0..n-1 of one world of size n each ran, and on which node; each rank's
stdout and stderr go to a file of its own (:class:`NodesRun`).

Run as a program (``python tests/nodes.py SPEC``) it is the driver that
makes the namespaces, runs the job and deletes them; :func:`run_nodes`
starts it, inside ``unshare -r -n -m`` where not root.
"""
import atexit
import contextlib
import dataclasses
import functools
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

from commlib.core.liveness import alive

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "benchmarks"))
from shaped_link import _interrupts_held  # noqa: E402
SUBNET = "10.250.0"
#: names of the namespaces this harness and benchmarks/shaped_link.py make:
#: ``commlib-<pid>...`` and ``commlib-probe-<pid>``, the pid of their maker
NAME_PATTERN = re.compile(r"^commlib-(?:probe-)?(\d+)(?:-|$)")
#: run_nodes' prefixes not yet cleaned (atexit cleans them)
_LIVE = set()
_LOCK = threading.Lock()


def address(node):
    """The address of ``node`` (0-based) on the job's network."""
    return "%s.%d" % (SUBNET, node + 1)


# ---------------------------------------------------------------- namespaces

def _run(cmd, check=True, timeout=30):
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode:
        raise NodesUnavailable("`%s` failed (exit %d): %s" % (
            " ".join(str(c) for c in cmd), proc.returncode, proc.stderr.strip()))
    return proc


class NodesUnavailable(RuntimeError):
    """This machine cannot make the namespaces of a multi-node job."""


def namespaces():
    """The names in ``ip netns list`` (empty where ``ip`` is missing)."""
    if shutil.which("ip") is None:
        return []
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.split()]


#: whether a process still exists: ended and reaped counts as gone, a
#: zombie not yet
_pid_alive = functools.partial(alive, zombie=True)


def _running(pid):
    """Whether ``pid`` runs (a zombie, ended but not reaped, does not)."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return False


def delete_namespace(name):
    """Kill every process in namespace ``name``, then delete it (no error
    if it is gone). Its processes are killed first: a namespace whose name
    is deleted lives on, unseen, as long as a process holds it."""
    for _ in range(10):
        pids = [int(p) for p in _run(["ip", "netns", "pids", name], check=False).stdout.split()]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)          # the kernel reaps them; bounded by the loop
    _run(["ip", "netns", "del", name], check=False)


def remove_namespaces(prefix):
    """Delete every namespace whose name is ``prefix`` or starts with
    ``prefix + "-"``, processes in it killed; returns the names removed."""
    gone = [n for n in namespaces() if n == prefix or n.startswith(prefix + "-")]
    for name in gone:
        delete_namespace(name)
    return gone


def remove_stale():
    """Delete the namespaces named after a process that is dead (see
    :data:`NAME_PATTERN`): left by a run killed with SIGKILL, or by a
    machine's crash. Those of live processes are left alone. Returns the
    names removed."""
    stale = [n for n in namespaces()
             if NAME_PATTERN.match(n) and not alive(int(NAME_PATTERN.match(n).group(1)))]
    for name in stale:
        delete_namespace(name)
    return stale


def _clean_live():
    with _LOCK:
        prefixes = list(_LIVE)
        _LIVE.clear()
    for prefix in prefixes:
        remove_namespaces(prefix)


atexit.register(_clean_live)


def _make_network(prefix, nodes):
    """Namespaces ``<prefix>-sw`` (a bridge) and ``<prefix>-<i>`` for each
    node (lo up; eth0 at :func:`address` on the bridge); returns the node
    namespaces' names. Raises NodesUnavailable; on any error the ones made
    are deleted."""
    switch = prefix + "-sw"
    names = ["%s-%d" % (prefix, i) for i in range(nodes)]
    try:
        for name in [switch] + names:
            _run(["ip", "netns", "add", name])
        _run(["ip", "-n", switch, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", switch, "link", "set", "br0", "up"])
        for i, name in enumerate(names):
            # made inside the switch: interface names never meet the machine's
            _run(["ip", "-n", switch, "link", "add", "p%d" % i, "type", "veth",
                  "peer", "name", "eth0", "netns", name])
            _run(["ip", "-n", switch, "link", "set", "p%d" % i, "master", "br0", "up"])
            _run(["ip", "-n", name, "link", "set", "lo", "up"])
            _run(["ip", "-n", name, "addr", "add", address(i) + "/24", "dev", "eth0"])
            _run(["ip", "-n", name, "link", "set", "eth0", "up"])
    except BaseException:
        remove_namespaces(prefix)
        raise
    return names


def _port_bytes(prefix, nodes):
    """{node: bytes node's eth0 sent} from the switch's port counters."""
    out = _run(["ip", "-n", prefix + "-sw", "-j", "-s", "link", "show"]).stdout
    got = {}
    for link in json.loads(out):
        m = re.fullmatch(r"p(\d+)", link.get("ifname", ""))
        if m and int(m.group(1)) < nodes:
            got[int(m.group(1))] = link["stats64"]["rx"]["bytes"]
    return got


# ------------------------------------------------------------------ the driver

FAKE_SSH = """\
#!/bin/sh
# ssh as hydra calls it (ssh [-x ...] HOST COMMAND): COMMAND runs on the
# node whose address is HOST, in that node's namespaces
while [ "${1#-}" != "$1" ]; do shift; done
host=$1
shift
case $host in
%s
*) echo "fake ssh: no node has the address $host" >&2; exit 255;;
esac
exec ip netns exec "$ns" unshare --uts --ipc --mount sh -c "hostname $name && $own exec $*"
"""


def _write_fake_ssh(folder, names, node_tmp):
    """The fake ssh in ``folder``; on every node but node 0, ``node_tmp`` is
    an empty folder of the node's own (a tmpfs over it)."""
    own = "mount -t tmpfs commlib-node-tmp %s &&" % shlex.quote(node_tmp)
    cases = "\n".join("%s) ns=%s; name=node%d; own=%s;;"
                      % (address(i), name, i, shlex.quote(own) if i else "''")
                      for i, name in enumerate(names))
    path = os.path.join(folder, "ssh")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o700)
    with os.fdopen(fd, "w") as f:
        f.write(FAKE_SSH % cases)
    return path


#: seconds a job's ranks may live on after its command exited
LEFT_S = 10.0


def _run_job(ssh, job, timeout, prefix, nodes):
    """Run one job's command on node 0; its result (a dict)."""
    result = {"timed_out": False}
    before = _port_bytes(prefix, nodes)
    start = time.monotonic()
    # SIGPIPE stays ignored (as Python has it), also in mpiexec: hydra
    # writing to the connection of a node whose ranks all ended (a rank's
    # os._exit, with -disable-auto-cleanup) then gets EPIPE, where the
    # default action killed it in about one run in eight
    proc = subprocess.Popen([ssh, address(0), " ".join(shlex.quote(c) for c in job["command"])],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=job["env"], start_new_session=True, restore_signals=False)
    try:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            result["timed_out"] = True
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    result.update(returncode=proc.returncode, stdout=out, stderr=err, ended=time.time(),
                  seconds=time.monotonic() - start)
    after = _port_bytes(prefix, nodes)
    result["sent"] = {i: after[i] - before[i] for i in range(nodes)}
    # the ranks it started (their records' pids): still running LEFT_S after it?
    pids = []
    reports = os.path.join(job["folder"], "reports")
    for name in os.listdir(reports) if os.path.isdir(reports) else []:
        with open(os.path.join(reports, name)) as f:
            pids.append(json.load(f)["pid"])
    deadline = time.monotonic() + LEFT_S
    while any(_running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    result["left"] = [p for p in pids if _running(p)]
    result["gone_s"] = time.time() - result["ended"]
    return result


def drive(spec):
    """Make the network, run the jobs one after the other, delete the
    network; writes ``result.json`` into ``spec["folder"]``. Runs in the
    driver process."""
    nodes, per_node = spec["layout"]
    prefix, folder = spec["prefix"], spec["folder"]
    result = {"jobs": []}
    if spec["private"]:
        # a user namespace's own /run, where ip keeps the namespaces' names
        _run(["mount", "-t", "tmpfs", "-o", "mode=0755", "tmpfs", "/run"])
    interrupted = []

    def interrupt(number, frame):
        interrupted.append(number)
        raise KeyboardInterrupt
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, interrupt)
    try:
        names = _make_network(prefix, nodes)
        result["namespaces"] = {i: os.stat("/run/netns/" + name).st_ino
                                for i, name in enumerate(names)}
        ssh = _write_fake_ssh(folder, names, spec["node_tmp"])
        assert ssh == spec["ssh"], (ssh, spec["ssh"])
        for job in spec["jobs"]:
            result["jobs"].append(_run_job(ssh, job, spec["timeout"], prefix, nodes))
    finally:
        remove_namespaces(prefix)
        if os.getppid() != spec["owner"]:         # run_nodes was killed: nobody reads it
            shutil.rmtree(folder, ignore_errors=True)
        else:
            with open(os.path.join(folder, "result.json"), "w") as f:
                json.dump(result, f)
    return 130 if interrupted else 0


# ------------------------------------------------------------------ run_nodes

#: where each rank writes its record, and its stdout and stderr
ENV_FOLDER = "COMMLIB_TEST_NODES_FOLDER"

# Runs first in every rank: stdout and stderr into files of this rank's own
# (by hydra's PMI_RANK), then MPI's world and this process's namespaces
# recorded.
PROLOGUE = """\
def _commlib_test_node():
    import json, os, socket, sys
    folder = os.environ[%r]
    rank = int(os.environ["PMI_RANK"])
    for fd, kind in ((1, "out"), (2, "err")):
        f = os.open(os.path.join(folder, "%%s-%%d" %% (kind, rank)),
                    os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout.reconfigure(line_buffering=True)
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    record = {"rank": world.Get_rank(), "size": world.Get_size(), "pid": os.getpid(),
              "host": socket.gethostname(),
              "library": MPI.Get_library_version().splitlines()[0]}
    record.update({ns: os.stat("/proc/self/ns/" + ns).st_ino for ns in ("net", "uts", "ipc")})
    with open(os.path.join(folder, "reports", "rank-%%d" %% world.Get_rank()), "x") as f:
        json.dump(record, f)
_commlib_test_node()
del _commlib_test_node
""" % ENV_FOLDER


@dataclasses.dataclass
class NodesRun:
    """What a :func:`run_nodes` job did.

    returncode: the exit status of the job's command (mpiexec, the
    launcher). outputs, errors: each rank's stdout and stderr (lists
    indexed by rank). node_of: each rank's node (0-based).
    sent: bytes each node's eth0 sent during the job. seconds: the job's
    wall time (namespaces' setup apart). launcher: the command's own output
    (stdout, then stderr).
    reports: each rank's record (rank, size, host, pid, namespaces).
    """
    returncode: int
    outputs: list
    errors: list
    node_of: list
    sent: dict
    seconds: float
    launcher: str
    reports: list = dataclasses.field(default_factory=list, repr=False)
    #: time.time() when the job's command (mpiexec, the launcher) had exited
    ended: float = 0.0
    #: pids of its ranks still running 10 s (LEFT_S) after that
    left: list = dataclasses.field(default_factory=list)
    #: seconds from ``ended`` until its ranks had all ended (LEFT_S at most)
    gone_s: float = 0.0
    #: what else the ranks wrote into their folder (COMMLIB_TEST_NODES_FOLDER): name -> text
    files: dict = dataclasses.field(default_factory=dict, repr=False)

    @property
    def text(self):
        """Every rank's stdout, in rank order."""
        return "".join(self.outputs)

    def describe(self):
        """All output, rank by rank, for a failure's message."""
        parts = ["the job's command exited %d; its output:\n%s"
                 % (self.returncode, self.launcher)]
        for rank, (out, err) in enumerate(zip(self.outputs, self.errors)):
            parts.append("--- rank %d (node %s) stdout:\n%s--- stderr:\n%s"
                         % (rank, self.node_of[rank] if rank < len(self.node_of) else "?",
                            out, err))
        return "\n".join(parts)


_MODE = {}


def _mode():
    """("root" or "private", None) or (None, why neither works); cached."""
    if "mode" in _MODE:
        return _MODE["mode"]
    why = []
    for tool in ("ip", "unshare", "hostname"):
        if shutil.which(tool) is None:
            why.append("`%s` not found (iproute2, util-linux, hostname)" % tool)
    if shutil.which("mpiexec.hydra", path=os.path.dirname(sys.executable)) is None:
        why.append("no hydra mpiexec beside %s (pip install mpich)" % sys.executable)
    if why:
        _MODE["mode"] = (None, "; ".join(why))
        return _MODE["mode"]
    found = None
    if os.geteuid() == 0:
        probe = "commlib-probe-%d" % os.getpid()
        try:
            _make_network(probe, 1)
            found = "root"
        except NodesUnavailable as exc:
            why.append("as root: %s" % exc)
        finally:
            remove_namespaces(probe)
    if found is None:
        test = ("mount -t tmpfs tmpfs /run && ip netns add probe && ip -n probe link add br0 "
                "type bridge && ip netns exec probe unshare --uts --ipc hostname node0")
        proc = _run(["unshare", "-r", "-n", "-m", "sh", "-c", test], check=False)
        if proc.returncode == 0:
            found = "private"
        else:
            why.append("in a user namespace (unshare -r -n -m): %s" % proc.stderr.strip())
    _MODE["mode"] = (found, None if found else "; ".join(why))
    return _MODE["mode"]


def unavailable_reason():
    """None where :func:`run_nodes` can run here, else why not."""
    return _mode()[1]


class Terminated(BaseException):
    """SIGTERM or SIGHUP arrived while :func:`terminate_raises` held."""


def _raise_terminated(number, frame):
    raise Terminated("signal %d" % number)


@contextlib.contextmanager
def terminate_raises():
    """In the body, SIGTERM and SIGHUP raise :class:`Terminated` in the main
    thread (as Ctrl-C raises KeyboardInterrupt), so that ``finally`` clauses
    delete namespaces before the process ends; the handlers before are put
    back afterwards. Elsewhere than in the main thread it does nothing (only
    the main thread can set handlers)."""
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            previous[sig] = signal.signal(sig, _raise_terminated)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def launcher(*options, args=(), tool="commlib.launch"):
    """A job for :func:`run_nodes`, started on node 0, with ``k`` ranks per
    node: ``python -m commlib.launch -n N --hosts <node 0>:k,<node 1>:k,...
    --launcher-exec <fake ssh> OPTIONS <the code> ARGS``; ``tool="mpiexec"``:
    hydra's ``mpiexec -launcher ssh -launcher-exec <fake ssh> -hosts ... -n
    N OPTIONS python <the code> ARGS``; ``tool="commlib.info"``: ``python
    -m commlib.info --run N --hosts ... --launcher-exec ... OPTIONS``, whose
    ranks do not run the code."""
    if tool == "mpiexec":
        mpiexec = shutil.which("mpiexec.hydra", path=os.path.dirname(sys.executable))
        return {"command": [mpiexec, "-launcher", "ssh", "-launcher-exec", "{ssh}", "-hosts",
                            "{hosts}", "-n", "{n}", *options, sys.executable, "{script}",
                            *map(str, args)], "reports": True}
    if tool == "commlib.info":
        return {"command": [sys.executable, "-m", tool, "--run", "{n}", "--hosts", "{hosts}",
                            "--launcher-exec", "{ssh}", *options], "reports": False}
    return {"command": [sys.executable, "-m", tool, "-n", "{n}", "--hosts", "{hosts}",
                        "--launcher-exec", "{ssh}", *options, "{script}", *map(str, args)],
            "reports": True}


def run_nodes(layout=(2, 1), code="", timeout=60, env=None, args=(), expect_fail=False,
              survivors=False, jobs=None):
    """Run ``code`` (Python source) on ``layout = (nodes, ranks per node)``
    ranks, each node a network namespace of its own (see the module's
    docstring); returns a :class:`NodesRun`.

    ``jobs``: instead of one mpiexec job, these commands one after the
    other in the same network, each made by :func:`launcher` (the
    launcher, mpiexec, ``commlib.info``), started on node 0; returns a list of
    :class:`NodesRun`, one per job. Each job's ranks have a folder of their
    own (``COMMLIB_TEST_NODES_FOLDER``), and ``TMPDIR`` is a folder that is
    empty, and of the node's own, on every node but node 0: the launcher's
    status directory exists on node 0 only, as on machines that share no
    file system.

    Skips the test (with :func:`unavailable_reason`) where no namespaces
    can be made. Fails the test when a job runs past ``timeout`` seconds
    (the whole job killed), when its exit status is not what
    ``expect_fail`` says (None: either), unless ranks 0..n-1 of one world of size n each
    reported, or unless node i holds ranks ``i*k .. i*k+k-1`` (k ranks per
    node), alone in its network, UTS and IPC namespaces. ``survivors``: a
    rank that leaves without ``MPI_Finalize`` does not end the others
    (hydra's ``-disable-auto-cleanup``). The namespaces are gone when it
    returns or raises, Ctrl-C and SIGTERM included.
    """
    import pytest
    from mpirun import check_world, python_path
    nodes, per_node = layout
    if nodes < 1 or per_node < 1:
        raise ValueError("layout %r: expected (nodes >= 1, ranks per node >= 1)" % (layout,))
    mode, why = _mode()
    if mode is None:
        pytest.skip("no namespaces for several nodes here: %s" % why)
    n = nodes * per_node
    tmp = os.environ.get("PYTEST_TMPDIR", tempfile.gettempdir())
    folder = tempfile.mkdtemp(prefix="commlib-nodes-", dir=tmp)       # mode 0700
    node_tmp = os.path.join(folder, "node-tmp")
    os.mkdir(node_tmp)
    fd, script = tempfile.mkstemp(prefix="commlib_nodes_", suffix=".py", dir=folder)
    with os.fdopen(fd, "w") as f:
        f.write(PROLOGUE + textwrap.dedent(code))
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = python_path(full_env)
    full_env.update(env or {})
    ssh = os.path.join(folder, "ssh")
    single = jobs is None
    if single:
        jobs = [launcher(*(["-disable-auto-cleanup"] if survivors else []), args=args,
                         tool="mpiexec")]
    hosts = ",".join("%s:%d" % (address(i), per_node) for i in range(nodes))
    specs = []
    for k, job in enumerate(jobs):
        job_folder = os.path.join(folder, "job-%d" % k)
        os.makedirs(os.path.join(job_folder, "reports"))
        specs.append({"folder": job_folder, "reports": job["reports"],
                      "env": dict(full_env, **{ENV_FOLDER: job_folder, "TMPDIR": node_tmp}),
                      "command": [c.format(n=n, hosts=hosts, ssh=ssh, script=script)
                                  for c in job["command"]]})
    prefix = "commlib-%d-%s" % (os.getpid(), secrets.token_hex(3))
    spec = {"layout": [nodes, per_node], "prefix": prefix, "folder": folder, "owner": os.getpid(),
            "private": mode == "private", "timeout": timeout, "ssh": ssh,
            "node_tmp": node_tmp, "jobs": specs}
    spec_path = os.path.join(folder, "spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    driver = [sys.executable, str(Path(__file__).resolve()), spec_path]
    if mode == "private":
        driver = ["unshare", "-r", "-n", "-m"] + driver
    else:
        remove_stale()
        with _LOCK:
            _LIVE.add(prefix)
    proc = None
    with terminate_raises():
        try:
            with _interrupts_held():
                # a Ctrl-C while the driver is being made acts once it is known
                proc = subprocess.Popen(driver, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True, start_new_session=True)
            dout, derr = _wait_driver(proc, timeout * len(specs), nodes, per_node)
            try:
                with open(os.path.join(folder, "result.json")) as f:
                    result = json.load(f)
            except FileNotFoundError:
                result = None
            if proc.returncode or result is None or len(result["jobs"]) != len(specs):
                pytest.fail("the driver of a %dx%d job failed (exit %d)\n%s%s"
                            % (nodes, per_node, proc.returncode, dout, derr))
            runs = [_collect(job["folder"], n, got, result["namespaces"])
                    for job, got in zip(specs, result["jobs"])]
        finally:
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            if mode == "root":
                remove_namespaces(prefix)
                with _LOCK:
                    _LIVE.discard(prefix)
            shutil.rmtree(folder, ignore_errors=True)
    for job, got, run in zip(specs, result["jobs"], runs):
        what = "%dx%d job %s" % (nodes, per_node, " ".join(job["command"][:4]))
        if got["timed_out"]:
            pytest.fail("%s timed out after %ss\n%s" % (what, timeout, run.describe()))
        if job["reports"]:
            check_world(run.reports, n, "a %s on namespaces" % what)
            _check_placement(run.reports, result["namespaces"], nodes, per_node, run)
        failed = run.returncode != 0 and not (survivors and _late_notice_only(run))
        if expect_fail is not None and failed != expect_fail:
            pytest.fail("%s: %s" % (what, run.describe()))
    return runs[0] if single else runs


def _wait_driver(proc, timeout, nodes, per_node):
    import pytest
    try:
        return proc.communicate(timeout=timeout + 60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        dout, derr = proc.communicate()
        pytest.fail("the driver of a %dx%d job did not end 60 s after its job's %s s bound"
                    "\n%s%s" % (nodes, per_node, timeout, dout, derr))


def _late_notice_only(run):
    """Whether hydra's only failure was to tell a node that had already ended
    that a rank had ended: with ``-disable-auto-cleanup`` it passes each
    rank's end on to the other nodes (SIGUSR1), and on a busy machine it may
    take a rank that finalized for one that did not (its exit seen before its
    finalisation) after another node's ranks had all finished; the write to
    that node gets EPIPE and mpiexec exits 255 although every rank finished.
    The ranks' own records (the tests') say whether they did."""
    return (run.returncode == 255 and "unable to send SIGUSR1 downstream" in run.launcher
            and "Broken pipe" in run.launcher)


def _collect(folder, n, result, namespaces):
    def read(name):
        try:
            with open(os.path.join(folder, name), errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""
    reports = []
    for name in sorted(os.listdir(os.path.join(folder, "reports"))):
        with open(os.path.join(folder, "reports", name)) as f:
            reports.append(json.load(f))
    net_to_node = {ino: int(i) for i, ino in namespaces.items()}
    node_of = [None] * n
    for r in reports:
        if 0 <= r["rank"] < n:
            node_of[r["rank"]] = net_to_node.get(r["net"])
    outputs = {"out-%d" % r for r in range(n)} | {"err-%d" % r for r in range(n)}
    files = {name: read(name) for name in os.listdir(folder)
             if name not in outputs and os.path.isfile(os.path.join(folder, name))}
    return NodesRun(returncode=result["returncode"],
                    outputs=[read("out-%d" % r) for r in range(n)],
                    errors=[read("err-%d" % r) for r in range(n)],
                    node_of=node_of, sent={int(k): v for k, v in result["sent"].items()},
                    seconds=result["seconds"],
                    launcher=result["stdout"] + result["stderr"], reports=reports,
                    ended=result["ended"], left=result["left"], gone_s=result["gone_s"],
                    files=files)


def _check_placement(reports, namespaces, nodes, per_node, run):
    """Fail unless node i holds ranks i*k..i*k+k-1, the ranks of a node
    share its network, UTS and IPC namespaces and host name, and no two
    nodes share any of them."""
    import pytest
    want = [r // per_node for r in range(nodes * per_node)]
    if run.node_of != want:
        pytest.fail("ranks were to run on nodes %s, ran on %s\n%s"
                    % (want, run.node_of, run.describe()))
    for kind in ("net", "uts", "ipc", "host"):
        seen = {}
        for r in reports:
            seen.setdefault(want[r["rank"]], set()).add(r[kind])
        if any(len(v) != 1 for v in seen.values()) or \
                len(set.union(*seen.values())) != nodes:
            pytest.fail("ranks' %s namespaces by node: %s; one per node expected"
                        % (kind, seen))


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        sys.exit(drive(json.load(f)))
