"""A kernel that keeps the GPU busy for a given time, for the GPU
benchmarks: queued ahead of a timed call, it lets the host-side work of
launching the call overlap GPU time, so that device time and host time can
be told apart."""

SOURCE = r"""
extern "C" __global__ void commlib_bench_spin(long long ns) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < (unsigned long long)ns);
}
"""


def spin_kernel(cupy):
    """The compiled spin kernel: ``kernel((1,), (1,), (nanoseconds,))``."""
    return cupy.RawKernel(SOURCE, "commlib_bench_spin")
