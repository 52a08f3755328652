// Building blocks of the selection and sparse kernels (topk.cu,
// threshold.cu, sparse.cu).
//
// Data is processed in tiles of kTile elements: kRounds rounds in which each
// of the kBlock threads holds one aligned group of four consecutive
// elements, so (round, thread, lane) order is index order. An array whose
// start is not 16-byte aligned is addressed by "virtual" positions shifted
// by its misalignment `off` (0..3 elements); groups that straddle either end
// are loaded element by element, so nothing outside [0, n) is touched.
//
// Ordered compaction (stream compaction that keeps index order) scans
// per-element classes inside a tile, then chains tiles with a decoupled
// look-back over one 64-bit status word per tile. Tiles are handed out in
// increasing order by an atomic counter, so every tile a block waits for is
// owned by a block that is already running.
#ifndef COMMLIB_SELECT_COMMON_CUH
#define COMMLIB_SELECT_COMMON_CUH

#include "common.cuh"

namespace sel {

typedef unsigned int u32;
typedef unsigned long long u64;

constexpr int kWarp = 32;
constexpr int kBlock = 256;
constexpr int kMinBlocks = 3;  // blocks per SM kernels are built for: <= 85 registers
constexpr int kWarps = kBlock / kWarp;
constexpr int kRounds = kWarp / kWarps;  // rounds x warps == 32: one warp scans a tile's table
constexpr int kVec = 4;
constexpr int kTileGroups = kBlock * kRounds;
constexpr int kTile = kTileGroups * kVec;  // 4096 elements
constexpr u32 kFull = 0xffffffffu;
constexpr u32 kInfKey = 0x7f800000u;  // magnitude keys above this are NaN

static_assert(kRounds * kWarps == kWarp, "tile table must fill one warp");
static_assert(kTile < 65536, "per-tile counts are packed in 16 bits");

// |v| as an unsigned integer that orders like |v| (sign bit cleared).
__device__ __forceinline__ u32 mag_key(float v) { return __float_as_uint(v) & 0x7fffffffu; }

__device__ __forceinline__ u32 umin32(u32 a, u32 b) { return a < b ? a : b; }

// IEEE float32 add / multiply without flush-to-zero (cupy compiles with
// -ftz=true): common.cuh's cl_add / cl_mul.
__device__ __forceinline__ float add_rn(float a, float b) { return cl_add(a, b); }
__device__ __forceinline__ float mul_rn(float a, float b) { return cl_mul(a, b); }

// A stream of (index, value) pairs. Direct: val[0, n) with index = position
// and `off` = misalignment of val in elements. Buffered: parallel arrays
// idx/val of n pairs, both 16-byte aligned (off = 0).
struct Source {
  const float* val;
  const int* idx;  // null for a direct source
  long long n;
  int off;
};

__device__ __forceinline__ long long source_tiles(const Source& s) {
  return (s.n + s.off + kTile - 1) / kTile;
}

// Group g covers virtual positions 4g..4g+3. Lanes outside [0, n) get index -1.
template <bool VEC>
__device__ __forceinline__ void load_group(const Source& s, long long g, float (&v)[kVec],
                                           int (&id)[kVec]) {
  const long long p0 = g * kVec - s.off;
  if (VEC && p0 >= 0 && p0 + kVec <= s.n) {
    // cl_ld16: a 128-bit global load also where val is a generic pointer
    const uint4 q = cl_ld16(s.val + p0);
    v[0] = __uint_as_float(q.x);
    v[1] = __uint_as_float(q.y);
    v[2] = __uint_as_float(q.z);
    v[3] = __uint_as_float(q.w);
    if (s.idx != nullptr) {
      const uint4 w = cl_ld16(s.idx + p0);
      id[0] = (int)w.x;
      id[1] = (int)w.y;
      id[2] = (int)w.z;
      id[3] = (int)w.w;
    } else {
#pragma unroll
      for (int e = 0; e < kVec; ++e) id[e] = (int)(p0 + e);
    }
  } else {
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      const long long p = p0 + e;
      const bool ok = p >= 0 && p < s.n;
      v[e] = ok ? s.val[p] : 0.0f;
      id[e] = ok ? (s.idx != nullptr ? s.idx[p] : (int)p) : -1;
    }
  }
}

