// msl_cpu.h — the subset of the Metal Shading Language that glimmer-mlx's kernel bodies use, in C++20, plus a
// runtime that executes a whole `mx.fast.metal_kernel` grid on the CPU.
//
// The kernel text compiled against this header is the text MLX itself generates (signature + body + template
// instantiation), obtained from MLX with `verbose=True`; see harness.py for the (small) rewrite applied to it.
//
// Execution model
//   * Threadgroups run one after another. Inside a threadgroup every thread is a fiber (ucontext) with its own
//     stack; fibers switch only at synchronisation points (threadgroup_barrier, simd_* collectives), so a barrier
//     really blocks until every thread of the group has reached it and a simd collective really waits for every
//     live lane of its 32-wide simdgroup.
//   * The scheduling order of fibers can be forward or reverse; harness.py runs each grid both ways and compares
//     the outputs bit for bit, which exposes most missing barriers / threadgroup-memory races.
//   * threadgroup arrays declared in the body live in a per-threadgroup arena that is filled with 0xFF bytes
//     (NaN for floats, -1 for ints) before each threadgroup runs, so reads of uninitialised shared memory show up.
//   * A barrier not reached by every thread, or a simd collective not reached by every live lane of its
//     simdgroup, is reported as a deadlock (an error), not emulated.
//   * Memory flags (strict mode, LaunchSpec.strict_tg): a thread's writes to threadgroup memory are visible to the
//     other threads only after a threadgroup_barrier whose flags (in every thread) include mem_threadgroup, or, to
//     the lanes of its simdgroup, a simdgroup_barrier with mem_threadgroup. Until then the others read what was
//     last published (the 0xFF fill at first; a simdgroup_barrier publishes its lanes' writes to the whole
//     threadgroup, more than Metal promises to the other simdgroups). Between two switches the runtime diffs the arena to find what the
//     running fiber wrote; two threads writing different values to one byte between the same barriers is an error
//     (a threadgroup-memory write race). Without strict mode, threadgroup memory is plain shared memory.
//     mem_device is not modelled: device memory is always shared.
//   * Out-of-bounds device reads (harness.py places every buffer against a PROT_NONE guard page, after its end or
//     before its start) fault; the SIGSEGV/SIGBUS handler installed for the launch records which buffer and where,
//     makes the page readable (zeros) and lets the kernel finish; the launch then fails with that report.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <signal.h>
#include <sys/mman.h>
#include <type_traits>
#include <ucontext.h>
#include <unistd.h>
#include <utility>
#include <vector>

// ---- address spaces and qualifiers ---------------------------------------------------------------------------
#define device
#define constant
#define threadgroup
#define thread

// ---- scalar types ---------------------------------------------------------------------------------------------
typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long ulong;
typedef _Float16 half;
typedef _Float16 float16_t;

