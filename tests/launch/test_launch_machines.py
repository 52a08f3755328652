"""The launcher's options for several machines, on this one: ``--hosts`` /
``-H`` and ``--hostfile`` (checked before anything starts: one line naming
the entry or the file's line, exit status 2), ``--launcher-exec``, the
mpiexec arguments they become for hydra and Open MPI, and Slurm: the
``srun`` step the launcher starts inside an allocation, run whole with a
stand-in ``srun`` that starts the ranks with hydra and gives them Slurm's
variables (and one that starts them as N separate singletons, which the
size check refuses). The runs across real nodes are test_launch_nodes.py's."""
import os
import re
import shutil
import sys

import pytest

from commlib import launch
from commlib.errors import ArgumentError, BackendUnavailableError, LaunchError
from commlib.launch import cli as launch_cli, jobs as launch_jobs, slurm
from commlib.startup import hosts as host_list, mpi_library
from mpirun import mpiexec
from test_launch import run_launcher, said, write


# -- hosts and hostfiles -----------------------------------------------------------------

def test_hosts_and_hostfile_parse():
    H = host_list.Host
    assert host_list.parse_hosts("a:2,b:2") == [H("a", 2), H("b", 2)]
    assert host_list.parse_hosts("node-1.cluster, 10.0.0.7:3") == [H("node-1.cluster", 1),
                                                                    H("10.0.0.7", 3)]
    assert host_list.text([H("a", 2), H("b", 1)]) == "a:2,b:1"


