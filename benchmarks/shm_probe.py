"""How costly is shared memory between these ranks right now?

    mpiexec -n 2 python benchmarks/shm_probe.py

Each round every rank writes ``--bytes`` into its slot of a shared window,
which the next rank read in the round before (the shared-memory all-reduce's
own pattern), then reads the next rank's slot. Prints the median write and
read times with plain and with streaming stores, and a write into memory no
other core has read, for reference. Where writing after the other core read
costs several times the reference, the cores sit far apart (another core
complex or socket, or a VM's vCPUs placed so), and every shared-memory
transfer, MPI's included, is slow: read benchmark ratios with that in mind.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # prefer the checkout
from commlib.ops import hostcopy  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bytes", type=int, default=512 << 10)
    p.add_argument("--rounds", type=int, default=30)
    args = p.parse_args(argv)
    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    if not hostcopy.available():
        raise SystemExit("the compiled host loops are unavailable: %s"
                         % hostcopy.unavailable_reason())
    count = args.bytes // 4
    win = MPI.Win.Allocate_shared((size + 1) * args.bytes if rank == 0 else 0, 1, comm=comm)
    memory, _ = win.Shared_query(0)
    shared = np.frombuffer(memory, np.float32, count=(size + 1) * count)
    slot = shared[rank * count:(rank + 1) * count]
    other = shared[((rank + 1) % size) * count:((rank + 1) % size + 1) * count]
    alone = shared[size * count:] if rank == 0 else None   # nobody else reads it
    mine, seen = np.ones(count, np.float32), np.empty(count, np.float32)
    clock = time.perf_counter_ns
    rows = {}
    for name, streaming in (("plain", False), ("streaming", True)):
        writes, reads = [], []
        for _ in range(args.rounds + 1):
            comm.Barrier()
            t = clock()
            hostcopy.gather((mine,), slot, None, streaming)
            writes.append(clock() - t)
            comm.Barrier()
            t = clock()
            hostcopy.gather((other,), seen)
            reads.append(clock() - t)
        rows[name] = (statistics.median(writes[1:]), statistics.median(reads[1:]))
    if alone is not None:
        times = []
        for _ in range(args.rounds + 1):
            t = clock()
            hostcopy.gather((mine,), alone)
            times.append(clock() - t)
        reference = statistics.median(times[1:])
    gathered = comm.gather(rows)
    if rank == 0:
        print("# %d ranks, %d bytes per copy, median of %d rounds, us (slowest rank)"
              % (size, args.bytes, args.rounds))
        print("| stores | write after the other read | read the other's write |")
        print("| --- | --- | --- |")
        for name in rows:
            write = max(g[name][0] for g in gathered) / 1e3
            read = max(g[name][1] for g in gathered) / 1e3
            print("| %s | %.1f | %.1f |" % (name, write, read))
        ratio = max(g["plain"][0] for g in gathered) / reference
        print("reference: a write nobody else reads: %.1f us; plain write-after-read is %.1fx "
              "that (about 3x: cores close; 10x and more: far apart)" % (reference / 1e3, ratio))
    win.Free()


if __name__ == "__main__":
    main()
