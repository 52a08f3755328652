"""Transports: the layer that moves flat buffers between ranks.

One class per transport (MPI, shared memory, NCCL, threads, one process),
each implementing :class:`Transport`. Everything above (validation,
bucketing, scaling, consistency checks) is shared.
"""
from .base import Transport

__all__ = ["Transport"]
