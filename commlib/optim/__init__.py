"""The training-step layer: :class:`DistributedOptimizer` (average the
gradients over the ranks, overlapped with the backward pass, then apply an
update rule), the rules :class:`SGD` and :class:`Adam`, parameter broadcast
and consistency checks, data partitioning, and checkpoints.

    opt = commlib.DistributedOptimizer(comm, params, commlib.optim.SGD(0.1, momentum=0.9))
    opt.broadcast_parameters()
    for batch in batches:
        backward(params, batch, out=opt.grads)     # calling opt.grad_ready(i) as they finish
        opt.step()
"""
from .distributed_optimizer import DistributedOptimizer
from .parameters import broadcast_parameters, check_parameters
from .partition import partition
from .rules import SGD, Adam, Rule
from .state import load, save

__all__ = ["DistributedOptimizer", "SGD", "Adam", "Rule", "broadcast_parameters",
           "check_parameters", "partition", "save", "load"]
