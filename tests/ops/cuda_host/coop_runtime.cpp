// Cooperative scheduler and checks behind coop_cuda.h. Built without
// instrumentation; the kernel translation units are built with
// -fsanitize=thread, so every load and store they make calls
// __tsan_{read,write}N, defined here to check the access (and maybe yield,
// see Config::p_yield).
//
// C API (ctypes):
//   coop_launch(name, grid, block, slots, nslots, regions, nregions, config)
//       runs the kernel `name` over a 1-D grid of 1-D blocks; returns the
//       number of errors found (0: clean), -1 unknown kernel, -2 wrong
//       argument count. Messages: coop_errors().
//   coop_spins()          __nanosleep calls of the last launch (spins on flags)
//   coop_signature(name)  one character per parameter (p pointer, f float,
//                         i/I 32-bit and q/Q 64-bit signed/unsigned), or NULL
//   coop_kernels()        space-separated names of the registered kernels
//   coop_unit(name)       the kernel's source (its shared memory is section
//                         coop_shared_<unit>), or NULL
#include <sys/mman.h>

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <map>
#include <string>
#include <type_traits>
#include <vector>

#include "coop_cuda.h"

#if defined(__x86_64__)
asm(R"(
  .text
  .p2align 4
  .globl coop_switch_ctx
  .hidden coop_switch_ctx
  .type coop_switch_ctx,@function
coop_switch_ctx:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size coop_switch_ctx, .-coop_switch_ctx
)");
extern "C" void coop_switch_ctx(void** save, void* to);
#else
#include <ucontext.h>
#endif

