"""The hierarchical all-reduce across nodes joined by a shaped link:
commlib (shared memory within a node, each rank's share across nodes)
beside commlib over flat MPI and beside MPICH's own ``Allreduce`` of one
flat buffer, in the same run.

    python benchmarks/hierarchical.py                       # 2x2, 1 Gbit/s, resnet50
    python benchmarks/hierarchical.py --layout 2x3 --rate 10gbit --repeats 5 --json out.json

The job runs on ``--layout`` nodes x ranks per node of tests/nodes.py
(each node a network namespace with one ``eth0`` on a bridge; MPICH talks
TCP between nodes, shared memory within one). Before timing, local rank 0
of every node shapes its ``eth0``'s egress with a token bucket (``tc
qdisc replace dev eth0 root tbf rate R``, burst the larger of 64 KiB and
1 ms at R, MTU 1500), so every node sends at most R bits/s, and every byte
a node receives was shaped by its sender. Needs root (or what
tests/nodes.py needs) and ``tc``; exits with status 2 and says why where
they are missing.

Methods, interleaved in every repeat after a barrier, over the gradient
list of ``--workload`` (benchmarks/workloads/<name>.json, float32):

- ``commlib``: ``comm.all_reduce(grads)`` on the default communicator
  (the hierarchical transport where several nodes hold several ranks);
- ``commlib flat``: the same on a communicator made with
  ``COMMLIB_SHM=0`` (flat MPI across every rank);
- ``MPICH Allreduce``: ``Allreduce(IN_PLACE, buf)`` of one flat float32
  buffer of the same bytes (packing not timed);
- ``TCP, the same bytes`` (2 nodes only): no all-reduce, the link's
  practical limit: each rank and the rank of its local rank on the other
  node send each other 1/L of the buffer over one TCP connection at once,
  so each node sends and receives the buffer's bytes, what the bound
  counts ("median / TCP" compares every method with it).

Where the job's ranks outnumber this machine's cores (the nodes are
emulated on one machine, and a node's ranks cannot see the others'),
``COMMLIB_WAIT=sleep`` is set for them unless it is set already: a rank
spinning while it waits would take the core that another node's rank, or
the kernel's TCP work, needs (2x2 on 2 cores at 1 Gbit/s: commlib 1.51 s
spinning, 1.03 s sleeping).

After the timing both commlib communicators' results on fresh inputs are
compared with MPICH's (float32 tolerance); a difference ends the job.

Columns: the median seconds per all-reduce (slowest rank), the bytes each
node's ``eth0`` sent per all-reduce (``/proc/net/dev``, the most of any
node, headers included), and the link's bound: with ``N`` nodes of one
link of ``R`` bits/s each, an all-reduce of ``B`` bytes makes every node
send and receive at least ``2 (N - 1) / N * B`` (each node's data must
leave it reduced with the others' ``(N-1)/N`` of it, and the others'
results come back: reduce-scatter and all-gather among the nodes), so it
takes at least ``2 (N - 1) / N * B * 8 / R`` seconds, TCP/IP and Ethernet
headers (about 4% at MTU 1500) not counted.
"""
import argparse
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

