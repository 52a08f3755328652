// Batched pack / unpack: many arrays <-> one flat bucket, in one launch.
//
// A segment table (int64, device memory) describes nseg arrays:
//   table[0      .. nseg)      array base addresses
//   table[nseg   .. 2 nseg)    element offset of each array in the bucket
//   table[2 nseg .. 3 nseg)    element count of each array (> 0)
//   table[3 nseg .. 4 nseg]    first[s]: index of the first chunk of array s
//                              (prefix sum of ceil(count / chunk)); first[nseg]
//                              is the total number of chunks
// Each block takes chunks c = blockIdx.x, blockIdx.x + gridDim.x, ...; chunk c
// belongs to the segment s with first[s] <= c < first[s + 1] (binary search)
// and covers elements [(c - first[s]) * chunk, +chunk) of that array, so a
// chunk never straddles two arrays. chunk must be a multiple of 16 and below
// 2^31 - 256 (in-chunk indices are 32-bit).
//
// Kernels (table, nseg, chunk, bucket, scale, counter, skip):
//   pack_<a>_<b>         bucket[off + i] = round_b(scale * float(array[i]))
//   unpack_<b>_<a>       array[i]        = round_a(scale * float(bucket[off + i]))
//   unpack_<b>_<a>_acc   array[i]        = round_a(float(array[i]) + scale * float(bucket[off + i]))
//     <a>, <b> in {f32, f16, bf16}; same arithmetic, rounding, canonical NaN and
//     non-finite counting (into *counter, may be null) as kernels/cast.cu.
//   pack_raw<w>, unpack_raw<w>   bit copy in units of w in {1, 2, 4, 8} bytes;
//     offsets and counts are in units; scale and counter are ignored.
//   skip (may be null): when *skip is not 0 the kernel writes nothing and
//     counts nothing, so that a decision made on the device (a count of NaN
//     and inf in the data to unpack) guards the write without a host read.
// Launch with a 1-D grid of 256-thread blocks; any grid size works. Every
// kernel fits 8 blocks per SM where 2048 threads do (__launch_bounds__(256,
// CL_FULL_SM_BLOCKS): at most 32 registers).
#include "common.cuh"

// Binary search: the segment s in [0, nseg) with first[s] <= c < first[s + 1].
CL_HD cl_i64 segment_of(const cl_i64* first, cl_i64 nseg, cl_i64 c) {
  cl_i64 lo = 0, hi = nseg;
  while (hi - lo > 1) {
    const cl_i64 mid = lo + (hi - lo) / 2;
    if (first[mid] <= c) lo = mid; else hi = mid;
  }
  return lo;
}

// Work of thread t (of nt) in block `block` (of nblocks). S is the source
// format and D the destination format; TO_BUCKET selects the direction.
template <class S, class D, bool ACC, bool TO_BUCKET>
CL_HD void segments_thread(const cl_i64* table, cl_i64 nseg, cl_i64 chunk, const void* bucket,
                           float scale, cl_u64* counter, const cl_i64* skip, cl_i64 block,
                           cl_i64 nblocks, cl_i64 t, cl_i64 nt) {
  if (skip != nullptr && *skip != 0) return;  // the same in every thread
  typedef typename S::T ST;
  typedef typename D::T DT;
  const cl_i64* base = table;
  const cl_i64* offset = table + nseg;
  const cl_i64* count_of = table + 2 * nseg;
  const cl_i64* first = table + 3 * nseg;
  // chunk numbers fit in 32 bits (a chunk holds at least 16 elements of
  // arrays indexed in 32 bits): 32-bit chunk arithmetic saves the registers
  // that kept pack_raw1 off the stack under NVRTC 13.5 on sm_90
  const int nchunks = nseg > 0 ? (int)first[nseg] : 0;
  cl_u64 count = 0;
  for (int c = (int)block; c < nchunks; c += (int)nblocks) {
    const cl_i64 s = segment_of(first, nseg, c);
    const cl_i64 begin = (c - first[s]) * chunk;
    const cl_i64 rest = count_of[s] - begin;
    const cl_i64 n = rest < chunk ? rest : chunk;
    const cl_u64 array = (cl_u64)base[s];
    const ST* src;
    DT* dst;
    if constexpr (TO_BUCKET) {
      src = reinterpret_cast<const ST*>(array) + begin;
      dst = const_cast<DT*>(static_cast<const DT*>(bucket)) + offset[s] + begin;
    } else {
      src = static_cast<const ST*>(bucket) + offset[s] + begin;
      dst = reinterpret_cast<DT*>(array) + begin;
    }
    cl_transform_range<S, D, ACC, int>(src, dst, (int)n, scale, (int)t, (int)nt, count);
  }
  if constexpr (!(S::raw && D::raw)) cl_count_add(counter, count);
}

// Each kernel NAME comes with NAME_thread(table, nseg, chunk, bucket, scale,
// counter, skip, block, nblocks, t, nt), the work of thread t (of nt) of block
// `block` (of nblocks), callable from host code too.
#define CL_SEGMENTS_KERNEL(NAME, S, D, ACC, TO_BUCKET)                                     \
  CL_HD void NAME##_thread(const cl_i64* table, cl_i64 nseg, cl_i64 chunk,                 \
                           const void* bucket, float scale, cl_u64* counter,              \
                           const cl_i64* skip, cl_i64 block, cl_i64 nblocks, cl_i64 t,      \
                           cl_i64 nt) {                                                     \
    segments_thread<S, D, ACC, TO_BUCKET>(table, nseg, chunk, bucket, scale, counter, skip,\
                                          block, nblocks, t, nt);                          \
  }                                                                                        \
  extern "C" __global__ void __launch_bounds__(256, CL_FULL_SM_BLOCKS)                    \
      NAME(const cl_i64* __restrict__ table, cl_i64 nseg, cl_i64 chunk, const void* bucket, \
           float scale, cl_u64* counter, const cl_i64* skip) {                             \
    NAME##_thread(table, nseg, chunk, bucket, scale, counter, skip, blockIdx.x, gridDim.x, \
                  threadIdx.x, blockDim.x);                                                \
  }

#define CL_PACK_PAIR(AN, A, BN, B)                                 \
  CL_SEGMENTS_KERNEL(pack_##AN##_##BN, A, B, false, true)          \
  CL_SEGMENTS_KERNEL(unpack_##BN##_##AN, B, A, false, false)       \
  CL_SEGMENTS_KERNEL(unpack_##BN##_##AN##_acc, B, A, true, false)

#define CL_PACK_ARRAY(AN, A)            \
  CL_PACK_PAIR(AN, A, f32, cl_f32)      \
  CL_PACK_PAIR(AN, A, f16, cl_f16)      \
  CL_PACK_PAIR(AN, A, bf16, cl_bf16)

CL_PACK_ARRAY(f32, cl_f32)
CL_PACK_ARRAY(f16, cl_f16)
CL_PACK_ARRAY(bf16, cl_bf16)

#define CL_RAW_PAIR(W, U)                                                        \
  CL_SEGMENTS_KERNEL(pack_raw##W, cl_raw<U>, cl_raw<U>, false, true)             \
  CL_SEGMENTS_KERNEL(unpack_raw##W, cl_raw<U>, cl_raw<U>, false, false)

CL_RAW_PAIR(1, cl_u8)
CL_RAW_PAIR(2, cl_u16)
CL_RAW_PAIR(4, cl_u32)
CL_RAW_PAIR(8, cl_u64)
