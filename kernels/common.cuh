// Device helpers shared by the kernels under kernels/.
//
// Header-only and free of #include, so it compiles the same under nvcc and
// under NVRTC (cupy.RawModule). Everything marked CL_HD also compiles as
// host code, which lets the kernels' per-thread bodies run on a CPU.
//
// API (stable)
//   cl_u8, cl_u16, cl_u32, cl_u64, cl_i64      fixed-width integers
//   CL_HD                                     __host__ __device__ inline
//   cl_thread_index(), cl_thread_count()      global thread index / count (cl_i64, device)
//   CL_GRID_STRIDE(i, n)                      for (cl_i64 i = ...; i < n; i += ...) header
//   CL_FULL_SM_BLOCKS                         256-thread blocks that fill an SM of the
//                                             target (8 on sm_80/90/100/103, 6 on other
//                                             sm_86+, 4 on sm_75): __launch_bounds__' minimum
//   cl_f32_bits(f), cl_bits_f32(u)            float <-> bit pattern
//   cl_is_nan(f), cl_is_finite(f)             tests on the bits (immune to fast-math)
//   cl_f32_to_bf16(f) -> cl_u16               round-to-nearest-even, overflow -> +-inf,
//                                             NaN -> 0x7FC0 (canonical quiet NaN)
//   cl_bf16_to_f32(h) -> float                exact
//   cl_f32_to_f16(f) -> cl_u16                round-to-nearest-even, overflow -> +-inf,
//                                             NaN -> 0x7E00 (canonical quiet NaN)
//   cl_f16_to_f32(h) -> float                 exact
//   cl_mul(a, b), cl_add(a, b)                IEEE fp32 ops: never fused into an FMA,
//                                             subnormals kept even under -ftz=true
//   cl_ld(p), cl_st(p, v)                     scalar global load / store
//   cl_ld16(p), cl_st16(p, v)                 16-byte (uint4) global load / store, one 128-bit
//                                             instruction each (LDG.E.128 / STG.E.128);
//                                             p 16-byte aligned, in global memory
//   cl_count_add(counter, c)                  add every thread's c to *counter (may be null):
//                                             called by all threads of the block (blockDim.x
//                                             a multiple of 32), one global atomic per block
//   Element formats (struct, member T = storage type):
//     cl_f32, cl_f16, cl_bf16                 widen(T) -> float, narrow(float) -> T (canonical
//                                             NaN), nonfinite(T) -> bool (inf or NaN)
//     cl_raw<U>                               bit copy of U, no arithmetic
//   cl_transform_range<S, D, ACC, I = cl_i64>(src, dst, n, scale, t, nt, count)
//       Thread t of nt computes dst[i] = D::narrow(scale * S::widen(src[i])
//       [+ D::widen(dst[i]) if ACC]) for i in [0, n); each element is done by
//       exactly one thread. Uses 16-byte vectors when src and dst can both be
//       16-byte aligned at a common element, scalar head/tail otherwise. I: the
//       type of n, t and nt (int where n < 2^31 - nt, which saves registers).
//       count += number of non-finite elements written.
//   CL_CHECK_ACCESS(ptr, bytes, is_write)     hook run before every cl_ld/cl_st;
//                                             define it before including to
//                                             bounds-check a host build (default: nothing)
//   CL_BLOCK_COLLECTIVES                      define it in a host build that runs whole
//                                             blocks (__syncthreads, warp shuffles), so
//                                             cl_count_add takes its device path there too
#ifndef COMMLIB_COMMON_CUH
#define COMMLIB_COMMON_CUH

typedef unsigned char cl_u8;
typedef unsigned short cl_u16;
typedef unsigned int cl_u32;
typedef unsigned long long cl_u64;
typedef long long cl_i64;

#define CL_HD __host__ __device__ inline

#ifndef CL_CHECK_ACCESS
#define CL_CHECK_ACCESS(ptr, bytes, is_write) ((void)0)
#endif