// Stores group g of a direct array (same addressing as load_group).
template <bool VEC>
__device__ __forceinline__ void store_group(float* dst, long long n, int off, long long g,
                                            const float (&v)[kVec]) {
  const long long p0 = g * kVec - off;
  if (VEC && p0 >= 0 && p0 + kVec <= n) {
    uint4 q;
    q.x = __float_as_uint(v[0]);
    q.y = __float_as_uint(v[1]);
    q.z = __float_as_uint(v[2]);
    q.w = __float_as_uint(v[3]);
    cl_st16(dst + p0, q);
  } else {
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      const long long p = p0 + e;
      if (p >= 0 && p < n) dst[p] = v[e];
    }
  }
}

// Loads the kRounds groups of this thread in `tile`.
template <bool VEC>
__device__ __forceinline__ void load_tile(const Source& s, long long tile,
                                          float (&v)[kRounds][kVec], int (&id)[kRounds][kVec]) {
#pragma unroll
  for (int r = 0; r < kRounds; ++r)
    load_group<VEC>(s, tile * kTileGroups + r * kBlock + threadIdx.x, v[r], id[r]);
}

// Calls f.visit(index, value) for every element of the source (index -1
// for the padding lanes of partial groups), tiles split statically over
// the grid.
template <class F>
__device__ __forceinline__ void visit_all(const Source& s, F& f) {
  const long long tiles = source_tiles(s);
  for (long long tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    float v[kRounds][kVec];
    int id[kRounds][kVec];
    load_tile<true>(s, tile, v, id);
#pragma unroll
    for (int r = 0; r < kRounds; ++r)
#pragma unroll
      for (int e = 0; e < kVec; ++e) f.visit(id[r][e], v[r][e]);
  }
}

// Histogram accumulation in shared memory that merges runs of equal bins
// seen by one thread into one atomic (cheap relief for heavy ties).
struct RunHist {
  u32* bins;
  u32 bin;
  u32 cnt;
  __device__ __forceinline__ void add(u32 b) {
    if (b == bin) {
      ++cnt;
    } else {
      if (cnt != 0) atomicAdd(bins + bin, cnt);
      bin = b;
      cnt = 1;
    }
  }
  __device__ __forceinline__ void flush() {
    if (cnt != 0) atomicAdd(bins + bin, cnt);
    cnt = 0;
  }
};

template <int BINS>
__device__ __forceinline__ void zero_bins(u32* bins) {
  for (int b = threadIdx.x; b < BINS; b += kBlock) bins[b] = 0;
  __syncthreads();
}

// Called by every thread of every block after its last access to what
// other blocks write: true (in every thread) in the block that finishes
// last, which then sees everything the other blocks wrote. *exits counts the
// blocks done (it is never reset here).
__device__ bool last_block(u32* exits) {
  __shared__ u32 last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(exits, 1u) == gridDim.x - 1 ? 1u : 0u;
  __syncthreads();
  const bool is_last = last != 0;
  if (is_last) __threadfence();
  return is_last;
}

// Adds the block's shared histogram into `global`. Returns true (in every
// thread) in the block that finishes last, which then sees every block's
// contribution.
template <int BINS>
__device__ bool merge_bins(const u32* bins, u32* global, u32* ticket) {
  __syncthreads();
  for (int b = threadIdx.x; b < BINS; b += kBlock) {
    const u32 c = bins[b];
    if (c != 0) atomicAdd(global + b, c);
  }
  return last_block(ticket);
}

// Inclusive prefix sum over the lanes of a warp.
__device__ __forceinline__ u32 warp_scan(u32 x, int lane) {
#pragma unroll
  for (int d = 1; d < kWarp; d <<= 1) {
    const u32 y = __shfl_up_sync(kFull, x, d);
    if (lane >= d) x += y;
  }
  return x;
}

// Result of pick_bucket (shared memory, valid in every thread on return).
struct Pick {
  u32 need;    // min(requested, total)
  u32 total;   // sum of all bins
  u32 bucket;  // bin holding the need-th largest key (need >= 1)
  u32 above;   // sum of the bins above `bucket`
  u32 count;   // hist[bucket]
};

// Block-wide: reads a global histogram (bins in increasing key order) and
// finds the bin b with above(b) < need <= above(b) + hist[b], where
// need = min(want, total). When need is 0 only need/total are set.
template <int BINS>
__device__ void pick_bucket(const u32* hist, u32 want, Pick& out) {
  constexpr int kPer = BINS / kBlock;
  static_assert(kPer * kBlock == BINS, "bins must split evenly over the block");
  __shared__ u32 warp_sums[kWarps];
  const volatile u32* h = hist;
  const int lane = threadIdx.x & (kWarp - 1);
  const int warp = threadIdx.x / kWarp;
  u32 c[kPer];
  u32 sum = 0;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    c[i] = h[threadIdx.x * kPer + i];
    sum += c[i];
  }
  // Suffix sums: bins owned by higher threads hold larger keys.
  u32 suf = sum;
