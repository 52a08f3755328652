// Sparse accumulation: dense[idx[i]] += alpha * val[i] for the entries
// i in [start, start + count), one segment of unique indices (so no two
// threads touch the same element and the result does not depend on
// scheduling). Index -1 is padding; any other index
// outside [0, n_dense) is counted in *bad and never written. The product is
// rounded before the add (no fused multiply-add, subnormals kept), matching
// the numpy twin bit for bit.
#include "select_common.cuh"

extern "C" __global__ void __launch_bounds__(256)
scatter_add(float* dense, long long n_dense, const int* idx, const float* val, long long start,
            long long count, float alpha, unsigned long long* bad) {
  unsigned int nbad = 0;
  const long long stride = (long long)gridDim.x * blockDim.x;
  const long long end = start + count;
  for (long long i = start + (long long)blockIdx.x * blockDim.x + threadIdx.x; i < end;
       i += stride) {
    const int j = idx[i];
    if (j == -1) continue;
    if (j < 0 || (long long)j >= n_dense) {
      ++nbad;
      continue;
    }
    dense[j] = sel::add_rn(dense[j], sel::mul_rn(alpha, val[i]));
  }
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) nbad += __shfl_xor_sync(0xffffffffu, nbad, d);
  if ((threadIdx.x & 31u) == 0 && nbad != 0) atomicAdd(bad, (unsigned long long)nbad);
}
