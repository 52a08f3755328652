"""A rank of the tracing tests: all-reduces the ResNet-50 gradient shapes
(or a part of them) plainly, in float16, with TopK and asynchronously,
then a broadcast and a barrier, with ``COMMLIB_TRACE`` set by the test.
The program marks its own work with spans (commlib.trace.span): a ``step``
around each synchronous all-reduce with a ``reduce`` inside it, a
``compute`` while the asynchronous one is in flight, a decorated ``scale``
and a ``helper`` on a thread of its own. Prints ``rank R ok {...}``: this
rank's ``stats.bytes_sent``, the collectives it made (name, seq) and the
native ids of its threads, for the test to hold the trace against."""
import json
import threading

import numpy as np

import commlib
from commlib import trace
from commlib.compression import TopK


@trace.spanned("scale", factor=0.5)
def scale(grads):
    for g in grads[:8]:
        g *= 0.5


def helper(found):
    found["helper_tid"] = threading.get_native_id()
    with trace.span("helper", job=np.int64(7)):      # args need not be JSON types
        sum(range(10000))


def main(shapes_path, arrays_wanted):
    shapes = json.loads(open(shapes_path).read())["shapes"][:int(arrays_wanted)]
    comm = commlib.init()
    rng = np.random.default_rng(comm.rank)
    grads = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    made = []
    for step, compression in enumerate((None, None, "fp16", "fp16", TopK(0.01), TopK(0.01))):
        with trace.span("step", step=step, compression=str(compression)):
            scale(grads)
            with trace.span("reduce"):
                comm.all_reduce(grads, division=True, compression=compression)
        made.append("all_reduce")
    work = comm.all_reduce(grads, division=True, async_op=True)
    with trace.span("compute"):
        sum(float(g.sum()) for g in grads[:20])
    work.wait()
    made.append("all_reduce")
    threads = {"main_tid": threading.get_native_id()}
    runner = threading.Thread(target=helper, args=(threads,), name="helper-thread")
    runner.start()
    runner.join()
    comm.broadcast(grads[:3], root=0)
    made.append("broadcast")
    comm.barrier()
    made.append("barrier")
    report = {"bytes_sent": comm.stats.bytes_sent, "collectives": made,
              "seqs": list(range(1, len(made) + 1)), **threads}
    comm.close()
    print("rank %d ok %s" % (comm.rank, json.dumps(report)), flush=True)
