"""Run TileLang-generated SIMT CUDA on the CPU: one fiber per CUDA thread (tests only).

Covers the subset the thread-level GDN template (tiles/gdn.py `gdn_buffered`) emits: threadIdx /
blockIdx, dynamic shared memory, __syncthreads, __shfl_xor_sync, float4 / uint4 vector moves, bf16
conversions, the __f*_rn intrinsics (tiles/conv1d.py; plain IEEE float ops here) and TileLang's
tl::mma_sync for m16n8k8 TF32 (the tensor-core S0 products, tiles/simt_parts.py `mma_products`); and
what T.gemm's warp-level products and T.reduce emit for the tensor-core decode attention
(tiles/attention.py `attention_decode_mma`): mma_sync m16n8k16 bf16, ldmatrix x4 (plain and
transposed), stmatrix x4 and tl::AllReduce (PTX fragment layouts, products summed in double); and
T.cumsum's tl::CumSum1D (the chunked prefill's within-chunk decay). Shared
memory starts NaN-poisoned, so reading a value no thread wrote shows in the outputs.
Blocks run one after another, each block's threads as fibers of one OS thread: a thread runs until it
waits at a barrier (__syncthreads, or its warp's in a shuffle or an mma), then the next one; even blocks
take their threads in ascending order, odd ones in descending, so a read of another thread's write
without a barrier between finds the NaN poison one way or the other. A barrier that never opens is an
error, not a hang. rsqrtf is exact here (the GPU's is within 2 ulp).
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import json
import os
import re
import subprocess
import tempfile

# the folder the builds go to when no `workdir` is given (tests/conftest.py sets it to the run's
# compile-cache folder, which pytest-xdist's workers share)
EMULATOR_DIR_VARIABLE = "KVBUFFER_TEST_EMULATOR_DIR"

PRELUDE = r"""
#include <cstdint>
#include <cmath>
#include <cstring>
#include <ucontext.h>
#include <vector>
#include <memory>
#include <algorithm>
using std::max; using std::min;
typedef unsigned int uint;
#define uchar unsigned char
#define __global__
#define __launch_bounds__(a, b)
#define __restrict__
#define __align__(x)
#define CUDART_INF_F INFINITY
struct dim3_ { int x, y, z; };
dim3_ threadIdx;  // the running fiber's
dim3_ blockIdx;
ucontext_t g_launcher;
ucontext_t* g_fiber;  // the running fiber's context
long g_arrivals;      // barrier arrivals and finished threads: the launcher's progress check
// a barrier of `expected` fibers: the last one to arrive opens it and runs on; the others yield to the
// launcher until it opens
struct Barrier {
  int expected, count = 0;
  long phase = 0;
  explicit Barrier(int n) : expected(n) {}
  void arrive_and_wait() {
    long mine = phase;
    ++g_arrivals;
    if (++count == expected) { count = 0; ++phase; return; }
    while (phase == mine) swapcontext(g_fiber, &g_launcher);
  }
};
Barrier* g_bar;
Barrier* g_warpbar[32];
float g_xch[32][32];
uchar* g_shmem;
static inline void __syncthreads() { g_bar->arrive_and_wait(); }
static inline float __shfl_xor_sync(uint, float v, int d, int) {
  int t = threadIdx.x, wp = t / 32, l = t % 32;
  g_xch[wp][l] = v; g_warpbar[wp]->arrive_and_wait();
  float r = g_xch[wp][l ^ d]; g_warpbar[wp]->arrive_and_wait();
  return r;
}
struct bfloat16_t {
  uint16_t bits;
  bfloat16_t() = default;
  explicit bfloat16_t(float f) {
    uint32_t u; std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000) { bits = 0x7fc0; return; }
    u += 0x7fff + ((u >> 16) & 1); bits = u >> 16;
  }
  explicit operator float() const { uint32_t u = uint32_t(bits) << 16; float f; std::memcpy(&f, &u, 4); return f; }
  explicit operator double() const { return double(float(*this)); }
};
struct __nv_bfloat162 { bfloat16_t x, y; };
struct float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) uint2 { uint x, y; };
struct alignas(16) uint4 { uint x, y, z, w; };
static inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
static inline uint4 make_uint4(uint a, uint b, uint c, uint d) { return {a, b, c, d}; }
static inline uint2 make_uint2(uint a, uint b) { return {a, b}; }
static inline float2 make_float2(float a, float b) { return {a, b}; }
static inline float2 __bfloat1622float2(__nv_bfloat162 v) { return {float(v.x), float(v.y)}; }
static inline uint __pack_nv_bfloat162(bfloat16_t a, bfloat16_t b) { return uint(a.bits) | (uint(b.bits) << 16); }
static inline uint __pack_half2(bfloat16_t a, bfloat16_t b) { return __pack_nv_bfloat162(a, b); }
static inline __nv_bfloat162 __float22bfloat162_rn(float2 v) { return {bfloat16_t(v.x), bfloat16_t(v.y)}; }
struct uint1 { uint x; };
static inline uint1 make_uint1(uint a) { return {a}; }
float g_red[1024];  // tl::AllReduce's exchange across warps
static inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
// mma.sync m16n8k8 with TF32 A and B and fp32 C/D (PTX fragment layouts; the low 13 mantissa bits of
// A and B are ignored as the tensor cores do), a warp-collective like the shuffle above
namespace tl {
enum class DataType { kTensorFloat32, kFloat32, kBFloat16 };
struct MmaLane { float a[4], b[2], c[4]; };
MmaLane g_mma[32][32];
static inline float tf32_bits(unsigned u) { u &= 0xffffe000u; float f; std::memcpy(&f, &u, 4); return f; }
static inline float bf16_half(unsigned u, int hi) { uint32_t v = (hi ? u >> 16 : u & 0xffffu) << 16; float f; std::memcpy(&f, &v, 4); return f; }
struct MmaBf16Lane { unsigned a[4], b[2]; };
MmaBf16Lane g_mma16[32][32];
// m16n8k16, bf16 A (row) and B (col), fp32 C/D: lane l = 4 g + t holds A rows g, g + 8 and columns
// 2t, 2t + 1 (+ 8), B column g and rows 2t, 2t + 1 (+ 8), C rows g, g + 8 and columns 2t, 2t + 1
static inline void mma_bf16(float* c, const unsigned* a, const unsigned* b) {
  int t = threadIdx.x, wp = t / 32, l = t % 32;
  for (int i = 0; i < 4; ++i) g_mma16[wp][l].a[i] = a[i];
  for (int i = 0; i < 2; ++i) g_mma16[wp][l].b[i] = b[i];
  g_warpbar[wp]->arrive_and_wait();
  auto A = [&](int m, int k) { return bf16_half(g_mma16[wp][4 * (m % 8) + (k % 8) / 2].a[(m >= 8) + 2 * (k >= 8)], k % 2); };
  auto B = [&](int k, int n) { return bf16_half(g_mma16[wp][4 * n + (k % 8) / 2].b[k >= 8], k % 2); };
  for (int i = 0; i < 4; ++i) {
    int m = l / 4 + 8 * (i / 2), n = 2 * (l % 4) + i % 2;
    double sum = 0;
    for (int k = 0; k < 16; ++k) sum += double(A(m, k)) * double(B(k, n));
    c[i] = float(double(c[i]) + sum);
  }
  g_warpbar[wp]->arrive_and_wait();
}
// ldmatrix / stmatrix x4: lane l names row l % 8 of 8 x 8 matrix l / 8; each lane's register i holds
// matrix i's row l / 4, columns 2 (l % 4), + 1 (transposed: that row and column swapped)
const uchar* g_rows[32][32];
static inline void ptx_ldmatrix(void const* const p, void* dst, bool trans) {
  int t = threadIdx.x, wp = t / 32, l = t % 32;
  g_rows[wp][l] = (const uchar*)p;
  g_warpbar[wp]->arrive_and_wait();
  unsigned* d = (unsigned*)dst;
  for (int i = 0; i < 4; ++i) {
    if (!trans) { std::memcpy(&d[i], g_rows[wp][8 * i + l / 4] + 4 * (l % 4), 4); continue; }
    uint16_t lo, hi;
    std::memcpy(&lo, g_rows[wp][8 * i + 2 * (l % 4)] + 2 * (l / 4), 2);
    std::memcpy(&hi, g_rows[wp][8 * i + 2 * (l % 4) + 1] + 2 * (l / 4), 2);
    d[i] = unsigned(lo) | (unsigned(hi) << 16);
  }
  g_warpbar[wp]->arrive_and_wait();
}
static inline void ptx_ldmatrix_x4(void const* const p, void* const dst) { ptx_ldmatrix(p, dst, false); }
static inline void ptx_ldmatrix_x4_trans(void const* const p, void* const dst) { ptx_ldmatrix(p, dst, true); }
static inline void ptx_stmatrix_m8n8_x4(void const* const p, unsigned v0, unsigned v1, unsigned v2, unsigned v3) {
  int t = threadIdx.x, wp = t / 32, l = t % 32;
  g_rows[wp][l] = (const uchar*)p;
  g_warpbar[wp]->arrive_and_wait();
  unsigned v[4] = {v0, v1, v2, v3};
  for (int i = 0; i < 4; ++i) std::memcpy((uchar*)g_rows[wp][8 * i + l / 4] + 4 * (l % 4), &v[i], 4);
  g_warpbar[wp]->arrive_and_wait();
}
struct MaxOp { float operator()(float a, float b) const { return std::max(a, b); } };
struct SumOp { float operator()(float a, float b) const { return a + b; } };
template <int N> struct NamedBarrier {};
// the reduction over the lanes whose index (less thread_offset) differs only in the bits from `scale`
// up to `threads`; across warps through g_red and the block barrier, within one through the warp's
template <class R, int threads, int scale, int thread_offset, class Barrier = void, int batch = 1, int stride = 0>
struct AllReduce {
  template <typename T> static T run(T x, T* = nullptr) {
    if constexpr (threads == scale) return x;
    int t = threadIdx.x - thread_offset, wp = threadIdx.x / 32, mask = (threads - 1) & ~(scale - 1);
    bool block = threads > 32;
    if (block) { g_red[t] = x; __syncthreads(); } else { g_xch[wp][threadIdx.x % 32] = x; g_warpbar[wp]->arrive_and_wait(); }
    T r = x;
    for (int k = 0; k < threads / scale; ++k) {
      int u = (t & ~mask) | (k * scale);
      if (u != t) r = R()(r, block ? g_red[u] : g_xch[wp][(u + thread_offset) % 32]);
    }
    if (block) __syncthreads(); else g_warpbar[wp]->arrive_and_wait();
    return r;
  }
};
static inline void mma_tf32(float* c, const unsigned* a, const unsigned* b) {
  int t = threadIdx.x, wp = t / 32, l = t % 32;
  MmaLane& me = g_mma[wp][l];
  for (int i = 0; i < 4; ++i) { me.a[i] = tf32_bits(a[i]); me.c[i] = c[i]; }
  for (int i = 0; i < 2; ++i) me.b[i] = tf32_bits(b[i]);
  g_warpbar[wp]->arrive_and_wait();
  auto A = [&](int m, int k) { return g_mma[wp][4 * (m % 8) + k % 4].a[(m >= 8) + 2 * (k >= 4)]; };
  auto B = [&](int k, int n) { return g_mma[wp][4 * n + k % 4].b[k >= 4]; };
  for (int i = 0; i < 4; ++i) {
    int m = l / 4 + 8 * (i / 2), n = 2 * (l % 4) + i % 2;
    double sum = 0;
    for (int k = 0; k < 8; ++k) sum += double(A(m, k)) * double(B(k, n));
    c[i] = float(double(g_mma[wp][l].c[i]) + sum);
  }
  g_warpbar[wp]->arrive_and_wait();
}
// T.cumsum of a shared vector: warp 0 scans it (with shuffles on the GPU); here its lane 0 alone, the sums in
// order, the whole source read before anything is written (so in place is right too)
template <int threads, bool reverse = false> struct CumSum1D {
  template <typename T> static void run(const T* src, T* dst, int n) {
    if (threadIdx.x != 0) return;
    std::vector<T> out(n);
    T acc = T(0);
    for (int i = 0; i < n; ++i) { int j = reverse ? n - 1 - i : i; acc = acc + src[j]; out[j] = acc; }
    for (int i = 0; i < n; ++i) dst[i] = out[i];
  }
};
template <DataType TA, DataType TB, DataType TC, int M, int N, int K, bool transA, bool transB>
static inline void mma_sync(float* c, const unsigned* a, const unsigned* b) {
  if constexpr (TA == DataType::kBFloat16) {
    static_assert(M == 16 && N == 8 && K == 16, "bf16: only m16n8k16 is emulated");
    mma_bf16(c, a, b);
  } else {
    static_assert(M == 16 && N == 8 && K == 8 && TA == DataType::kTensorFloat32, "only m16n8k8 TF32 is emulated");
    mma_tf32(c, a, b);
  }
}
}  // namespace tl
"""

LAUNCH = r"""
void** g_ptrs; int* g_ints; float* g_floats;
char* g_done;
static void run_thread() { KERNEL_CALL; g_done[threadIdx.x] = 1; ++g_arrivals; }  // then back to the launcher
// 0, or 1 when a block's live threads all wait at barriers that cannot open
extern "C" int launch(void** ptrs, int* ints, float* floats, int gx, int gy, int gz, int nt) {
  const size_t stack = 256 << 10;
  g_ptrs = ptrs; g_ints = ints; g_floats = floats;
  std::vector<uchar> smem(262144);
  std::vector<ucontext_t> fibers(nt);
  std::vector<std::unique_ptr<char[]>> stacks;
  for (int t = 0; t < nt; ++t) stacks.emplace_back(new char[stack]);
  std::vector<char> done(nt);
  g_done = done.data();
  int block = 0;
  for (int bz = 0; bz < gz; ++bz) for (int by = 0; by < gy; ++by) for (int bx = 0; bx < gx; ++bx, ++block) {
    blockIdx = {bx, by, bz};
    std::memset(smem.data(), 0xff, smem.size());
    g_shmem = smem.data();
    Barrier bar(nt); g_bar = &bar;
    std::vector<std::unique_ptr<Barrier>> wb;
    for (int w = 0; w < (nt + 31) / 32; ++w) { wb.emplace_back(new Barrier(32)); g_warpbar[w] = wb.back().get(); }
    std::fill(done.begin(), done.end(), 0);
    for (int t = 0; t < nt; ++t) {
      getcontext(&fibers[t]);
      fibers[t].uc_stack.ss_sp = stacks[t].get();
      fibers[t].uc_stack.ss_size = stack;
      fibers[t].uc_link = &g_launcher;
      makecontext(&fibers[t], run_thread, 0);
    }
    for (int live = nt; live > 0;) {
      long before = g_arrivals;
      for (int i = 0; i < nt; ++i) {
        int t = block % 2 ? nt - 1 - i : i;
        if (done[t]) continue;
        threadIdx = {t, 0, 0};
        g_fiber = &fibers[t];
        swapcontext(&g_launcher, g_fiber);
        live -= done[t];
      }
      if (live && g_arrivals == before) return 1;
    }
  }
  return 0;
}
"""


def _build(code: str, so: str) -> None:
    """Compile `code` into the shared library `so`, written beside it and renamed into place."""
    src, partial = so[:-3] + ".cpp", so + f".{os.getpid()}.partial"
    with open(src, "w") as f:
        f.write(code)
    r = subprocess.run(["g++", "-O1", "-std=c++20", "-shared", "-fPIC", "-w", "-o", partial, src],
                       capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"emulator build failed:\n{r.stderr[-3000:]}")
    os.replace(partial, so)


def cuda_source(prim, target: dict, workdir: str | None = None) -> str:
    """The CUDA source TileLang generates for the template `prim` on `target` (a TileLang target dict such as
    `get_gpu("h200").target`): what `kvbuffer.tiles.compile_template` hands nvcc, lowered the same way
    (tests/kernels/test_tiles_compile.py checks that the two agree) but without running nvcc, which the
    emulator does not need. Kept in `workdir` (as `Emulated`'s builds) by the template's script, the target
    and TileLang's version: one process lowers it while the others wait, then read it."""
    import tilelang

    key = json.dumps([prim.script(show_meta=True), target, tilelang.__version__], sort_keys=True)
    workdir = workdir or os.environ.get(EMULATOR_DIR_VARIABLE) or tempfile.gettempdir()
    path = os.path.join(workdir, f"kvb_src_{hashlib.sha256(key.encode()).hexdigest()[:24]}.cu")
    with open(path[:-3] + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(path):
            partial = path + f".{os.getpid()}.partial"
            with open(partial, "w") as f:
                f.write(_lower(prim, target))
            os.replace(partial, path)
    with open(path) as f:
        return f.read()


def _lower(prim, target: dict) -> str:
    """TileLang's lowering as `tilelang.compile` runs it (the template's own pass configs over the defaults, the
    execution backend's context), up to the generated source."""
    import tvm
    from tilelang.backend.module import create_backend_context
    from tilelang.engine.lower import lower_with_context
    from tilelang.transform.pass_config import normalize_pass_configs

    attrs = prim.attrs or {}
    configs = normalize_pass_configs(dict(attrs["tilelang_pass_configs"]) if "tilelang_pass_configs" in attrs else None)
    context = create_backend_context(target, None, "auto")
    with tvm.transform.PassContext(opt_level=3, config=configs), context.target:
        artifact = lower_with_context(prim, context, enable_host_codegen=False, enable_device_compile=False)
    return str(artifact.kernel_source)


def emulated(prim, target: dict) -> "Emulated":
    """The emulator build of the template `prim`'s CUDA source for `target`."""
    return Emulated(cuda_source(prim, target))


class Emulated:
    """A compiled CPU stand-in for one kernel; call with the grid, the block size and named arguments.

    The C++ source and shared library go to `workdir`, named by the source's hash: an existing one is
    reused, and one process builds it while the others wait (a lock file beside it; the library is
    renamed into place whole). By default $KVBUFFER_TEST_EMULATOR_DIR, else the temporary directory.
    """

    def __init__(self, cuda_source: str, workdir: str | None = None):
        body = cuda_source[cuda_source.index('extern "C" __global__ void __launch_bounds__'):]
        body = body.replace("extern __shared__ __align__(1024) uchar buf_dyn_shmem[];", "uchar* buf_dyn_shmem = g_shmem;")
        sig = re.search(r"void __launch_bounds__\([^)]*\) (\w+)\(([^)]*)\)", body)
        params = [p.strip() for p in sig.group(2).split(",")]
        self.names = [p.split()[-1].lstrip("*") for p in params]
        self.pointer = ["*" in p for p in params]
        self.real = [not ptr and p.split()[0] == "float" for p, ptr in zip(params, self.pointer)]  # float scalars
        args = [f"({p.rsplit(' ', 1)[0].replace('__restrict__', '').strip()})g_ptrs[{i}]" if ptr
                else f"g_floats[{i}]" if real else f"g_ints[{i}]"
                for i, (p, ptr, real) in enumerate(zip(params, self.pointer, self.real))]
        code = PRELUDE + body.replace('extern "C" ', "") + LAUNCH.replace("KERNEL_CALL", f"{sig.group(1)}({', '.join(args)})")
        workdir = workdir or os.environ.get(EMULATOR_DIR_VARIABLE) or tempfile.gettempdir()
        so = os.path.join(workdir, f"kvb_emu_{hashlib.sha1(code.encode()).hexdigest()[:16]}.so")
        with open(so[:-3] + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not os.path.exists(so):
                _build(code, so)
        self.lib = ctypes.CDLL(so)

    def __call__(self, grid: tuple, threads: int, **args) -> None:
        n = len(self.names)
        ptrs, ints, floats = (ctypes.c_void_p * n)(), (ctypes.c_int * n)(), (ctypes.c_float * n)()
        for i, (name, ptr, real) in enumerate(zip(self.names, self.pointer, self.real)):
            a = args[name]
            if ptr:  # a view only where the kernel takes the tensor's strides (`<name>_..._stride` parameters)
                strided = any(p.startswith(name + "_") and p.endswith("_stride") for p in self.names)
                assert (strided or a.is_contiguous()) and a.device.type == "cpu", name
                ptrs[i] = a.data_ptr()
            elif real:
                floats[i] = float(a)
            else:
                ints[i] = int(a)
        if self.lib.launch(ptrs, ints, floats, *grid, threads):
            raise RuntimeError(f"the kernel's threads wait at a barrier that never opens (grid {grid}, {threads} threads)")
