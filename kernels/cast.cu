// Elementwise cast with scale between float32, float16 and bfloat16.
//
//   cast_<s>_<d>(const S* src, D* dst, long long n, float scale, unsigned long long* counter)
//       dst[i] = round_d(scale * float(src[i]))              i in [0, n)
//   cast_<s>_<d>_acc(...)  (same arguments)
//       dst[i] = round_d(float(dst[i]) + scale * float(src[i]))
//
// <s>, <d> in {f32, f16, bf16}; f16/bf16 are passed as 16-bit bit patterns.
// Arithmetic is IEEE fp32 (no FMA contraction), rounding to f16/bf16 is
// round-to-nearest-even, every NaN written is the canonical quiet NaN of the
// output format, and the number of non-finite values written (overflow to
// inf, inf or NaN from the inputs) is added to *counter (may be null).
// Launch with a 1-D grid of blocks of at most 256 threads, a multiple of 32;
// any grid size works. Every kernel fits 8 blocks of 256 threads per SM where
// 2048 threads do (__launch_bounds__(256, CL_FULL_SM_BLOCKS): <= 32 registers).
#include "common.cuh"

template <class S, class D, bool ACC>
CL_HD void cast_thread(const typename S::T* src, typename D::T* dst, cl_i64 n, float scale,
                       cl_u64* counter, cl_i64 t, cl_i64 nt) {
  cl_u64 count = 0;
  cl_transform_range<S, D, ACC>(src, dst, n, scale, t, nt, count);
  cl_count_add(counter, count);
}

// Each kernel NAME comes with NAME_thread(src, dst, n, scale, counter, t, nt),
// the work of global thread t of nt, callable from host code too.
#define CL_CAST_KERNEL(NAME, S, D, ACC)                                                  \
  CL_HD void NAME##_thread(const void* src, void* dst, cl_i64 n, float scale,            \
                           cl_u64* counter, cl_i64 t, cl_i64 nt) {                       \
    cast_thread<S, D, ACC>(static_cast<const S::T*>(src), static_cast<D::T*>(dst), n,     \
                           scale, counter, t, nt);                                       \
  }                                                                                      \
  extern "C" __global__ void __launch_bounds__(256, CL_FULL_SM_BLOCKS)                  \
      NAME(const void* __restrict__ src, void* __restrict__ dst, cl_i64 n, float scale,  \
           cl_u64* counter) {                                                            \
    NAME##_thread(src, dst, n, scale, counter, cl_thread_index(), cl_thread_count());    \
  }

#define CL_CAST_PAIR(SN, S, DN, D)                  \
  CL_CAST_KERNEL(cast_##SN##_##DN, S, D, false)     \
  CL_CAST_KERNEL(cast_##SN##_##DN##_acc, S, D, true)

#define CL_CAST_FROM(SN, S)         \
  CL_CAST_PAIR(SN, S, f32, cl_f32)  \
  CL_CAST_PAIR(SN, S, f16, cl_f16)  \
  CL_CAST_PAIR(SN, S, bf16, cl_bf16)

CL_CAST_FROM(f32, cl_f32)
CL_CAST_FROM(f16, cl_f16)
CL_CAST_FROM(bf16, cl_bf16)
