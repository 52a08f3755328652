"""A rank of the tracing tests: all-reduces the ResNet-50 gradient shapes
(or a part of them) plainly, in float16, with TopK and asynchronously,
then a broadcast and a barrier, with ``COMMLIB_TRACE`` set by the test.
Prints ``rank R ok {...}``: this rank's ``stats.bytes_sent`` and the
collectives it made (name, seq), for the test to hold the trace against."""
import json

import numpy as np

import commlib
from commlib.compression import TopK


def main(shapes_path, arrays_wanted):
    shapes = json.loads(open(shapes_path).read())["shapes"][:int(arrays_wanted)]
    comm = commlib.init()
    rng = np.random.default_rng(comm.rank)
    grads = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    made = []
    for compression in (None, None, "fp16", "fp16", TopK(0.01), TopK(0.01)):
        comm.all_reduce(grads, division=True, compression=compression)
        made.append("all_reduce")
    work = comm.all_reduce(grads, division=True, async_op=True)
    work.wait()
    made.append("all_reduce")
    comm.broadcast(grads[:3], root=0)
    made.append("broadcast")
    comm.barrier()
    made.append("barrier")
    report = {"bytes_sent": comm.stats.bytes_sent, "collectives": made,
              "seqs": list(range(1, len(made) + 1))}
    comm.close()
    print("rank %d ok %s" % (comm.rank, json.dumps(report)), flush=True)
