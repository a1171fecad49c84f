"""C++ text the emulated kernels compile against (see the package docstring).

CORE: the CUDA types and built-ins the generated code uses, one fiber per CUDA thread of the running block
(switched only at block / warp barriers: __syncthreads, __syncwarp, shuffles and the warp-collective
helpers below), blocks run one after another. HELPERS: CPU versions of the kernels' inline-PTX device
helpers, by the names the kernel generators give them (their CUDA definitions are dropped with the
source's preamble). x86-64 only (the fiber switch is a few lines of assembly).
"""
from __future__ import annotations

CORE = r"""
#include <cstdint>
#include <cstring>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <functional>
#define uint unsigned int
#define uchar unsigned char
#define ushort unsigned short
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define CUDART_INF_F INFINITY
struct emu_dim3 { unsigned x, y, z; };
static emu_dim3 threadIdx, blockIdx, blockDim, gridDim;
struct nv_bfloat16 {
  uint16_t b;
  nv_bfloat16() = default;
  nv_bfloat16(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) b = (uint16_t)((u >> 16) | 0x40);
    else { u += 0x7fffu + ((u >> 16) & 1u); b = (uint16_t)(u >> 16); }
  }
  operator float() const { uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f; }
};
typedef _Float16 half;
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) int2 { int x, y; };
struct alignas(16) int4 { int x, y, z, w; };
struct alignas(8) float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
struct ulonglong2 { unsigned long long x, y; };
struct ulonglong4 { unsigned long long x, y, z, w; };
static inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return uint4{a, b, c, d}; }
static inline float4 make_float4(float a, float b, float c, float d) { return float4{a, b, c, d}; }
static inline float2 make_float2(float a, float b) { return float2{a, b}; }
static inline float max(float a, float b) { return fmaxf(a, b); }
static inline float min(float a, float b) { return fminf(a, b); }
template <class A, class B> static inline auto max(A a, B b) { return a > b ? a : b; }
template <class A, class B> static inline auto min(A a, B b) { return a < b ? a : b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }

// ---- fibers: one per CUDA thread of the running block, switched on barriers -----------------
extern "C" void emu_switch(void** save_sp, void* load_sp);
asm(R"(
.text
.globl emu_switch
.hidden emu_switch
.type emu_switch,@function
emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
)");
struct EmuFiber { void* sp; char* stack; bool done; int wait_bar; unsigned wait_gen; };
struct EmuBar { int expected, count; unsigned gen; };
static const size_t EMU_STACK = 1 << 18;
static std::vector<EmuFiber> g_fib;
static std::vector<EmuBar> g_bar;  // 0: block, 1 + w: warp w
static int g_cur;
static void* g_sched_sp;
static std::function<void()> g_fn;
static uint64_t g_slot[32][32];
static long long g_switches;
// shared arrays are static storage (blocks run one at a time); the first fiber of a block fills them with
// 0xff bytes (NaN for floats) as it passes their declarations, so a read before any write shows up
static bool g_block_fresh;
#define EMU_FRESH(name) do { if (g_block_fresh) memset((void*)(name), 0xff, sizeof(name)); } while (0)

static void emu_yield() { emu_switch(&g_fib[g_cur].sp, g_sched_sp); }
static void emu_bar_wait(int b) {
  EmuBar& B = g_bar[b];
  if (++B.count == B.expected) { B.count = 0; B.gen++; return; }
  g_fib[g_cur].wait_bar = b;
  g_fib[g_cur].wait_gen = B.gen;
  emu_yield();
}
static void emu_fiber_main() {
  g_fn();
  g_fib[g_cur].done = true;
  emu_switch(&g_fib[g_cur].sp, g_sched_sp);
  abort();
}
static void emu_run_block(int nt) {
  if ((int)g_fib.size() < nt) {
    size_t old = g_fib.size();
    g_fib.resize(nt);
    for (size_t t = old; t < (size_t)nt; ++t) g_fib[t].stack = (char*)aligned_alloc(64, EMU_STACK);
  }
  g_bar.assign(1 + (nt + 31) / 32, EmuBar{0, 0, 0});
  g_bar[0].expected = nt;
  for (int w = 0; w * 32 < nt; ++w) g_bar[1 + w].expected = (nt - 32 * w < 32) ? nt - 32 * w : 32;
  for (int t = 0; t < nt; ++t) {
    EmuFiber& f = g_fib[t];
    uintptr_t top = ((uintptr_t)(f.stack + EMU_STACK)) & ~(uintptr_t)15;
    void** sp = (void**)top;
    *--sp = nullptr;
    *--sp = (void*)&emu_fiber_main;
    for (int r = 0; r < 6; ++r) *--sp = nullptr;
    f.sp = sp; f.done = false; f.wait_bar = -1; f.wait_gen = 0;
  }
  int alive = nt;
  g_block_fresh = true;
  while (alive) {
    bool progress = false;
    for (int t = 0; t < nt; ++t) {
      EmuFiber& f = g_fib[t];
      if (f.done) continue;
      if (f.wait_bar >= 0) {
        if (g_bar[f.wait_bar].gen == f.wait_gen) continue;
        f.wait_bar = -1;
      }
      g_cur = t;
      threadIdx = emu_dim3{(unsigned)t, 0, 0};
      ++g_switches;
      emu_switch(&g_sched_sp, f.sp);
      g_block_fresh = false;
      progress = true;
      if (f.done) --alive;
    }
    if (!progress) { fprintf(stderr, "emulator: deadlock in block (%u,%u,%u)\n", blockIdx.x, blockIdx.y, blockIdx.z); abort(); }
  }
}
static void emu_launch(int gx, int gy, int gz, int bx, std::function<void()> fn) {
  g_fn = fn;
  gridDim = emu_dim3{(unsigned)gx, (unsigned)gy, (unsigned)gz};
  blockDim = emu_dim3{(unsigned)bx, 1, 1};
  for (int z = 0; z < gz; ++z)
    for (int y = 0; y < gy; ++y)
      for (int x = 0; x < gx; ++x) {
        blockIdx = emu_dim3{(unsigned)x, (unsigned)y, (unsigned)z};
        emu_run_block(bx);
      }
}
template <class T> static T emu_shfl(T v, int src) {
  int w = g_cur >> 5, l = g_cur & 31;
  uint64_t bits = 0;
  memcpy(&bits, &v, sizeof(T));
  g_slot[w][l] = bits;
  emu_bar_wait(1 + w);
  uint64_t sb = g_slot[w][src & 31];
  T r;
  memcpy(&r, &sb, sizeof(T));
  emu_bar_wait(1 + w);
  return r;
}
template <class T> static T __shfl_xor_sync(unsigned, T v, int m, int = 32) { return emu_shfl(v, (g_cur & 31) ^ m); }
template <class T> static T __shfl_sync(unsigned, T v, int src, int = 32) { return emu_shfl(v, src); }
static void __syncthreads() { emu_bar_wait(0); }
static void __syncwarp(unsigned = 0xffffffffu) { emu_bar_wait(1 + (g_cur >> 5)); }
extern "C" long long emu_switch_count() { return g_switches; }
"""

