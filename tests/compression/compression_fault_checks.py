"""Faults in compressed all-reduce, run inside MPI jobs
(tests/compression/test_compression_faults.py): NaN and inf with ``nonfinite="raise"``
and ``"warn"``, and tampered sparse payloads. Every rank knows every rank's
inputs (same seeds) and checks its own outcome against an independent numpy
model; residuals are read through the workspace the strategy was handed."""
import sys
import warnings

import numpy as np
from mpi4py import MPI

import commlib
from commlib import errors
from commlib.compression import BF16, FP16, Threshold, TopK
from commlib.ops.arrays import array_module
from compression_checks import select_threshold, select_topk

WORLD = MPI.COMM_WORLD
LAYOUTS = {"single": [(1000,)], "fused": [(7,), (30, 3), (200,)]}   # one unit each
NAN, INF = float("nan"), float("inf")


def recording(cls):
    """``cls`` keeping the workspace of its last call, and, on rank
    ``tamper_rank``, passing its selection through ``tamper(indices,
    values, n)``."""
    class Recording(cls):
        workspace = tamper = None
        tamper_rank = -1

        def reduce(self, bucket):
            self.workspace = bucket.state
            return super().reduce(bucket)

        def reduce_all(self, buckets, state):
            # the layouts are one unit each: its state holds the residual
            self.workspace = buckets[0].state
            return super().reduce_all(buckets, state)

        def select(self, acc):
            indices, values = super().select(acc)
            if self.tamper is not None and WORLD.rank == self.tamper_rank:
                return self.tamper(indices, values, acc.size)
            return indices, values
    return Recording


class Setup:
    """Arrays of one layout on this rank, every rank's inputs, and a numpy
    model of every rank's residual for a sparse ``strategy``."""

    def __init__(self, comm, xp, to_host, layout, strategy=None, select=None):
        self.comm, self.xp, self.to_host = comm, xp, to_host
        self.shapes = LAYOUTS[layout]
        self.n = sum(int(np.prod(s)) for s in self.shapes)
        self.arrays = [xp.zeros(s, dtype=np.float32) for s in self.shapes]
        self.strategy, self.select = strategy, select
        self.residual = [np.zeros(self.n, np.float32) for _ in range(comm.size)]

    def inputs(self, seed, faults=(), integers=False):
        """Every rank's flat inputs; ``faults``: (rank, position, value)."""
        rng = np.random.default_rng(seed)
        if integers:
            grads = [rng.integers(-8, 9, self.n).astype(np.float32) for _ in range(self.comm.size)]
        else:
            grads = [(rng.standard_normal(self.n) * (r + 1)).astype(np.float32)
                     for r in range(self.comm.size)]
        for r, pos, value in faults:
            grads[r][pos] = value
        flat = grads[self.comm.rank]
        start = 0
        for a in self.arrays:
            a[...] = self.xp.asarray(flat[start:start + a.size].reshape(a.shape))
            start += a.size
        return grads

    def got(self):
        return np.concatenate([self.to_host(a).reshape(-1) for a in self.arrays])

    def snapshot(self):
        """Bytes of the arrays and of the residual the strategy keeps."""
        ws = self.strategy.workspace if self.strategy is not None else None
        res = b"" if not ws or "residual" not in ws else self.to_host(ws["residual"]).tobytes()
        return self.got().tobytes(), res

    def expect(self, grads, op, chosen=None):
        """The sparse model: (result, dropped counts, new residuals)."""
        out = np.zeros(self.n, np.float32)
        counts, new = [], []
        for r, grad in enumerate(grads):
            with np.errstate(over="ignore", invalid="ignore"):
                acc = self.residual[r] + grad if self.strategy.error_feedback else grad.copy()
            bad = ~np.isfinite(acc)
            counts.append(int(bad.sum()))
            acc[bad] = 0
            sel = self.select(acc)
            if chosen is not None and r in chosen:
                sel = chosen[r](sel)
            out[sel] += acc[sel]
            acc[sel] = 0
            new.append(acc if self.strategy.error_feedback else self.residual[r])
        if op == "avg":
            out *= np.float32(1.0 / self.comm.size)
        return out, counts, new

    def clean_step(self, seed, op, chosen=None):
        """A call without faults: exact model result on every rank."""
        grads = self.inputs(seed)
        want, _, new = self.expect(grads, op, chosen)
        self.comm.all_reduce(self.arrays, op=op, compression=self.strategy)
        assert self.got().tobytes() == want.tobytes(), (self.strategy, seed, op)
        self.residual = new
        return want