// ---------------------------------------------------------------- threads
__device__ inline cl_i64 cl_thread_index() {
  return (cl_i64)blockIdx.x * blockDim.x + threadIdx.x;
}
__device__ inline cl_i64 cl_thread_count() {
  return (cl_i64)gridDim.x * blockDim.x;
}

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ == 800 || __CUDA_ARCH__ == 900 || \
    __CUDA_ARCH__ == 1000 || __CUDA_ARCH__ == 1030
#define CL_FULL_SM_BLOCKS 8  // 2048 threads per SM
#elif __CUDA_ARCH__ >= 860
#define CL_FULL_SM_BLOCKS 6  // 1536
#else
#define CL_FULL_SM_BLOCKS 4  // 1024
#endif

#define CL_GRID_STRIDE(i, n) \
  for (cl_i64 i = cl_thread_index(); i < (cl_i64)(n); i += cl_thread_count())

// ---------------------------------------------------------------- bits
CL_HD cl_u32 cl_f32_bits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  union { float f; cl_u32 u; } c;
  c.f = f;
  return c.u;
#endif
}

CL_HD float cl_bits_f32(cl_u32 u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  union { cl_u32 u; float f; } c;
  c.u = u;
  return c.f;
#endif
}

CL_HD bool cl_is_nan(float f) { return (cl_f32_bits(f) & 0x7FFFFFFFu) > 0x7F800000u; }
CL_HD bool cl_is_finite(float f) { return (cl_f32_bits(f) & 0x7F800000u) != 0x7F800000u; }

// Inline PTX without .ftz: cupy compiles every module with -ftz=true, which
// would flush subnormal fp32 results of plain operators and intrinsics.
CL_HD float cl_mul(float a, float b) {
#ifdef __CUDA_ARCH__
  float r;
  asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return a * b;
#endif
}

CL_HD float cl_add(float a, float b) {
#ifdef __CUDA_ARCH__
  float r;
  asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return a + b;
#endif
}

// ---------------------------------------------------------------- bfloat16
CL_HD cl_u16 cl_f32_to_bf16(float f) {
  const cl_u32 u = cl_f32_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (cl_u16)0x7FC0u;
  return (cl_u16)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

CL_HD float cl_bf16_to_f32(cl_u16 h) { return cl_bits_f32((cl_u32)h << 16); }

// ---------------------------------------------------------------- float16
CL_HD cl_u16 cl_f32_to_f16(float f) {
  if (cl_is_nan(f)) return (cl_u16)0x7E00u;
#ifdef __CUDA_ARCH__
  cl_u16 h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
#else
  const cl_u32 u = cl_f32_bits(f);
  const cl_u32 sign = (u >> 16) & 0x8000u;
  cl_u32 a = u & 0x7FFFFFFFu;
  if (a >= 0x477FF000u) return (cl_u16)(sign | 0x7C00u);      // >= 65520: inf
  if (a >= 0x38800000u) {                                     // normal half
    a -= 0x38000000u;                                         // rebias 127 -> 15
    return (cl_u16)(sign | ((a + 0xFFFu + ((a >> 13) & 1u)) >> 13));
  }
  if (a <= 0x33000000u) return (cl_u16)sign;                  // <= 2^-25: zero
  const cl_u32 m = (a & 0x7FFFFFu) | 0x800000u;               // subnormal half
  const cl_u32 shift = 126u - (a >> 23);                      // 14 .. 24
  cl_u32 r = m >> shift;
  const cl_u32 rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (r & 1u))) ++r;
  return (cl_u16)(sign | r);
#endif
}

CL_HD float cl_f16_to_f32(cl_u16 h) {
#ifdef __CUDA_ARCH__
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
#else
  const cl_u32 sign = ((cl_u32)h & 0x8000u) << 16;
  cl_u32 e = ((cl_u32)h >> 10) & 0x1Fu, m = (cl_u32)h & 0x3FFu;
  if (e == 0x1Fu) return cl_bits_f32(sign | 0x7F800000u | (m << 13));
  if (e == 0u) {
    if (m == 0u) return cl_bits_f32(sign);
    e = 1u;
    while (!(m & 0x400u)) { m <<= 1; --e; }                   // e may wrap: fine mod 2^32
    m &= 0x3FFu;
  }
  return cl_bits_f32(sign | ((e + 112u) << 23) | (m << 13));
#endif
}