MMA16 = r"""
// ---- shared by the kernel families: mma.sync m16n8k16 with fp16 / bf16 operands ------------------
static float emu_h2f_bf16(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static float emu_h2f_f16(uint16_t h) { _Float16 x; memcpy(&x, &h, 2); return (float)x; }
static uint32_t g_mma[32][32][6];
// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}: a warp-collective D = A B + C with the PTX fragment
// layouts (groupID = lane >> 2, tig = lane & 3): A reg r holds rows g + 8 (r & 1), cols 2 tig + 8 (r >> 1)
// (+0, +1 in the low / high half); B reg r holds rows (k) 2 tig + 8 r (+0, +1), col g; C holds
// (g, 2 tig + {0, 1}) and (g + 8, 2 tig + {0, 1}).
template <int F16> static void emu_mma(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                                       unsigned b1) {
  int w = g_cur >> 5, l = g_cur & 31;
  uint32_t* me = g_mma[w][l];
  me[0] = a0; me[1] = a1; me[2] = a2; me[3] = a3; me[4] = b0; me[5] = b1;
  emu_bar_wait(1 + w);
  auto h2f = [](uint32_t word, int hi) { uint16_t h = (uint16_t)(hi ? word >> 16 : word & 0xffffu);
                                         return F16 ? emu_h2f_f16(h) : emu_h2f_bf16(h); };
  auto A = [&](int r, int k) { int lane = (r & 7) * 4 + ((k & 7) >> 1); int reg = (r >> 3) + 2 * (k >> 3);
                               return h2f(g_mma[w][lane][reg], k & 1); };
  auto B = [&](int k, int n) { int lane = n * 4 + ((k & 7) >> 1); return h2f(g_mma[w][lane][4 + (k >> 3)], k & 1); };
  int g = l >> 2, t = l & 3;
  float d[4];
  for (int o = 0; o < 4; ++o) {
    int r = g + 8 * (o >> 1), n = 2 * t + (o & 1);
    float acc = c[o];
    for (int k = 0; k < 16; ++k) acc += A(r, k) * B(k, n);
    d[o] = acc;
  }
  emu_bar_wait(1 + w);
  for (int o = 0; o < 4; ++o) c[o] = d[o];
}
"""

