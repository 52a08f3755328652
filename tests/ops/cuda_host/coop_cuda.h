// Host C++ definitions that let kernels/*.cu compile with g++ and run on a
// CPU with per-thread CUDA semantics (see coop_runtime.cpp).
//
// Every CUDA thread is a fiber with its own stack, scheduled cooperatively:
//   __syncthreads()       block barrier; a barrier that part of the block
//                         never reaches (threads exited, or waiting at
//                         another __syncthreads) is reported, not hung
//   __*_sync(mask, ...)   rendezvous of the lanes named in `mask` (the
//                         calling lane must be in it; a named lane that has
//                         exited, is outside the block or waits at another
//                         collective is reported)
//   __shared__            static storage in section "coop_shared_<unit>" (one
//                         per kernel source); the runtime swaps a per-block
//                         image of the launched kernel's section in and out,
//                         each block's image starts filled with junk
//   atomic*, __nanosleep  checked, atomic (no fiber switch inside); a
//                         __nanosleep yields, so spin loops on a flag let
//                         the flag's writer run
// Every load and store of the kernel code (g++ -fsanitize=thread, see
// coop_runtime.cpp) is checked against the regions the
// launch registered (fiber stacks and shared memory are always allowed);
// float4/int4 copies and cl_ld16/cl_st16 are checked for 16-byte alignment.
#ifndef COOP_CUDA_H
#define COOP_CUDA_H

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

struct uint3 { unsigned x, y, z; };
struct dim3 { unsigned x, y, z; };

namespace coop {
dim3 thread_idx();
dim3 block_idx();
dim3 block_dim();
dim3 grid_dim();
void syncthreads(const char* file, int line);
// kind: 0 sync, 1 shfl idx, 2 shfl up, 3 shfl down, 4 shfl xor, 5 ballot, 6 any, 7 all
uint64_t warp_op(int kind, unsigned mask, uint64_t value, int arg, int width, const char* file,
                 int line);
unsigned activemask();
void nanosleep_yield();
void fence();
void check_access(const void* p, unsigned long long bytes, bool is_write, bool vector);
// A 16-byte access (instrumented as narrower ones): alignment and bounds.
void check_vector(const void* p, bool is_write);
uint32_t atomic32(int op, void* p, uint32_t v, uint32_t cmp);
uint64_t atomic64(int op, void* p, uint64_t v, uint64_t cmp);
enum { kAdd, kOr, kAnd, kXor, kMaxU, kMinU, kMaxS, kMinS, kExch, kCas, kAddF };

template <class T>
inline uint64_t bits_of(T v) {
  static_assert(sizeof(T) <= 8, "warp operands are at most 8 bytes");
  uint64_t b = 0;
  std::memcpy(&b, &v, sizeof(T));
  return b;
}
template <class T>
inline T from_bits(uint64_t b) {
  T v;
  std::memcpy(&v, &b, sizeof(T));
  return v;
}

// Kernel registry: each kernel is called from its fibers through
// Invoker<decltype(&k)>::call<&k>(argument slots). A slot holds a pointer,
// an integer (sign- or zero-extended) or a float's bits in its low half.
// A kernel's shared memory is the [shared_lo, shared_hi) part of the
// __shared__ statics: its source's (the unit's .bss, renamed to section
// coop_shared_<unit> after compiling), which a block of it owns alone.
typedef void (*Invoke)(const uint64_t* slots);
void register_kernel(const char* name, Invoke call, const char* signature, char* shared_lo,
                     char* shared_hi, const char* unit);

template <class T>
inline T arg_of(uint64_t v) {
  if constexpr (std::is_pointer_v<T>) {
    return reinterpret_cast<T>(static_cast<uintptr_t>(v));
  } else if constexpr (std::is_same_v<T, float>) {
    return from_bits<float>(v & 0xffffffffu);
  } else {
    return static_cast<T>(v);
  }
}
template <class T>
constexpr char kind_of() {
  if constexpr (std::is_pointer_v<T>) return 'p';
  else if constexpr (std::is_same_v<T, float>) return 'f';
  else if constexpr (std::is_signed_v<T>) return sizeof(T) == 8 ? 'q' : 'i';
  else return sizeof(T) == 8 ? 'Q' : 'I';
}

template <class F>
struct Invoker;
template <class... A>
struct Invoker<void (*)(A...)> {
  template <void (*f)(A...), size_t... I>
  static void call_with(const uint64_t* s, std::index_sequence<I...>) {
    f(arg_of<A>(s[I])...);
  }
  template <void (*f)(A...)>
  static void call(const uint64_t* s) {
    call_with<f>(s, std::index_sequence_for<A...>{});
  }
  static const char* signature() {
    static const char sig[] = {kind_of<A>()..., '\0'};
    return sig;
  }
};

struct Registrar {
  Registrar(const char* name, Invoke call, const char* sig, char* lo, char* hi, const char* unit) {
    register_kernel(name, call, sig, lo, hi, unit);
  }
};
}  // namespace coop