def expect_raise(exc_type, call, *fragments):
    try:
        call()
    except exc_type as exc:
        assert type(exc) is exc_type, (type(exc).__name__, exc_type.__name__, str(exc))
        for f in fragments:
            assert f in str(exc), (f, str(exc))
        return exc
    raise AssertionError("%s not raised (expected %s)" % (exc_type.__name__, fragments))


def counted(faults, size):
    counts = [0] * size
    for r, _, _ in faults:
        counts[r] += 1
    return counts


def ranks_text(counts):
    return [("rank %d (%d value" % (r, c)) for r, c in enumerate(counts) if c]


def fault_sets(size):
    """NaN / inf on the last rank only, then on several ranks."""
    last = size - 1
    return [[(last, 5, NAN)], [(0, 1, INF), (0, 2, NAN), (last, 7, -INF)]]


def check_sparse_raise(comm, xp, to_host, cls, args, select, op, layout):
    s = Setup(comm, xp, to_host, layout, recording(cls)(*args), select)
    s.clean_step(1, op)
    for k, faults in enumerate(fault_sets(comm.size)):
        grads = s.inputs(10 + k, faults)
        before = s.snapshot()
        counts = counted(faults, comm.size)
        assert s.expect(grads, op)[1] == counts
        exc = expect_raise(errors.NonFiniteError,
                           lambda: comm.all_reduce(s.arrays, op=op, compression=s.strategy),
                           "rank %d: compression %s" % (comm.rank, s.strategy.name),
                           "nothing was written", *ranks_text(counts))
        assert exc.counts == tuple(counts), (exc.counts, counts)
        assert exc.culprits == tuple(r for r, c in enumerate(counts) if c), exc.culprits
        assert s.snapshot() == before, "arrays or residual changed by a failed call"
        s.clean_step(20 + k, op)             # the model's residual is as it was: exact


def check_sparse_warn(comm, xp, to_host, cls, args, select, op, layout):
    s = Setup(comm, xp, to_host, layout, recording(cls)(*args, nonfinite="warn"), select)
    s.clean_step(1, op)
    for k, faults in enumerate(fault_sets(comm.size)):
        grads = s.inputs(30 + k, faults)
        want, counts, new = s.expect(grads, op)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            comm.all_reduce(s.arrays, op=op, compression=s.strategy)
        caught = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        assert len(caught) == 1, caught
        for f in ranks_text(counts) + ["dropped NaN and inf"]:
            assert f in caught[0], (f, caught[0])
        assert s.got().tobytes() == want.tobytes(), (s.strategy, faults)
        s.residual = new
        if s.strategy.error_feedback:
            res = to_host(s.strategy.workspace["residual"])
            assert res.tobytes() == new[comm.rank].tobytes()
            for r, pos, _ in faults:
                if r == comm.rank:
                    assert res[pos] == 0 and not np.signbit(res[pos]), res[pos]
        # the coordinate still travels: a large value there is sent and summed
        r, pos, _ = faults[0]
        grads = s.inputs(40 + k, [(r, pos, 1e4)])
        want, _, s.residual = s.expect(grads, op)
        comm.all_reduce(s.arrays, op=op, compression=s.strategy)
        got = s.got()
        assert got.tobytes() == want.tobytes() and abs(got[pos]) > 1e3 / comm.size, got[pos]


