// Sparse accumulation: dense[idx[i]] += alpha * val[i] for every entry, one
// segment after another, in one launch. Indices are unique within a
// segment (so no two threads touch one element at the same time and the
// result does not depend on scheduling) and may repeat across segments,
// where the segments' order is kept: the entries are split into items of
// kItem entries of one segment, handed out in order by an atomic counter,
// and a block writes an item of segment s only once every item of the
// segments before s is done (one counter of items done; items are claimed in
// order, so every item waited for belongs to a block that is running). An
// item's indices and values are loaded before the wait.
//
// Index -1 is padding; any other index outside [0, n_dense) is counted in
// *bad and never written. The product is rounded before the add (no fused
// multiply-add, subnormals kept), matching the numpy twin bit for bit.
#include "select_common.cuh"

namespace sparse_impl {
constexpr int kPer = 4;                   // entries per thread and item
constexpr int kItem = sel::kBlock * kPer;  // 1024 entries

// Segment s of item c: first[s] <= c < first[s + 1] (binary search).
__device__ __forceinline__ long long item_segment(const long long* first, long long nseg,
                                                  long long c) {
  long long lo = 0, hi = nseg;
  while (hi - lo > 1) {
    const long long mid = lo + (hi - lo) / 2;
    if (first[mid] <= c) lo = mid; else hi = mid;
  }
  return lo;
}
}  // namespace sparse_impl

using namespace sparse_impl;

// table (int64, 3 * nseg + 1 words): first[0..nseg] (first item of each
// segment, prefix sums of ceil(count / kItem); first[nseg] = items), then
// start[0..nseg) (first entry of each segment), count[0..nseg). ws: 3 u32
// counters (items claimed, items done, blocks finished), zero on entry and
// zero again on return (the last block clears them). Launch with 256-thread
// blocks; any grid size works.
extern "C" __global__ void __launch_bounds__(sel::kBlock, CL_FULL_SM_BLOCKS)
scatter_add(float* dense, long long n_dense, const int* idx, const float* val,
            const long long* table, long long nseg, float alpha, unsigned long long* bad,
            unsigned int* ws) {
  __shared__ long long item_sh;
  const long long* first = table;
  const long long* start = table + nseg + 1;
  const long long* count = start + nseg;
  const long long items = first[nseg];
  unsigned int nbad = 0;
  for (;;) {
    if (threadIdx.x == 0) item_sh = atomicAdd(ws, 1u);
    __syncthreads();
    const long long item = item_sh;
    if (item >= items) break;
    const long long s = item_segment(first, nseg, item);
    const long long lo = start[s] + (item - first[s]) * kItem;
    const long long end = start[s] + count[s];
    int j[kPer];
    float p[kPer];
#pragma unroll
    for (int e = 0; e < kPer; ++e) {
      const long long i = lo + e * sel::kBlock + threadIdx.x;
      j[e] = -1;
      p[e] = 0.0f;
      if (i < end) {
        j[e] = idx[i];
        p[e] = sel::mul_rn(alpha, val[i]);
      }
    }
    if (s > 0) {
      // every item of the segments before s done (their stores visible)
      if (threadIdx.x == 0) {
        const volatile unsigned int* done = ws + 1;
        while ((long long)*done < first[s]) __nanosleep(100);
        __threadfence();
      }
      __syncthreads();
    }
    float d[kPer];
#pragma unroll
    for (int e = 0; e < kPer; ++e) {
      const bool ok = j[e] >= 0 && (long long)j[e] < n_dense;
      if (!ok && j[e] != -1) ++nbad;
      if (!ok) j[e] = -1;
      d[e] = j[e] >= 0 ? dense[j[e]] : 0.0f;
    }
#pragma unroll
    for (int e = 0; e < kPer; ++e)
      if (j[e] >= 0) dense[j[e]] = sel::add_rn(d[e], p[e]);
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) atomicAdd(ws + 1, 1u);
  }
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) nbad += __shfl_xor_sync(0xffffffffu, nbad, d);
  if ((threadIdx.x & 31u) == 0 && nbad != 0) atomicAdd(bad, (unsigned long long)nbad);
  if (sel::last_block(ws + 2)) {
    if (threadIdx.x < 3) ws[threadIdx.x] = 0;
  }
}
