"""Array kernels: one module per kernel, each with a CUDA path (a RawKernel
from ``kernels/*.cu``) and a numpy twin of the same semantics.

Every public function takes numpy or cupy arrays; numpy inputs run the numpy
twin, cupy inputs run the CUDA kernel.
"""