#pragma unroll
  for (int d = 1; d < kWarp; d <<= 1) {
    const u32 y = __shfl_down_sync(kFull, suf, d);
    if (lane + d < kWarp) suf += y;
  }
  if (lane == 0) warp_sums[warp] = suf;
  __syncthreads();
  u32 total = 0;
  u32 later = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    const u32 ws = warp_sums[w];
    total += ws;
    if (w > warp) later += ws;
  }
  const u32 need = umin32(want, total);
  u32 above = later + suf - sum;
  if (threadIdx.x == 0) {
    out.need = need;
    out.total = total;
  }
  if (need > above && need - above <= sum) {
#pragma unroll
    for (int i = kPer - 1; i >= 0; --i) {
      if (need - above <= c[i]) {
        out.bucket = threadIdx.x * kPer + i;
        out.above = above;
        out.count = c[i];
        break;
      }
      above += c[i];
    }
  }
  __syncthreads();
}

// Pairs of counts packed as (a << 31) | b; both stay below 2^31 because
// they count distinct elements of an array shorter than 2^31.
__device__ __forceinline__ u64 pack_pair(u32 a, u32 b) { return ((u64)a << 31) | b; }
__device__ __forceinline__ u32 pair_a(u64 p) { return (u32)(p >> 31) & 0x7fffffffu; }
__device__ __forceinline__ u32 pair_b(u64 p) { return (u32)p & 0x7fffffffu; }

constexpr u64 kFlagAgg = 1ull << 62;  // status holds the tile's own counts
constexpr u64 kFlagInc = 2ull << 62;  // status holds counts up to and including the tile
constexpr u64 kValueMask = kFlagAgg - 1;

// Decoupled look-back, called by all lanes of one warp. Publishes the
// tile's aggregate, sums predecessors until one with an inclusive prefix,
// publishes the tile's inclusive prefix and returns its exclusive prefix.
__device__ u64 look_back(u64* status, long long tile, u64 aggregate, int lane) {
  volatile u64* st = status;
  if (tile == 0) {
    if (lane == 0) st[0] = kFlagInc | aggregate;
    return 0;
  }
  if (lane == 0) st[tile] = kFlagAgg | aggregate;
  u64 prefix = 0;
  for (long long base = tile - 1;; base -= kWarp) {
    const long long t = base - lane;
    u64 s = kFlagInc;  // before tile 0: an inclusive zero
    if (t >= 0) {
      s = st[t];
      while ((s & ~kValueMask) == 0) {
        __nanosleep(64);
        s = st[t];
      }
    }
    const u32 inc = __ballot_sync(kFull, (s & kFlagInc) != 0);
    const int stop = inc != 0 ? __ffs(inc) - 1 : kWarp - 1;
    u64 part = lane <= stop ? (s & kValueMask) : 0;
#pragma unroll
    for (int d = kWarp / 2; d > 0; d >>= 1) part += __shfl_xor_sync(kFull, part, d);
    prefix += part;
    if (inc != 0) break;
  }
  if (lane == 0) st[tile] = kFlagInc | (prefix + aggregate);
  return prefix;
}

// Claims the next tile for the whole block; tiles come out in increasing
// order. The caller's loop body must contain a __syncthreads() (compact_tile
// does) before the next call.
__device__ __forceinline__ long long next_tile(u32* counter) {
  __shared__ long long tile;
  if (threadIdx.x == 0) tile = atomicAdd(counter, 1u);
  __syncthreads();
  return tile;
}