def test_hostfile_lines_comments_and_blanks(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("# the job's machines\n\nnode0:2   # two GPUs\n  node1:2\nnode2\n")
    assert host_list.read_hostfile(str(path)) == [
        host_list.Host("node0", 2), host_list.Host("node1", 2), host_list.Host("node2", 1)]


@pytest.mark.parametrize("text, entry", [("a:0", "a:0"), ("a:2,,b", ""), ("a:two", "a:two"),
                                         ("a b:2", "a b:2"), ("a:-1", "a:-1"), ("a:2:3", "a:2:3")])
def test_a_bad_hosts_entry_is_named(text, entry):
    with pytest.raises(ArgumentError, match="^%s$" % re.escape(
            "--hosts entry: %r: expected HOST or HOST:SLOTS (a host name or IPv4 address; "
            "SLOTS an int >= 1)" % entry)):
        host_list.parse_hosts(text)


def test_more_ranks_than_slots_is_refused():
    hosts = host_list.parse_hosts("a:2,b:2")
    host_list.check_slots(hosts, 4)
    host_list.check_slots(hosts, 1)
    with pytest.raises(ArgumentError, match=re.escape(
            "-n 5 is more than the 4 slots of --hosts (a:2,b:2): give each host as many slots "
            "as ranks it is to run (HOST:SLOTS), or -n 4 or fewer")):
        host_list.check_slots(hosts, 5)


def test_mpiexec_arguments_of_each_family():
    hosts = host_list.parse_hosts("a:2,b:2")
    assert host_list.mpiexec_args(mpi_library.MPICH, hosts, "/x/ssh") == [
        "-hosts", "a:2,b:2", "-launcher", "ssh", "-launcher-exec", "/x/ssh"]
    assert host_list.mpiexec_args(mpi_library.OPENMPI, hosts, "/x/ssh") == [
        "--host", "a:2,b:2", "--mca", "plm_rsh_agent", "/x/ssh"]
    assert host_list.mpiexec_args(mpi_library.MPICH) == []


def test_the_hydra_command_line(tmp_path, monkeypatch):
    """--hosts and --launcher-exec reach hydra's command line ahead of -n."""
    script = write(tmp_path / "ok.py", "print('ran')\n")
    started = []

    def popen(cmd, env, **kwargs):
        started.append((cmd, env))
        raise OSError("not started")
    monkeypatch.setattr(launch_jobs, "popen", popen)
    ns = launch_cli.parse_args(["-n", "4", "-H", "a:2,b:2", "--launcher-exec", "true",
                                str(script), "x"])
    with pytest.raises(LaunchError, match="not started"):
        launch_cli.start_job(ns)
    (cmd, env), = started
    at = cmd.index("-hosts")
    assert cmd[at:] == ["-hosts", "a:2,b:2", "-launcher", "ssh", "-launcher-exec",
                        shutil.which("true"),
                        "-prepend-rank", "-n", "4", sys.executable, "-m", "commlib.launch",
                        "--_worker", str(script), "x"], cmd


@pytest.mark.parametrize("args, message", [
    (["-n", "2", "--hosts", "a:0", "{script}"], "error: --hosts entry: 'a:0': expected HOST or "
     "HOST:SLOTS (a host name or IPv4 address; SLOTS an int >= 1)"),
    (["-n", "5", "-H", "a:2,b:2", "{script}"], "error: -n 5 is more than the 4 slots of --hosts "
     "(a:2,b:2)"),
    (["-n", "2", "--hostfile", "{hostfile}", "{script}"], "error: --hostfile {hostfile} line 3: "
     "'b:x': expected HOST or HOST:SLOTS"),
    (["-n", "9", "--hostfile", "{goodfile}", "{script}"], "error: -n 9 is more than the 3 slots "
     "of --hostfile {goodfile} (a:2,b:1)"),
    (["-n", "2", "--hostfile", "{missing}", "{script}"], "error: --hostfile '{missing}': cannot "
     "be read (No such file or directory)"),
    (["-n", "2", "--hostfile", "{empty}", "{script}"], "error: --hostfile '{empty}': no host "
     "in it"),
    (["-n", "2", "-H", "a:2", "--launcher-exec", "{missing}", "{script}"], "error: "
     "--launcher-exec '{missing}': expected the program that reaches the other hosts"),
    (["-n", "2", "-H", "a:2", "--hostfile", "{goodfile}", "{script}"], "argument --hostfile: "
     "not allowed with argument -H/--hosts"),
    (["-n", "2", "-H", "a:2", "--starter", "srun", "{script}"], "error: --starter srun: Slurm "
     "places the ranks on the allocation's nodes"),
    (["-n", "2", "-H", "a:2", "--backend", "nccl", "{script}"], "error: --backend nccl: forked "
     "workers run on this machine only"),
])
def test_bad_machines_are_one_line_and_status_2(tmp_path, args, message):
    script = write(tmp_path / "ok.py", "print('ran')\n")
    files = {"hostfile": "a:2\n# b\nb:x\n", "goodfile": "a:2\nb\n", "empty": "# none\n"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    names = dict({k: tmp_path / k for k in files}, script=script, missing=tmp_path / "missing")
    res = run_launcher(*[a.format(**names) for a in args], timeout=30, backend="auto")
    assert res.returncode == 2, res
    assert message.format(**names) in res.stderr, res.stderr
    if "not allowed" not in message:          # argparse's own errors come with the usage
        assert len(res.stderr.splitlines()) == 1, res.stderr
    assert "ran" not in res.stdout and "Traceback" not in res.stderr


# -- Slurm -------------------------------------------------------------------------------

@pytest.mark.parametrize("requested, env, across, expected", [
    ("auto", {}, False, "mpiexec"),
    ("auto", {"SLURM_JOB_ID": "7"}, False, "srun"),
    ("auto", {"SLURM_JOB_ID": "7"}, True, "mpiexec"),
    ("auto", {"SLURM_JOB_ID": "7", "PATH": "/nonexistent"}, False, "mpiexec"),
    ("mpiexec", {"SLURM_JOB_ID": "7"}, False, "mpiexec"),
    ("srun", {}, False, "srun"),
])
def test_the_starter(tmp_path, requested, env, across, expected):
    srun = write(tmp_path / "srun", "#!/bin/sh\n")
    srun.chmod(0o755)
    env = dict({"PATH": str(tmp_path)}, **env)
    assert slurm.choose_starter(requested, env, across) == expected


def test_srun_with_mpiexecs_options_or_too_many_tasks_is_refused():
    with pytest.raises(ArgumentError, match="--starter srun: Slurm places the ranks"):
        slurm.choose_starter("srun", {}, across=True)
    slurm.check_tasks(4, {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4"})
    slurm.check_tasks(9, {"SLURM_JOB_ID": "7"})          # no task count: srun decides
    with pytest.raises(ArgumentError, match=re.escape(
            "-n 5 is more than the 4 tasks of Slurm job 7 (SLURM_NTASKS=4)")):
        slurm.check_tasks(5, {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4"})
    with pytest.raises(BackendUnavailableError, match="srun not found on PATH"):
        slurm.srun({"PATH": "/nonexistent"})


# a stand-in srun: writes its arguments into $SRUN_ARGS, then starts the step's
# ranks with hydra, each with the variables Slurm gives a task
FAKE_SRUN = """#!/bin/sh
printf '%%s\\n' "$@" > "$SRUN_ARGS"
[ "$1" = -n ] || exit 64
n=$2
shift 3
%s
"""
AS_ONE_JOB = ("exec %s -n \"$n\" sh -c 'SLURM_PROCID=$PMI_RANK SLURM_STEP_NUM_TASKS=$PMI_SIZE "
              "SLURM_STEP_ID=0 exec \"$@\"' sh \"$@\"")
# ... or as n separate processes, each an MPI job of its own (a broken PMI set-up)
AS_SINGLETONS = """trap 'kill 0' TERM INT
i=0
while [ $i -lt $n ]; do
  SLURM_PROCID=$i SLURM_STEP_NUM_TASKS=$n SLURM_STEP_ID=0 "$@" &
  i=$((i + 1))
done
wait"""

SLURM_JOB = """
import os
import numpy as np
import commlib
comm = commlib.init()
x = np.full(5, comm.rank + 1.0)
comm.all_reduce(x)
assert (x == comm.size * (comm.size + 1) / 2).all(), x
print("rank %d of %d: task %s of %s, sum %g" % (comm.rank, comm.size, os.environ["SLURM_PROCID"],
      os.environ["SLURM_STEP_NUM_TASKS"], x[0]), flush=True)
comm.close()
"""


def slurm_run(tmp_path, body, n):
    folder = tmp_path / "bin"
    folder.mkdir()
    srun = folder / "srun"
    srun.write_text(FAKE_SRUN % body)
    srun.chmod(0o755)
    script = write(tmp_path / "job.py", SLURM_JOB)
    res = run_launcher("-n", n, script, timeout=60, backend="auto", env={
        "PATH": "%s%s%s" % (folder, os.pathsep, os.environ["PATH"]), "SLURM_JOB_ID": "4242",
        "SLURM_NTASKS": str(n), "SRUN_ARGS": str(tmp_path / "srun-args")})
    return res, (tmp_path / "srun-args").read_text().splitlines(), script


def test_a_slurm_step_runs_the_job(tmp_path):
    """Inside an allocation the launcher starts ``srun -n 3
    --kill-on-bad-exit=1 python -m commlib.launch --_worker job.py``; the
    ranks form one world of 3, each prints its line with the rank prefix
    the supervisors add, and the launcher exits 0."""
    res, args, script = slurm_run(tmp_path, AS_ONE_JOB % " ".join(mpiexec()), 3)
    assert args == ["-n", "3", "--kill-on-bad-exit=1", sys.executable, "-m", "commlib.launch",
                    "--_worker", str(script)], args
    assert res.returncode == 0, res
    assert sorted(res.stdout.splitlines()) == [
        "[%d] rank %d of 3: task %d of 3, sum 6" % (r, r, r) for r in range(3)], res
    assert not said(res.stderr), res.stderr


def test_a_slurm_step_of_singletons_is_refused(tmp_path):
    """An srun whose tasks do not join one MPI world (N jobs of size 1):
    every rank's commlib.init() raises LaunchError (SLURM_STEP_NUM_TASKS=3,
    world of 1), and the launcher ends the job with status 3, naming the
    sizes."""
    res, _, _ = slurm_run(tmp_path, AS_SINGLETONS, 3)
    assert res.returncode == launch.EXIT_WRONG_SIZE, res
    assert said(res.stderr)[-1].startswith("-n 3, but rank "), res.stderr
    assert "sees a world of 1" in said(res.stderr)[-1], res.stderr
    assert "rank" not in res.stdout or "sum" not in res.stdout, res.stdout
