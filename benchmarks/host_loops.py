"""The compiled host loops of the shared-memory path, one process: the
share's reduction (float32, and the half formats with this rank's float32
share cast inside it) and the casts to and from the half formats, beside a
numpy copy of the same float32 bytes (the least a pass over them costs).

    python benchmarks/host_loops.py                  # one window (1M elements), 2 and 4 ranks
    python benchmarks/host_loops.py --elements 4M --repeats 61

Slots stand for the other ranks' shared memory (plain numpy arrays); the
reduction covers the whole range as rank 1, as one rank's share would.
Times are the median of the repeats, in ns per element; "x copy" divides by
the float32 copy's time measured in the same run. "check" compares each
loop's output once, bit for bit, with the numpy twins
(``commlib.ops.hostcast.numpy_cast_into`` and ``numpy_reduce_into``); a
failed check prints FAIL and makes the exit status 1.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # prefer the checkout's commlib
from commlib.ops import hostcast, hostreduce, native  # noqa: E402

SCALE = np.float32(0.5)


def parse_size(text):
    units = {"K": 1 << 10, "M": 1 << 20}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def median_ns(call, n, repeats):
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) / n * 1e9


def twin_share(own, slots, storage, scale):
    """The numpy twins' rank-order sum with ``own`` (float32, times
    ``scale``, rounded to the slots' format) as rank 1's contribution."""
    mine = np.empty(own.size, storage)
    hostcast.numpy_cast_into(own, mine, scale)
    parts = [slots[0], mine] + list(slots[2:])
    want = parts[0].copy()
    for part in parts[1:]:
        hostcast.numpy_reduce_into(part, want, "sum")
    return want


def rows_for(n, reps, rng):
    """``[(loop, ns per element, check)]``, the copy first."""
    own = rng.standard_normal(n).astype(np.float32)
    out32 = np.empty_like(own)
    rows = [("numpy float32 copy", median_ns(lambda: np.copyto(out32, own), n, reps),
             out32.tobytes() == own.tobytes())]
    for ranks in (2, 4):
        slots32 = tuple(rng.standard_normal(n).astype(np.float32) for _ in range(ranks))
        mine = own.copy()                       # the float32 reduction writes it back
        time_ns = median_ns(lambda: hostreduce.reduce_share(
            [mine], slots32, 1, out32, 0, n, "sum"), n, reps)
        mine[...] = own
        hostreduce.reduce_share([mine], slots32, 1, out32, 0, n, "sum")
        want = slots32[0] + own
        for slot in slots32[2:]:
            want = want + slot
        rows.append(("reduce_share float32, %d ranks" % ranks, time_ns,
                     out32.tobytes() == want.tobytes()))
        for fmt, storage in (("float16", np.float16), ("bfloat16", np.uint16)):
            slots = tuple(np.empty(n, storage) for _ in range(ranks))
            for slot in slots:
                hostcast.numpy_cast_into(rng.standard_normal(n).astype(np.float32), slot)
            out = np.empty(n, storage)
            bits = "bfloat16" if fmt == "bfloat16" else None

            def share():
                hostreduce.reduce_share([own], slots, 1, out, 0, n, "sum", None, False, bits,
                                        cast_own=SCALE)

            time_ns = median_ns(share, n, reps)
            rows.append(("reduce_share %s, own share cast inside, %d ranks" % (fmt, ranks),
                         time_ns, out.tobytes() == twin_share(own, slots, storage,
                                                              SCALE).tobytes()))
    for fmt, storage in (("float16", np.float16), ("bfloat16", np.uint16)):
        half, want = np.empty(n, storage), np.empty(n, storage)
        time_ns = median_ns(lambda: hostcast.cast_into(own, half, SCALE), n, reps)
        hostcast.numpy_cast_into(own, want, SCALE)
        rows.append(("cast float32 to %s" % fmt, time_ns, half.tobytes() == want.tobytes()))
        wide = np.empty(n, np.float32)
        time_ns = median_ns(lambda: hostcast.cast_into(half, out32), n, reps)
        hostcast.numpy_cast_into(half, wide)
        rows.append(("cast %s to float32" % fmt, time_ns, out32.tobytes() == wide.tobytes()))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--elements", default="1M", type=parse_size)
    p.add_argument("--repeats", default=31, type=int)
    args = p.parse_args(argv)
    if not native.available():
        sys.exit("the compiled host loops are not built: python setup.py build_ext --inplace")
    rows = rows_for(args.elements, args.repeats, np.random.default_rng(0))
    copy = rows[0][1]
    print("%d elements, median of %d\n" % (args.elements, args.repeats))
    print("| loop | ns per element | x copy | check |\n| --- | --- | --- | --- |")
    for name, ns, ok in rows:
        print("| %s | %.3f | %.2f | %s |" % (name, ns, ns / copy, "ok" if ok else "FAIL"))
    return 0 if all(ok for _, _, ok in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
