// Threshold selection: every element with |x| > t (NaN never) compacted in
// index order, in one pass over x (ordered compaction with decoupled
// look-back, one look-back per super-tile of 32768 elements whose selected
// elements wait in shared memory, see select_common.cuh).
#include "select_common.cuh"

namespace threshold_impl {

using namespace sel;

struct ThresholdPolicy {
  u32 tkey;  // magnitude key of t
  int* out_idx;
  float* out_val;
  long long cap;
  long long* count;
  __device__ __forceinline__ int classify(int id, float v) {
    const u32 key = mag_key(v);
    return id >= 0 && key > tkey && key <= kInfKey ? 1 : 0;
  }
  __device__ __forceinline__ int reclassify(int id, float v) { return classify(id, v); }
  __device__ __forceinline__ void emit(u32 pos, int id, float v) {
    if ((long long)pos < cap) {
      out_idx[pos] = id;
      out_val[pos] = v;
    }
  }
  __device__ __forceinline__ void total(u64 packed) { *count = (long long)pair_a(packed); }
};

}  // namespace threshold_impl

using namespace threshold_impl;

// Built for kMinBlocks blocks per SM (at most 85 registers) on every
// architecture: at 4 on sm_90 (64 registers) the NVRTC of CUDA 12.9 and
// 13.0 kept 8 bytes of it on the stack.
#define CL_THRESHOLD_BLOCKS kMinBlocks

// x: n floats misaligned by `off` elements; t >= 0. out_idx/out_val hold
// `cap` entries; *count receives the number of qualifying elements.
// ws: 1 + tiles u64 words (super-tile and exit counters, look-back status), zero
// on entry and zero again on return: the last block to finish clears what
// the launch used, so a workspace kept per stream needs no memset per call.
extern "C" __global__ void __launch_bounds__(kBlock, CL_THRESHOLD_BLOCKS)
threshold_select(const float* x, long long n, int off, float t, u64* ws, int* out_idx,
                 float* out_val, long long cap, long long* count) {
  ThresholdPolicy pol{mag_key(t), out_idx, out_val, cap, count};
  const Source src{x, nullptr, n, off};
  u32* counters = reinterpret_cast<u32*>(ws);  // [0] tiles handed out, [1] blocks finished
  compact_all_super(src, ws + 1, counters, pol);
  if (last_block(counters + 1)) {
    const long long words = 1 + source_tiles(src);
    for (long long i = threadIdx.x; i < words; i += kBlock) ws[i] = 0;
  }
}