# compile/kernels/cuda/attention.py (_MMA_SRC, LD_SRC, _PACK_SRC, LDSM_SRC, CP_SRC; the fp8 / nvfp4 converters)
ATTENTION = r"""
static void ninfer_attn_mma_bf16(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0, unsigned b1) {
  emu_mma<0>(c, a0, a1, a2, a3, b0, b1);
}
static void ninfer_attn_mma_f16(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0, unsigned b1) {
  emu_mma<1>(c, a0, a1, a2, a3, b0, b1);
}
static void ninfer_attn_ld16(unsigned* d, const void* p) { memcpy(d, p, 16); }
static unsigned ninfer_attn_ld4(const void* p) { unsigned r; memcpy(&r, p, 4); return r; }
// fp4_qk: mma.sync.aligned.kind::mxf4nvf4.block_scale.scale_vec::4X.m16n8k64.row.col.f32.e2m1.e2m1.f32.ue4m3
// (scale byte-id / thread-id 0): D = (A x SFA)(B x SFB) + C with the fragment layouts of
// compile/kernels/cuda/fp4_mma.py (groupID g = lane >> 2, t = lane & 3): A reg i holds row g + 8 (i & 1), k
// 8 (t + 4 (i >> 1)) + nibble (lowest k in the lowest nibble); B reg j holds column g, k 8 (t + 4 j) + nibble; SFA
// of row r comes from lane 4 (r & 7) + (r >> 3), SFB of column n from lane 4 n, byte k / 16 of their scale word;
// C as m16n8k16. Products of E2M1 x UE4M3 values are exact; the sum is formed in double, added to C in fp32.
static uint32_t g_mma4[32][32][8];
static double emu_e2m1(unsigned c) {
  static const double mag[8] = {0., .5, 1., 1.5, 2., 3., 4., 6.};
  return (c & 8u) ? -mag[c & 7u] : mag[c & 7u];
}
static double emu_ue4m3(unsigned b) {
  b &= 0x7Fu;
  if (b == 0x7Fu) return NAN;
  const unsigned e = b >> 3, m = b & 7u;
  return e ? ldexp(1.0 + m / 8.0, (int)e - 7) : ldexp((double)m, -9);
}
static void ninfer_attn_mma_nvf4(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0, unsigned b1,
                                 unsigned sfa, unsigned sfb) {
  int w = g_cur >> 5, l = g_cur & 31;
  uint32_t* me = g_mma4[w][l];
  me[0] = a0; me[1] = a1; me[2] = a2; me[3] = a3; me[4] = b0; me[5] = b1; me[6] = sfa; me[7] = sfb;
  emu_bar_wait(1 + w);
  auto A = [&](int r, int k) {
    const int word = k >> 3;
    const unsigned reg = g_mma4[w][4 * (r & 7) + (word & 3)][(r >> 3) + 2 * (word >> 2)];
    const unsigned sf = g_mma4[w][4 * (r & 7) + (r >> 3)][6];
    return emu_e2m1((reg >> (4 * (k & 7))) & 15u) * emu_ue4m3(sf >> (8 * (k >> 4)));
  };
  auto B = [&](int k, int n) {
    const int word = k >> 3;
    const unsigned reg = g_mma4[w][4 * n + (word & 3)][4 + (word >> 2)];
    const unsigned sf = g_mma4[w][4 * n][7];
    return emu_e2m1((reg >> (4 * (k & 7))) & 15u) * emu_ue4m3(sf >> (8 * (k >> 4)));
  };
  int g = l >> 2, t = l & 3;
  float d[4];
  for (int o = 0; o < 4; ++o) {
    int r = g + 8 * (o >> 1), n = 2 * t + (o & 1);
    double acc = 0.0;
    for (int k = 0; k < 64; ++k) acc += A(r, k) * B(k, n);
    d[o] = c[o] + (float)acc;
  }
  emu_bar_wait(1 + w);
  for (int o = 0; o < 4; ++o) c[o] = d[o];
}
#define ninfer_attn_pf_mma_bf16 ninfer_attn_mma_bf16
#define ninfer_attn_pf_mma_f16 ninfer_attn_mma_f16
#define ninfer_attn_pf_pack_bf16x2 ninfer_attn_pack_bf16x2
#define ninfer_attn_pf_pack_f16x2 ninfer_attn_pack_f16x2
// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: lane l gives the row address of matrix l / 8, row l % 8
// (16 bytes); lane (g, t) receives of matrix j: row g, elements 2t, 2t+1 (.trans: rows 2t, 2t+1 of column g)
static const void* g_ldsm[32][32];
template <int TR> static void emu_ldsm(unsigned* r, const void* p) {
  int w = g_cur >> 5, l = g_cur & 31;
  g_ldsm[w][l] = p;
  emu_bar_wait(1 + w);
  int g = l >> 2, t = l & 3;
  unsigned d[4];
  for (int j = 0; j < 4; ++j) {
    uint16_t lo, hi;
    if (TR) {
      memcpy(&lo, (const char*)g_ldsm[w][8 * j + 2 * t] + 2 * g, 2);
      memcpy(&hi, (const char*)g_ldsm[w][8 * j + 2 * t + 1] + 2 * g, 2);
    } else {
      memcpy(&lo, (const char*)g_ldsm[w][8 * j + g] + 4 * t, 2);
      memcpy(&hi, (const char*)g_ldsm[w][8 * j + g] + 4 * t + 2, 2);
    }
    d[j] = (unsigned)lo | ((unsigned)hi << 16);
  }
  emu_bar_wait(1 + w);
  for (int j = 0; j < 4; ++j) r[j] = d[j];
}
static void ninfer_attn_ldsm_x4(unsigned* r, const void* p) { emu_ldsm<0>(r, p); }
static void ninfer_attn_ldsm_x4_t(unsigned* r, const void* p) { emu_ldsm<1>(r, p); }
// cp.async: the copy happens at once (fibers only switch at barriers / warp collectives, and the kernels
// __syncthreads() after cp.async.wait_group before any other thread reads the data)
static void ninfer_attn_cp16(void* dst, const void* src) { memcpy(dst, src, 16); }
static void ninfer_attn_cp_commit() {}
static void ninfer_attn_cp_wait0() {}
static void ninfer_attn_cp_wait1() {}
static unsigned ninfer_attn_pack_bf16x2(float lo, float hi) {
  nv_bfloat16 a(lo), b(hi);
  return (unsigned)a.b | ((unsigned)b.b << 16);
}
static unsigned ninfer_attn_pack_f16x2(float lo, float hi) {
  _Float16 a = (_Float16)lo, b = (_Float16)hi;
  uint16_t x, y; memcpy(&x, &a, 2); memcpy(&y, &b, 2);
  return (unsigned)x | ((unsigned)y << 16);
}
// ---- qattn: fp8 / nvfp4 pages on tensor cores (compile/kernels/cuda/attention.py NVFP4_F16X8_SRC, E4M3*_F16X2_SRC, H2F_SRC)
static unsigned ninfer_attn_e4m3_f16x2(unsigned b) {  // cvt.rn.f16x2.e4m3x2 of the byte pair (b, b)
  b &= 0xFFu;
  const unsigned e = (b >> 3) & 15u, m = b & 7u;
  float v = e ? ldexpf(1.0f + (float)m / 8.0f, (int)e - 7) : ldexpf((float)m, -9);
  if (b & 0x80u) v = -v;
  _Float16 h = (_Float16)v;
  uint16_t u; memcpy(&u, &h, 2);
  return (unsigned)u * 0x10001u;
}
static float ninfer_attn_h2f(unsigned h) { return emu_h2f_f16((uint16_t)(h & 0xFFFFu)); }  // cvt.f32.f16
static unsigned ninfer_attn_e4m3x2_f16x2(unsigned w) {  // cvt.rn.f16x2.e4m3x2 of the low 16 bits
  const unsigned lo = ninfer_attn_e4m3_f16x2(w & 0xFFu), hi = ninfer_attn_e4m3_f16x2((w >> 8) & 0xFFu);
  return (lo & 0xFFFFu) | (hi & 0xFFFF0000u);
}
static void ninfer_attn_nvfp4_f16x8(unsigned* d, unsigned w, unsigned s2) {  // pairs (0,2) (1,3) (4,6) (5,7) x scale
  static const float mag[8] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
  static const int first[4] = {0, 1, 4, 5};
  uint16_t sb = (uint16_t)(s2 & 0xFFFFu); _Float16 s; memcpy(&s, &sb, 2);
  for (int k = 0; k < 4; ++k) {
    unsigned r = 0;
    for (int hh = 0; hh < 2; ++hh) {
      const unsigned c = (w >> (4 * (first[k] + 2 * hh))) & 15u;
      _Float16 x = (_Float16)((c & 8u ? -mag[c & 7u] : mag[c & 7u]) * (float)s);  // exact product, one rounding
      uint16_t u; memcpy(&u, &x, 2);
      r |= (unsigned)u << (16 * hh);
    }
    d[k] = r;
  }
}
"""