struct bfloat16_t {
  uint16_t bits;
  bfloat16_t() = default;
  static uint16_t from_float(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
    return uint16_t(u >> 16);
  }
  bfloat16_t(float f) : bits(from_float(f)) {}
  bfloat16_t(double f) : bits(from_float(float(f))) {}
  bfloat16_t(int i) : bits(from_float(float(i))) {}
  bfloat16_t(uint i) : bits(from_float(float(i))) {}
  bfloat16_t(half h) : bits(from_float(float(h))) {}
  operator float() const {
    uint32_t u = uint32_t(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};
typedef bfloat16_t bfloat;
#define BF16_BINOP(op)                                                                               \
  inline bfloat16_t operator op(bfloat16_t a, bfloat16_t b) { return bfloat16_t(float(a) op float(b)); } \
  inline float operator op(bfloat16_t a, float b) { return float(a) op b; }                          \
  inline float operator op(float a, bfloat16_t b) { return a op float(b); }
BF16_BINOP(+)
BF16_BINOP(-)
BF16_BINOP(*)
BF16_BINOP(/)
#undef BF16_BINOP

// ---- vector types (the few the kernels and the attribute parameters need) -----------------------------------
template <typename T>
struct vec2 {
  T x, y;
  T& operator[](int i) { return (&x)[i]; }
  const T& operator[](int i) const { return (&x)[i]; }
};
template <typename T>
struct vec3 {
  T x, y, z;
  T& operator[](int i) { return (&x)[i]; }
  const T& operator[](int i) const { return (&x)[i]; }
};
template <typename T>
struct vec4 {
  T x, y, z, w;
  T& operator[](int i) { return (&x)[i]; }
  const T& operator[](int i) const { return (&x)[i]; }
};
typedef vec2<uint> uint2;
typedef vec3<uint> uint3;
typedef vec4<uint> uint4;
typedef vec2<int> int2;
typedef vec3<int> int3;
typedef vec4<int> int4;
typedef vec2<float> float2;
typedef vec3<float> float3;
typedef vec4<float> float4;
typedef vec4<half> half4;

// ---- metal:: math ---------------------------------------------------------------------------------------------
#ifndef INFINITY
#define INFINITY (__builtin_inff())
#endif
#ifndef NAN
#define NAN (__builtin_nanf(""))
#endif
#define MAXFLOAT (3.40282347e+38f)

namespace metal {
template <typename T>
inline T max(T a, T b) {
  if constexpr (std::is_floating_point_v<T>) return std::fmax(a, b);  // Metal fmax semantics: NaN ignored
  else return a < b ? b : a;
}
template <typename T>
inline T min(T a, T b) {
  if constexpr (std::is_floating_point_v<T>) return std::fmin(a, b);
  else return b < a ? b : a;
}
inline half max(half a, half b) { return half(std::fmax(float(a), float(b))); }
inline half min(half a, half b) { return half(std::fmin(float(a), float(b))); }
inline float exp(float x) { return std::exp(x); }
inline float exp2(float x) { return std::exp2(x); }
inline float log(float x) { return std::log(x); }
inline float log2(float x) { return std::log2(x); }
inline float sqrt(float x) { return std::sqrt(x); }
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
inline float tanh(float x) { return std::tanh(x); }
inline float abs(float x) { return std::fabs(x); }
inline int abs(int x) { return std::abs(x); }
inline float fabs(float x) { return std::fabs(x); }
inline float floor(float x) { return std::floor(x); }
inline float ceil(float x) { return std::ceil(x); }
inline float pow(float x, float y) { return std::pow(x, y); }
inline float fma(float a, float b, float c) { return std::fma(a, b, c); }
inline float fmax(float a, float b) { return std::fmax(a, b); }
inline float fmin(float a, float b) { return std::fmin(a, b); }
inline bool isnan(float x) { return std::isnan(x); }
inline bool isinf(float x) { return std::isinf(x); }
inline bool isfinite(float x) { return std::isfinite(x); }
template <typename T>
inline T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }
template <typename T>
inline T select(T a, T b, bool c) { return c ? b : a; }
namespace fast {
inline float exp(float x) { return std::exp(x); }
inline float exp2(float x) { return std::exp2(x); }
inline float log(float x) { return std::log(x); }
inline float tanh(float x) { return std::tanh(x); }
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
}  // namespace fast
namespace precise {
inline float exp(float x) { return std::exp(x); }
inline float log(float x) { return std::log(x); }
inline float tanh(float x) { return std::tanh(x); }
}  // namespace precise
template <typename T>
struct numeric_limits : std::numeric_limits<T> {};

enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
inline mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(int(a) | int(b)); }
}  // namespace metal
using namespace metal;

template <typename To, typename From>
inline To as_type(From f) {
  static_assert(sizeof(To) == sizeof(From), "as_type: sizes differ");
  To t;
  std::memcpy(&t, &f, sizeof(To));
  return t;
}

