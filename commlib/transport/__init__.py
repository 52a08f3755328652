"""Transports: the layer that moves flat buffers between ranks.

One class per transport (:class:`MpiTransport`, :class:`NcclTransport`),
both implementing :class:`Transport`. Everything above (validation,
bucketing, scaling, consistency checks) is shared.
"""
from .base import Transport

__all__ = ["Transport"]
