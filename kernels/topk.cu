// Top-K by magnitude: radix select on the 31-bit magnitude key
// (bits & 0x7fffffff orders like |x|; keys above 0x7f800000 are NaN and never
// selected), then one ordered compaction. Everything is decided on the
// device; the host launches a fixed sequence:
//
//   topk_sample   (one block) the rank-th largest key of 8192 evenly spaced
//                 elements: a low bound L that very likely lies below the
//                 k-th largest key
//   topk_hist1*   histogram of key bits 30..20 (optionally fusing
//                 acc = residual + x, written back into residual); after a
//                 sample it also compacts every key >= L into the candidate
//                 buffer in index order, by super-tiles (select_common.cuh:
//                 the candidates of up to 8 tiles wait in shared memory and
//                 one look-back is paid per super-tile). The last block picks the bucket of
//                 the s-th largest key, s = min(k, #non-NaN), and decides
//                 where the candidates are: the gathered buffer (it holds at
//                 least s keys and did not overflow), else the bucket and
//                 everything above it, compacted by topk_filter if it fits,
//                 else the whole input
//   topk_filter   histogram of bits 19..9 inside the bucket
//   topk_refine   histogram of bits 8..0 inside the 22-bit prefix
//   topk_compact  writes every key above the final prefix plus the first
//                 `rem` equal keys in index order, then the padding
//
// In the common case the input is read once; the later passes read the
// candidate buffer. A pass whose predecessor already settled the selection
// returns at once. All counters live in one zero-filled u32 workspace.
#include "select_common.cuh"

namespace topk_impl {

using namespace sel;

enum : int {
  kSel = 0,  // number of selected entries s
  kRem,      // ties still to take at the current prefix
  kPrefix,   // key >> kShiftAt of the current bucket
  kShiftAt,  // shift of that prefix
  kDone,     // selection settled
  kUseBuf,   // later passes read the candidate buffer
  kFill,     // topk_filter compacts the bucket and above into the buffer
  kCand,     // number of candidates in the buffer
  kLow,      // sampled low bound L
  kGathered, // keys >= L counted by topk_hist1
  kTicket1,
  kTicket2,
  kTicket3,
  kTiles1,  // tile counters of the three compactions
  kTiles2,
  kTiles4,
  kHist1 = 16,
  kHist2 = kHist1 + 2048,
  kHist3 = kHist2 + 2048,
  kStatus = kHist3 + 512,  // then 3 x (n / kTile + 2) u64 look-back words
};
static_assert(kTiles4 < kHist1, "state overlaps the histograms");
static_assert(kStatus % 2 == 0, "status words must be 8-byte aligned");

constexpr u32 kNone = 0xffffffffu;  // prefix that no key matches
constexpr int kSamplePer = 32;      // samples per thread in topk_sample
constexpr int kSamples = kBlock * kSamplePer;

// Look-back words of compaction `which` (0 gather, 1 filter, 2 final).
__device__ __forceinline__ u64* status_of(u32* ws, long long n, int which) {
  return reinterpret_cast<u64*>(ws + kStatus) + which * (n / kTile + 2);
}

__device__ __forceinline__ bool valid_key(int id, float v, u32& key) {
  key = mag_key(v);
  return id >= 0 && key <= kInfKey;
}

// Pass 1 policy: histogram of the top digit; keeps keys >= low.
struct GatherPolicy {
  RunHist run;
  u32 low;
  int* cand_idx;
  float* cand_val;
  u32 cap;
  u32* gathered;
  __device__ __forceinline__ int classify(int id, float v) {
    u32 key;
    if (!valid_key(id, v, key)) return 0;
    run.add(key >> 20);
    return key >= low ? 1 : 0;
  }
  __device__ __forceinline__ int reclassify(int id, float v) {
    u32 key;
    return valid_key(id, v, key) && key >= low ? 1 : 0;
  }
  __device__ __forceinline__ void visit(int id, float v) { (void)classify(id, v); }
  __device__ __forceinline__ void emit(u32 pos, int id, float v) {
    if (pos < cap) {
      cand_idx[pos] = id;
      cand_val[pos] = v;
    }
  }
  __device__ __forceinline__ void total(u64 packed) { *gathered = pair_a(packed); }
};

// Loads this thread's part of `tile` of x; with RESID adds the residual and
// stores the sum back into it.
template <bool RESID, bool VEC>
__device__ __forceinline__ void load_acc(const float* x, float* resid, long long n, int off,
                                         long long tile, float (&v)[kRounds][kVec],
                                         int (&id)[kRounds][kVec]) {
  load_tile<VEC>(Source{x, nullptr, n, off}, tile, v, id);
  if (RESID) {
    float w[kRounds][kVec];
    load_tile<VEC>(Source{resid, nullptr, n, off}, tile, w, id);
#pragma unroll
    for (int r = 0; r < kRounds; ++r) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) v[r][e] = add_rn(w[r][e], v[r][e]);
      store_group<VEC>(resid, n, off, tile * kTileGroups + r * kBlock + threadIdx.x, v[r]);
    }
  }
}