// Ordered compaction of one tile (all threads of the block). Policy P:
//   int  classify(int index, float value): 0 drop, 1 keep, 2 tie
//   void emit(u32 pos, int index, float value)
//   void total(u64 packed)  (inclusive counts after the last tile, lane 0 only)
// A kept element lands at kept_before + min(ties_before, rem); a tie is
// kept while ties_before < rem and lands at kept_before + ties_before
// (counts over all tiles in index order). Outputs come out in index order
// and fill [0, kept + min(ties, rem)).
template <class P>
__device__ __forceinline__ void compact_tile(long long tile, long long tiles,
                                             const float (&v)[kRounds][kVec],
                                             const int (&id)[kRounds][kVec], u64* status,
                                             u32 rem, P& pol) {
  __shared__ u32 table[kWarp];  // (round, warp) totals, then their exclusive prefixes
  __shared__ u64 tile_prefix;   // counts before the tile
  const int lane = threadIdx.x & (kWarp - 1);
  const int warp = threadIdx.x / kWarp;

  u32 cls = 0;  // two bits per element
  u32 excl[kRounds];
#pragma unroll
  for (int r = 0; r < kRounds; ++r) {
    u32 c = 0;
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      const u32 k = (u32)pol.classify(id[r][e], v[r][e]);
      cls |= k << (2 * (r * kVec + e));
      c += k == 1u ? 0x10000u : (k == 2u ? 1u : 0u);
    }
    const u32 inc = warp_scan(c, lane);
    excl[r] = inc - c;
    if (lane == kWarp - 1) table[r * kWarps + warp] = inc;
  }
  __syncthreads();

  if (warp == 0) {
    const u32 x = table[lane];
    const u32 inc = warp_scan(x, lane);
    table[lane] = inc - x;
    const u32 tot = __shfl_sync(kFull, inc, kWarp - 1);
    const u64 agg = pack_pair(tot >> 16, tot & 0xffffu);
    const u64 before = look_back(status, tile, agg, lane);
    if (lane == 0) {
      tile_prefix = before;
      if (tile == tiles - 1) pol.total(before + agg);
    }
  }
  __syncthreads();

  if (cls != 0) {
    const u64 before = tile_prefix;
#pragma unroll
    for (int r = 0; r < kRounds; ++r) {
      const u32 t = table[r * kWarps + warp] + excl[r];
      u32 a = pair_a(before) + (t >> 16);
      u32 b = pair_b(before) + (t & 0xffffu);
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const u32 k = (cls >> (2 * (r * kVec + e))) & 3u;
        if (k == 1u) {
          pol.emit(a + umin32(b, rem), id[r][e], v[r][e]);
          ++a;
        } else if (k == 2u) {
          if (b < rem) pol.emit(a + b, id[r][e], v[r][e]);
          ++b;
        }
      }
    }
  }
}

// Ordered compaction of a whole source; `tile_counter` and `status` must
// start zeroed.
template <class P>
__device__ void compact_all(const Source& src, u64* status, u32* tile_counter, u32 rem, P& pol) {
  const long long tiles = source_tiles(src);
  for (;;) {
    const long long tile = next_tile(tile_counter);
    if (tile >= tiles) break;
    float v[kRounds][kVec];
    int id[kRounds][kVec];
    load_tile<true>(src, tile, v, id);
    compact_tile(tile, tiles, v, id, status, rem, pol);
  }
}

// ------------------------------------------------------------ super-tiles
// Ordered compaction that pays one look-back per super-tile of `per` tiles
// (at most kSuperTiles, kSuper elements) instead of one per tile: the block
// scans the super-tile's tiles one after another and keeps the selected
// elements, in order, in a shared-memory stash; then it looks back once and
// writes the stash out. A super-tile with more than kStash selected elements
// is read a second time from global memory and written out directly instead.
//
// Policy P as for compact_tile, but without ties (classify returns 0 or 1),
// plus
//   int reclassify(int index, float value): classify's answer without its
//       side effects (the second read of an overflowing super-tile).
constexpr int kSuperTiles = 8;
constexpr int kSuper = kSuperTiles * kTile;  // 32768 elements
constexpr int kStash = 4096;                 // selected elements held per super-tile
static_assert(kSuper < 65536, "in-tile counts are packed in 16 bits");

__device__ __forceinline__ long long source_supers(const Source& s) {
  return (source_tiles(s) + kSuperTiles - 1) / kSuperTiles;
}

struct Stash {
  int id[kStash];
  float v[kStash];
};

// Classifies (first read: classify, else reclassify) and scans one tile:
// cls (1 bit per element), excl[r]: the thread's exclusive count inside its
// (round, warp) row; table: exclusive prefixes of the 32 rows; returns the
// tile's total (every thread).
template <bool FIRST, class P>
__device__ __forceinline__ u32 scan_tile(const float (&v)[kRounds][kVec],
                                         const int (&id)[kRounds][kVec], P& pol, u32& cls,
                                         u32 (&excl)[kRounds], u32* table, u32* tile_total) {
  const int lane = threadIdx.x & (kWarp - 1);
  const int warp = threadIdx.x / kWarp;
  cls = 0;
#pragma unroll
  for (int r = 0; r < kRounds; ++r) {
    u32 c = 0;
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      const u32 k = (u32)(FIRST ? pol.classify(id[r][e], v[r][e])
                                : pol.reclassify(id[r][e], v[r][e])) & 1u;
      cls |= k << (r * kVec + e);
      c += k;
    }
    const u32 inc = warp_scan(c, lane);
    excl[r] = inc - c;
    if (lane == kWarp - 1) table[r * kWarps + warp] = inc;
  }
  __syncthreads();
  if (warp == 0) {
    const u32 x = table[lane];
    const u32 inc = warp_scan(x, lane);
    table[lane] = inc - x;
    if (lane == kWarp - 1) *tile_total = inc;
  }
  __syncthreads();
  return *tile_total;
}