def check_half(comm, xp, to_host, strategy_cls, mode, op, layout):
    """Integer inputs: half-precision sums are exact in any order."""
    s = Setup(comm, xp, to_host, layout)
    strategy = strategy_cls(nonfinite=mode)
    fmt = "float16" if strategy_cls is FP16 else "bfloat16"
    for k, faults in enumerate(fault_sets(comm.size)):
        grads = s.inputs(50 + k, faults, integers=True)
        before = s.got().tobytes()
        counts = counted(faults, comm.size)
        call = lambda: comm.all_reduce(s.arrays, op=op, compression=strategy)  # noqa: E731
        with np.errstate(invalid="ignore"):
            total = sum(grads)
        if mode == "raise":
            exc = expect_raise(errors.NonFiniteError, call, "reduced %s result" % fmt,
                               "nothing was written", *ranks_text(counts))
            assert exc.counts == tuple(counts) and exc.culprits == tuple(
                r for r, c in enumerate(counts) if c), (exc.counts, exc.culprits)
            assert s.got().tobytes() == before, "arrays changed by a failed call"
        else:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                call()
            caught = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
            assert len(caught) == 1 and all(f in caught[0] for f in ranks_text(counts)), caught
            got, bad = s.got(), ~np.isfinite(total)
            assert (~np.isfinite(got) == bad).all(), (got[bad], total[bad])
            want = total * np.float32(1.0 / comm.size) if op == "avg" else total
            assert (got[~bad] == want[~bad]).all()
        grads = s.inputs(60 + k, integers=True)        # then a clean call is exact
        comm.all_reduce(s.arrays, op="sum", compression=strategy)
        assert s.got().tobytes() == sum(grads).tobytes()


def check_half_units(comm, xp, to_host, strategy_cls):
    """A call of three units (each array above the bucket size), NaN in the
    middle one on the last rank, ``"raise"``: every rank raises naming it,
    the middle array is unchanged and the other two hold their exact sums
    (each unit is written unless its own result holds NaN or inf)."""
    n = 20000                                            # 80 KB: a unit of its own
    rng = np.random.default_rng(70)
    grads = [[rng.integers(-8, 9, n).astype(np.float32) for _ in range(3)]
             for _ in range(comm.size)]
    grads[comm.size - 1][1][123] = NAN
    arrays = [xp.array(g) for g in grads[comm.rank]]         # copies: grads stay the inputs
    before = to_host(arrays[1]).tobytes()
    counts = [0] * (comm.size - 1) + [1]
    exc = expect_raise(errors.NonFiniteError,
                       lambda: comm.all_reduce(arrays, op="sum", compression=strategy_cls()),
                       "nothing was written", *ranks_text(counts))
    assert exc.counts == tuple(counts), exc.counts
    assert to_host(arrays[1]).tobytes() == before, "the failed unit was written"
    for i in (0, 2):
        want = sum(g[i] for g in grads)
        assert to_host(arrays[i]).tobytes() == want.tobytes(), "unit %d not written" % i


# --- tampered payloads -------------------------------------------------------------

def _set(a, j, value):
    a = a.copy()
    a[j] = value
    return a


def _append(i, v, n):
    free = int(np.setdiff1d(np.arange(n), np.asarray(i.tolist()))[0])
    xp = array_module(i)
    return (xp.concatenate([i, xp.asarray([free], dtype=i.dtype)]),
            xp.concatenate([v, xp.asarray([1.0], dtype=v.dtype)]))


def _too_many(i, v, n):
    xp = array_module(i)
    return xp.arange(n + 1, dtype=xp.int32) % n, xp.ones(n + 1, dtype=xp.float32)


# name: (tamper(indices, values, n), message fragment (``{n}``: bucket length), strategies)
BOTH = ("topk", "threshold")
TAMPERS = {
    "high": (lambda i, v, n: (_set(i, 0, n + 17), v), "index {big} outside [0, {n})", BOTH),
    "negative": (lambda i, v, n: (_set(i, 0, -5), v), "index -5 outside [0, {n})", BOTH),
    "padding value": (lambda i, v, n: (_set(i, -1, -1), _set(v, -1, 2.5)),
                      "padding index -1 with value 2.5", BOTH),
    "duplicate": (lambda i, v, n: (_set(i, 1, i[0]), v), "2 times", BOTH),
    "int64": (lambda i, v, n: (i.astype(np.int64), v),
              "indices of dtype int64 (expected int32)", BOTH),
    "float64": (lambda i, v, n: (i, v.astype(np.float64)),
                "values of dtype float64 (expected float32)", BOTH),
    "2-D": (lambda i, v, n: (i.reshape(1, -1), v), "indices that are not a 1-D array", BOTH),
    "lengths": (lambda i, v, n: (i, v[:-1]), "indices but", BOTH),
    "nan value": (lambda i, v, n: (i, _set(v, 0, NAN)), "non-finite value nan", BOTH),
    "fewer": (lambda i, v, n: (i[:-1], v[:-1]), "entries where every rank sends", ("topk",)),
    "more": (_append, "entries where every rank sends", ("topk",)),
    "too many": (_too_many, "an entry count of {big1} outside [0, {n}]", ("threshold",)),
}