// compact_super's loader of pass 1: the first read of a tile loads (and with
// RESID accumulates into the residual), a second read loads the sums back.
template <bool RESID, bool VEC>
struct AccLoader {
  const float* x;
  float* resid;
  long long n;
  int off;
  __device__ __forceinline__ void operator()(long long tile, float (&v)[kRounds][kVec],
                                             int (&id)[kRounds][kVec], bool first) const {
    if (!RESID || first) {
      load_acc<RESID, VEC>(x, resid, n, off, tile, v, id);
    } else {
      load_tile<VEC>(Source{resid, nullptr, n, off}, tile, v, id);
    }
  }
};

template <bool RESID, bool VEC>
__device__ __forceinline__ void hist1_body(const float* x, float* resid, long long n, int off,
                                           u32* ws, u32 k, u32 cap, int* cand_idx,
                                           float* cand_val, int per) {
  __shared__ u32 bins[2048];
  __shared__ Pick pick;
  zero_bins<2048>(bins);
  GatherPolicy pol{{bins, 0u, 0u}, ws[kLow], cand_idx, cand_val, cap, ws + kGathered};
  const long long tiles = source_tiles(Source{x, nullptr, n, off});
  float v[kRounds][kVec];
  int id[kRounds][kVec];
  if (cap != 0) {
    u64* status = status_of(ws, n, 0);
    const long long supers = (tiles + per - 1) / per;
    const AccLoader<RESID, VEC> load{x, resid, n, off};
    for (;;) {
      const long long st = next_tile(ws + kTiles1);
      if (st >= supers) break;
      compact_super(load, tiles, per, st, supers, status, pol);
    }
  } else {
    for (long long tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
      load_acc<RESID, VEC>(x, resid, n, off, tile, v, id);
#pragma unroll
      for (int r = 0; r < kRounds; ++r)
#pragma unroll
        for (int e = 0; e < kVec; ++e) pol.visit(id[r][e], v[r][e]);
    }
  }
  pol.run.flush();
  if (!merge_bins<2048>(bins, ws + kHist1, ws + kTicket1)) return;

  pick_bucket<2048>(ws + kHist1, k, pick);
  if (threadIdx.x == 0) {
    const u32 s = pick.need;
    const u32 got = cap != 0 ? *(volatile u32*)(ws + kGathered) : 0u;
    const bool gathered = cap != 0 && got >= s && got <= cap;
    ws[kSel] = s;
    if (s == 0) {
      ws[kPrefix] = kNone;
      ws[kShiftAt] = 0;
      ws[kRem] = 0;
      ws[kDone] = 1;
      return;
    }
    const u32 rem = s - pick.above;
    ws[kPrefix] = pick.bucket;
    ws[kShiftAt] = 20;
    ws[kRem] = rem;
    if (rem == pick.count) ws[kDone] = 1;
    if (gathered) {
      ws[kUseBuf] = 1;
      ws[kCand] = got;
    } else if (rem != pick.count) {
      const u32 m = pick.above + pick.count;
      if (m <= cap) {
        ws[kUseBuf] = 1;
        ws[kFill] = 1;
        ws[kCand] = m;
      }
    }
  }
}