// Loads tiles of a Source (compact_super's loader L: load(tile, v, id, first),
// first: whether this is the tile's first read).
struct SourceLoader {
  Source src;
  __device__ __forceinline__ void operator()(long long tile, float (&v)[kRounds][kVec],
                                             int (&id)[kRounds][kVec], bool) const {
    load_tile<true>(src, tile, v, id);
  }
};

// Ordered compaction of super-tile `st` (tiles st * per ... of `tiles`; per
// <= kSuperTiles) by all threads of the block; status: one look-back word per
// super-tile. Call it after next_tile(), whose barrier keeps the stash of the
// previous super-tile from being overwritten while it is still written out.
template <class P, class L>
__device__ void compact_super(const L& load, long long tiles, int per, long long st,
                              long long supers, u64* status, P& pol) {
  __shared__ Stash stash;
  __shared__ u32 table[kWarp];
  __shared__ u32 tile_total;
  __shared__ u64 super_prefix;
  const int lane = threadIdx.x & (kWarp - 1);
  const int warp = threadIdx.x / kWarp;
  const long long first = st * per;
  const int count = (int)(tiles - first < per ? tiles - first : per);

  float v[kRounds][kVec];
  int id[kRounds][kVec];
  u32 cls;
  u32 excl[kRounds];
  u32 run = 0;  // selected in the earlier tiles of the super-tile
  for (int j = 0; j < count; ++j) {
    load(first + j, v, id, true);
    const u32 tot = scan_tile<true>(v, id, pol, cls, excl, table, &tile_total);
    if (cls != 0) {
#pragma unroll
      for (int r = 0; r < kRounds; ++r) {
        u32 s = run + table[r * kWarps + warp] + excl[r];
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          if ((cls >> (r * kVec + e)) & 1u) {
            if (s < (u32)kStash) {
              stash.id[s] = id[r][e];
              stash.v[s] = v[r][e];
            }
            ++s;
          }
        }
      }
    }
    run += tot;
    __syncthreads();  // table and tile_total are rewritten by the next tile
  }

  if (warp == 0) {
    const u64 agg = pack_pair(run, 0u);
    const u64 before = look_back(status, st, agg, lane);
    if (lane == 0) {
      super_prefix = before;
      if (st == supers - 1) pol.total(before + agg);
    }
  }
  __syncthreads();
  const u32 kept0 = pair_a(super_prefix);
  if (run <= (u32)kStash) {
    for (u32 s = threadIdx.x; s < run; s += kBlock) pol.emit(kept0 + s, stash.id[s], stash.v[s]);
  } else {
    // too many to hold: read the super-tile again and write out directly
    run = 0;
    for (int j = 0; j < count; ++j) {
      load(first + j, v, id, false);
      const u32 tot = scan_tile<false>(v, id, pol, cls, excl, table, &tile_total);
      if (cls != 0) {
#pragma unroll
        for (int r = 0; r < kRounds; ++r) {
          u32 a = kept0 + run + table[r * kWarps + warp] + excl[r];
#pragma unroll
          for (int e = 0; e < kVec; ++e) {
            if ((cls >> (r * kVec + e)) & 1u) {
              pol.emit(a, id[r][e], v[r][e]);
              ++a;
            }
          }
        }
      }
      run += tot;
      __syncthreads();
    }
  }
  // no barrier here: the caller's next_tile() has one before the stash is refilled
}

// Ordered compaction of a whole source by super-tiles of kSuperTiles tiles;
// `counter` and `status` (one word per super-tile) must start zeroed.
template <class P>
__device__ void compact_all_super(const Source& src, u64* status, u32* counter, P& pol) {
  const long long supers = source_supers(src);
  for (;;) {
    const long long st = next_tile(counter);
    if (st >= supers) break;
    compact_super(SourceLoader{src}, source_tiles(src), kSuperTiles, st, supers, status, pol);
  }
}

}  // namespace sel

#endif  // COMMLIB_SELECT_COMMON_CUH
