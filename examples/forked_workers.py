"""Data-parallel workers started with multiprocessing, sharing an NCCL ID (GPUs only).

    python examples/forked_workers.py [--nprocs N] [--steps S]

The parent process makes one ``commlib.NcclId`` and starts N processes
(``multiprocessing``, "spawn" start method, so that no CUDA state is
inherited); the ID pickles into each of them, and process r calls
``Communicator.from_nccl_id(nid, r, N)`` on GPU r. No MPI is involved. The
workers fit a linear model y = X @ w by least squares, each on its own
generated shard of (X, y) as cupy float32 arrays, averaging gradients with
``comm.all_reduce([grad], division=True)``. At the end every worker checks
that all ranks hold the same w, and rank 0 prints the distance to the true w.

If a worker fails, the parent terminates the others (peers blocked in an NCCL
collective would otherwise wait forever) and exits with status 1. Without
cupy, NCCL and a GPU the script exits at once with status 1 and says why.
"""
import argparse
import multiprocessing
import multiprocessing.connection
import sys

import numpy as np

import commlib

N_FEATURES = 64
SAMPLES_PER_WORKER = 4096


def worker(nid, rank, size, steps, lr):
    """One data-parallel worker on GPU ``rank``; raises on any failure."""
    import cupy
    with commlib.Communicator.from_nccl_id(nid, rank, size, device=rank) as comm:
        cupy.cuda.Device(comm.device).use()
        true_w = cupy.asarray(np.random.default_rng(0).normal(size=N_FEATURES), cupy.float32)
        rng = cupy.random.default_rng(1 + rank)  # this worker's shard
        x = rng.standard_normal((SAMPLES_PER_WORKER, N_FEATURES), dtype=cupy.float32)
        y = x @ true_w + 0.01 * rng.standard_normal(SAMPLES_PER_WORKER, dtype=cupy.float32)
        w = cupy.zeros(N_FEATURES, cupy.float32)
        for _ in range(steps):
            grad = 2.0 / len(y) * (x.T @ (x @ w - y))  # d mean squared error / dw
            comm.all_reduce([grad], division=True)
            w -= lr * grad
        gathered = comm.all_gather(w)  # (size, N_FEATURES)
        if not bool((gathered == gathered[0]).all()):
            raise RuntimeError("rank %d: parameters differ across ranks" % rank)
        if rank == 0:
            print("%d workers, %d steps: |w - w_true| = %.2e, parameters identical on all ranks"
                  % (size, steps, float(cupy.linalg.norm(w - true_w))), flush=True)


def run_all(nid, nprocs, steps, lr):
    """Start the workers, end them all as soon as one fails; returns the exit status."""
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(nid, r, nprocs, steps, lr), name="rank%d" % r)
             for r in range(nprocs)]
    for p in procs:
        p.start()
    running = list(procs)
    while running:
        for sentinel in multiprocessing.connection.wait([p.sentinel for p in running]):
            p = next(p for p in running if p.sentinel == sentinel)
            p.join()
            running.remove(p)
            if p.exitcode != 0:
                print("forked_workers.py: %s failed (exit code %s); terminating the others"
                      % (p.name, p.exitcode), file=sys.stderr, flush=True)
                for q in running:
                    q.terminate()
                for q in running:
                    q.join()
                return 1
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nprocs", type=int, default=None, help="workers (default: all GPUs)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args(argv)
    try:
        nid = commlib.NcclId()
    except commlib.BackendUnavailableError as exc:
        sys.exit("forked_workers.py needs cupy with NCCL and a CUDA GPU: %s" % exc)
    import cupy
    gpus = cupy.cuda.runtime.getDeviceCount()
    nprocs = gpus if args.nprocs is None else args.nprocs
    if not 1 <= nprocs <= gpus:
        parser.error("--nprocs must be between 1 and the %d visible GPUs" % gpus)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    return run_all(nid, nprocs, args.steps, args.lr)


if __name__ == "__main__":
    sys.exit(main())