// ---------------------------------------------------------------- memory
template <class T>
CL_HD T cl_ld(const T* p) {
  CL_CHECK_ACCESS(p, sizeof(T), false);
  return *p;
}

template <class T>
CL_HD void cl_st(T* p, T v) {
  CL_CHECK_ACCESS(p, sizeof(T), true);
  *p = v;
}

// Inline PTX: through a plain uint4 dereference the compiler splits a store
// into four 32-bit ones where it cannot prove the pointer's alignment (a
// pointer read from a table). A generic pointer into global memory is a valid
// global address. The store clobbers memory, so nothing moves across it.
CL_HD uint4 cl_ld16(const void* p) {
  CL_CHECK_ACCESS(p, 16, false);
#ifdef __CUDA_ARCH__
  uint4 v;
  asm("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
#else
  return *reinterpret_cast<const uint4*>(p);
#endif
}

CL_HD void cl_st16(void* p, uint4 v) {
  CL_CHECK_ACCESS(p, 16, true);
#ifdef __CUDA_ARCH__
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};"
               :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
#else
  *reinterpret_cast<uint4*>(p) = v;
#endif
}

CL_HD void cl_count_add(cl_u64* counter, cl_u64 c) {
  if (counter == nullptr) return;  // the same in every thread
#if defined(__CUDA_ARCH__) || defined(CL_BLOCK_COLLECTIVES)
  __shared__ cl_u64 block_sum;
  if (threadIdx.x == 0) block_sum = 0;
  __syncthreads();
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) c += __shfl_xor_sync(0xffffffffu, c, d);
  if ((threadIdx.x & 31u) == 0 && c != 0) atomicAdd(&block_sum, c);
  __syncthreads();
  if (threadIdx.x == 0 && block_sum != 0) atomicAdd(counter, block_sum);
#else
  *counter += c;
#endif
}

// ---------------------------------------------------------------- formats
struct cl_f32 {
  typedef float T;
  static constexpr bool raw = false;
  static CL_HD float widen(T x) { return x; }
  static CL_HD T narrow(float v) { return cl_is_nan(v) ? cl_bits_f32(0x7FC00000u) : v; }
  static CL_HD bool nonfinite(T x) { return !cl_is_finite(x); }
};

struct cl_f16 {
  typedef cl_u16 T;
  static constexpr bool raw = false;
  static CL_HD float widen(T x) { return cl_f16_to_f32(x); }
  static CL_HD T narrow(float v) { return cl_f32_to_f16(v); }
  static CL_HD bool nonfinite(T x) { return (x & 0x7C00u) == 0x7C00u; }
};

struct cl_bf16 {
  typedef cl_u16 T;
  static constexpr bool raw = false;
  static CL_HD float widen(T x) { return cl_bf16_to_f32(x); }
  static CL_HD T narrow(float v) { return cl_f32_to_bf16(v); }
  static CL_HD bool nonfinite(T x) { return (x & 0x7F80u) == 0x7F80u; }
};

template <class U>
struct cl_raw {
  typedef U T;
  static constexpr bool raw = true;
};

// ---------------------------------------------------------------- transform
template <class S, class D, bool ACC>
CL_HD typename D::T cl_transform_one(typename S::T x, typename D::T old, float scale,
                                     cl_u64& count) {
  float v = cl_mul(S::widen(x), scale);
  if constexpr (ACC) v = cl_add(D::widen(old), v);
  (void)old;
  const typename D::T r = D::narrow(v);
  count += D::nonfinite(r) ? 1u : 0u;
  return r;
}

// Smallest h < 16 at which src + h and dst + h are both 16-byte aligned;
// n when there is none or it is not below n.
template <int SS, int DS>
CL_HD cl_i64 cl_vec_head(const void* src, const void* dst, cl_i64 n) {
  const cl_u64 a = (cl_u64)src, b = (cl_u64)dst;
  for (cl_u64 h = 0; h < 16; ++h)
    if (((a + h * SS) & 15u) == 0 && ((b + h * DS) & 15u) == 0)
      return (cl_i64)h < n ? (cl_i64)h : n;
  return n;
}