# compile/kernels/cuda/gdn.py (_mma_src: mma.sync m16n8k8 tf32, plain and 3xTF32; ninfer_gdn_st / _bar)
GDN = r"""
static float g_mma_f[32][32][6];
static inline float emu_tf32(float x) {  // cvt.rna.tf32.f32
  uint32_t u; memcpy(&u, &x, 4); u = (u + 0x1000u) & 0xffffe000u; float r; memcpy(&r, &u, 4); return r;
}
// D[16x8] += A[16x8] B[8x8] from fp32 fragments (groupID = lane >> 2, tig = lane & 3): A reg r holds
// (row g + 8 (r & 1), col tig + 4 (r >> 1)), B reg r (row tig + 4 r, col g), D as m16n8k16. Operands are
// rounded to tf32; split: 3xTF32, the products As Bb, Ab Bs, Ab Bb in that order (small = tf32(x - big)).
static void emu_mma_tf32(float* c, float a0, float a1, float a2, float a3, float b0, float b1, bool split) {
  int w = g_cur >> 5, l = g_cur & 31;
  float* me = g_mma_f[w][l];
  me[0] = a0; me[1] = a1; me[2] = a2; me[3] = a3; me[4] = b0; me[5] = b1;
  emu_bar_wait(1 + w);
  auto A = [&](int m, int k, int part) {
    float x = g_mma_f[w][(m % 8) * 4 + k % 4][(m >= 8) + 2 * (k >= 4)], big = emu_tf32(x);
    return part ? emu_tf32(x - big) : big; };
  auto B = [&](int k, int n, int part) {
    float x = g_mma_f[w][n * 4 + k % 4][4 + (k >= 4)], big = emu_tf32(x);
    return part ? emu_tf32(x - big) : big; };
  int g = l >> 2, t = l & 3;
  float d[4];
  for (int r = 0; r < 4; ++r) {
    int m = g + 8 * (r >> 1), n = 2 * t + (r & 1);
    float acc = c[r];
    for (int p = split ? 0 : 2; p < 3; ++p) {  // p: 0 As Bb, 1 Ab Bs, 2 Ab Bb
      float s = 0.f;
      for (int k = 0; k < 8; ++k) s += A(m, k, p == 0) * B(k, n, p == 1);
      acc += s;
    }
    d[r] = acc;
  }
  emu_bar_wait(1 + w);
  for (int r = 0; r < 4; ++r) c[r] = d[r];
}
static void ninfer_gdn_mma_tf32x3(float* c, float a0, float a1, float a2, float a3, float b0, float b1) {
  emu_mma_tf32(c, a0, a1, a2, a3, b0, b1, true);
}
static void ninfer_gdn_mma_tf32(float* c, float a0, float a1, float a2, float a3, float b0, float b1) {
  emu_mma_tf32(c, a0, a1, a2, a3, b0, b1, false);
}
static inline void ninfer_gdn_st(float* p, float v) { *p = v; }
static inline void ninfer_gdn_bar() { __syncthreads(); }
"""