CODE = r"""
import json, os, subprocess, sys, time
import numpy as np
from mpi4py import MPI
import commlib

rate, burst, repeats, warmup, workload = sys.argv[1:6]
repeats, warmup = int(repeats), int(warmup)
world = MPI.COMM_WORLD
comm = commlib.init()
os.environ["COMMLIB_SHM"] = "0"
flat = commlib.Communicator.from_mpi()
del os.environ["COMMLIB_SHM"]
if comm.local_rank == 0:
    subprocess.run(["tc", "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", rate,
                    "burst", burst, "latency", "200ms"], check=True, timeout=30)
world.Barrier()

shapes = json.load(open(workload))["shapes"]
rng = np.random.default_rng(comm.rank)
grads = [rng.standard_normal(s).astype(np.float32) for s in shapes]
buf = np.concatenate([g.reshape(-1) for g in grads])


def sent():
    for line in open("/proc/net/dev"):
        name, _, fields = line.partition(":")
        if name.strip() == "eth0":
            return int(fields.split()[8])
    raise RuntimeError("no eth0 here")


METHODS = {"commlib": lambda: comm.all_reduce(grads),
           "commlib flat": lambda: flat.all_reduce(grads),
           "MPICH Allreduce": lambda: world.Allreduce(MPI.IN_PLACE, buf)}


def tcp_pair():
    # at 2 nodes: this rank's TCP connection to the rank of its local rank on
    # the other node, and its 1/L of the buffer's bytes to send both ways at
    # once: the bytes the link must carry each way, with no MPI
    import socket, threading
    node, port = comm.rank // comm.local_size, 47000 + comm.local_rank
    if node == 0:
        server = socket.socket()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("10.250.0.1", port))
        server.listen(1)
        world.Barrier()
        conn, _ = server.accept()
        server.close()
    else:
        world.Barrier()
        conn = socket.create_connection(("10.250.0.1", port), timeout=60)
    share = buf.view(np.uint8)[:buf.nbytes // comm.local_size].copy()
    got = memoryview(np.empty_like(share))

    def exchange():
        sender = threading.Thread(target=conn.sendall, args=(share,))
        sender.start()
        done = 0
        while done < len(got):
            done += conn.recv_into(got[done:])
        sender.join()
    return exchange


if world.Get_size() == 2 * comm.local_size:
    METHODS["TCP, the same bytes"] = tcp_pair()
times = {m: [] for m in METHODS}
tx = {m: 0 for m in METHODS}
for k in range(warmup + repeats):
    for name, call in METHODS.items():
        world.Barrier()
        before = sent()
        start = time.perf_counter()
        call()
        took = time.perf_counter() - start
        slowest = world.allreduce(took, op=MPI.MAX)
        world.Barrier()
        if k >= warmup:
            times[name].append(slowest)
            tx[name] += sent() - before
# the results: commlib's (both) beside MPICH's on fresh inputs, at float32's tolerance
fresh = [rng.standard_normal(s).astype(np.float32) for s in shapes]
want = np.concatenate([g.reshape(-1) for g in fresh])
world.Allreduce(MPI.IN_PLACE, want)
for c in (comm, flat):
    got = [g.copy() for g in fresh]
    c.all_reduce(got)
    np.testing.assert_allclose(np.concatenate([g.reshape(-1) for g in got]), want,
                               rtol=1e-5, atol=1e-4 * comm.size)
nodes_tx = world.allgather({m: tx[m] / repeats for m in METHODS} if comm.local_rank == 0
                           else None)
if comm.rank == 0:
    print("RESULT " + json.dumps({
        "transports": [t.name for t in comm._session.transports],
        "flat_transports": [t.name for t in flat._session.transports],
        "bytes": int(buf.nbytes), "times": times,
        "node_tx": [t for t in nodes_tx if t is not None]}), flush=True)
flat.close()
comm.close()
"""


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layout", default="2x2", help="nodes x ranks per node (default 2x2)")
    p.add_argument("--rate", default="1gbit", help="each node's link, tc units (default 1gbit)")
    p.add_argument("--workload", default="resnet50", help="benchmarks/workloads/<name>.json")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed repeats first (default 1)")
    p.add_argument("--timeout", type=float, default=600, help="the whole job's bound, seconds")
    p.add_argument("--json", help="also write the results here")
    return p.parse_args(argv)


def main(argv=None):
    from shaped_link import parse_rate
    args = parse_args(argv)
    nodes, per_node = (int(x) for x in args.layout.lower().split("x"))
    bits = parse_rate(args.rate)
    burst = max(64 * 1024, bits // 8 // 1000)
    workload = HERE / "workloads" / ("%s.json" % args.workload)
    import shutil
    import nodes as harness
    if shutil.which("tc") is None or harness.unavailable_reason():
        print("benchmarks/hierarchical.py: cannot run here: %s"
              % ("`tc` not found (install iproute2)" if shutil.which("tc") is None
                 else harness.unavailable_reason()), file=sys.stderr)
        return 2
    # the emulated nodes share this machine's cores: a node's ranks cannot
    # see the others', so the waits are told (unless the caller chose)
    env = {}
    if nodes * per_node > len(os.sched_getaffinity(0)) and "COMMLIB_WAIT" not in os.environ:
        env["COMMLIB_WAIT"] = "sleep"
    run = harness.run_nodes((nodes, per_node), CODE, timeout=args.timeout, env=env,
                            args=("%dbit" % bits, burst, args.repeats, args.warmup, workload))
    line = next(l for l in run.text.splitlines() if l.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    nbytes = result["bytes"]
    bound = 2 * (nodes - 1) / nodes * nbytes * 8 / bits
    print("%dx%d nodes x ranks, each node's link %s, %s: %d bytes (%.1f MiB) of float32; "
          "commlib's transports %s, flat %s"
          % (nodes, per_node, args.rate, args.workload, nbytes, nbytes / 2**20,
             "+".join(result["transports"]), "+".join(result["flat_transports"])))
    print("link bound 2(N-1)/N * B * 8 / R = %.3f s; COMMLIB_WAIT=%s"
          % (bound, env.get("COMMLIB_WAIT", os.environ.get("COMMLIB_WAIT", "auto"))))
    print()
    print("| method | median s | min s | MB sent per node per call | bound s | median / bound "
          "| median / TCP |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    rows = []
    tcp = result["times"].get("TCP, the same bytes")
    tcp = sorted(tcp)[len(tcp) // 2] if tcp else None
    for name, samples in result["times"].items():
        median = sorted(samples)[len(samples) // 2]
        tx = max(node[name] for node in result["node_tx"])
        rows.append(dict(method=name, median=median, min=min(samples), tx=tx))
        print("| %s | %.3f | %.3f | %.1f | %.3f | %.2f | %s |"
              % (name, median, min(samples), tx / 1e6, bound, median / bound,
                 "-" if tcp is None else "%.2f" % (median / tcp)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(vars(args), bound=bound, rows=rows, **result), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
