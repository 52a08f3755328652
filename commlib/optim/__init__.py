"""The training-step layer: :class:`DistributedOptimizer` (average the
gradients over the ranks, overlapped with the backward pass, then apply an
update rule per parameter group), the rules :class:`SGD`, :class:`Adam`,
:class:`AdamW` and :class:`LAMB`, learning-rate schedules, a dynamic loss
scaler, a distributed sampler, parameter broadcast and consistency checks,
data partitioning, and checkpoints.

    opt = commlib.DistributedOptimizer(comm, params, commlib.optim.SGD(0.1, momentum=0.9))
    opt.broadcast_parameters()
    for batch in batches:
        backward(params, batch, out=opt.grads)     # calling opt.grad_ready(i) as they finish
        opt.step()
"""
from .distributed_optimizer import DistributedOptimizer
from .lr_scheduler import (CosineAnnealingLR, ExponentialLR, LambdaLR, LinearLR, LinearWarmup,
                           LRScheduler, SequentialLR, StepLR)
from .parameters import broadcast_parameters, check_parameters
from .partition import partition
from .rules import LAMB, SGD, Adam, AdamW, Rule
from .sampler import DistributedSampler
from .scaler import DynamicLossScaler
from .state import load, save

__all__ = ["DistributedOptimizer", "SGD", "Adam", "AdamW", "LAMB", "Rule",
           "LRScheduler", "LambdaLR", "StepLR", "ExponentialLR", "CosineAnnealingLR", "LinearLR",
           "LinearWarmup", "SequentialLR", "DynamicLossScaler", "DistributedSampler",
           "broadcast_parameters", "check_parameters", "partition", "save", "load"]