# compile/kernels/cuda/gemv.py (_mma_source, _ldg_source, _CP16_SRC / _CP4_SRC / _cp_wait, _BF16X2_MUL_SRC; the NVFP4 decode helper
# _NVFP4_DQ_BODY is plain C around ninfer_bf16x2_mul and runs as it is, see source())
GEMV = r"""
static void ninfer_gemv_mma_bf16(float* d, unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0, unsigned b1) {
  emu_mma<0>(d, a0, a1, a2, a3, b0, b1);
}
static void ninfer_gemv_mma_f16(float* d, unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0, unsigned b1) {
  emu_mma<1>(d, a0, a1, a2, a3, b0, b1);
}
// predicated 16-byte loads: a false predicate gives zeros and touches no memory
static inline uint4 ninfer_gemv_ldg_w(const void* p, int pred) { uint4 r = {0, 0, 0, 0}; if (pred) memcpy(&r, p, 16); return r; }
static inline uint4 ninfer_gemv_ldg_x(const void* p, int pred) { uint4 r = {0, 0, 0, 0}; if (pred) memcpy(&r, p, 16); return r; }
// cp.async (NVFP4 stage rings): the copy (or zero fill) happens at once; every lane reads back only its own slots
static inline void ninfer_gemv_cp16(void* d, const void* p, int pred) { if (pred) memcpy(d, p, 16); else memset(d, 0, 16); }
static inline void ninfer_gemv_cp4(void* d, const void* p, int pred) { if (pred) memcpy(d, p, 4); else memset(d, 0, 4); }
static inline void ninfer_gemv_cp_commit() {}
#define ninfer_gemv_cp_wait0() ((void)0)
#define ninfer_gemv_cp_wait1() ((void)0)
#define ninfer_gemv_cp_wait2() ((void)0)
#define ninfer_gemv_cp_wait3() ((void)0)
#define ninfer_gemv_cp_wait4() ((void)0)
#define ninfer_gemv_cp_wait5() ((void)0)
#define ninfer_gemv_cp_wait6() ((void)0)
static inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  uint64_t v = ((uint64_t)y << 32) | x; unsigned r = 0;
  for (int i = 0; i < 4; ++i) r |= (unsigned)((v >> (8 * ((s >> (4 * i)) & 7))) & 0xffu) << (8 * i);
  return r;
}
// fma.rn.bf16x2(a, b, -0): the fp32 product is exact here (<= 16 significant bits, no fp32 underflow in our
// use), then round to nearest even bf16 (fp32 and bf16 subnormals share the exponent range)
static inline uint16_t emu_bf16_rn(float f) {
  uint32_t u; memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u); return (uint16_t)(u >> 16);
}
// the RMS-normed input word (gemv.py _RMS_X_SRC, the same arithmetic: squares added, times g, rounded to bf16)
static inline unsigned ninfer_gemv_rms_x_bf16(unsigned x, unsigned g0, unsigned g1, float* ss) {
  unsigned xl = x << 16, xh = x & 0xffff0000u; float lo, hi, a0, a1; memcpy(&lo, &xl, 4); memcpy(&hi, &xh, 4);
  memcpy(&a0, &g0, 4); memcpy(&a1, &g1, 4);
  *ss = *ss + (lo * lo + hi * hi);
  float pa = lo * a0, pb = hi * a1; unsigned a, b; memcpy(&a, &pa, 4); memcpy(&b, &pb, 4);
  a = (a + 0x7fffu + ((a >> 16) & 1u)) >> 16;
  b = (b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u;
  return a | b;
}
static inline unsigned ninfer_bf16x2_mul(unsigned a, unsigned b) {
  float lo = emu_h2f_bf16((uint16_t)a) * emu_h2f_bf16((uint16_t)b);
  float hi = emu_h2f_bf16((uint16_t)(a >> 16)) * emu_h2f_bf16((uint16_t)(b >> 16));
  return (unsigned)emu_bf16_rn(lo) | ((unsigned)emu_bf16_rn(hi) << 16);
}
"""