namespace coop {

struct Region {
  uint64_t lo, hi;
  const char* name;
  unsigned char* writes;  // null, or one saturating store count per byte of the region
};

struct Config {
  int order;          // blocks start in 0 ascending, 1 descending, 2 seeded random order
  int resident;       // blocks running at once (1: one after another)
  int policy;         // threads of a block: 0 round robin, 1 reverse, 2 random
  double p_yield;     // chance that a shared/global access or atomic switches fibers
  uint64_t seed;
  long long spin_limit;  // __nanosleep calls allowed per launch
  long long op_limit;    // checked accesses allowed per launch
};

namespace {

constexpr size_t kStack = 64 * 1024;
enum State { kReady, kAtBarrier, kAtWarp, kDone };

struct Block;

// Last accesses of one 4-byte word of shared memory, for the race check: an
// access conflicts with an earlier one by another thread of the block in the
// same barrier interval unless both are atomic or a warp collective of their
// (common) warp completed in between.
struct Access {
  int tid = -1;  // -1 none, -2 several threads (reads only)
  uint32_t epoch = 0, clock = 0;
  bool atomic = false;
};
struct Shadow {
  Access write, read;
};

struct Fiber {
#if defined(__x86_64__)
  void* sp;
#else
  ucontext_t ctx;
#endif
  dim3 tid;
  int index;
  Block* blk;
  State state;
  uint64_t result;
  char* stack;
};

struct Warp {
  unsigned arrived = 0, mask = 0, exited = 0;
  uint32_t clock = 0;  // collectives completed: they order the accesses of their lanes
  int kind = -1, width = 32, line = 0;
  const char* file = "";
  uint64_t vals[32];
  int args[32];
};

struct Block {
  dim3 id;
  int slot;
  std::vector<Fiber> fibers;
  std::vector<Warp> warps;
  int live = 0, at_barrier = 0, bline = 0;
  const char* bfile = "";
  std::vector<unsigned char> image;
  size_t cursor = 0;
  uint32_t epoch = 1;          // barriers completed + 1
  std::vector<Shadow> shadow;  // one per 4-byte word of shared memory
};

const char* const kOpNames[] = {"__syncwarp", "__shfl_sync", "__shfl_up_sync",
                                "__shfl_down_sync", "__shfl_xor_sync", "__ballot_sync",
                                "__any_sync", "__all_sync"};

struct Kernel {
  Invoke call;
  const char* signature;
  char* shared_lo;   // its source's __shared__ statics: the block's shared memory
  char* shared_hi;
  const char* unit;
};

std::map<std::string, Kernel>& registry() {
  static std::map<std::string, Kernel> r;
  return r;
}

// launch state
const char* g_kernel = "";
Invoke g_call = nullptr;
const uint64_t* g_slots = nullptr;
int g_nslots = 0;
dim3 g_grid{1, 1, 1}, g_block{1, 1, 1};
std::vector<Region> g_regions;
Config g_cfg;
bool g_active = false, g_abort = false;
Fiber* g_cur = nullptr;
Block* g_loaded = nullptr;  // block whose shared image is in the section
char* g_shared = nullptr;   // the launched kernel's part of the section
size_t g_shared_bytes = 0;
long long g_spins = 0, g_ops = 0;
uint64_t g_rng = 1;
int g_nerrors = 0;
std::string g_errors;
char* g_stacks = nullptr;
size_t g_stack_count = 0;
#if defined(__x86_64__)
void* g_sched_sp = nullptr;
#else
ucontext_t g_sched_ctx;
#endif

uint64_t next_random() {
  g_rng ^= g_rng << 13;
  g_rng ^= g_rng >> 7;
  g_rng ^= g_rng << 17;
  return g_rng;
}

void error(const char* fmt, ...) {
  ++g_nerrors;
  if (g_nerrors > 20) return;
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  g_errors += g_kernel;
  if (g_cur != nullptr) {
    char who[64];
    snprintf(who, sizeof who, " (block %u thread %u)", g_cur->blk->id.x, g_cur->tid.x);
    g_errors += who;
  }
  g_errors += ": ";
  g_errors += buf;
  g_errors += "\n";
}

void to_scheduler() {
  Fiber* f = g_cur;
#if defined(__x86_64__)
  coop_switch_ctx(&f->sp, g_sched_sp);
#else
  swapcontext(&f->ctx, &g_sched_ctx);
#endif
}

// A fatal error: report it and never run this launch's fibers again.
void fatal_in_fiber() {
  g_abort = true;
  to_scheduler();
  __builtin_unreachable();
}

void maybe_yield() {
  if (g_cfg.p_yield > 0 &&
      (double)(next_random() >> 11) * (1.0 / 9007199254740992.0) < g_cfg.p_yield)
    to_scheduler();
}

void release_barrier_if_complete(Block* b) {
  const int n = (int)b->fibers.size();
  if (b->at_barrier == 0) return;
  if (b->at_barrier == n) {
    for (Fiber& f : b->fibers) f.state = kReady;
    b->at_barrier = 0;
    ++b->epoch;
  } else if (b->at_barrier == b->live) {
    error("__syncthreads at %s:%d reached by %d of %d threads; the other %d exited", b->bfile,
          b->bline, b->at_barrier, n, n - b->live);
    g_abort = true;
  }
}

void fiber_exit() {
  Fiber* f = g_cur;
  Block* b = f->blk;
  f->state = kDone;
  --b->live;
  Warp& w = b->warps[f->index / 32];
  const unsigned bit = 1u << (f->index % 32);
  w.exited |= bit;
  if (w.arrived != 0 && (w.mask & bit)) {
    error("exited while lanes 0x%08x wait for it at %s (mask 0x%08x) at %s:%d", w.arrived,
          kOpNames[w.kind], w.mask, w.file, w.line);
    g_abort = true;
  }
  release_barrier_if_complete(b);
  to_scheduler();
  __builtin_unreachable();
}

void fiber_entry() {
  g_call(g_slots);
  fiber_exit();
}

void ensure_stacks(size_t count) {
  if (count <= g_stack_count) return;
  if (g_stacks != nullptr) munmap(g_stacks, g_stack_count * kStack);
  void* p = mmap(nullptr, count * kStack, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    g_stacks = nullptr;
    g_stack_count = 0;
    return;
  }
  g_stacks = static_cast<char*>(p);
  g_stack_count = count;
}

void init_fiber(Fiber& f) {
  char* top = f.stack + kStack;
#if defined(__x86_64__)
  uint64_t* sp = reinterpret_cast<uint64_t*>(reinterpret_cast<uintptr_t>(top) & ~uintptr_t(15));
  *--sp = 0;                                          // fiber_entry never returns
  *--sp = reinterpret_cast<uint64_t>(&fiber_entry);  // popped by ret
  for (int r = 0; r < 6; ++r) *--sp = 0;              // rbp rbx r12 r13 r14 r15
  *--sp = 0x1F80ull | (0x037Full << 32);              // mxcsr, x87 control word
  f.sp = sp;
#else
  getcontext(&f.ctx);
  f.ctx.uc_stack.ss_sp = f.stack;
  f.ctx.uc_stack.ss_size = kStack;
  f.ctx.uc_link = nullptr;
  makecontext(&f.ctx, &fiber_entry, 0);
#endif
}

size_t shared_bytes() { return g_shared_bytes; }

Block* start_block(unsigned id, int slot) {
  Block* b = new Block;
  b->id = dim3{id, 0, 0};
  b->slot = slot;
  const unsigned n = g_block.x;
  b->fibers.resize(n);
  b->warps.resize((n + 31) / 32);
  for (unsigned t = 0; t < n; ++t) {
    Fiber& f = b->fibers[t];
    f.tid = dim3{t, 0, 0};
    f.index = (int)t;
    f.blk = b;
    f.state = kReady;
    f.stack = g_stacks + ((size_t)slot * n + t) * kStack;
    init_fiber(f);
  }
  b->live = (int)n;
  const size_t bytes = shared_bytes();
  b->image.resize(bytes);
  b->shadow.assign((bytes + 3) / 4, Shadow());
  for (size_t i = 0; i < bytes; i += 8) {  // uninitialised junk
    const uint64_t r = next_random();
    std::memcpy(b->image.data() + i, &r, std::min<size_t>(8, bytes - i));
  }
  return b;
}

void load_image(Block* b) {
  if (g_loaded == b) return;
  const size_t n = shared_bytes();
  if (n != 0) {
    if (g_loaded != nullptr) std::memcpy(g_loaded->image.data(), g_shared, n);
    std::memcpy(g_shared, b->image.data(), n);
  }
  g_loaded = b;
}

void report_stall(Block* b) {
  int barrier = 0, warp = 0;
  for (Fiber& f : b->fibers) {
    barrier += f.state == kAtBarrier;
    warp += f.state == kAtWarp;
  }
  std::string pending;
  for (size_t w = 0; w < b->warps.size(); ++w)
    if (b->warps[w].arrived != 0) {
      char buf[160];
      snprintf(buf, sizeof buf, "; warp %zu: lanes 0x%08x at %s:%d wait for mask 0x%08x", w,
               b->warps[w].arrived, b->warps[w].file, b->warps[w].line, b->warps[w].mask);
      pending += buf;
    }
  error("block %u deadlocked: %d threads at __syncthreads (%s:%d), %d at warp collectives%s",
        b->id.x, barrier, b->bfile, b->bline, warp, pending.c_str());
}

// Next ready fiber of b by the policy, or null.
Fiber* pick_fiber(Block* b) {
  const size_t n = b->fibers.size();
  size_t start = b->cursor;
  if (g_cfg.policy == 2) start = next_random() % n;
  for (size_t k = 0; k < n; ++k) {
    const size_t i = g_cfg.policy == 1 ? (start + n - k) % n : (start + k) % n;
    if (b->fibers[i].state == kReady) {
      b->cursor = g_cfg.policy == 1 ? (i + n - 1) % n : (i + 1) % n;
      return &b->fibers[i];
    }
  }
  return nullptr;
}

void run_fiber(Fiber* f) {
  load_image(f->blk);
  g_cur = f;
#if defined(__x86_64__)
  coop_switch_ctx(&g_sched_sp, f->sp);
#else
  swapcontext(&g_sched_ctx, &f->ctx);
#endif
  g_cur = nullptr;
}

void schedule() {
  std::vector<unsigned> order(g_grid.x);
  for (unsigned i = 0; i < g_grid.x; ++i) order[i] = i;
  if (g_cfg.order == 1) std::reverse(order.begin(), order.end());
  if (g_cfg.order == 2)
    for (size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[next_random() % i]);
  const int resident = std::max(1, std::min<int>(g_cfg.resident, (int)g_grid.x));
  std::vector<Block*> active;
  std::vector<int> free_slots;
  for (int s = resident - 1; s >= 0; --s) free_slots.push_back(s);
  size_t started = 0;
  Block* cur = nullptr;
  long long quantum = 0;
  while (!g_abort) {
    while ((int)active.size() < resident && started < order.size()) {
      const int slot = free_slots.back();
      free_slots.pop_back();
      active.push_back(start_block(order[started++], slot));
    }
    if (active.empty()) break;
    if (cur == nullptr || quantum-- <= 0) {
      cur = active[next_random() % active.size()];
      quantum = (long long)(next_random() % 512);
    }
    Fiber* f = pick_fiber(cur);
    if (f == nullptr) {
      report_stall(cur);
      break;
    }
    run_fiber(f);
    if (cur->live == 0) {
      if (g_loaded == cur) g_loaded = nullptr;
      free_slots.push_back(cur->slot);
      active.erase(std::find(active.begin(), active.end(), cur));
      delete cur;
      cur = nullptr;
    }
  }
  for (Block* b : active) delete b;
  g_loaded = nullptr;
}

// Regions sorted by start when none overlap (binary search), else in the
// caller's order (the first region holding an address wins).
bool g_disjoint = false;

void prepare_regions() {
  std::vector<Region> sorted = g_regions;
  std::sort(sorted.begin(), sorted.end(),
            [](const Region& x, const Region& y) { return x.lo < y.lo; });
  g_disjoint = true;
  for (size_t i = 1; i < sorted.size(); ++i)
    if (sorted[i].lo < sorted[i - 1].hi) g_disjoint = false;
  if (g_disjoint) g_regions.swap(sorted);
}

const Region* region_of(uint64_t a) {
  if (!g_disjoint) {
    for (const Region& r : g_regions)
      if (a >= r.lo && a < r.hi) return &r;
    return nullptr;
  }
  auto it = std::upper_bound(g_regions.begin(), g_regions.end(), a,
                             [](uint64_t x, const Region& r) { return x < r.lo; });
  if (it == g_regions.begin()) return nullptr;
  --it;
  return a < it->hi ? &*it : nullptr;
}

void report_outside(uint64_t a, unsigned long long bytes, bool is_write) {
  const Region* near = nullptr;
  long long best = 0;
  for (const Region& r : g_regions) {
    const long long d = a < r.lo ? (long long)(r.lo - a)
                                 : (a >= r.hi ? (long long)(a - r.hi + 1) : 0);
    if (near == nullptr || d < best) {
      near = &r;
      best = d;
    }
  }
  if (near == nullptr)
    error("%llu-byte %s at %#llx: no region registered", bytes, is_write ? "store" : "load",
          (unsigned long long)a);
  else
    error("out-of-bounds %llu-byte %s at byte offset %lld of '%s' (%llu bytes)", bytes,
          is_write ? "store" : "load", (long long)(a - near->lo), near->name,
          (unsigned long long)(near->hi - near->lo));
}

}  // namespace

namespace {
bool ordered(const Access& prev, const Fiber* f) {
  if (prev.tid < 0 && prev.tid != -2) return true;
  if (prev.epoch != f->blk->epoch) return true;
  if (prev.tid == f->index) return true;
  return prev.tid >= 0 && prev.tid / 32 == f->index / 32 &&
         f->blk->warps[f->index / 32].clock != prev.clock;
}

void race(const char* what, uint64_t offset, const Access& prev, const char* prev_what) {
  if (prev.tid == -2)
    error("shared memory race: %s of byte %llu of shared memory after reads by several other "
          "threads, no __syncthreads between", what, (unsigned long long)offset);
  else
    error("shared memory race: %s of byte %llu of shared memory after %s by thread %d, no "
          "__syncthreads between", what, (unsigned long long)offset, prev_what, prev.tid);
}

void check_shared(uint64_t offset, unsigned long long bytes, bool is_write, bool atomic) {
  Fiber* f = g_cur;
  Block* b = f->blk;
  const uint32_t clock = b->warps[f->index / 32].clock;
  for (uint64_t w = offset / 4; w <= (offset + bytes - 1) / 4 && w < b->shadow.size(); ++w) {
    Shadow& sh = b->shadow[w];
    if (!ordered(sh.write, f) && !(atomic && sh.write.atomic)) {
      race(is_write ? (atomic ? "atomic" : "write") : "read", offset, sh.write,
           sh.write.atomic ? "an atomic" : "a write");
      continue;
    }
    if (is_write) {
      if (!ordered(sh.read, f)) {
        race(atomic ? "atomic" : "write", offset, sh.read, "a read");
        continue;
      }
      sh.write = Access{f->index, b->epoch, clock, atomic};
      sh.read = Access();
    } else if (sh.read.tid >= 0 && sh.read.epoch == b->epoch && sh.read.tid != f->index &&
               !ordered(sh.read, f)) {
      sh.read.tid = -2;  // several readers: any other thread's write now conflicts
    } else if (sh.read.tid != -2 || sh.read.epoch != b->epoch) {
      sh.read = Access{f->index, b->epoch, clock, false};
    }
  }
}
}  // namespace

void register_kernel(const char* name, Invoke call, const char* signature, char* shared_lo,
                     char* shared_hi, const char* unit) {
  if (shared_lo == nullptr || shared_hi == nullptr) shared_lo = shared_hi = nullptr;
  registry()[name] = Kernel{call, signature, shared_lo, shared_hi, unit};
}

dim3 thread_idx() { return g_cur ? g_cur->tid : dim3{0, 0, 0}; }
dim3 block_idx() { return g_cur ? g_cur->blk->id : dim3{0, 0, 0}; }
dim3 block_dim() { return g_block; }
dim3 grid_dim() { return g_grid; }

namespace {
// vector: a 16-byte access that the instrumentation also sees (as narrower
// ones, which count the stores and may switch fibers): alignment and bounds
// only.
void check(const void* p, unsigned long long bytes, bool is_write, bool vector, bool atomic) {
  if (!g_active || g_cur == nullptr) return;
  const uint64_t a = (uint64_t)(uintptr_t)p;
  if (++g_ops > g_cfg.op_limit) {
    error("more than %lld checked accesses: runaway loop?", g_cfg.op_limit);
    fatal_in_fiber();
  }
  const uint64_t stack_lo = (uint64_t)(uintptr_t)g_stacks;
  if (a >= stack_lo && a + bytes <= stack_lo + g_stack_count * kStack) return;  // locals
  const uint64_t slots_lo = (uint64_t)(uintptr_t)g_slots;
  if (a >= slots_lo && a + bytes <= slots_lo + 8 * g_nslots) return;  // kernel arguments
  const uint64_t sh_lo = (uint64_t)(uintptr_t)g_shared;
  if (shared_bytes() != 0 && a >= sh_lo && a < sh_lo + shared_bytes()) {
    if (a + bytes > sh_lo + shared_bytes())
      error("%llu-byte shared access runs past the end of shared memory", bytes);
    if (vector) return;
    check_shared(a - sh_lo, bytes, is_write, atomic);
    maybe_yield();
    return;
  }
  const unsigned long long align = vector ? 16 : bytes;
  if ((align == 2 || align == 4 || align == 8 || align == 16) && a % align != 0)
    error("misaligned %llu-byte %s at %#llx", bytes, is_write ? "store" : "load",
          (unsigned long long)a);
  const Region* r = region_of(a);
  if (r == nullptr || a + bytes > r->hi) {
    report_outside(a, bytes, is_write);
  } else if (vector) {
    return;
  } else if (is_write && r->writes != nullptr) {
    for (uint64_t i = a - r->lo; i < a - r->lo + bytes; ++i)
      if (r->writes[i] != 255) ++r->writes[i];
  }
  maybe_yield();
}
}  // namespace

void check_access(const void* p, unsigned long long bytes, bool is_write, bool vector) {
  check(p, bytes, is_write, vector, false);
}

void check_vector(const void* p, bool is_write) { check(p, 16, is_write, true, false); }

namespace {
// Read-modify-write of *p as one step: no fiber switch inside.
template <class U>
U atomic_rmw(int op, void* p, U v, U cmp) {
  typedef std::make_signed_t<U> S;
  check(p, sizeof(U), true, false, true);
  U* q = static_cast<U*>(p);
  const U old = *q;
  switch (op) {
    case kAdd: *q = old + v; break;
    case kOr: *q = old | v; break;
    case kAnd: *q = old & v; break;
    case kXor: *q = old ^ v; break;
    case kMaxU: *q = std::max(old, v); break;
    case kMinU: *q = std::min(old, v); break;
    case kMaxS: *q = (U)std::max((S)old, (S)v); break;
    case kMinS: *q = (U)std::min((S)old, (S)v); break;
    case kExch: *q = v; break;
    case kCas: if (old == cmp) *q = v; break;
    case kAddF:
      if constexpr (sizeof(U) == 4) *q = from_bits<U>(bits_of(from_bits<float>(old) +
                                                              from_bits<float>(v)));
      break;
  }
  return old;
}
}  // namespace

uint32_t atomic32(int op, void* p, uint32_t v, uint32_t cmp) {
  return atomic_rmw<uint32_t>(op, p, v, cmp);
}

uint64_t atomic64(int op, void* p, uint64_t v, uint64_t cmp) {
  return atomic_rmw<uint64_t>(op, p, v, cmp);
}

void fence() {
  if (g_cur != nullptr) maybe_yield();
}

void nanosleep_yield() {
  if (g_cur == nullptr) return;
  if (++g_spins > g_cfg.spin_limit) {
    error("spun more than %lld times in __nanosleep: waits for a flag nobody sets?",
          g_cfg.spin_limit);
    fatal_in_fiber();
  }
  to_scheduler();
}

unsigned activemask() {
  if (g_cur == nullptr) return 0;
  const Block* b = g_cur->blk;
  const int w = g_cur->index / 32;
  const int lanes = std::min(32, (int)b->fibers.size() - 32 * w);
  const unsigned present = lanes == 32 ? 0xffffffffu : ((1u << lanes) - 1u);
  return present & ~b->warps[w].exited;
}

namespace {

// Results of the collective of warp w of b once every lane of its mask arrived.
bool complete_collective(Block* b, int w) {
  Warp& W = b->warps[w];
  unsigned ballot = 0;
  for (int l = 0; l < 32; ++l)
    if ((W.mask >> l & 1u) && W.vals[l] != 0) ballot |= 1u << l;
  for (int l = 0; l < 32; ++l) {
    if (!(W.mask >> l & 1u)) continue;
    const int base = l & ~(W.width - 1), pos = l & (W.width - 1);
    int src = l;
    switch (W.kind) {
      case 1: src = base + (W.args[l] & (W.width - 1)); break;
      case 2: src = pos - W.args[l] >= 0 ? l - W.args[l] : l; break;
      case 3: src = pos + W.args[l] < W.width ? l + W.args[l] : l; break;
      case 4: src = ((l ^ W.args[l]) & ~(W.width - 1)) == base ? (l ^ W.args[l]) : l; break;
      default: break;
    }
    if (!(W.mask >> src & 1u)) {
      error("%s at %s:%d: lane %d reads lane %d, which is not in mask 0x%08x",
            kOpNames[W.kind], W.file, W.line, l, src, W.mask);
      return false;
    }
    uint64_t r = 0;
    switch (W.kind) {
      case 0: r = 0; break;
      case 5: r = ballot; break;
      case 6: r = ballot != 0; break;
      case 7: r = ballot == W.mask; break;
      default: r = W.vals[src];
    }
    Fiber& f = b->fibers[w * 32 + l];
    f.result = r;
    f.state = kReady;
  }
  W.arrived = 0;
  ++W.clock;
  return true;
}
}  // namespace

uint64_t warp_op(int kind, unsigned mask, uint64_t value, int arg, int width, const char* file,
                 int line) {
  Fiber* f = g_cur;
  if (f == nullptr) return value;
  Block* b = f->blk;
  const int w = f->index / 32, lane = f->index % 32;
  Warp& W = b->warps[w];
  const int lanes = std::min(32, (int)b->fibers.size() - 32 * w);
  const unsigned present = lanes == 32 ? 0xffffffffu : ((1u << lanes) - 1u);
  if (!(mask >> lane & 1u)) {
    error("%s at %s:%d: calling lane %d is not in mask 0x%08x", kOpNames[kind], file, line, lane,
          mask);
    fatal_in_fiber();
  }
  if (mask & ~present) {
    error("%s at %s:%d: mask 0x%08x names lanes outside the block", kOpNames[kind], file, line,
          mask);
    fatal_in_fiber();
  }
  if (mask & W.exited) {
    error("%s at %s:%d: mask 0x%08x names exited lanes 0x%08x", kOpNames[kind], file, line, mask,
          mask & W.exited);
    fatal_in_fiber();
  }
  if (width < 1 || width > 32 || (width & (width - 1))) {
    error("%s at %s:%d: width %d is not a power of two <= 32", kOpNames[kind], file, line, width);
    fatal_in_fiber();
  }
  if (W.arrived == 0) {
    W.kind = kind;
    W.mask = mask;
    W.width = width;
    W.file = file;
    W.line = line;
  } else if (W.kind != kind || W.mask != mask || W.width != width || W.line != line ||
             std::strcmp(W.file, file) != 0) {
    error("%s (mask 0x%08x) at %s:%d while lanes 0x%08x wait at %s (mask 0x%08x) at %s:%d",
          kOpNames[kind], mask, file, line, W.arrived, kOpNames[W.kind], W.mask, W.file, W.line);
    fatal_in_fiber();
  }
  W.vals[lane] = value;
  W.args[lane] = arg;
  W.arrived |= 1u << lane;
  f->state = kAtWarp;
  if (W.arrived == W.mask && !complete_collective(b, w)) fatal_in_fiber();
  to_scheduler();
  return f->result;
}

void syncthreads(const char* file, int line) {
  Fiber* f = g_cur;
  if (f == nullptr) return;
  Block* b = f->blk;
  if (b->at_barrier == 0) {
    b->bfile = file;
    b->bline = line;
  } else if (b->bline != line || std::strcmp(b->bfile, file) != 0) {
    error("__syncthreads at %s:%d while %d threads wait at the one at %s:%d", file, line,
          b->at_barrier, b->bfile, b->bline);
    fatal_in_fiber();
  }
  f->state = kAtBarrier;
  ++b->at_barrier;
  release_barrier_if_complete(b);
  to_scheduler();
}

}  // namespace coop