def check_tampered(comm, xp, to_host, cls, args, select, layout, which):
    """Each tamper of ``which`` ("topk" or "threshold") on rank 1 (rank 0
    alone): PayloadError on every rank naming it, nothing written; then
    clean calls stay exact. Two culprits at 3 ranks or more."""
    s = Setup(comm, xp, to_host, layout, recording(cls)(*args), select)
    s.clean_step(1, "sum")
    culprit = min(1, comm.size - 1)
    s.strategy.tamper_rank = culprit
    for k, (name, (tamper, fragment, applies)) in enumerate(TAMPERS.items()):
        if which not in applies:
            continue
        s.inputs(70 + k)
        before = s.snapshot()
        s.strategy.tamper = tamper
        fragment = fragment.format(n=s.n, big=s.n + 17, big1=s.n + 1)
        exc = expect_raise(errors.PayloadError,
                           lambda: comm.all_reduce(s.arrays, op="sum", compression=s.strategy),
                           "rank %d: compression %s" % (comm.rank, s.strategy.name),
                           "rank %d sent" % culprit, fragment, "nothing was written")
        assert exc.culprits == (culprit,), (name, exc.culprits)
        assert s.snapshot() == before, "arrays or residual changed: " + name
        s.strategy.tamper = None
        s.clean_step(80 + k, "sum")
    # valid but unusual: descending order (the sort path), padding in place of an entry
    s.strategy.tamper = lambda i, v, n: (i[::-1].copy(), v[::-1].copy())
    s.clean_step(90, "avg")
    if which == "topk":
        s.strategy.tamper = lambda i, v, n: (_set(i, -1, -1), _set(v, -1, 0.0))
        s.clean_step(91, "sum", chosen={culprit: lambda sel: sel[:-1]})
    s.strategy.tamper = None
    s.clean_step(92, "sum")
    if comm.size >= 3:      # two culprits, two problems: both named
        s.strategy.tamper_rank = -1
        s.inputs(93)
        before = s.snapshot()
        s.strategy.tamper = TAMPERS["high" if comm.rank == 1 else "duplicate"][0]
        s.strategy.tamper_rank = comm.rank if comm.rank in (1, 2) else -1
        exc = expect_raise(errors.PayloadError,
                           lambda: comm.all_reduce(s.arrays, op="sum", compression=s.strategy),
                           "rank 1 sent index %d outside" % (s.n + 17), "; rank 2 sent index ")
        assert exc.culprits == (1, 2) and s.snapshot() == before, exc.culprits
        s.strategy.tamper = None
        s.clean_step(94, "sum")


SPARSE = [("topk", TopK, (0.05,), lambda acc: select_topk(acc, 0.05)),
          ("threshold", Threshold, (1.5,), lambda acc: select_threshold(acc, 1.5))]


def main(which, device):
    if device == "cupy":
        import cupy
        xp, to_host = cupy, (lambda a: a.get())
        comm = commlib.Communicator.from_mpi(bucket_bytes=64 << 10)
    else:
        xp, to_host = np, (lambda a: a)
        comm = commlib.Communicator.from_mpi(backend="mpi", bucket_bytes=64 << 10)
    if which == "nonfinite":
        for layout in LAYOUTS:
            for tag, cls, args, select in SPARSE:
                check_sparse_raise(comm, xp, to_host, cls, args, select, "avg", layout)
                check_sparse_warn(comm, xp, to_host, cls, args, select, "sum", layout)
            check_sparse_raise(comm, xp, to_host, TopK, (0.05, False),
                               lambda acc: select_topk(acc, 0.05), "sum", layout)
            check_sparse_warn(comm, xp, to_host, Threshold, (1.5, False),
                              lambda acc: select_threshold(acc, 1.5), "avg", layout)
        for cls in (FP16, BF16):
            for layout in LAYOUTS:
                for mode in ("raise", "warn"):
                    check_half(comm, xp, to_host, cls, mode, "sum", layout)
                check_half(comm, xp, to_host, cls, "raise", "avg", layout)
            check_half_units(comm, xp, to_host, cls)
    else:
        for tag, cls, args, select in SPARSE:
            for layout in LAYOUTS:
                check_tampered(comm, xp, to_host, cls, args, select, layout, tag)
    comm.close()
    print("faults %s rank %d ok" % (which, WORLD.rank))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