# compile/kernels/cuda/moe.py (_mma_helper, _LDW, _ATOMIC, _BF16X2: attention's and gemv's helpers renamed)
MOE = r"""
#define ninfer_moe_mma_bf16 ninfer_attn_mma_bf16
#define ninfer_moe_mma_f16 ninfer_attn_mma_f16
#define ninfer_moe_bf16x2_mul ninfer_bf16x2_mul
static inline uint4 ninfer_moe_ldw(const void* p) { uint4 r; memcpy(&r, p, 16); return r; }
// fibers switch only at barriers and warp collectives: a plain read-modify-write is atomic here
static inline int ninfer_moe_atomic_add(int* p, int v) { int o = *p; *p += v; return o; }
// blocks run one after another: every earlier block's writes are in memory
template <class T> static inline T ninfer_moe_ldcg(const T* p) { return *p; }
static inline void ninfer_moe_fence() {}
"""

# compile/kernels/cuda/dequant_nvfp4.py (PACK_SRC, gemv.py's bf16x2 multiply renamed)
DEQUANT = r"""
#define ninfer_dqw_bf16x2_mul ninfer_bf16x2_mul
static inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
static inline unsigned ninfer_dqw_pack_bf16(float a, float b) {
  return (unsigned)emu_bf16_rn(a) | ((unsigned)emu_bf16_rn(b) << 16);
}
static inline unsigned ninfer_dqw_pack_f16(float a, float b) {
  _Float16 h[2] = {(_Float16)a, (_Float16)b}; unsigned r; memcpy(&r, h, 4); return r;
}
"""

# compile/kernels/cuda/sampling.py (T.cuda.atomic_add on shared memory, __dmul_rn; __fdiv_rn is in CORE)
SAMPLER = r"""
template <class T> static T tvm_builtin_cuda_atomic_add(T* addr, T value) {
  T old = *addr; *addr = old + value; return old;  // atomic for the same reason as ninfer_moe_atomic_add
}
static double __dmul_rn(double a, double b) { return a * b; }
"""


def source() -> str:
    """The whole prelude: CORE, then every kernel family's helpers (their names do not collide)."""
    from .. import gemv

    return "\n".join((CORE, MMA16, ATTENTION, GDN, GEMV, gemv._NVFP4_DQ_BODY, DEQUANT, MOE, SAMPLER))