// Pass 2 policy: histogram of the middle digit inside bucket b1; keeps the
// bucket and everything above it.
struct FilterPolicy {
  RunHist run;
  u32 b1;
  int* cand_idx;
  float* cand_val;
  u32 cap;
  __device__ __forceinline__ int classify(int id, float v) {
    u32 key;
    if (!valid_key(id, v, key)) return 0;
    const u32 d1 = key >> 20;
    if (d1 == b1) run.add((key >> 9) & 2047u);
    return d1 >= b1 ? 1 : 0;
  }
  __device__ __forceinline__ void visit(int id, float v) { (void)classify(id, v); }
  __device__ __forceinline__ void emit(u32 pos, int id, float v) {
    if (pos < cap) {
      cand_idx[pos] = id;
      cand_val[pos] = v;
    }
  }
  __device__ __forceinline__ void total(u64) {}
};

struct RefineVisitor {
  RunHist run;
  u32 prefix;  // key >> 9
  __device__ __forceinline__ void visit(int id, float v) {
    u32 key;
    if (valid_key(id, v, key) && (key >> 9) == prefix) run.add(key & 511u);
  }
};

// Pairs still in play: the candidate buffer, or the input.
__device__ __forceinline__ Source candidates(const u32* ws, const float* x, long long n, int off,
                                             const int* cand_idx, const float* cand_val) {
  if (ws[kUseBuf] != 0) return Source{cand_val, cand_idx, (long long)ws[kCand], 0};
  return Source{x, nullptr, n, off};
}

struct EmitPolicy {
  u32 shift;
  u32 prefix;
  int* out_idx;
  float* out_val;
  float* resid;  // null: no error feedback
  u32 k;
  __device__ __forceinline__ int classify(int id, float v) {
    u32 key;
    if (!valid_key(id, v, key)) return 0;
    const u32 h = key >> shift;
    return h > prefix ? 1 : (h == prefix ? 2 : 0);
  }
  __device__ __forceinline__ void emit(u32 pos, int id, float v) {
    if (pos < k) {
      out_idx[pos] = id;
      out_val[pos] = v;
      if (resid != nullptr) resid[id] = 0.0f;
    }
  }
  __device__ __forceinline__ void total(u64) {}
};

}  // namespace topk_impl

using namespace topk_impl;

// Sampling pass, one block: ws[kLow] = the rank-th largest magnitude key of
// kSamples elements spaced evenly over x (of resid + x with has_resid; NaN
// counts as 0). 1 <= rank <= kSamples.
extern "C" __global__ void __launch_bounds__(kBlock, kMinBlocks)
topk_sample(const float* x, const float* resid, int has_resid, long long n, u32* ws, u32 rank) {
  __shared__ u32 bins[256];
  __shared__ Pick pick;
  u32 keys[kSamplePer];
#pragma unroll
  for (int i = 0; i < kSamplePer; ++i) {
    const long long j = (long long)i * kBlock + threadIdx.x;
    const long long p = j * n / kSamples;
    float v = x[p];
    if (has_resid) v = add_rn(resid[p], v);
    const u32 key = mag_key(v);
    keys[i] = key <= kInfKey ? key : 0u;
  }
  u32 prefix = 0;
  u32 need = rank;
  for (int shift = 24; shift >= 0; shift -= 8) {
    zero_bins<256>(bins);
#pragma unroll
    for (int i = 0; i < kSamplePer; ++i)
      if (shift == 24 || (keys[i] >> (shift + 8)) == prefix)
        atomicAdd(bins + ((keys[i] >> shift) & 255u), 1u);
    __syncthreads();
    pick_bucket<256>(bins, need, pick);
    prefix = (prefix << 8) | pick.bucket;
    need -= pick.above;
  }
  if (threadIdx.x == 0) ws[kLow] = prefix;
}

// Pass 1. x: input (n floats, misaligned by `off` elements); resid:
// residual of the same length (ignored by topk_hist1); k: entries wanted;
// cap: candidate buffer capacity (0: no sample, no buffer); ws: zero-filled
// workspace; per: tiles per super-tile of the gathering compaction (1 to
// kSuperTiles, chosen so that the candidates of a super-tile likely fit its
// stash).
extern "C" __global__ void __launch_bounds__(kBlock, kMinBlocks)
topk_hist1(const float* x, float* resid, long long n, int off, u32* ws, u32 k, u32 cap,
           int* cand_idx, float* cand_val, int per) {
  hist1_body<false, true>(x, resid, n, off, ws, k, cap, cand_idx, cand_val, per);
}

