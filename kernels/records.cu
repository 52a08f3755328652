// The sparsifying strategies' records on the device
// (commlib/compression/_payload.py, commlib/ops/records.py), each one
// launch whose workspace is left zeroed by its last block, so a call needs
// no memset:
//
//   accumulate_finite  acc = residual + x (x alone without a residual),
//                      NaN and +-inf stored as 0 and counted; the last block
//                      writes the record's header [entries, count, 0, 0]
//   split_records      the gathered records' entries copied out rank after
//                      rank into one index and one value array, every entry
//                      checked on the way; the last block writes the
//                      headers (widened to int64) and the two counts the
//                      host reads: [bad entries, entries out of order]
#include "select_common.cuh"

namespace records_impl {

using namespace sel;

// Sums a and b over the block (valid in thread 0). Every thread calls it.
__device__ __forceinline__ void block_sum2(u64& a, u64& b) {
  __shared__ u64 part[2][kWarps];
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) {
    a += __shfl_xor_sync(kFull, a, d);
    b += __shfl_xor_sync(kFull, b, d);
  }
  const int warp = threadIdx.x / kWarp;
  if (threadIdx.x % kWarp == 0) {
    part[0][warp] = a;
    part[1][warp] = b;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    a = b = 0;
    for (int w = 0; w < kWarps; ++w) {
      a += part[0][w];
      b += part[1][w];
    }
  }
}

// Rank r of entry e: out_at[r] <= e < out_at[r + 1] (binary search).
__device__ __forceinline__ int entry_rank(const long long* out_at, int ranks, long long e) {
  int lo = 0, hi = ranks;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (out_at[mid] <= e) lo = mid; else hi = mid;
  }
  return lo;
}

}  // namespace records_impl

using namespace records_impl;

// acc[i] = residual[i] + x[i] (x[i] without has_residual; rounded as
// numpy's float32 add, subnormals kept), NaN and +-inf stored as 0 and
// counted. The last block writes header[0] = entries, header[1] = the
// count, header[2] = header[3] = 0. ws: 2 u64 (count so far, blocks
// finished), zero on entry and on return. acc may be x or residual. Any
// grid of 256-thread blocks.
extern "C" __global__ void __launch_bounds__(kBlock, CL_FULL_SM_BLOCKS)
accumulate_finite(const float* residual, int has_residual, const float* x, float* acc,
                  long long n, int* header, int entries, u64* ws) {
  u64 bad = 0, unused = 0;
  CL_GRID_STRIDE(i, n) {
    float v = x[i];
    if (has_residual) v = add_rn(residual[i], v);
    const bool finite = mag_key(v) < kInfKey;
    acc[i] = finite ? v : 0.0f;
    bad += finite ? 0 : 1;
  }
  block_sum2(bad, unused);
  if (threadIdx.x == 0 && bad != 0) atomicAdd(ws, bad);
  if (last_block(reinterpret_cast<u32*>(ws + 1))) {
    if (threadIdx.x == 0) {
      header[0] = entries;
      header[1] = (int)ws[0];
      header[2] = 0;
      header[3] = 0;
      ws[0] = 0;
      ws[1] = 0;
    }
  }
}

// The entries of `ranks` records in src (int32 words): rank r's indices
// at src[idx_at[r] ...] and the bits of its float32 values at
// src[val_at[r] ...], count[r] of each; table (int64, 4 * ranks + 1):
// idx_at[ranks], val_at[ranks], count[ranks], out_at[ranks + 1] (prefix
// sums of count). Entry j of rank r goes to idx[out_at[r] + j] and
// val[out_at[r] + j], and counts as
//   bad        its index is outside [0, n) and it is not the padding
//              (index -1, value +-0), or its value is NaN or +-inf;
//   unordered  j > 0, it is not padding, and the entry before it is
//              padding or has an index not below its own.
// The last block writes reads[4 r + h] = src[r * header_stride + h]
// (h < 4) when header_stride > 0 (the records' headers), then the two
// counts after them (at reads[4 * ranks], else reads[0]). ws: 3 u64 (the counts, blocks finished),
// zero on entry and on return. Any grid of 256-thread blocks.
extern "C" __global__ void __launch_bounds__(kBlock, CL_FULL_SM_BLOCKS)
split_records(const int* src, const long long* table, int ranks, long long n, int* idx,
              float* val, long long header_stride, long long* reads, u64* ws) {
  const long long* idx_at = table;
  const long long* val_at = table + ranks;
  const long long* out_at = table + 3 * ranks;
  u64 bad = 0, unordered = 0;
  CL_GRID_STRIDE(e, out_at[ranks]) {
    const int r = entry_rank(out_at, ranks, e);
    const long long j = e - out_at[r];
    const int i = src[idx_at[r] + j];
    const float v = __int_as_float(src[val_at[r] + j]);
    idx[e] = i;
    val[e] = v;
    const bool pad = i == -1 && v == 0.0f;
    bad += ((unsigned int)i < (unsigned long long)n || pad) && mag_key(v) < kInfKey ? 0 : 1;
    if (j > 0 && !pad) {
      const int p = src[idx_at[r] + j - 1];
      const bool pad_before = p == -1 && __int_as_float(src[val_at[r] + j - 1]) == 0.0f;
      unordered += pad_before || i <= p ? 1 : 0;
    }
  }
  block_sum2(bad, unordered);
  if (threadIdx.x == 0) {
    if (bad != 0) atomicAdd(ws, bad);
    if (unordered != 0) atomicAdd(ws + 1, unordered);
  }
  if (last_block(reinterpret_cast<u32*>(ws + 2))) {
    const int base = header_stride > 0 ? 4 * ranks : 0;
    for (int w = threadIdx.x; w < base; w += kBlock)
      reads[w] = src[(long long)(w / 4) * header_stride + w % 4];
    if (threadIdx.x == 0) {
      reads[base] = (long long)ws[0];
      reads[base + 1] = (long long)ws[1];
      ws[0] = 0;
      ws[1] = 0;
      ws[2] = 0;
    }
  }
}