// ---- runtime: fibers, barriers, simd collectives --------------------------------------------------------------
namespace msl_rt {

constexpr int SIMD = 32;
constexpr size_t STACK = 256 * 1024;
constexpr size_t TG_MEMORY_LIMIT = 32 * 1024;  // bytes of threadgroup memory on Apple GPUs

struct Attr3 {  // an attribute value; MLX declares some as uint3 and some as uint
  uint3 v;
  operator uint3() const { return v; }
  operator uint() const { return v.x; }
};
inline Attr3 mk3(uint x, uint y, uint z) {
  Attr3 a;
  a.v.x = x;
  a.v.y = y;
  a.v.z = z;
  return a;
}

struct ThreadIds {
  Attr3 thread_position_in_grid, thread_position_in_threadgroup, threadgroup_position_in_grid,
      threads_per_threadgroup, threadgroups_per_grid, threads_per_grid, grid_size, grid_origin,
      dispatch_threads_per_threadgroup;
  uint thread_index_in_threadgroup, thread_index_in_simdgroup, simdgroup_index_in_threadgroup,
      simdgroups_per_threadgroup, threads_per_simdgroup, thread_execution_width, thread_index_in_quadgroup,
      quadgroup_index_in_threadgroup, quadgroups_per_threadgroup, dispatch_simdgroups_per_threadgroup,
      dispatch_quadgroups_per_threadgroup;
};

struct Fiber {
  ucontext_t ctx;
  char* stack = nullptr;
  bool done = false;
  ThreadIds ids;
};

struct SimdState {
  int alive = 0;     // lanes of this simdgroup that have not returned
  int arrived = 0;   // lanes waiting in the current collective
  uint64_t gen = 0;  // completed collectives
  bool present[SIMD] = {};
  alignas(16) unsigned char in[SIMD][16];
  alignas(16) unsigned char out[SIMD][16];
  int arg[SIMD] = {};
  void (*finish)(SimdState&) = nullptr;  // completes the pending collective (set by its first lane)
  uint64_t published_gen = 0;            // the last simdgroup_barrier(mem_threadgroup) already published
};

struct TgBlock {
  size_t offset, size;
};

struct Group;
typedef void (*ThreadFn)(const ThreadIds&, void**);

struct Group {
  int n = 0;
  std::vector<Fiber> fibers;
  ucontext_t sched;
  int cur = -1;
  int bar_count = 0;
  uint64_t bar_gen = 0;
  std::vector<SimdState> simd;
  int stalls = 0;
  // memory-flag model (strict mode): published threadgroup memory, each fiber's unpublished writes
  bool strict_tg = false;
  std::vector<unsigned char> visible, snapshot;
  std::vector<std::vector<std::pair<uint32_t, unsigned char>>> pending;
  std::vector<int> stamp, owner;
  std::vector<unsigned char> owner_val;
  int bar_flags = ~0;          // AND of the flags of the threads arrived at the current barrier
  bool publish_all = false;    // a threadgroup_barrier(mem_threadgroup) was released: publish every fiber's writes
  uint64_t publish_simd = 0;   // simdgroups whose simdgroup_barrier(mem_threadgroup) completed
  // threadgroup memory
  std::vector<unsigned char> arena;
  std::vector<long> block_offset;  // by declaration id, -1 = not yet placed
  size_t arena_used = 0;
  // the kernel
  ThreadFn fn = nullptr;
  void** buffers = nullptr;
  char error[512] = {0};
};

inline Group*& current() {
  static Group* g = nullptr;
  return g;
}

inline void fail(const char* msg) {
  Group* g = current();
  if (!g->error[0]) std::snprintf(g->error, sizeof(g->error), "%s", msg);
}

inline void yield() {
  Group* g = current();
  swapcontext(&g->fibers[g->cur].ctx, &g->sched);
}

template <typename Pred>
inline void wait_until(Pred p) {
  if (p()) return;
  yield();
  while (!p()) {
    current()->stalls++;
    yield();
  }
}

inline const ThreadIds& me() { return current()->fibers[current()->cur].ids; }

inline void barrier(int flags) {
  Group* g = current();
  uint64_t gen = g->bar_gen;
  g->bar_flags &= flags;
  if (++g->bar_count == g->n) {
    g->bar_count = 0;
    g->bar_gen++;
    if (g->strict_tg && (g->bar_flags & 2)) {  // mem_threadgroup in every thread's call
      g->publish_all = true;
      yield();  // the scheduler publishes before anyone runs past the barrier
    }
    g->bar_flags = ~0;
    return;
  }
  wait_until([g, gen] { return g->bar_gen != gen || g->error[0]; });
}

// -- the memory-flag model: what the scheduler does around each fiber switch (strict mode only)
inline void tg_present(Group& g, int i) {  // fiber i sees the published memory plus its own writes
  size_t used = g.arena_used;
  std::memcpy(g.arena.data(), g.visible.data(), used);
  for (auto& w : g.pending[i]) g.arena[w.first] = w.second;
  std::memcpy(g.snapshot.data(), g.arena.data(), used);
}
inline void tg_collect(Group& g, int i) {  // what fiber i wrote since tg_present
  size_t used = g.arena_used;
  for (size_t b = 0; b < used; b++)
    if (g.arena[b] != g.snapshot[b]) g.pending[i].push_back({(uint32_t)b, g.arena[b]});
}
inline void tg_publish(Group& g, int lo, int hi) {  // fibers [lo, hi) publish; a byte two of them wrote differently is a race
  size_t used = g.arena_used;
  for (int t = lo; t < hi; t++) {
    auto& pw = g.pending[t];
    for (size_t j = pw.size(); j-- > 0;) {  // the last write of each byte is the fiber's value
      uint32_t off = pw[j].first;
      if (g.stamp[off] == t + 1) continue;
      g.stamp[off] = t + 1;
      if (g.owner[off] >= 0 && g.owner_val[off] != pw[j].second && !g.error[0]) {
        std::snprintf(g.error, sizeof(g.error),
                      "threadgroup memory write race: threads %d and %d wrote different values to byte %u of "
                      "threadgroup memory between the same barriers", g.owner[off], t, off);
      }
      g.owner[off] = t;
      g.owner_val[off] = pw[j].second;
      g.visible[off] = pw[j].second;
    }
  }
  for (int t = lo; t < hi; t++) {
    for (auto& w : g.pending[t]) {
      g.stamp[w.first] = 0;
      g.owner[w.first] = -1;
    }
    g.pending[t].clear();
  }
  (void)used;
}

// One simd collective: every live lane deposits `v` (and an int argument); the last to arrive computes every
// lane's result with `op(state, lane)`; then each lane reads its own result.
// `Op` is a captureless lambda type (default-constructible in C++20), so a lane that returns early can complete a
// collective the remaining lanes are waiting in (returned lanes are inactive, as on the GPU).
template <typename T, typename Op>
inline void finish_collective(SimdState& s) {
  Op op{};
  for (int l = 0; l < SIMD; l++)
    if (s.present[l]) {
      T r = op(s, l);
      std::memcpy(s.out[l], &r, sizeof(T));
    }
  for (int l = 0; l < SIMD; l++) s.present[l] = false;
  s.arrived = 0;
  s.gen++;
}

template <typename T, typename Op>
inline T simd_collective(T v, int arg, Op) {
  static_assert(sizeof(T) <= 16, "simd collective on a type wider than 16 bytes");
  Group* g = current();
  const ThreadIds& t = me();
  SimdState& s = g->simd[t.simdgroup_index_in_threadgroup];
  int lane = t.thread_index_in_simdgroup;
  uint64_t gen = s.gen;
  if (s.arrived > 0 && s.finish != &finish_collective<T, Op>) {
    fail("lanes of one simdgroup are in different simd collectives (divergent simd operation)");
    return v;
  }
  std::memcpy(s.in[lane], &v, sizeof(T));
  s.arg[lane] = arg;
  s.present[lane] = true;
  s.finish = &finish_collective<T, Op>;
  if (++s.arrived == s.alive) {
    finish_collective<T, Op>(s);
  } else {
    wait_until([&s, gen, g] { return s.gen != gen || g->error[0]; });
  }
  T r;
  std::memcpy(&r, s.out[lane], sizeof(T));
  return r;
}

template <typename T>
inline T lane_value(const SimdState& s, int l) {
  T x;
  std::memcpy(&x, s.in[l], sizeof(T));
  return x;
}

inline void fiber_main(int idx) {
  Group* g = current();
  Fiber& f = g->fibers[idx];
  g->fn(f.ids, g->buffers);
  f.done = true;
  SimdState& s = g->simd[f.ids.simdgroup_index_in_threadgroup];
  s.alive--;
  if (s.arrived > 0 && s.arrived == s.alive) s.finish(s);  // the waiting lanes were the last live ones
  swapcontext(&f.ctx, &g->sched);
}

// threadgroup array placement: every thread of the group gets the same block for declaration `id`
template <typename A>
inline A* tg_array(int id) {
  Group* g = current();
  if (id >= (int)g->block_offset.size()) g->block_offset.resize(id + 1, -1);
  if (g->block_offset[id] < 0) {
    size_t off = (g->arena_used + 15) & ~size_t(15);
    if (off + sizeof(A) > TG_MEMORY_LIMIT) {
      fail("threadgroup memory exceeds 32 KiB");
      off = 0;
    }
    g->block_offset[id] = (long)off;
    g->arena_used = off + sizeof(A);
  }
  return reinterpret_cast<A*>(g->arena.data() + g->block_offset[id]);
}

constexpr int MAX_GUARDS = 128;
struct LaunchSpec {
  uint32_t grid[3];
  uint32_t group[3];
  int32_t reverse;  // schedule fibers in reverse order
  char error[512];
  int32_t strict_tg;  // model memory flags (see the header comment)
  int32_t n_guards;   // PROT_NONE guard pages set up by harness.py: [lo, hi) each, and the buffer it guards
  uint64_t guard_lo[MAX_GUARDS], guard_hi[MAX_GUARDS];
  int32_t guard_buf[MAX_GUARDS];
  int32_t fault_guard;    // out: index of the first guard page touched, -1 if none, -2: an unmapped address
  uint64_t fault_addr;    // out: the address touched
};

// the fault handler: a touched guard page is recorded and made accessible (zeros); anything else is a real crash
inline LaunchSpec*& fault_spec() {
  static LaunchSpec* s = nullptr;
  return s;
}
inline struct sigaction& old_segv() {
  static struct sigaction a;
  return a;
}
inline struct sigaction& old_bus() {
  static struct sigaction a;
  return a;
}
constexpr int MAX_WILD = 64;
inline void** wild_pages() {  // zero pages mapped at wild addresses during a launch (unmapped after it)
  static void* w[MAX_WILD];
  return w;
}
inline int& n_wild() {
  static int n = 0;
  return n;
}
inline void on_fault(int sig, siginfo_t* info, void*) {
  LaunchSpec* s = fault_spec();
  uint64_t a = (uint64_t)info->si_addr;
  if (s) {
    for (int i = 0; i < s->n_guards; i++) {
      if (a >= s->guard_lo[i] && a < s->guard_hi[i]) {
        if (s->fault_guard < 0) {
          s->fault_guard = i;
          s->fault_addr = a;
        }
        long page = sysconf(_SC_PAGESIZE);
        mprotect((void*)(a & ~(uint64_t)(page - 1)), page, PROT_READ | PROT_WRITE);
        return;
      }
    }
#ifdef MAP_FIXED_NOREPLACE
    // an address outside every mapping (say a negative index in unsigned arithmetic): map zeros there, report it
    long page = sysconf(_SC_PAGESIZE);
    void* at = (void*)(a & ~(uint64_t)(page - 1));
    if (n_wild() < MAX_WILD) {
      void* m = mmap(at, page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
      if (m == at) {
        wild_pages()[n_wild()++] = m;
        if (s->fault_guard == -1) {
          s->fault_guard = -2;
          s->fault_addr = a;
        }
        return;
      }
      if (m != MAP_FAILED) munmap(m, page);
    }
#endif
  }
  sigaction(SIGSEGV, &old_segv(), nullptr);  // not ours: let the previous handler (or the default) take it
  sigaction(SIGBUS, &old_bus(), nullptr);
}

inline int launch(LaunchSpec* spec, void** buffers, ThreadFn fn) {
  uint gx = spec->grid[0], gy = spec->grid[1], gz = spec->grid[2];
  // MLX: group dims = min(threadgroup, grid) per axis; dispatchThreads (partial edge groups)
  uint tx = std::min(spec->group[0], gx), ty = std::min(spec->group[1], gy),
       tz = std::min(spec->group[2], gz);
  spec->error[0] = 0;
  spec->fault_guard = -1;
  spec->fault_addr = 0;
  if (gx == 0 || gy == 0 || gz == 0) return 0;
  if ((uint64_t)tx * ty * tz > 1024) {
    std::snprintf(spec->error, sizeof(spec->error), "threadgroup of %u threads exceeds 1024", tx * ty * tz);
    return 1;
  }
  uint ngx = (gx + tx - 1) / tx, ngy = (gy + ty - 1) / ty, ngz = (gz + tz - 1) / tz;
  Group g;
  g.fn = fn;
  g.buffers = buffers;
  g.arena.assign(TG_MEMORY_LIMIT, 0xFF);
  int cap = tx * ty * tz;
  g.strict_tg = spec->strict_tg != 0;
  if (g.strict_tg) {
    g.visible.assign(TG_MEMORY_LIMIT, 0xFF);
    g.snapshot.assign(TG_MEMORY_LIMIT, 0xFF);
    g.pending.assign(cap, {});
    g.stamp.assign(TG_MEMORY_LIMIT, 0);
    g.owner.assign(TG_MEMORY_LIMIT, -1);
    g.owner_val.assign(TG_MEMORY_LIMIT, 0);
  }
  struct sigaction sa;
  std::memset(&sa, 0, sizeof(sa));
  sa.sa_sigaction = on_fault;
  sa.sa_flags = SA_SIGINFO;
  sigemptyset(&sa.sa_mask);
  fault_spec() = spec;
  sigaction(SIGSEGV, &sa, &old_segv());
  sigaction(SIGBUS, &sa, &old_bus());
  g.fibers.resize(cap);
  for (auto& f : g.fibers) f.stack = (char*)std::malloc(STACK);
  current() = &g;
  int rc = 0;
  for (uint bz = 0; bz < ngz && !rc; bz++)
    for (uint by = 0; by < ngy && !rc; by++)
      for (uint bx = 0; bx < ngx && !rc; bx++) {
        uint ax = std::min(tx, gx - bx * tx), ay = std::min(ty, gy - by * ty), az = std::min(tz, gz - bz * tz);
        int n = ax * ay * az;
        g.n = n;
        g.bar_count = 0;
        g.stalls = 0;
        g.simd.assign((n + SIMD - 1) / SIMD, SimdState());
        std::memset(g.arena.data(), 0xFF, g.arena.size());
        g.bar_flags = ~0;
        g.publish_all = false;
        g.publish_simd = 0;
        if (g.strict_tg) {
          std::memset(g.visible.data(), 0xFF, g.visible.size());
          for (auto& pw : g.pending) pw.clear();
        }
        int nsg = (n + SIMD - 1) / SIMD;
        for (int i = 0; i < n; i++) {
          uint lx = i % ax, ly = (i / ax) % ay, lz = i / (ax * ay);
          Fiber& f = g.fibers[i];
          f.done = false;
          ThreadIds& t = f.ids;
          t.thread_position_in_threadgroup = mk3(lx, ly, lz);
          t.threadgroup_position_in_grid = mk3(bx, by, bz);
          t.thread_position_in_grid = mk3(bx * tx + lx, by * ty + ly, bz * tz + lz);
          t.threads_per_threadgroup = mk3(ax, ay, az);
          t.dispatch_threads_per_threadgroup = mk3(tx, ty, tz);
          t.threadgroups_per_grid = mk3(ngx, ngy, ngz);
          t.threads_per_grid = mk3(gx, gy, gz);
          t.grid_size = mk3(gx, gy, gz);
          t.grid_origin = mk3(0, 0, 0);
          t.thread_index_in_threadgroup = i;
          t.thread_index_in_simdgroup = i % SIMD;
          t.simdgroup_index_in_threadgroup = i / SIMD;
          t.simdgroups_per_threadgroup = nsg;
          t.dispatch_simdgroups_per_threadgroup = (cap + SIMD - 1) / SIMD;
          t.threads_per_simdgroup = SIMD;
          t.thread_execution_width = SIMD;
          t.thread_index_in_quadgroup = i % 4;
          t.quadgroup_index_in_threadgroup = i / 4;
          t.quadgroups_per_threadgroup = (n + 3) / 4;
          t.dispatch_quadgroups_per_threadgroup = (cap + 3) / 4;
          g.simd[i / SIMD].alive++;
          getcontext(&f.ctx);
          f.ctx.uc_stack.ss_sp = f.stack;
          f.ctx.uc_stack.ss_size = STACK;
          f.ctx.uc_link = nullptr;
          makecontext(&f.ctx, (void (*)())fiber_main, 1, i);
        }
        int alive = n;
        while (alive > 0 && !g.error[0]) {
          int resumed = 0, stalls_before = g.stalls;
          for (int j = 0; j < n && !g.error[0]; j++) {
            int i = spec->reverse ? n - 1 - j : j;
            if (g.fibers[i].done) continue;
            g.cur = i;
            resumed++;
            if (g.strict_tg) tg_present(g, i);
            swapcontext(&g.sched, &g.fibers[i].ctx);
            if (g.strict_tg) {
              tg_collect(g, i);
              if (g.publish_all) {
                tg_publish(g, 0, n);
                g.publish_all = false;
              }
              for (int s = 0; g.publish_simd && s < (int)g.simd.size(); s++)
                if (g.publish_simd & (1ull << s)) {
                  tg_publish(g, s * SIMD, std::min(n, (s + 1) * SIMD));
                  g.publish_simd &= ~(1ull << s);
                }
            }
            if (g.fibers[i].done) alive--;
          }
          if (alive > 0 && resumed > 0 && g.stalls - stalls_before == resumed && !g.error[0]) {
            std::snprintf(g.error, sizeof(g.error),
                          "deadlock in threadgroup (%u,%u,%u): %d thread(s) wait at a barrier or simd collective "
                          "that the others never reach (divergent barrier)",
                          bx, by, bz, alive);
          }
        }
        if (g.error[0]) {
          std::snprintf(spec->error, sizeof(spec->error), "%s", g.error);
          rc = 1;
        }
      }
  for (auto& f : g.fibers) std::free(f.stack);
  current() = nullptr;
  sigaction(SIGSEGV, &old_segv(), nullptr);
  sigaction(SIGBUS, &old_bus(), nullptr);
  fault_spec() = nullptr;
  for (int i = 0; i < n_wild(); i++) munmap(wild_pages()[i], sysconf(_SC_PAGESIZE));
  n_wild() = 0;
  return rc;
}

}  // namespace msl_rt

// ---- the Metal builtins the kernel bodies call --------------------------------------------------------------
inline void threadgroup_barrier(metal::mem_flags f) { msl_rt::barrier((int)f); }
inline void simdgroup_barrier(metal::mem_flags f) {
  // the flags of every lane are ANDed; with mem_threadgroup (strict mode) the lanes' writes are published
  msl_rt::Group* g = msl_rt::current();
  int sg = msl_rt::me().simdgroup_index_in_threadgroup;
  uint64_t gen0 = g->simd[sg].gen;
  int all = msl_rt::simd_collective<int>((int)f, 0, [](const msl_rt::SimdState& s, int) {
    int a = ~0;
    for (int l = 0; l < msl_rt::SIMD; l++)
      if (s.present[l]) a &= msl_rt::lane_value<int>(s, l);
    return a;
  });
  msl_rt::SimdState& st = g->simd[sg];
  if (g->strict_tg && (all & 2) && st.published_gen <= gen0) {
    st.published_gen = gen0 + 1;  // the first lane past this barrier asks; the scheduler publishes at once
    g->publish_simd |= 1ull << sg;
    msl_rt::yield();
  }
}

template <typename T>
inline T simd_sum(T v) {
  return msl_rt::simd_collective<T>(v, 0, [](const msl_rt::SimdState& s, int) {
    T acc = T(0);
    for (int l = 0; l < msl_rt::SIMD; l++)
      if (s.present[l]) acc = T(acc + msl_rt::lane_value<T>(s, l));
    return acc;
  });
}
template <typename T>
inline T simd_max(T v) {
  return msl_rt::simd_collective<T>(v, 0, [](const msl_rt::SimdState& s, int) {
    bool first = true;
    T acc{};
    for (int l = 0; l < msl_rt::SIMD; l++)
      if (s.present[l]) {
        T x = msl_rt::lane_value<T>(s, l);
        acc = first ? x : metal::max(acc, x);
        first = false;
      }
    return acc;
  });
}
template <typename T>
inline T simd_min(T v) {
  return msl_rt::simd_collective<T>(v, 0, [](const msl_rt::SimdState& s, int) {
    bool first = true;
    T acc{};
    for (int l = 0; l < msl_rt::SIMD; l++)
      if (s.present[l]) {
        T x = msl_rt::lane_value<T>(s, l);
        acc = first ? x : metal::min(acc, x);
        first = false;
      }
    return acc;
  });
}
template <typename T>
inline T simd_prefix_exclusive_sum(T v) {
  return msl_rt::simd_collective<T>(v, 0, [](const msl_rt::SimdState& s, int lane) {
    T acc = T(0);
    for (int l = 0; l < lane; l++)
      if (s.present[l]) acc = T(acc + msl_rt::lane_value<T>(s, l));
    return acc;
  });
}
template <typename T>
inline T simd_prefix_inclusive_sum(T v) {
  return msl_rt::simd_collective<T>(v, 0, [](const msl_rt::SimdState& s, int lane) {
    T acc = T(0);
    for (int l = 0; l <= lane; l++)
      if (s.present[l]) acc = T(acc + msl_rt::lane_value<T>(s, l));
    return acc;
  });
}
// shuffles: reading an inactive (returned) lane yields the caller's own value (undefined on the GPU)
template <typename T>
inline T simd_shuffle(T v, ushort src) {
  return msl_rt::simd_collective<T>(v, src, [](const msl_rt::SimdState& s, int lane) {
    int from = s.arg[lane];
    return (from >= 0 && from < msl_rt::SIMD && s.present[from]) ? msl_rt::lane_value<T>(s, from)
                                                                  : msl_rt::lane_value<T>(s, lane);
  });
}
template <typename T>
inline T simd_broadcast(T v, ushort src) { return simd_shuffle(v, src); }
template <typename T>
inline T simd_shuffle_down(T v, ushort delta) {
  return msl_rt::simd_collective<T>(v, delta, [](const msl_rt::SimdState& s, int lane) {
    int from = lane + s.arg[lane];
    return (from < msl_rt::SIMD && s.present[from]) ? msl_rt::lane_value<T>(s, from) : msl_rt::lane_value<T>(s, lane);
  });
}
template <typename T>
inline T simd_shuffle_up(T v, ushort delta) {
  return msl_rt::simd_collective<T>(v, delta, [](const msl_rt::SimdState& s, int lane) {
    int from = lane - s.arg[lane];
    return (from >= 0 && s.present[from]) ? msl_rt::lane_value<T>(s, from) : msl_rt::lane_value<T>(s, lane);
  });
}
template <typename T>
inline T simd_shuffle_xor(T v, ushort mask) {
  return msl_rt::simd_collective<T>(v, mask, [](const msl_rt::SimdState& s, int lane) {
    int from = lane ^ s.arg[lane];
    return (from < msl_rt::SIMD && s.present[from]) ? msl_rt::lane_value<T>(s, from) : msl_rt::lane_value<T>(s, lane);
  });
}
inline bool simd_any(bool v) {
  return msl_rt::simd_collective<int>(v ? 1 : 0, 0, [](const msl_rt::SimdState& s, int) {
    for (int l = 0; l < msl_rt::SIMD; l++)
      if (s.present[l] && msl_rt::lane_value<int>(s, l)) return 1;
    return 0;
  });
}
inline bool simd_all(bool v) {
  return msl_rt::simd_collective<int>(v ? 1 : 0, 0, [](const msl_rt::SimdState& s, int) {
    for (int l = 0; l < msl_rt::SIMD; l++)
      if (s.present[l] && !msl_rt::lane_value<int>(s, l)) return 0;
    return 1;
  });
}

#include "msl_simdgroup.h"  // simdgroup_matrix (8x8), owned by the kernels-attention work