// Pass 1 with error feedback: resid <- resid + x, selection on the sum.
// x and resid share the misalignment `off`.
extern "C" __global__ void __launch_bounds__(kBlock, kMinBlocks)
topk_hist1_resid(const float* x, float* resid, long long n, int off, u32* ws, u32 k, u32 cap,
                 int* cand_idx, float* cand_val, int per) {
  hist1_body<true, true>(x, resid, n, off, ws, k, cap, cand_idx, cand_val, per);
}

// Same, when x and resid are misaligned differently (scalar loads, off = 0).
extern "C" __global__ void __launch_bounds__(kBlock, kMinBlocks)
topk_hist1_resid_scalar(const float* x, float* resid, long long n, int off, u32* ws, u32 k,
                        u32 cap, int* cand_idx, float* cand_val, int per) {
  hist1_body<true, false>(x, resid, n, off, ws, k, cap, cand_idx, cand_val, per);
}

// Pass 2 over `x` (the residual when error feedback is on) or the buffer.
extern "C" __global__ void __launch_bounds__(kBlock, kMinBlocks)
topk_filter(const float* x, long long n, int off, u32* ws, int* cand_idx, float* cand_val,
            u32 cap) {
  if (ws[kDone] != 0) return;
  __shared__ u32 bins[2048];
  __shared__ Pick pick;
  zero_bins<2048>(bins);
  FilterPolicy pol{{bins, 0u, 0u}, ws[kPrefix], cand_idx, cand_val, cap};
  if (ws[kFill] != 0) {
    compact_all(Source{x, nullptr, n, off}, status_of(ws, n, 1), ws + kTiles2, 0u, pol);
  } else {
    visit_all(candidates(ws, x, n, off, cand_idx, cand_val), pol);
  }
  pol.run.flush();
  if (!merge_bins<2048>(bins, ws + kHist2, ws + kTicket2)) return;

  pick_bucket<2048>(ws + kHist2, ws[kRem], pick);
  if (threadIdx.x == 0) {
    const u32 rem = ws[kRem] - pick.above;
    ws[kPrefix] = (ws[kPrefix] << 11) | pick.bucket;
    ws[kShiftAt] = 9;
    ws[kRem] = rem;
    if (rem == pick.count) ws[kDone] = 1;
  }
}

// Pass 3 over the candidates.
extern "C" __global__ void __launch_bounds__(kBlock, kMinBlocks)
topk_refine(const float* x, long long n, int off, u32* ws, const int* cand_idx,
            const float* cand_val) {
  if (ws[kDone] != 0) return;
  __shared__ u32 bins[512];
  __shared__ Pick pick;
  zero_bins<512>(bins);
  RefineVisitor vis{{bins, 0u, 0u}, ws[kPrefix]};
  visit_all(candidates(ws, x, n, off, cand_idx, cand_val), vis);
  vis.run.flush();
  if (!merge_bins<512>(bins, ws + kHist3, ws + kTicket3)) return;

  pick_bucket<512>(ws + kHist3, ws[kRem], pick);
  if (threadIdx.x == 0) {
    ws[kPrefix] = (ws[kPrefix] << 9) | pick.bucket;
    ws[kShiftAt] = 0;
    ws[kRem] = ws[kRem] - pick.above;
    ws[kDone] = 1;
  }
}

// Final pass: out_idx/out_val receive k entries (selected ones in index
// order, then index -1 / value 0). With has_resid, selected entries of
// resid are zeroed.
extern "C" __global__ void __launch_bounds__(kBlock, kMinBlocks)
topk_compact(const float* x, long long n, int off, u32* ws, const int* cand_idx,
             const float* cand_val, float* resid, int has_resid, int* out_idx, float* out_val,
             u32 k) {
  const u32 s = ws[kSel];
  for (long long p = s + (long long)blockIdx.x * kBlock + threadIdx.x; p < k;
       p += (long long)gridDim.x * kBlock) {
    out_idx[p] = -1;
    out_val[p] = 0.0f;
  }
  EmitPolicy pol{ws[kShiftAt], ws[kPrefix], out_idx, out_val, has_resid ? resid : nullptr, k};
  compact_all(candidates(ws, x, n, off, cand_idx, cand_val), status_of(ws, n, 2), ws + kTiles4,
              ws[kRem], pol);
}