template <class S, class D, bool ACC>
CL_HD void cl_transform_vec(const typename S::T* src, typename D::T* dst, float scale,
                            cl_u64& count) {
  typedef typename S::T ST;
  typedef typename D::T DT;
  if constexpr (S::raw && D::raw) {
    // a bit copy moves the vector as it is (no element view: with one, NVRTC
    // 13.5 kept part of pack_raw1's vector on the stack on sm_90)
    cl_st16(dst, cl_ld16(src));
    (void)scale;
    (void)count;
    return;
  }
  constexpr int V = 16 / (sizeof(ST) < sizeof(DT) ? sizeof(ST) : sizeof(DT));
  constexpr int QS = V * (int)sizeof(ST) / 16, QD = V * (int)sizeof(DT) / 16;
  union { uint4 q[QS]; ST e[V]; } a;
  union { uint4 q[QD]; DT e[V]; } b;
#pragma unroll
  for (int k = 0; k < QS; ++k) a.q[k] = cl_ld16(src + k * (16 / (int)sizeof(ST)));
  if constexpr (S::raw && D::raw) {
#pragma unroll
    for (int k = 0; k < QD; ++k) b.q[k] = a.q[k];
  } else {
    if constexpr (ACC) {
#pragma unroll
      for (int k = 0; k < QD; ++k) b.q[k] = cl_ld16(dst + k * (16 / (int)sizeof(DT)));
#pragma unroll
      for (int e = 0; e < V; ++e) b.e[e] = cl_transform_one<S, D, ACC>(a.e[e], b.e[e], scale, count);
    } else {
#pragma unroll
      for (int e = 0; e < V; ++e) b.e[e] = cl_transform_one<S, D, ACC>(a.e[e], DT(), scale, count);
    }
  }
#pragma unroll
  for (int k = 0; k < QD; ++k) cl_st16(dst + k * (16 / (int)sizeof(DT)), b.q[k]);
}

template <class S, class D, bool ACC>
CL_HD void cl_transform_scalar(const typename S::T* src, typename D::T* dst, float scale,
                               cl_u64& count) {
  if constexpr (S::raw && D::raw) {
    cl_st(dst, cl_ld(src));
  } else if constexpr (ACC) {
    cl_st(dst, cl_transform_one<S, D, ACC>(cl_ld(src), cl_ld(dst), scale, count));
  } else {
    cl_st(dst, cl_transform_one<S, D, ACC>(cl_ld(src), typename D::T(), scale, count));
  }
}

template <class S, class D, bool ACC, class I = cl_i64>
CL_HD void cl_transform_range(const typename S::T* __restrict__ src,
                              typename D::T* __restrict__ dst, I n, float scale, I t, I nt,
                              cl_u64& count) {
  typedef typename S::T ST;
  typedef typename D::T DT;
  static_assert(!(S::raw && D::raw && ACC), "bit copies cannot accumulate");
  constexpr int V = 16 / (sizeof(ST) < sizeof(DT) ? sizeof(ST) : sizeof(DT));
  const I head = (I)cl_vec_head<sizeof(ST), sizeof(DT)>(src, dst, n);
  const I nvec = (n - head) / V;
  // head and tail hold fewer than V elements: their loops stay rolled (an
  // unrolled one costs registers the vector loop needs)
#pragma unroll 1
  for (I i = t; i < head; i += nt)
    cl_transform_scalar<S, D, ACC>(src + i, dst + i, scale, count);
  for (I j = t; j < nvec; j += nt)
    cl_transform_vec<S, D, ACC>(src + head + j * V, dst + head + j * V, scale, count);
#pragma unroll 1
  for (I i = head + nvec * V + t; i < n; i += nt)
    cl_transform_scalar<S, D, ACC>(src + i, dst + i, scale, count);
}

#endif  // COMMLIB_COMMON_CUH