// COOP_UNIT_SHARED: the unit's section bounds and name, "lo, hi, name"
// (defined by the unit, see tests/ops/cuda_host_build.py)
#define COOP_REGISTER(NAME)                                                          \
  static ::coop::Registrar coop_registrar_##NAME(                                    \
      #NAME, &::coop::Invoker<decltype(&NAME)>::call<&NAME>,                         \
      ::coop::Invoker<decltype(&NAME)>::signature(), COOP_UNIT_SHARED);

// ---------------------------------------------------------------- keywords
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __shared__ static  // .bss of a kernel unit, renamed coop_shared_<unit> by the build

#define threadIdx (::coop::thread_idx())
#define blockIdx (::coop::block_idx())
#define blockDim (::coop::block_dim())
#define gridDim (::coop::grid_dim())
#define warpSize 32

#define __syncthreads() ::coop::syncthreads(__FILE__, __LINE__)

// Vector types. float4/int4 are only ever read or written whole through a
// reinterpret_cast pointer by the kernels: copying checks the 16-byte access.
#define COOP_VEC4(NAME, T)                                                            \
  struct alignas(16) NAME {                                                         \
    T x, y, z, w;                                                                   \
    NAME() = default;                                                               \
    NAME(const NAME& o) {                                                           \
      ::coop::check_vector(&o, false);                                              \
      x = o.x; y = o.y; z = o.z; w = o.w;                                           \
    }                                                                               \
    NAME& operator=(const NAME& o) {                                                \
      ::coop::check_vector(this, true);                                             \
      x = o.x; y = o.y; z = o.z; w = o.w;                                           \
      return *this;                                                                 \
    }                                                                               \
  };
COOP_VEC4(float4, float)
COOP_VEC4(int4, int)
#undef COOP_VEC4
struct alignas(16) uint4 { unsigned x, y, z, w; };  // cl_ld16/cl_st16 check it

#ifndef CL_CHECK_ACCESS
#define CL_CHECK_ACCESS(ptr, bytes, is_write) \
  ((bytes) == 16 ? ::coop::check_vector((const void*)(ptr), (is_write)) : (void)0)
#endif

// ---------------------------------------------------------------- intrinsics
inline unsigned __float_as_uint(float f) { return coop::from_bits<unsigned>(coop::bits_of(f)); }
inline float __uint_as_float(unsigned u) { return coop::from_bits<float>(u); }
inline int __float_as_int(float f) { return coop::from_bits<int>(coop::bits_of(f)); }
inline float __int_as_float(int i) { return coop::from_bits<float>(coop::bits_of(i)); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll((unsigned long long)x); }
inline unsigned __brev(unsigned x) {
  x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
  x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
  x = ((x >> 4) & 0x0f0f0f0fu) | ((x & 0x0f0f0f0fu) << 4);
  x = ((x >> 8) & 0x00ff00ffu) | ((x & 0x00ff00ffu) << 8);
  return (x >> 16) | (x << 16);
}
inline void __nanosleep(unsigned) { coop::nanosleep_yield(); }
inline void __threadfence() { coop::fence(); }
inline void __threadfence_block() { coop::fence(); }
inline unsigned __activemask() { return coop::activemask(); }