using coop::check_access;

extern "C" {
// g++ -fsanitize=thread (--param tsan-distinguish-volatile=1) instruments
// every load and store of the kernel units separately (unlike
// -fsanitize=address, which drops the check of a store to an address a load
// just checked): the calls land here.
void __tsan_init() {}
void __tsan_func_entry(void*) {}
void __tsan_func_exit() {}
#define COOP_TSAN(N)                                                                      \
  void __tsan_read##N(void* a) { check_access(a, N, false, false); }                     \
  void __tsan_write##N(void* a) { check_access(a, N, true, false); }                     \
  void __tsan_unaligned_read##N(void* a) { check_access(a, N, false, false); }           \
  void __tsan_unaligned_write##N(void* a) { check_access(a, N, true, false); }           \
  void __tsan_volatile_read##N(void* a) { check_access(a, N, false, false); }            \
  void __tsan_volatile_write##N(void* a) { check_access(a, N, true, false); }
COOP_TSAN(1)
COOP_TSAN(2)
COOP_TSAN(4)
COOP_TSAN(8)
COOP_TSAN(16)
#undef COOP_TSAN
void __tsan_read_range(void* a, unsigned long n) { check_access(a, n, false, false); }
void __tsan_write_range(void* a, unsigned long n) { check_access(a, n, true, false); }

int coop_launch(const char* name, unsigned grid, unsigned block, const uint64_t* slots,
                int nslots, const coop::Region* regions, int nregions,
                const coop::Config* config) {
  using namespace coop;
  auto it = registry().find(name);
  if (it == registry().end()) return -1;
  if ((int)std::strlen(it->second.signature) != nslots) return -2;
  g_kernel = it->first.c_str();
  g_call = it->second.call;
  g_shared = it->second.shared_lo;
  g_shared_bytes = (size_t)(it->second.shared_hi - it->second.shared_lo);
  g_slots = slots;
  g_nslots = nslots;
  g_grid = dim3{grid, 1, 1};
  g_block = dim3{block, 1, 1};
  g_regions.assign(regions, regions + nregions);
  prepare_regions();
  g_cfg = *config;
  g_rng = config->seed * 2654435761u + 0x9E3779B97F4A7C15ull;
  g_errors.clear();
  g_nerrors = 0;
  g_abort = false;
  g_spins = g_ops = 0;
  if (grid == 0 || block == 0 || block > 1024) {
    error("bad launch configuration: grid %u, block %u", grid, block);
    return g_nerrors;
  }
  const int resident = std::max(1, std::min<int>(config->resident, (int)grid));
  ensure_stacks((size_t)resident * block);
  if (g_stacks == nullptr) {
    error("cannot map %d fiber stacks", resident * (int)block);
    return g_nerrors;
  }
  g_active = true;
  schedule();
  g_active = false;
  if (g_nerrors > 20) {
    char buf[64];
    snprintf(buf, sizeof buf, "... %d errors in all\n", g_nerrors);
    g_errors += buf;
  }
  return g_nerrors;
}

const char* coop_errors() { return coop::g_errors.c_str(); }

long long coop_spins() { return coop::g_spins; }

const char* coop_signature(const char* name) {
  auto it = coop::registry().find(name);
  return it == coop::registry().end() ? nullptr : it->second.signature;
}

const char* coop_unit(const char* name) {
  auto it = coop::registry().find(name);
  return it == coop::registry().end() ? nullptr : it->second.unit;
}

const char* coop_kernels() {
  static std::string names;
  names.clear();
  for (auto& kv : coop::registry()) names += kv.first + " ";
  return names.c_str();
}
}
