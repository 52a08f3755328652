"""A compression strategy written outside commlib, against its documented
interface only (commlib.compression.Compression and Bucket): every rank
sends its bucket as 8-bit codes with a scale of its own; the codes of all
ranks are gathered and summed in rank order. numpy arrays only."""
import numpy as np

from commlib.compression import Compression
from commlib.errors import ArgumentError


class Int8(Compression):
    """8-bit quantisation, one scale per rank and bucket (no error feedback)."""

    name = "user-int8"

    def applies_to(self, dtype):
        return dtype == np.float32

    def check(self, op, rank):
        if op != "sum":
            raise ArgumentError("rank %d: Int8 serves sum and avg only, got op=%r" % (rank, op))

    @staticmethod
    def encode(flat):
        """(step, int8 codes) of a float32 vector: codes * step ~ flat."""
        peak = float(np.abs(flat).max()) if flat.size else 0.0
        step = peak / 127.0 if peak > 0 else 1.0
        return step, np.clip(np.rint(flat / step), -127, 127).astype(np.int8)

    def reduce(self, bucket):
        flat = np.concatenate([a.reshape(-1) for a in bucket.arrays])
        step, codes = self.encode(flat)
        payload = np.empty(8 + flat.size, np.uint8)
        payload[:8] = np.frombuffer(np.float64(step).tobytes(), np.uint8)
        payload[8:] = codes.view(np.uint8)
        table = np.empty(bucket.size * payload.size, np.uint8)
        bucket.all_gather(payload, table)
        total = np.zeros(flat.size, np.float64)
        for row in table.reshape(bucket.size, payload.size):
            total += row[8:].view(np.int8) * row[:8].view(np.float64)[0]
        if bucket.scale is not None:
            total *= bucket.scale
        start = 0
        for a in bucket.arrays:
            a.reshape(-1)[...] = total[start:start + a.size]
            start += a.size
        bucket.state["calls"] = bucket.state.get("calls", 0) + 1


class Int8Deferred(Int8):
    """Int8 in the form of a DDP hook that returns a future: ``reduce``
    communicates and reduces into copies of the arrays, and returns the
    bucket's completion, which writes them. ``log`` (a list) records
    ``("issue", i)`` and ``("complete", i)`` for the i-th bucket this object
    reduced."""

    name = "user-int8-deferred"

    def __init__(self, log):
        self.log = log

    def reduce(self, bucket):
        index = sum(1 for event, _ in self.log if event == "issue")
        arrays = bucket.arrays
        staged = bucket.arrays = [a.copy() for a in arrays]
        try:
            super().reduce(bucket)
        finally:
            bucket.arrays = arrays
        self.log.append(("issue", index))

        def complete():
            for a, result in zip(arrays, staged):
                a[...] = result
            self.log.append(("complete", index))
        return complete


def expected(per_rank_flat, scale):
    """What Int8 gives, computed apart: each rank's codes and step, summed
    in rank order in float64, scaled, as float32."""
    total = np.zeros(per_rank_flat[0].size, np.float64)
    for flat in per_rank_flat:
        step, codes = Int8.encode(flat)
        total += codes * step
    if scale is not None:
        total *= scale
    return total.astype(np.float32)