// The call site names the collective (lanes of one rendezvous must agree).
inline void coop_syncwarp(const char* file, int line, unsigned mask = 0xffffffffu) {
  coop::warp_op(0, mask, 0, 0, 32, file, line);
}
template <class T>
inline T coop_shfl(int kind, const char* file, int line, unsigned mask, T v, int arg,
                   int width = 32) {
  return coop::from_bits<T>(coop::warp_op(kind, mask, coop::bits_of(v), arg, width, file, line));
}
#define __syncwarp(...) coop_syncwarp(__FILE__, __LINE__, ##__VA_ARGS__)
#define __shfl_sync(...) coop_shfl(1, __FILE__, __LINE__, __VA_ARGS__)
#define __shfl_up_sync(...) coop_shfl(2, __FILE__, __LINE__, __VA_ARGS__)
#define __shfl_down_sync(...) coop_shfl(3, __FILE__, __LINE__, __VA_ARGS__)
#define __shfl_xor_sync(...) coop_shfl(4, __FILE__, __LINE__, __VA_ARGS__)
#define __ballot_sync(m, p) \
  ((unsigned)::coop::warp_op(5, m, (p) ? 1 : 0, 0, 32, __FILE__, __LINE__))
#define __any_sync(m, p) ((int)::coop::warp_op(6, m, (p) ? 1 : 0, 0, 32, __FILE__, __LINE__))
#define __all_sync(m, p) ((int)::coop::warp_op(7, m, (p) ? 1 : 0, 0, 32, __FILE__, __LINE__))

#define COOP_ATOMIC32(T)                                                                   \
  inline T atomicAdd(T* p, T v) { return (T)coop::atomic32(coop::kAdd, p, (uint32_t)v, 0); } \
  inline T atomicOr(T* p, T v) { return (T)coop::atomic32(coop::kOr, p, (uint32_t)v, 0); }   \
  inline T atomicAnd(T* p, T v) { return (T)coop::atomic32(coop::kAnd, p, (uint32_t)v, 0); } \
  inline T atomicXor(T* p, T v) { return (T)coop::atomic32(coop::kXor, p, (uint32_t)v, 0); } \
  inline T atomicExch(T* p, T v) { return (T)coop::atomic32(coop::kExch, p, (uint32_t)v, 0); } \
  inline T atomicCAS(T* p, T c, T v) {                                                     \
    return (T)coop::atomic32(coop::kCas, p, (uint32_t)v, (uint32_t)c);                     \
  }
COOP_ATOMIC32(unsigned)
COOP_ATOMIC32(int)
#undef COOP_ATOMIC32
inline unsigned atomicMax(unsigned* p, unsigned v) { return coop::atomic32(coop::kMaxU, p, v, 0); }
inline unsigned atomicMin(unsigned* p, unsigned v) { return coop::atomic32(coop::kMinU, p, v, 0); }
inline int atomicMax(int* p, int v) { return (int)coop::atomic32(coop::kMaxS, p, (uint32_t)v, 0); }
inline int atomicMin(int* p, int v) { return (int)coop::atomic32(coop::kMinS, p, (uint32_t)v, 0); }
inline float atomicAdd(float* p, float v) {
  return __uint_as_float(coop::atomic32(coop::kAddF, p, __float_as_uint(v), 0));
}
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
  return coop::atomic64(coop::kAdd, p, v, 0);
}
inline unsigned long long atomicOr(unsigned long long* p, unsigned long long v) {
  return coop::atomic64(coop::kOr, p, v, 0);
}
inline unsigned long long atomicMax(unsigned long long* p, unsigned long long v) {
  return coop::atomic64(coop::kMaxU, p, v, 0);
}
inline unsigned long long atomicExch(unsigned long long* p, unsigned long long v) {
  return coop::atomic64(coop::kExch, p, v, 0);
}
inline unsigned long long atomicCAS(unsigned long long* p, unsigned long long c,
                                    unsigned long long v) {
  return coop::atomic64(coop::kCas, p, v, c);
}

#endif  // COOP_CUDA_H
