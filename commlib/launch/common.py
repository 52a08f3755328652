"""What the launcher's modules share: its name, the flags of its worker
processes, the environment variables it sets, exit statuses, poll periods,
and how it speaks (one line on stderr, prefixed with its name)."""
import sys

from .. import settings


PROG = "commlib.launch"  # also the module name workers run with -m
WORKER_FLAG = "--_worker"  # the supervisor of one rank under mpiexec
RANK_FLAG = "--_rank"  # the rank process itself: runs the script
ENV_MPIEXEC = settings.MPIEXEC  # the mpiexec to use
#: "1": supervisors prefix output lines with "[rank] " (mpiexec without -prepend-rank)
ENV_PREFIX = settings.LAUNCH_PREFIX
EXIT_TIMEOUT = 124
#: the job was not -n ranks: they reported an MPI world of another size, or
#: mpiexec exited 0 while ranks never reported finishing
EXIT_WRONG_SIZE = 3
POLL_S = 0.05
PIPE_DRAIN_S = 1.0  # after a process ended, wait for its pipes (held by its children?)


def say(message):
    sys.stderr.write("%s: %s\n" % (PROG, message))  # one write: other output is per line
    sys.stderr.flush()
