//! The CUDA dialect: one CUDA C++ module per graph, compiled by NVRTC. Each kernel takes its
//! buffers as pointers (in buffer-id order) and then its size symbols as `long long`.
//!
//! - Pointwise kernels: a grid-stride loop over the flattened domain, one element per
//!   thread per step, the last dim fastest (coalesced).
//! - Column kernels (the kept dim is the fastest): 8 outer points per block, 64 threads
//!   per point over the reduced elements, combined through shared memory.
//! - Tiny rows (at most `SERIAL_ROW_MAX` reduced elements): one thread per outer point,
//!   a grid-stride loop like a pointwise kernel's; no combination across threads.
//! - Short rows (at most `WARP_ROW_MAX` reduced elements): one warp per outer point, 8 per
//!   block, combined by shuffles alone.
//! - Reduction kernels: one block per outer point (grid-stride over outer points); threads
//!   stride over the reduced elements, then combine through warp shuffles and shared memory
//!   (Welford's combination for variance); every thread gets the result, so later passes and
//!   the outer-point math run in all threads and only thread 0 stores outer-point values.
//!
//! Half types are computed in f32 registers. Statements are written by `c_emit.rs`.

use crate::c_emit::{index, tmp_deps, Emitter};
use crate::dialect::{compute_type, storage_type, Dialect};
use crate::CodegenError;
use braze_ir::{DType, Expr, ReduceKind};
use braze_sched::loop_ir::{stmt_reads, Kernel, Stmt};
use std::fmt::Write;

pub struct Cuda;

const PRELUDE: &str = concat!(
    r#"typedef long long int64_t;
typedef int int32_t;
typedef short int16_t;
typedef signed char int8_t;
typedef unsigned long long uint64_t;
typedef unsigned int uint32_t;
typedef unsigned short uint16_t;
typedef unsigned char uint8_t;
#define INFINITY __int_as_float(0x7f800000)
#define NAN __int_as_float(0x7fffffff)
#define INT64_MIN (-9223372036854775807LL - 1)
#define INT64_MAX 9223372036854775807LL
#define bz_min_int64_t INT64_MIN
#define bz_max_int64_t INT64_MAX
#define bz_min_int32_t (-2147483647 - 1)
#define bz_max_int32_t 2147483647
#define bz_min_int16_t ((int16_t)-32768)
#define bz_max_int16_t ((int16_t)32767)
#define bz_min_int8_t ((int8_t)-128)
#define bz_max_int8_t ((int8_t)127)
#define bz_min_uint8_t ((uint8_t)0)
#define bz_max_uint8_t ((uint8_t)255)
#define BZ __device__ __forceinline__
// Every kernel starts here ([Note: programmatic launch] in braze-runtime): on Hopper and newer
// it waits until the kernel before it in the stream has finished and its writes are visible,
// then lets the next kernel launch, whose blocks start while this one runs.
BZ void bz_entry() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
BZ float bz_self(int c, float a, float b) { return c ? a : b; }
// Welford's mean update divides by the element count once per element: __fdividef (a
// reciprocal and a multiply, within 2 ulp) instead of IEEE division, which was most of the
// work of a LayerNorm's statistics pass on the H100.
BZ float bz_wdiv(float a, float b) { return __fdividef(a, b); }
// Welford's element count per thread: 32-bit (its conversion to float is one instruction).
typedef int bz_count_t;
BZ double bz_wdivd(double a, double b) { return a / b; }
BZ double bz_seld(int c, double a, double b) { return c ? a : b; }
BZ int64_t bz_seli(int c, int64_t a, int64_t b) { return c ? a : b; }
BZ double bz_f64_from_bits(int64_t x) { return __longlong_as_double(x); }
template <class T> BZ bool bz_isinf(T x) { return x == (T)INFINITY || x == -(T)INFINITY; }
BZ float bz_h2f(uint16_t h) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }
BZ uint16_t bz_f2h(float f) { uint16_t h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }
BZ float bz_round_h(float x) { return bz_h2f(bz_f2h(x)); }
BZ float bz_bf2f(uint16_t h) { return __uint_as_float(((uint32_t)h) << 16); }
// Round to nearest even: one instruction from sm_80 on (what ATen's c10::BFloat16 uses on
// the GPU); the integer form before it.
BZ uint16_t bz_f2bf(float x) {
#if __CUDA_ARCH__ >= 800
  uint16_t h; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x)); return h;
#else
  uint32_t u = __float_as_uint(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
#endif
}
BZ float bz_round_bf(float x) { return bz_bf2f(bz_f2bf(x)); }
BZ float bz_rem_float(float a, float b) { float r = fmodf(a, b); if (r != 0 && ((r < 0) != (b < 0))) r += b; return r; }
BZ double bz_rem_double(double a, double b) { double r = fmod(a, b); if (r != 0 && ((r < 0) != (b < 0))) r += b; return r; }
// An index read from memory out of range traps, as eager's device-side assert does.
BZ int64_t bz_bounded(int64_t i, int64_t n) { if ((uint64_t)i >= (uint64_t)n) __trap(); return i; }
#define BZ_INT BZ
"#,
    integer_division_helpers!(),
    r#"BZ int64_t bz_pow_i64(int64_t a, int64_t b) { int64_t r = 1; if (b < 0) return a == 1 ? 1 : (a == -1 ? ((b & 1) ? -1 : 1) : 0); while (b) { if (b & 1) r *= a; a *= a; b >>= 1; } return r; }
#define BZ_RNG __device__ __noinline__
// The random helpers are functions of their own (Philox inlined into each, its rounds a
// loop): inlined and unrolled into every element of a vectorized kernel, they made NVRTC's
// time for a GPT-2 forward half as long again.
#define BZ_RNG_PHILOX BZ
#define BZ_RNG_ROUNDS _Pragma("unroll 1")
"#,
    random_helpers!(),
    r#"
/* Warp shuffles for every accumulator type (narrow integers travel as int). */
BZ float bz_shfl(float v, int o) { return __shfl_xor_sync(0xffffffffu, v, o); }
BZ double bz_shfl(double v, int o) { return __shfl_xor_sync(0xffffffffu, v, o); }
BZ long long bz_shfl(long long v, int o) { return __shfl_xor_sync(0xffffffffu, v, o); }
BZ int bz_shfl(int v, int o) { return __shfl_xor_sync(0xffffffffu, v, o); }
BZ bool bz_shfl(bool v, int o) { return __shfl_xor_sync(0xffffffffu, (int)v, o) != 0; }
BZ short bz_shfl(short v, int o) { return (short)__shfl_xor_sync(0xffffffffu, (int)v, o); }
BZ signed char bz_shfl(signed char v, int o) { return (signed char)__shfl_xor_sync(0xffffffffu, (int)v, o); }
BZ unsigned char bz_shfl(unsigned char v, int o) { return (unsigned char)__shfl_xor_sync(0xffffffffu, (int)v, o); }

/* Block-wide reduction: every thread returns the combination of all threads' values. */
template <class T, class F> __device__ T bz_block_reduce(T v, F f) {
  __shared__ T sh[32];
  for (int o = 16; o > 0; o >>= 1) v = f(v, bz_shfl(v, o));
  int nw = (blockDim.x + 31) >> 5;
  if (nw == 1) return v;
  __syncthreads();
  if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
  __syncthreads();
  v = sh[0];
  for (int i = 1; i < nw; i++) v = f(v, sh[i]);
  return v;
}

/* Welford partial results (count, mean, M2) combined across the block (Chan et al.). */
template <class T> __device__ void bz_block_welford(T& mean, T& m2, T& n) {
  __shared__ T sh[3][32];
  for (int o = 16; o > 0; o >>= 1) {
    T nb = bz_shfl(n, o), mb = bz_shfl(mean, o), qb = bz_shfl(m2, o);
    T nn = n + nb;
    if (nn > 0) { T d = mb - mean; mean += d * nb / nn; m2 += qb + d * d * n * nb / nn; }
    n = nn;
  }
  int nw = (blockDim.x + 31) >> 5;
  if (nw == 1) return;
  __syncthreads();
  if ((threadIdx.x & 31) == 0) { sh[0][threadIdx.x >> 5] = mean; sh[1][threadIdx.x >> 5] = m2; sh[2][threadIdx.x >> 5] = n; }
  __syncthreads();
  mean = sh[0][0]; m2 = sh[1][0]; n = sh[2][0];
  for (int i = 1; i < nw; i++) {
    T nb = sh[2][i], nn = n + nb;
    if (nn > 0) { T d = sh[0][i] - mean; mean += d * nb / nn; m2 += sh[1][i] + d * d * n * nb / nn; }
    n = nn;
  }
}

/* Warp kernels: one warp per outer point; lanes combine through shuffles alone. */
template <class T, class F> BZ T bz_warp_reduce(T v, F f) {
  for (int o = 16; o > 0; o >>= 1) v = f(v, bz_shfl(v, o));
  return v;
}
template <class T> BZ void bz_warp_welford(T& mean, T& m2, T& n) {
  for (int o = 16; o > 0; o >>= 1) {
    T nb = bz_shfl(n, o), mb = bz_shfl(mean, o), qb = bz_shfl(m2, o);
    T nn = n + nb;
    if (nn > 0) { T d = mb - mean; mean += d * nb / nn; m2 += qb + d * d * n * nb / nn; }
    n = nn;
  }
}
template <class T> BZ bool bz_arg_better(T a, long long ia, T b, long long ib, bool is_max);
template <class T> BZ void bz_warp_arg(T& v, long long& idx, bool is_max) {
  for (int o = 16; o > 0; o >>= 1) {
    T ov = bz_shfl(v, o); long long oi = bz_shfl(idx, o);
    if (bz_arg_better(ov, oi, v, idx, is_max)) { v = ov; idx = oi; }
  }
}

/* Column kernels (CX outer points per block, CY threads per point): threads with the same
   threadIdx.x share an outer point; combine over y as a tree in shared memory (log2(CY)
   steps; a serial pass over the 64 partials by every thread cost more than the loads when
   rows are short). */
template <int CX, int CY, class T, class F> __device__ T bz_col_reduce(T v, F f) {
  __shared__ T sh[CY][CX + 1];
  __syncthreads();
  sh[threadIdx.y][threadIdx.x] = v;
  __syncthreads();
  for (int s = CY / 2; s > 0; s >>= 1) {
    if (threadIdx.y < s) sh[threadIdx.y][threadIdx.x] = v = f(v, sh[threadIdx.y + s][threadIdx.x]);
    __syncthreads();
  }
  return sh[0][threadIdx.x];
}
template <int CX, int CY, class T> __device__ void bz_col_welford(T& mean, T& m2, T& n) {
  __shared__ T sh[3][CY][CX + 1];
  const int x = threadIdx.x, y = threadIdx.y;
  __syncthreads();
  sh[0][y][x] = mean; sh[1][y][x] = m2; sh[2][y][x] = n;
  __syncthreads();
  for (int s = CY / 2; s > 0; s >>= 1) {
    if (y < s) {
      T nb = sh[2][y + s][x], nn = n + nb;
      if (nn > 0) { T d = sh[0][y + s][x] - mean; mean += d * nb / nn; m2 += sh[1][y + s][x] + d * d * n * nb / nn; }
      n = nn;
      sh[0][y][x] = mean; sh[1][y][x] = m2; sh[2][y][x] = n;
    }
    __syncthreads();
  }
  mean = sh[0][0][x]; m2 = sh[1][0][x]; n = sh[2][0][x];
}

/* Arg-reductions: the first index of the max (min); NaN counts as the max (min). */
template <class T> BZ bool bz_arg_better(T a, long long ia, T b, long long ib, bool is_max) {
  bool an = a != a, bn = b != b;
  if (an || bn) return an && (!bn || ia < ib);
  if (a == b) return ia < ib;
  return is_max ? a > b : a < b;
}
template <class T> __device__ void bz_block_arg(T& v, long long& idx, bool is_max) {
  __shared__ T shv[32];
  __shared__ long long shi[32];
  for (int o = 16; o > 0; o >>= 1) {
    T ov = bz_shfl(v, o); long long oi = bz_shfl(idx, o);
    if (bz_arg_better(ov, oi, v, idx, is_max)) { v = ov; idx = oi; }
  }
  int nw = (blockDim.x + 31) >> 5;
  if (nw == 1) return;
  __syncthreads();
  if ((threadIdx.x & 31) == 0) { shv[threadIdx.x >> 5] = v; shi[threadIdx.x >> 5] = idx; }
  __syncthreads();
  v = shv[0]; idx = shi[0];
  for (int i = 1; i < nw; i++) if (bz_arg_better(shv[i], shi[i], v, idx, is_max)) { v = shv[i]; idx = shi[i]; }
}
template <int CX, int CY, class T> __device__ void bz_col_arg(T& v, long long& idx, bool is_max) {
  __shared__ T shv[CY][CX + 1];
  __shared__ long long shi[CY][CX + 1];
  const int x = threadIdx.x, y = threadIdx.y;
  __syncthreads();
  shv[y][x] = v; shi[y][x] = idx;
  __syncthreads();
  for (int s = CY / 2; s > 0; s >>= 1) {
    if (y < s) {
      if (bz_arg_better(shv[y + s][x], shi[y + s][x], v, idx, is_max)) { v = shv[y + s][x]; idx = shi[y + s][x]; }
      shv[y][x] = v; shi[y][x] = idx;
    }
    __syncthreads();
  }
  v = shv[0][x]; idx = shi[0][x];
}

/* Vector column kernels ([Note: vector columns]): thread (x, y), t = y * CX + x, holds V
   neighbouring outer points; threads with the same x share them. Lanes CX apart in a warp
   combine through shuffles, then one partial per warp and point through shared memory. */
template <int CX, int CY, int V, class T, class F> __device__ void bz_colv_reduce(T (&v)[V], F f, int x, int t) {
  constexpr int NW = CX * CY / 32;
  __shared__ T sh[NW][CX * V];
  #pragma unroll
  for (int l = 0; l < V; l++)
    for (int o = 16; o >= CX; o >>= 1) v[l] = f(v[l], bz_shfl(v[l], o));
  __syncthreads();
  if ((t & 31) < CX) {
    #pragma unroll
    for (int l = 0; l < V; l++) sh[t >> 5][x * V + l] = v[l];
  }
  __syncthreads();
  if (t < CX * V) { T a = sh[0][t]; for (int w = 1; w < NW; w++) a = f(a, sh[w][t]); sh[0][t] = a; }
  __syncthreads();
  #pragma unroll
  for (int l = 0; l < V; l++) v[l] = sh[0][x * V + l];
}
template <class T> BZ void bz_welford_merge(T& mean, T& m2, T& n, T mb, T qb, T nb) {
  T nn = n + nb;
  if (nn > 0) { T d = mb - mean; mean += d * nb / nn; m2 += qb + d * d * n * nb / nn; }
  n = nn;
}
template <int CX, int CY, int V, class T> __device__ void bz_colv_welford(T (&mean)[V], T (&m2)[V], T (&n)[V], int x, int t) {
  constexpr int NW = CX * CY / 32;
  __shared__ T sh[3][NW][CX * V];
  #pragma unroll
  for (int l = 0; l < V; l++)
    for (int o = 16; o >= CX; o >>= 1) bz_welford_merge(mean[l], m2[l], n[l], bz_shfl(mean[l], o), bz_shfl(m2[l], o), bz_shfl(n[l], o));
  __syncthreads();
  if ((t & 31) < CX) {
    #pragma unroll
    for (int l = 0; l < V; l++) { sh[0][t >> 5][x * V + l] = mean[l]; sh[1][t >> 5][x * V + l] = m2[l]; sh[2][t >> 5][x * V + l] = n[l]; }
  }
  __syncthreads();
  if (t < CX * V) {
    T a = sh[0][0][t], q = sh[1][0][t], c = sh[2][0][t];
    for (int w = 1; w < NW; w++) bz_welford_merge(a, q, c, sh[0][w][t], sh[1][w][t], sh[2][w][t]);
    sh[0][0][t] = a; sh[1][0][t] = q; sh[2][0][t] = c;
  }
  __syncthreads();
  #pragma unroll
  for (int l = 0; l < V; l++) { mean[l] = sh[0][0][x * V + l]; m2[l] = sh[1][0][x * V + l]; n[l] = sh[2][0][x * V + l]; }
}

/* Cluster columns ([Note: cluster columns]): the C blocks of a cluster share their points and
   split the rows; each block's result for point p (lane l of its V) is combined with the
   others' through distributed shared memory, in rank order, so every block of the cluster
   holds the same value. The second barrier keeps a block's shared memory alive until the
   others have read it. Hopper and newer. */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
BZ unsigned bz_cluster_rank() { unsigned r; asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r)); return r; }
BZ void bz_cluster_sync() { asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory"); }
template <class T> BZ const T* bz_cluster_ptr(const T* p, unsigned rank) {
  unsigned long long r; asm volatile("mapa.u64 %0, %1, %2;" : "=l"(r) : "l"(p), "r"(rank)); return (const T*)r;
}
template <int C, int P, int V, class T, class F> __device__ void bz_cluster_reduce(T (&v)[V], F f, int p, bool writer) {
  __shared__ T part[P * V];
  if (writer) {
    #pragma unroll
    for (int l = 0; l < V; l++) part[p * V + l] = v[l];
  }
  bz_cluster_sync();
  #pragma unroll
  for (int l = 0; l < V; l++) v[l] = bz_cluster_ptr(part, 0)[p * V + l];
  for (int r = 1; r < C; r++) {
    const T* q = bz_cluster_ptr(part, r);
    #pragma unroll
    for (int l = 0; l < V; l++) v[l] = f(v[l], q[p * V + l]);
  }
  bz_cluster_sync();
}
template <int C, int P, int V, class T> __device__ void bz_cluster_welford(T (&mean)[V], T (&m2)[V], T (&n)[V], int p, bool writer) {
  __shared__ T part[3][P * V];
  if (writer) {
    #pragma unroll
    for (int l = 0; l < V; l++) { part[0][p * V + l] = mean[l]; part[1][p * V + l] = m2[l]; part[2][p * V + l] = n[l]; }
  }
  bz_cluster_sync();
  #pragma unroll
  for (int l = 0; l < V; l++) { mean[l] = bz_cluster_ptr(part[0], 0)[p * V + l]; m2[l] = bz_cluster_ptr(part[1], 0)[p * V + l]; n[l] = bz_cluster_ptr(part[2], 0)[p * V + l]; }
  for (int r = 1; r < C; r++) {
    const T *qm = bz_cluster_ptr(part[0], r), *qq = bz_cluster_ptr(part[1], r), *qn = bz_cluster_ptr(part[2], r);
    #pragma unroll
    for (int l = 0; l < V; l++) bz_welford_merge(mean[l], m2[l], n[l], qm[p * V + l], qq[p * V + l], qn[p * V + l]);
  }
  bz_cluster_sync();
}
#endif
"#
);

impl Dialect for Cuda {
    fn prelude(&self) -> &'static str {
        PRELUDE
    }
    fn restrict(&self) -> &'static str {
        "__restrict__"
    }
}

/// Threads per block.
pub const BLOCK: u32 = 256;
/// Rows of at most this many reduced elements get one warp each (8 rows per block) instead
/// of a block each: shuffles only, no block barriers.
pub const WARP_ROW_MAX: i64 = 2048;
/// Reductions over at most this many elements per outer point run one thread per point.
pub const SERIAL_ROW_MAX: i64 = 16;
/// Column reductions over at most this many elements run one thread per point when there
/// are at least `COL_SERIAL_MIN_POINTS` points (enough threads to fill the card).
pub const COL_SERIAL_MAX: i64 = 64;
pub const COL_SERIAL_MIN_POINTS: i64 = 1 << 15;
/// Column kernels: outer points per block (threadIdx.x) and threads per point (threadIdx.y).
/// 8 neighbouring floats fill a 32-byte sector; 64 lanes per point keep enough loads in
/// flight when there are few outer points (a bias gradient of 768 columns is 96 blocks).
/// Narrower columns take more points per block ([`col_geometry`]).
pub const COL_X: u32 = 8;
pub const COL_Y: u32 = 64;
/// Threads of a column kernel's block.
pub const COL_THREADS: u32 = COL_X * COL_Y;

/// [Note: column geometry] A column kernel's (points per block, threads per point): as many
/// neighbouring points as fill a 32-byte sector with the narrowest element the kernel reads,
/// at [`COL_THREADS`] threads a block. With 8 points, a warp (8 points × 4 rows) reading 2-byte
/// elements used 16 bytes of each 32-byte sector it fetched, the other half left to the next
/// block: BatchNorm statistics of a bf16 channels_last activation (64×256×56×56) ran at about
/// a third of the H100's copy bandwidth. 16 points of 2 bytes (32 of 1 byte) fill the sector.
///
/// Few rows take fewer threads per point and more points per block, so that a thread walks
/// about [`COL_ROWS_PER_THREAD`] rows: a squeeze-and-excitation mean over 7×7 positions
/// (MobileNet-v3-small, 32×576 points of 49 rows) gave 64 threads to each point's 49 rows and
/// spent its time in the combination across them (9.5 µs on the H100 against Inductor's 4.5).
pub fn col_geometry(k: &Kernel) -> (u32, u32) {
    // Threads along the rows: COL_Y, or fewer (at least `min`) for short rows, as long as the
    // grid keeps MIN_COL_BLOCKS blocks (a split reduction's stage 1 over few points) and each
    // thread keeps a row: a split's stage 2 over 32 partial rows of 120 points can never reach
    // the floor, and doubling toward it gave each point 64 threads, half of them idle.
    let points = product(&k.outer).as_const().unwrap_or(i64::MAX).max(1) as u64;
    let rows = product(&k.inner).as_const().filter(|&n| n > 0).map(|n| n as u64);
    let along = |min: u32, points_per_thread: u32| {
        let mut y = match rows {
            Some(n) => ((n.div_ceil(COL_ROWS_PER_THREAD)).next_power_of_two().min(COL_Y as u64) as u32).clamp(min, COL_Y),
            None => COL_Y,
        };
        while y < COL_Y
            && rows.is_none_or(|n| n >= 2 * y as u64)
            && points.div_ceil((COL_THREADS / y * points_per_thread) as u64) < MIN_COL_BLOCKS
        {
            y *= 2;
        }
        y
    };
    if let Some(v) = column_lanes(k, 8) {
        // [Note: vector columns]: `xt` threads across points (a warp's width at most), `v`
        // points each, `yt` along the rows.
        let yt = along(COL_THREADS / 32, v as u32);
        let xt = COL_THREADS / yt;
        return (xt * v as u32, yt / v as u32);
    }
    let narrowest = k.bufs.iter().filter(|b| !b.written).map(|b| b.dtype.size()).min().unwrap_or(4).clamp(1, 4) as u32;
    let y = along(COL_THREADS / 64, 1).min(COL_THREADS / (COL_X * 4 / narrowest));
    (COL_THREADS / y, y)
}

/// Rows a column kernel's thread aims to walk ([Note: column geometry]).
const COL_ROWS_PER_THREAD: u64 = 8;
/// Fewest blocks a column kernel's grid keeps when short rows widen its blocks: the
/// MobileNet means over 14×14 (240 blocks of 32 points) measured faster than the 64-thread
/// geometry on the H100's 132 multiprocessors.
const MIN_COL_BLOCKS: u64 = 128;

/// The device kernels are generated for: its multiprocessor count, and whether its blocks
/// may form clusters (Hopper and newer, [Note: cluster columns]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Gpu {
    pub sms: u32,
    pub clusters: bool,
}

impl Gpu {
    /// The device of architecture `arch` (`sm_90`, `compute_80`) with `sms` multiprocessors.
    pub fn new(arch: &str, sms: u32) -> Gpu {
        let digits: String = arch.chars().filter(char::is_ascii_digit).collect();
        let cc: u32 = digits.parse().unwrap_or(0);
        Gpu { sms, clusters: cc >= 90 }
    }
}

/// Threads a multiprocessor holds at once (Hopper and newer, where clusters run).
const SM_THREADS: i64 = 2048;
/// Most blocks of a cluster (the portable limit).
pub const MAX_CLUSTER: u32 = 8;
/// Fewest rows per thread of a clustered column kernel.
const CLUSTER_MIN_ROWS: i64 = 4;

/// [Note: cluster columns] A column kernel gives each block `col_x` neighbouring points and
/// all their rows. With few points that is few blocks: a BatchNorm+hardswish backward over 576
/// channels × 1568 rows (MobileNet-v3-small, channels_last, both passes in one kernel) ran
/// on 72 of the H100's 132 multiprocessors, one 512-thread block each, at 0.7 TB/s. On
/// Hopper and newer the kernel instead runs `cluster` blocks per group of points, launched as
/// one thread-block cluster (`__cluster_dims__`): each block takes every `cluster`-th run of
/// rows, reduces them as before, and the blocks' partial results combine through distributed
/// shared memory in rank order (`bz_cluster_reduce`, `bz_cluster_welford`), so every block
/// holds the whole result and a later pass (the backward's gradient store) runs over its own
/// rows, still one kernel and one read of the input per pass. Values of the points (the
/// reductions' stores) are stored by the first block. Unlike a split reduction (two kernels,
/// the partial results through memory: a loss for ResNet-18's 512-channel BatchNorm kernels,
/// twenty-ninth session) nothing extra goes to memory. The heuristic doubles the cluster (up
/// to [`MAX_CLUSTER`]) while the grid is under as many blocks per multiprocessor as their
/// threads allow (four of 512) and each thread keeps at least [`CLUSTER_MIN_ROWS`] rows. It
/// once stopped at two blocks per multiprocessor, where 54 registers held ResNet-18's stem
/// backward (max pool backward + BatchNorm sums, 224 groups of 32 channels: 448 blocks, 1.7
/// waves); with 32-bit indices ([Note: 32-bit indices] in braze-sched) it needs 40 and three
/// blocks fit, and 448 blocks were 1.13 waves, the last nearly empty (288 → 400 µs on the
/// H100, forty-fourth session); as clusters of 4 (896 blocks, 2.26 waves) it takes 327 µs,
/// and the whole training step is as fast as before the change (4.82 against 4.84 ms)
/// while the other kernels keep their gains. Measured per kernel on the H100 (MobileNet-v3-small
/// and ResNet-18 fp32 training, thirty-eighth session, programmatic launch on, so durations
/// include waits for the kernel before), clusters won for the backward's sums
/// (576 channels × 1568 rows: 72 → 38 µs; ResNet-18's 512-channel ReLU + BatchNorm backward
/// 47 → 35) and lost for kernels with a variance (the forward's statistics, 20 → 27 µs) and
/// for vector column kernels ([Note: vector columns], mostly stage 1 of split reductions:
/// the stem's 16-channel statistics 18 → 70 µs), so the heuristic clusters only scalar column
/// kernels without a variance; max-autotune may choose a cluster for any column kernel.
/// Arg-reductions and symbolic sizes keep one block.
pub fn cluster_size(k: &Kernel, gpu: Gpu, cfg: &Config, vector: bool) -> u32 {
    let kinds = || k.passes.iter().flat_map(|p| &p.reductions).map(|r| r.kind);
    if !gpu.clusters || kinds().any(|r| matches!(r, ReduceKind::ArgMax | ReduceKind::ArgMin)) || cfg.cluster == 1 {
        return 1;
    }
    if cfg.cluster > 1 {
        return cfg.cluster;
    }
    if vector || kinds().any(|r| r == ReduceKind::Var) {
        return 1;
    }
    let (Some(outer), Some(inner)) = (product(&k.outer).as_const(), product(&k.inner).as_const()) else { return 1 };
    let blocks = (outer + cfg.col.0 as i64 - 1) / cfg.col.0 as i64;
    let (rows, sms) = (cfg.col.1 as i64, gpu.sms as i64);
    let mut c: i64 = 1;
    let per_sm = SM_THREADS / (cfg.col.0 as i64 * cfg.col.1 as i64).max(1);
    while c < MAX_CLUSTER as i64 && blocks * c < per_sm * sms && inner >= 2 * c * rows * CLUSTER_MIN_ROWS {
        c *= 2;
    }
    c as u32
}

/// [Note: kernel configurations] How a kernel spreads its work over the GPU, the part of
/// its code that does not change what it computes: threads per block, the grid's cap, a warp
/// or a block per short row, a column kernel's geometry, the widest vector access, the loads
/// a reduction's thread keeps in flight (its loop's unrolling). The
/// heuristic ([`Config::heuristic`], what every mode but max-autotune uses) is right for most
/// kernels; `max-autotune` compiles the [`candidates`] of each kernel of static size, times
/// them on the device and keeps the fastest (braze-runtime's `kernel_tune`). A configuration
/// is part of the kernel's text, so each candidate is cached like any kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Config {
    /// Threads per block of a pointwise, tiny-row or block-per-row kernel; 32 times the rows
    /// per block of a warp-per-row kernel.
    pub threads: u32,
    /// Pointwise and tiny-row kernels: the grid's cap in blocks per multiprocessor (past it,
    /// threads take several grid-stride steps); 0 for the heuristic's (32, or 8 when the
    /// kernel hoists column-invariant values).
    pub blocks_per_sm: u32,
    /// Rows of at most [`WARP_ROW_MAX`] elements: a warp per row (else a block per row).
    pub warp_rows: bool,
    /// Column kernels: (outer points per block, threads per point); both powers of two.
    pub col: (u32, u32),
    /// The most elements a thread accesses at once: pointwise kernels' vector path, tiled
    /// transposes, [Note: vector rows] and [Note: vector columns]; 1 turns them off.
    pub max_vec: u32,
    /// Reductions: iterations of the loop over reduced elements unrolled (loads in flight per
    /// thread); 0 for the heuristic's (8 for tiny rows, 4 otherwise).
    pub unroll: u32,
    /// Column kernels: blocks per cluster sharing each block's points ([Note: cluster
    /// columns]); 0 for the heuristic's ([`cluster_size`]), 1 for none.
    pub cluster: u32,
}

impl Config {
    /// The static choice for kernel `k`.
    pub fn heuristic(k: &Kernel) -> Config {
        Config { threads: BLOCK, blocks_per_sm: 0, warp_rows: true, col: col_geometry(k), max_vec: 8, unroll: 0, cluster: 0 }
    }

    /// A short text that [`Config::from_text`] reads back (remembered choices).
    pub fn to_text(&self) -> String {
        format!("t{} g{} w{} c{}x{} v{} u{} k{}", self.threads, self.blocks_per_sm, self.warp_rows as u8, self.col.0, self.col.1, self.max_vec, self.unroll, self.cluster)
    }

    pub fn from_text(s: &str) -> Option<Config> {
        let mut it = s.split(' ');
        let mut field = |p: &str| it.next()?.strip_prefix(p).map(str::to_string);
        let threads = field("t")?.parse().ok()?;
        let blocks_per_sm = field("g")?.parse().ok()?;
        let warp_rows = field("w")? == "1";
        let col = field("c")?;
        let (x, y) = col.split_once('x')?;
        let max_vec = field("v")?.parse().ok()?;
        let unroll = field("u")?.parse().ok()?;
        let cluster = field("k")?.parse().ok()?;
        let c = Config { threads, blocks_per_sm, warp_rows, col: (x.parse().ok()?, y.parse().ok()?), max_vec, unroll, cluster };
        c.valid().then_some(c)
    }

    /// Whether the kernels can be launched this way (power-of-two shapes within a block's
    /// 1024 threads).
    fn valid(&self) -> bool {
        let p2 = |v: u32| v.is_power_of_two();
        p2(self.threads) && (32..=1024).contains(&self.threads) && p2(self.col.0) && p2(self.col.1) && self.col.1 >= 2 && self.col.0 * self.col.1 <= 1024 && p2(self.max_vec) && self.max_vec <= 16 && self.unroll <= 32
            && (self.cluster == 0 || (p2(self.cluster) && self.cluster <= MAX_CLUSTER))
    }
}

/// The configurations max-autotune times for kernel `k`, the heuristic's first: variations of
/// the block size, the grid's cap, warp or block rows, the column geometry and the vector
/// width that apply to the kernel's kind. Several may emit the same code (a vector width the
/// kernel cannot use); [`emit_candidates`] keeps one of each.
pub fn candidates(k: &Kernel) -> Vec<Config> {
    let h = Config::heuristic(k);
    let mut out = vec![h];
    let mut add = |c: Config| {
        if c.valid() && !out.contains(&c) {
            out.push(c);
        }
    };
    let is_red = !k.is_pointwise();
    if !is_red {
        for threads in [128, 512] {
            add(Config { threads, ..h });
        }
        for blocks_per_sm in [4, 16, 64] {
            add(Config { blocks_per_sm, ..h });
        }
        add(Config { max_vec: 4, ..h });
        return out;
    }
    if k.column {
        let (x, _) = h.col;
        for (cx, threads) in [(x, 256), (x, 1024), (x * 2, 512), (x * 2, 1024), (x / 2, 512)] {
            if cx >= 4 {
                add(Config { col: (cx, threads / cx), ..h });
            }
        }
        for unroll in [8, 16] {
            add(Config { unroll, ..h });
        }
        // One point per thread ([Note: vector columns] off).
        add(Config { max_vec: 1, ..h });
        // One block per group of points, or clusters of 4 ([Note: cluster columns]; the same
        // code as another candidate where the kernel cannot cluster or the heuristic chose so).
        add(Config { cluster: 1, ..h });
        add(Config { cluster: 4, ..h });
        return out;
    }
    for threads in [128, 512, 1024] {
        add(Config { threads, ..h });
    }
    for threads in [128, 256, 512] {
        add(Config { threads, warp_rows: false, ..h });
    }
    for blocks_per_sm in [8, 64] {
        add(Config { blocks_per_sm, ..h });
    }
    add(Config { unroll: 8, ..h });
    add(Config { unroll: 8, warp_rows: false, ..h });
    // Element-by-element block rows ([Note: vector rows] off).
    if product(&k.inner).as_const().is_none_or(|n| n > WARP_ROW_MAX) {
        add(Config { max_vec: 1, ..h });
    }
    out
}

fn product(v: &[Expr]) -> Expr {
    v.iter().fold(Expr::one(), |a, b| a.mul(b))
}

/// Launch facts for the runtime: kernel name, buffer ids (passed as pointers, in order) then
/// size symbols (passed as i64), block shape, and one block per `per_block` of `work` items,
/// at most `cap` blocks, rounded up to a multiple of `grid_multiple` (a kernel whose threads
/// keep their column across grid-stride steps, [Note: column-invariant hoisting]).
#[derive(Clone, Debug)]
pub struct Launch {
    /// The function to launch: this kernel's own, or an identical earlier kernel's.
    pub name: String,
    /// The translation unit that defines `name`.
    pub unit: usize,
    pub bufs: Vec<u32>,
    pub syms: Vec<u32>,
    pub block: u32,
    pub block_y: u32,
    pub work: Expr,
    pub per_block: u64,
    pub cap: u32,
    pub grid_multiple: u32,
    /// The element-by-element version of a vector kernel, for calls whose pointers are not
    /// aligned for its wide accesses ([Note: lazy scalar fallback]).
    pub fallback: Option<Fallback>,
}

/// [Note: lazy scalar fallback] A vector kernel's wide accesses need its buffers' pointers
/// aligned to the access width. Arena buffers, temps and ATen results always are; a graph
/// input sliced at an odd offset may not be. Compiling a scalar loop into every vector kernel
/// for that case cost NVRTC a fifth to a quarter of a module's time (GPT-2 and ResNet-50
/// training graphs), so the module holds the vector loop alone, and the scalar version is a
/// separate translation unit the runtime compiles the first time a call's pointers fail
/// `align` (then cached like any unit).
#[derive(Clone, Debug)]
pub struct Fallback {
    /// The fallback kernel's function name (the kernel's own name with `_scalar`).
    pub name: String,
    /// A whole translation unit: the prelude and the fallback kernel.
    pub source: String,
    /// (buffer id, alignment mask): the vector kernel may run only when every
    /// `pointer & mask` is zero.
    pub align: Vec<(u32, u64)>,
}

impl Launch {
    /// Whether pointers `ptrs` (by buffer id) need the fallback.
    pub fn misaligned(&self, ptrs: &[usize]) -> bool {
        self.fallback.as_ref().is_some_and(|f| f.align.iter().any(|&(b, m)| ptrs.get(b as usize).is_some_and(|&p| p as u64 & m != 0)))
    }
}

impl Launch {
    /// Blocks to launch for `n` work items.
    /// Past the cap, the blocks are spread so that every thread takes the same number of
    /// grid-stride steps (6250 blocks' work over a cap of 4224 runs as 3125 blocks of two
    /// steps, not 4224 of which half take two).
    pub fn blocks(&self, n: u64) -> u64 {
        let need = n.div_ceil(self.per_block).max(1);
        let cap = (self.cap as u64).max(1);
        let b = if need <= cap { need } else { need.div_ceil(need.div_ceil(cap)) };
        b.next_multiple_of(self.grid_multiple.max(1) as u64)
    }
}

/// Loads held in registers ([Note: persistent rows]): by (buffer, index), the register array's
/// number and the value's dtype.
type Held = std::collections::HashMap<(u32, Expr), (usize, DType)>;

/// Most row elements a lane holds in registers across passes ([Note: persistent rows]).
pub const PERSIST_MAX_ITERS: i64 = 32;
/// Most registers the held loads may take per lane.
pub const PERSIST_MAX_REGS: i64 = 64;

/// [Note: persistent rows] A warp-per-row kernel with several passes over a short row of
/// constant length (LayerNorm: statistics, then the normalized store) reloaded every element
/// in each pass. Its lanes instead keep the first pass's loads of read-only buffers, and the
/// values it stores that later passes load back, in register arrays (the loop fully
/// unrolled, `per` elements per lane) and later passes read them there. Loads the same for
/// every row (a norm's weight, read back from L1) are not held, leaving the registers to the
/// row's own values (Llama's RMSNorm backward held its weight and reloaded its input; the
/// reload hit in cache, and the H100 showed neither bytes nor time move). Returns `per` and the held loads by (buffer, index), each with its array number
/// and dtype; `None` when the kernel has one pass, a long or symbolic row, or nothing to hold.
fn persistent_loads(k: &Kernel) -> Option<(i64, Held)> {
    if k.passes.len() < 2 {
        return None;
    }
    let n = product(&k.inner).as_const()?;
    let per = (n + 31) / 32;
    if per > PERSIST_MAX_ITERS {
        return None;
    }
    let written: std::collections::HashSet<u32> = k.bufs.iter().filter(|b| b.written).map(|b| b.id).collect();
    let later: Vec<&Stmt> = k.passes[1..].iter().flat_map(|p| p.body.iter()).collect();
    let mut loads = std::collections::HashMap::new();
    // A value the first pass stores and later passes load back ([Note: stored values
    // reloaded] in braze-sched) is held like a load: the buffer's one store, of the value's
    // own dtype, and nothing in the first pass reads it.
    let all = || k.stmts();
    let held_store = |buf: u32, value: u32| {
        k.bufs.iter().any(|b| b.id == buf && b.dtype == k.tmp_dtypes[value as usize])
            && all().filter(|s| matches!(s, Stmt::Store { buf: b, .. } if *b == buf)).count() == 1
            && !k.passes[0].body.iter().any(|s| matches!(s, Stmt::Load { buf: b, .. } if *b == buf))
    };
    for st in &k.passes[0].body {
        let (buf, index, dt, ok) = match st {
            Stmt::Load { dst, buf, index, mask: None } => (buf, index, k.tmp_dtypes[*dst as usize], !written.contains(buf)),
            Stmt::Store { buf, index, value } => (buf, index, k.tmp_dtypes[*value as usize], held_store(*buf, *value)),
            _ => continue,
        };
        let reused = later.iter().any(|s| matches!(s, Stmt::Load { buf: b, index: i, mask: None, .. } if b == buf && i == index));
        // A load the same for every row (a norm's weight) is read from L1 again instead of
        // taking registers that a row's own values need.
        let per_row = k.outer.is_empty() || (0..k.outer.len() as u32).any(|v| index.uses_var(v));
        if ok && reused && per_row && !loads.contains_key(&(*buf, index.clone())) && (loads.len() as i64 + 1) * per <= PERSIST_MAX_REGS {
            let id = loads.len();
            loads.insert((*buf, index.clone()), (id, dt));
        }
    }
    (!loads.is_empty()).then_some((per, loads))
}

/// Writes `idx`'s decomposition of a flat index `flat` over `dims`, variables from `first`.
/// When the dims are constants whose product fits 32 bits, the divisions are 32-bit
/// unsigned ones: a 64-bit `/` or `%` is a long software routine on the GPU, and a
/// pointwise kernel over rows of odd length (copying GPT-2's [4096, 50257] logits out of
/// padded rows) spent most of its time in them.
fn decompose(out: &mut String, pad: &str, flat: &str, dims: &[Expr], first: usize) {
    let n = dims.len();
    if n == 0 {
        return;
    }
    if n == 1 {
        writeln!(out, "{pad}const bz_ix i{first} = {flat};").unwrap();
        return;
    }
    let narrow = dims.iter().try_fold(1i64, |p, d| d.as_const().and_then(|c| p.checked_mul(c))).is_some_and(|t| t < (1 << 31));
    let mut rest = if narrow {
        writeln!(out, "{pad}const unsigned u{first} = (unsigned)({flat});").unwrap();
        format!("u{first}")
    } else {
        flat.to_string()
    };
    for d in (0..n).rev() {
        if d == 0 {
            writeln!(out, "{pad}const bz_ix i{} = {rest};", first + d).unwrap();
        } else if narrow {
            let size = dims[d].as_const().unwrap();
            writeln!(out, "{pad}const bz_ix i{} = ({rest}) % {size}u;", first + d).unwrap();
            rest = format!("({rest}) / {size}u");
        } else {
            let size = index(&dims[d]);
            writeln!(out, "{pad}const bz_ix i{} = ({rest}) % ({size});", first + d).unwrap();
            rest = format!("({rest}) / ({size})");
        }
    }
}

/// `sin(x)` and `cos(x)` of one value in one statement list: the sine's destination maps to
/// the cosine's, which is then computed by the same `sincosf` call (one range reduction).
fn sincos_pairs(stmts: &[Stmt], k: &Kernel) -> std::collections::HashMap<u32, u32> {
    use braze_ir::UnaryOp;
    let mut out = std::collections::HashMap::new();
    for (i, s) in stmts.iter().enumerate() {
        if let Stmt::Unary { dst, op: UnaryOp::Sin, a } = s {
            if !k.tmp_dtypes[*a as usize].is_float() {
                continue;
            }
            let cos = stmts[i + 1..].iter().find_map(|t| match t {
                Stmt::Unary { dst: d2, op: UnaryOp::Cos, a: a2 } if a2 == a => Some(*d2),
                _ => None,
            });
            if let Some(c) = cos {
                if !out.values().any(|v| *v == c) {
                    out.insert(*dst, c);
                }
            }
        }
    }
    out
}

/// Writes a statement list, pairing sin and cos of one value into one `sincos` call.
/// Statements of a loop body. With `held` ([Note: persistent rows]) the held loads are
/// stored into their register arrays at iteration `j` (the first pass, `true`) or read from
/// them (later passes).
fn emit_list(e: &Emitter, k: &Kernel, stmts: &[Stmt], guard: Option<&str>, pad: &str, out: &mut String, held: Option<(&Held, bool)>) -> Result<(), CodegenError> {
    use braze_ir::UnaryOp;
    let pairs = sincos_pairs(stmts, k);
    let paired: std::collections::HashSet<u32> = pairs.values().copied().collect();
    for s in stmts {
        if let (Stmt::Load { dst, buf, index, mask: None }, Some((h, first))) = (s, held) {
            if let Some(&(c, dt)) = h.get(&(*buf, index.clone())) {
                if first {
                    writeln!(out, "{pad}{} c{c}[j] = t{dst};", emit_stmt(e, s, guard)?).unwrap();
                } else {
                    writeln!(out, "{pad}{} t{dst} = c{c}[j];", compute_type(dt)).unwrap();
                }
                continue;
            }
        }
        if let (Stmt::Store { buf, index, value }, Some((h, true))) = (s, held) {
            if let Some(&(c, _)) = h.get(&(*buf, index.clone())) {
                writeln!(out, "{pad}{} c{c}[j] = t{value};", emit_stmt(e, s, guard)?).unwrap();
                continue;
            }
        }
        match s {
            Stmt::Unary { dst, op: UnaryOp::Sin, a } if pairs.contains_key(dst) => {
                let c = pairs[dst];
                let dt = k.tmp_dtypes[*a as usize];
                let (ty, f) = if dt == braze_ir::DType::F64 { ("double", "sincos") } else { ("float", "sincosf") };
                writeln!(out, "{pad}{ty} t{dst}, t{c}; {f}(t{a}, &t{dst}, &t{c});").unwrap();
            }
            Stmt::Unary { dst, op: UnaryOp::Cos, .. } if paired.contains(dst) => {}
            _ => writeln!(out, "{pad}{}", emit_stmt(e, s, guard)?).unwrap(),
        }
    }
    Ok(())
}

/// A statement; stores get `guard` as their condition when given.
fn emit_stmt(e: &Emitter, s: &Stmt, guard: Option<&str>) -> Result<String, CodegenError> {
    let line = e.stmt(s)?;
    Ok(match guard {
        Some(g) if matches!(s, Stmt::Store { .. }) => format!("if ({g}) {line}"),
        _ => line,
    })
}

/// Emits one kernel; returns its launch facts. Its buffer parameters are in the order the
/// body first uses them, not by buffer id: the same code over inputs numbered the other way
/// round (another graph's, a layer whose operands were created in another order) is then the
/// same text up to names, so it is deduplicated and found in the per-kernel cache
/// ([Note: kernel dedup], [Note: per-kernel CUDA cache] in braze-runtime).
pub fn emit_kernel(k: &Kernel, gpu: Gpu, out: &mut String) -> Result<Launch, CodegenError> {
    emit_kernel_with(k, gpu, &Config::heuristic(k), out)
}

/// [`emit_kernel`] in configuration `cfg` ([Note: kernel configurations]).
pub fn emit_kernel_with(k: &Kernel, gpu: Gpu, cfg: &Config, out: &mut String) -> Result<Launch, CodegenError> {
    let mut text = String::new();
    let mut launch = emit_kernel_by_id(k, gpu, cfg, &mut text)?;
    let body_at = text.find(") {\n").map_or(0, |i| i + 4);
    let order = crate::dedup::first_use_order(&text[body_at..], &launch.bufs);
    if order != launch.bufs {
        text = reorder_params(&text, &order);
        if let Some(f) = &mut launch.fallback {
            f.source = reorder_params(&f.source, &order);
        }
        launch.bufs = order;
    }
    out.push_str(&text);
    Ok(launch)
}

/// The declaration of `bz_ix`, the type of a kernel's loop variables and flat positions: `int`
/// where every index fits 32 bits ([Note: 32-bit indices] in braze-sched), else `long long`.
fn index_type(k: &Kernel) -> &'static str {
    if k.index32 {
        "typedef int bz_ix;"
    } else {
        "typedef long long bz_ix;"
    }
}

/// `source` with the buffer parameters of each kernel signature in it (`extern "C" ...
/// NAME(params) {`) put in `order`; size parameters stay last.
fn reorder_params(source: &str, order: &[u32]) -> String {
    let mut out = String::with_capacity(source.len());
    for line in source.split_inclusive('\n') {
        let sig = line.starts_with("extern \"C\" __global__");
        let (Some(open), Some(close)) = (line.rfind('('), line.rfind(") {")) else {
            out.push_str(line);
            continue;
        };
        if !sig || close < open {
            out.push_str(line);
            continue;
        }
        let params: Vec<&str> = line[open + 1..close].split(", ").collect();
        let id_of = |p: &str| p.rsplit_once(" b").and_then(|(_, id)| id.parse::<u32>().ok());
        let mut bufs: Vec<&str> = params.iter().copied().filter(|p| id_of(p).is_some()).collect();
        bufs.sort_by_key(|p| order.iter().position(|&o| Some(o) == id_of(p)).unwrap_or(usize::MAX));
        let rest = params.iter().copied().filter(|p| id_of(p).is_none());
        let joined: Vec<&str> = bufs.into_iter().chain(rest).collect();
        out.push_str(&line[..open + 1]);
        out.push_str(&joined.join(", "));
        out.push_str(&line[close..]);
    }
    out
}

fn emit_kernel_by_id(k: &Kernel, gpu: Gpu, cfg: &Config, out: &mut String) -> Result<Launch, CodegenError> {
    let sms = gpu.sms;
    let d = Cuda;
    let e = Emitter { k, d: &d };
    let mut bufs = k.bufs.clone();
    bufs.sort_by_key(|b| b.id);
    let syms = k.syms();
    let mut params: Vec<String> = bufs
        .iter()
        .map(|b| format!("{}{}* __restrict__ b{}", if b.written { "" } else { "const " }, storage_type(b.dtype), b.id))
        .collect();
    params.extend(syms.iter().map(|s| format!("long long s{s}")));
    writeln!(out, "/* {}: stores {} */", k.name, k.roots.join(", ")).unwrap();
    let is_red = !k.is_pointwise();
    let n_outer = k.outer.len();
    let outer_total = product(&k.outer);
    let block = cfg.threads;
    // The grid's cap in blocks per multiprocessor: the configuration's, else `heuristic`.
    let per_sm = |heuristic: u32| if cfg.blocks_per_sm > 0 { cfg.blocks_per_sm } else { heuristic };
    // Tiny rows (a sum over the 4 query heads of a KV head): one thread per outer point
    // walks its row alone; a block or warp per point would leave most threads idle.
    // Short column reductions over many outer points (a global average pool of a
    // channels_last activation: 49 elements for each of 131 072 outputs) also run a thread
    // per point: neighbouring threads read neighbouring points, so every load coalesces, and
    // there is no combination across threads (a column block took 56 us for ResNet-50's
    // pool on the H100, Inductor 23).
    let inner_n = product(&k.inner).as_const();
    let serial = is_red
        && (inner_n.is_some_and(|n| n <= SERIAL_ROW_MAX)
            || (k.column && inner_n.is_some_and(|n| n <= COL_SERIAL_MAX) && outer_total.as_const().is_some_and(|o| o >= COL_SERIAL_MIN_POINTS)));
    let col = k.column && !serial;
    let (col_x, col_y) = cfg.col;
    let vector_col = if col { column_vector_width(k, cfg) } else { None };
    let cluster = if col { cluster_size(k, gpu, cfg, vector_col.is_some()) } else { 1 };
    // [Note: tiled transposes]
    let tiled = if is_red { None } else { crate::tiles::tile_plan(k).filter(|p| tiles_fit(k, p)) };
    let threads = if col { col_x * col_y } else if tiled.is_some() { TILE as u32 * TILE_ROWS } else { block };
    let dims = if cluster > 1 { format!("__cluster_dims__({cluster}, 1, 1) ") } else { String::new() };
    writeln!(out, "extern \"C\" __global__ void {dims}__launch_bounds__({threads}) {}({}) {{\n  bz_entry();\n  {}", k.name, params.join(", "), index_type(k)).unwrap();
    let launch = |work: Expr, per_block: u64, cap: u32| Launch {
        name: k.name.clone(),
        unit: 0,
        bufs: bufs.iter().map(|b| b.id).collect(),
        syms: syms.clone(),
        block: if col { col_x } else { block },
        block_y: if col { col_y } else { 1 },
        work,
        per_block,
        cap,
        grid_multiple: 1,
        fallback: None,
    };
    if !is_red {
        let total = index(&outer_total);
        // A block per 256 elements, at most 32 per multiprocessor. A kernel that hoists
        // per-thread work runs at most one wave of vector-wide threads (8 blocks per
        // multiprocessor), each taking several grid-stride steps over which that work is
        // shared: on the H100 that beat a block per 256 vectors for ResNet-50's BatchNorm
        // kernels of 3-13 M elements (layer-3 residual 29 vs 35 us).
        let (mut per_block, mut cap, mut grid_multiple) = (block as u64, sms.max(1) * per_sm(32), 1);
        if let Some(plan) = &tiled {
            let (work, align) = emit_tiled(&e, k, plan, cfg.max_vec as i64, out)?;
            let mut l = Launch { block: TILE as u32, block_y: TILE_ROWS, ..launch(work, 1, sms.max(1) * 32) };
            if !align.is_empty() {
                // The one-element tiles for unaligned pointers.
                l.fallback = Some(one_element_fallback(k, gpu, cfg, align)?);
            }
            return Ok(l);
        }
        let mut scalar = String::new();
        writeln!(scalar, "  for (bz_ix x = (bz_ix)blockIdx.x * blockDim.x + threadIdx.x; x < {total}; x += (bz_ix)gridDim.x * blockDim.x) {{").unwrap();
        decompose(&mut scalar, "    ", "x", &k.outer, 0);
        emit_list(&e, k, &k.passes[0].body, None, "    ", &mut scalar, None)?;
        writeln!(scalar, "  }}\n}}\n").unwrap();
        let Some(plan) = vector_plan(k, block, cfg.max_vec as i64) else {
            out.push_str(&scalar);
            return Ok(launch(outer_total, per_block, cap));
        };
        if let Some(h) = &plan.hoist {
            (per_block, cap, grid_multiple) = (block as u64 * plan.v as u64, sms.max(1) * per_sm(HOIST_BLOCKS_PER_SM), h.grid_multiple);
        }
        let align = emit_vector_path(&e, k, &plan, out)?;
        writeln!(out, "}}\n").unwrap();
        let name = format!("{}_scalar", k.name);
        let source = format!(
            "{}\n/* {name}: {}'s loop for unaligned pointers */\nextern \"C\" __global__ void __launch_bounds__({threads}) {name}({}) {{\n  bz_entry();\n  {}\n{scalar}",
            d.prelude(),
            k.name,
            params.join(", "),
            index_type(k)
        );
        return Ok(Launch { grid_multiple, fallback: Some(Fallback { name, source, align }), ..launch(outer_total, per_block, cap) });
    }
    // Row kernels: a block per outer point, threads over the reduced elements (x).
    // Column kernels: 8 to 32 outer points per block (x), 64 to 16 threads per point over the
    // reduced elements (y), so loads of neighbouring outer points coalesce ([Note: column
    // geometry]).
    // A cluster's blocks share their points ([Note: cluster columns]): `cluster` blocks per
    // `col_x` points, the grid a whole number of clusters.
    let col_launch = || {
        let l = launch(outer_total.mul(&Expr::constant(cluster as i64)), col_x as u64, 1 << 30);
        Launch { grid_multiple: cluster, ..l }
    };
    if let Some(v) = vector_col {
        return emit_vector_column(&e, k, gpu, cfg, v, cluster, col_launch(), out);
    }
    let warp = !col && !serial && cfg.warp_rows && product(&k.inner).as_const().is_some_and(|n| n <= WARP_ROW_MAX);
    let (lane, step, store_guard, body_guard) = if serial {
        ("0", "1".to_string(), None, None)
    } else if col && cluster > 1 {
        ("(bz_rank * blockDim.y + threadIdx.y)", format!("{}", col_y * cluster), Some("live && threadIdx.y == 0 && bz_rank == 0"), Some("live"))
    } else if col {
        ("threadIdx.y", format!("{col_y}"), Some("live && threadIdx.y == 0"), Some("live"))
    } else if warp {
        ("(threadIdx.x & 31)", "32".to_string(), Some("(threadIdx.x & 31) == 0"), None)
    } else {
        ("threadIdx.x", "blockDim.x".to_string(), Some("threadIdx.x == 0"), None)
    };
    if serial {
        writeln!(out, "  for (bz_ix o = (bz_ix)blockIdx.x * blockDim.x + threadIdx.x; o < {}; o += (bz_ix)gridDim.x * blockDim.x) {{", index(&outer_total)).unwrap();
    } else if warp {
        writeln!(out, "  for (bz_ix o = (bz_ix)blockIdx.x * {w} + (threadIdx.x >> 5); o < {}; o += (bz_ix)gridDim.x * {w}) {{", index(&outer_total), w = block / 32).unwrap();
    } else if col {
        writeln!(out, "  {{").unwrap();
        if cluster > 1 {
            writeln!(out, "    const unsigned bz_rank = bz_cluster_rank();").unwrap();
            writeln!(out, "    const bz_ix ox = (bz_ix)(blockIdx.x / {cluster}) * {col_x} + threadIdx.x;").unwrap();
        } else {
            writeln!(out, "    const bz_ix ox = (bz_ix)blockIdx.x * {col_x} + threadIdx.x;").unwrap();
        }
        writeln!(out, "    const bool live = ox < {};", index(&outer_total)).unwrap();
        writeln!(out, "    const bz_ix o = live ? ox : 0;").unwrap();
    } else {
        writeln!(out, "  for (bz_ix o = blockIdx.x; o < {}; o += gridDim.x) {{", index(&outer_total)).unwrap();
    }
    decompose(out, "    ", "o", &k.outer, 0);
    for s in &k.prelude {
        writeln!(out, "    {}", emit_stmt(&e, s, store_guard)?).unwrap();
    }
    let inner_total = index(&product(&k.inner));
    let col_fns;
    let (reduce, welford, arg) = if col {
        col_fns = [format!("bz_col_reduce<{col_x}, {col_y}>"), format!("bz_col_welford<{col_x}, {col_y}>"), format!("bz_col_arg<{col_x}, {col_y}>")];
        (col_fns[0].as_str(), col_fns[1].as_str(), col_fns[2].as_str())
    } else if warp {
        ("bz_warp_reduce", "bz_warp_welford", "bz_warp_arg")
    } else {
        ("bz_block_reduce", "bz_block_welford", "bz_block_arg")
    };
    let cache = if warp { persistent_loads(k) } else { None };
    let block_row = !col && !serial && !warp;
    // Buffers the vector rows read or write wide, and the alignment they need.
    let mut row_align: Vec<(u32, u64)> = Vec::new();
    if let Some((per, loads)) = &cache {
        // In array order: the source (and so its cache key) must not depend on hash order.
        let mut arrays: Vec<(usize, DType)> = loads.values().copied().collect();
        arrays.sort_by_key(|a| a.0);
        for (i, dt) in arrays {
            writeln!(out, "    {} c{i}[{per}];", compute_type(dt)).unwrap();
        }
    }
    for (pi, p) in k.passes.iter().enumerate() {
        for r in &p.reductions {
            for l in e.red_init(r) {
                writeln!(out, "    {l}").unwrap();
            }
        }
        // A partial last iteration of a persistent row is guarded.
        let mut tail_guard = false;
        // [Note: vector rows]
        let v = if block_row { row_vector_width(k, &p.body, cfg.max_vec as i64) } else { 1 };
        if let Some((per, _)) = &cache {
            // [Note: persistent rows] the row's loads stay in registers between passes.
            let n = product(&k.inner).as_const().unwrap();
            writeln!(out, "    #pragma unroll").unwrap();
            writeln!(out, "    for (int j = 0; j < {per}; j++) {{").unwrap();
            writeln!(out, "      const bz_ix r = {lane} + 32 * j;").unwrap();
            tail_guard = n % 32 != 0;
            if tail_guard {
                writeln!(out, "      if (r < {n}) {{").unwrap();
            }
        } else {
            // Four iterations' loads in flight per thread: one 2-byte load at a time left a
            // 50 257-wide bf16 log-softmax at 1.2 TB/s on the H100.
            let unroll = if cfg.unroll > 0 { cfg.unroll } else if serial { 8 } else { 4 };
            writeln!(out, "    #pragma unroll {unroll}").unwrap();
            if v > 1 {
                writeln!(out, "    for (bz_ix rv = {lane}; rv < ({inner_total}) / {v}; rv += {step}) {{").unwrap();
            } else {
                writeln!(out, "    for (bz_ix r = {lane}; r < {inner_total}; r += {step}) {{").unwrap();
            }
        }
        if v > 1 {
            let last = (n_outer + k.inner.len() - 1) as u32;
            decompose(out, "      ", &format!("rv * {v}"), &k.inner, n_outer);
            let mut lanes = Lanes::default();
            for r in &p.reductions {
                let (before, each, after) = e.red_vector(r, v);
                lanes.before.extend(before);
                lanes.each.push(each);
                lanes.after.extend(after);
            }
            emit_lanes(&e, k, &p.body, last, v, &|_| false, &[], &lanes, "      ", out)?;
            add_wide_alignment(&mut row_align, k, &p.body, last, v, &|_| false);
        } else {
            decompose(out, "      ", "r", &k.inner, n_outer);
            emit_list(&e, k, &p.body, body_guard, "      ", out, cache.as_ref().map(|(_, h)| (h, pi == 0)))?;
            for r in &p.reductions {
                writeln!(out, "      {}", e.red_update(r)).unwrap();
            }
        }
        if tail_guard {
            writeln!(out, "      }}").unwrap();
        }
        writeln!(out, "    }}").unwrap();
        for r in &p.reductions {
            let n = r.dst;
            let st = compute_type(k.tmp_dtypes[r.src as usize]);
            let line = match r.kind {
                ReduceKind::ArgMax => format!("{arg}(a{n}, ai{n}, true);"),
                ReduceKind::ArgMin => format!("{arg}(a{n}, ai{n}, false);"),
                ReduceKind::Var => {
                    // [Note: cluster columns]: then across the cluster's blocks.
                    let across = if cluster > 1 {
                        format!(" {st} cm[1] = {{wm{n}}}, cq[1] = {{wq{n}}}, cn[1] = {{fn}}; bz_cluster_welford<{cluster}, {col_x}, 1>(cm, cq, cn, threadIdx.x, threadIdx.y == 0); wm{n} = cm[0]; wq{n} = cq[0]; fn = cn[0];")
                    } else {
                        String::new()
                    };
                    format!("{{ {st} fn = ({st})wn{n}; {welford}(wm{n}, wq{n}, fn);{across} wn{n} = (bz_count_t)fn; }}")
                }
                kind => {
                    let f = combine_lambda(kind, &format!("decltype(a{n})"), st);
                    let across = if cluster > 1 {
                        format!(" {{ decltype(a{n}) cv[1] = {{a{n}}}; bz_cluster_reduce<{cluster}, {col_x}, 1>(cv, {f}, threadIdx.x, threadIdx.y == 0); a{n} = cv[0]; }}")
                    } else {
                        String::new()
                    };
                    format!("a{n} = {reduce}(a{n}, {f});{across}")
                }
            };
            if !serial {
                writeln!(out, "    {line}").unwrap();
            }
            writeln!(out, "    {}", e.red_final(r)).unwrap();
        }
        for s in &p.after {
            writeln!(out, "    {}", emit_stmt(&e, s, store_guard)?).unwrap();
        }
    }
    if serial {
        writeln!(out, "  }}\n}}\n").unwrap();
        return Ok(launch(outer_total, block as u64, sms.max(1) * per_sm(32)));
    }
    if col {
        writeln!(out, "  }}\n}}\n").unwrap();
        return Ok(col_launch());
    }
    if warp {
        writeln!(out, "  }}\n}}\n").unwrap();
        return Ok(launch(outer_total, (block / 32) as u64, 1 << 30));
    }
    writeln!(out, "    __syncthreads();\n  }}\n}}\n").unwrap();
    if row_align.is_empty() {
        return Ok(launch(outer_total, 1, 1 << 30));
    }
    // The element-by-element rows for calls whose pointers are not aligned for the wide loads.
    Ok(Launch { fallback: Some(one_element_fallback(k, gpu, cfg, row_align)?), ..launch(outer_total, 1, 1 << 30) })
}

/// The lambda combining two partial results of a sum, product, max, min, any or all, whose
/// accumulators are of type `acc` and elements of type `st` (max and min keep NaN).
fn combine_lambda(kind: ReduceKind, acc: &str, st: &str) -> String {
    match kind {
        ReduceKind::Sum => format!("[]({acc} x, {acc} y) {{ return x + y; }}"),
        ReduceKind::Prod => format!("[]({acc} x, {acc} y) {{ return x * y; }}"),
        ReduceKind::Max => format!("[]({st} x, {st} y) {{ return (x != x || x > y) ? x : y; }}"),
        ReduceKind::Min => format!("[]({st} x, {st} y) {{ return (x != x || x < y) ? x : y; }}"),
        ReduceKind::Any => "[](bool x, bool y) { return x || y; }".to_string(),
        ReduceKind::All => "[](bool x, bool y) { return x && y; }".to_string(),
        ReduceKind::ArgMax | ReduceKind::ArgMin | ReduceKind::Var => unreachable!("combined by their own functions"),
    }
}

/// Kernel `k` emitted with one element per access (`max_vec` 1), as the fallback of its wide
/// version for calls whose pointers fail `align` ([Note: lazy scalar fallback]). Its block
/// shape and grid are the wide version's.
fn one_element_fallback(k: &Kernel, gpu: Gpu, cfg: &Config, align: Vec<(u32, u64)>) -> Result<Fallback, CodegenError> {
    let name = format!("{}_scalar", k.name);
    let mut scalar = String::new();
    emit_kernel_by_id(&Kernel { name: name.clone(), ..k.clone() }, gpu, &Config { max_vec: 1, ..*cfg }, &mut scalar)?;
    Ok(Fallback { source: format!("{}\n{scalar}", Cuda.prelude()), name, align })
}

/// [Note: vector columns] A column kernel (a kept dim innermost in memory: channels_last
/// BatchNorm statistics and their backward sums, bias gradients) whose loads walk that dim
/// contiguously reads `v` neighbouring points per thread with one wide load (16 bytes),
/// keeping `v` reductions' states in registers: with one 2-byte load per thread and step,
/// channels_last statistics of a bf16 64×256×56×56 activation ran at 55% of the H200's copy
/// bandwidth. The block keeps the scalar kernel's shape and points per block (the scalar
/// version is its fallback, [Note: lazy scalar fallback]): its `col_x × col_y` threads are
/// renumbered as `col_x / v` threads across points by `col_y × v` along the reduced
/// elements. States combine within a warp by shuffles and across warps through shared
/// memory (`bz_colv_reduce`, `bz_colv_welford`). Single-pass kernels without a prelude or
/// arg-reductions only.
fn column_vector_width(k: &Kernel, cfg: &Config) -> Option<i64> {
    let v = column_lanes(k, (cfg.max_vec as i64).min(cfg.col.0 as i64))?;
    // Threads across points within a warp's width (`bz_colv_*` combine a warp's lanes CX apart).
    let xt = cfg.col.0 as i64 / v;
    ((cfg.col.0 as i64) % v == 0 && xt <= 32 && cfg.col.0 * cfg.col.1 >= 32).then_some(v)
}

/// Bytes a vector column kernel's thread loads at once from its narrowest buffer: 8 threads
/// of 8 bytes read 64 neighbouring bytes of a row, 4 rows per warp. With 16 bytes a thread
/// and 2 threads per row, a warp's load touched 16 rows.
const COL_VEC_BYTES: i64 = 8;

/// Points per thread of column kernel `k` as a vector column kernel, at most `max_vec`, or
/// `None` when it cannot be one.
fn column_lanes(k: &Kernel, max_vec: i64) -> Option<i64> {
    if !k.column || k.passes.len() != 1 || !k.prelude.is_empty() || k.passes[0].reductions.iter().any(|r| matches!(r.kind, ReduceKind::ArgMax | ReduceKind::ArgMin)) {
        return None;
    }
    let n = k.outer.len();
    let len = k.outer.last()?.as_const()?;
    let body = &k.passes[0].body;
    let narrowest = k.bufs.iter().filter(|b| !b.written).map(|b| b.dtype.size() as i64).min().unwrap_or(4).max(1);
    let v = vector_width(k, body, (n - 1) as u32, len, &tmp_deps(body), &|_| true, max_vec.min(COL_VEC_BYTES / narrowest).max(1));
    (v > 1).then_some(v)
}

/// The body of a vector column kernel ([Note: vector columns]); `launch` is the scalar
/// kernel's.
#[allow(clippy::too_many_arguments)]
fn emit_vector_column(e: &Emitter, k: &Kernel, gpu: Gpu, cfg: &Config, v: i64, cluster: u32, launch: Launch, out: &mut String) -> Result<Launch, CodegenError> {
    let (col_x, col_y) = cfg.col;
    let (xt, yt) = (col_x as i64 / v, col_y as i64 * v);
    let n_outer = k.outer.len();
    let last = (n_outer - 1) as u32;
    let p = &k.passes[0];
    let total = index(&product(&k.outer));
    writeln!(out, "  {{").unwrap();
    writeln!(out, "    const int t = threadIdx.y * {col_x} + threadIdx.x, cx = t % {xt}, cy = t / {xt};").unwrap();
    // [Note: cluster columns]: the cluster's blocks share the points and take every
    // `cluster`-th run of `yt` rows each; `cr` is this thread's first row.
    let group = if cluster > 1 { format!("(blockIdx.x / {cluster})") } else { "blockIdx.x".to_string() };
    if cluster > 1 {
        writeln!(out, "    const unsigned bz_rank = bz_cluster_rank();").unwrap();
        writeln!(out, "    const bz_ix cr = (bz_ix)bz_rank * {yt} + cy;").unwrap();
    } else {
        writeln!(out, "    const bz_ix cr = cy;").unwrap();
    }
    // Rows a thread steps over: the cluster's blocks' runs of `yt` rows in turn.
    let row_step = yt * cluster as i64;
    writeln!(out, "    const bz_ix ox = ((bz_ix){group} * {xt} + cx) * {v};").unwrap();
    writeln!(out, "    const bool live = ox < {total};").unwrap();
    writeln!(out, "    const bz_ix o = live ? ox : 0;").unwrap();
    decompose(out, "    ", "o", &k.outer, 0);
    writeln!(out, "    const bz_ix ov = i{last};").unwrap();
    // Each reduction's state, `v` lanes of it. A variance's lanes see the same rows, so they
    // share its count and the count's reciprocal, computed once per step.
    let shared_count = |r: &braze_sched::loop_ir::Reduction, name: &str| r.kind == ReduceKind::Var && name.starts_with("wn");
    let mut refs = Vec::new();
    let mut before = Vec::new();
    let mut each = Vec::new();
    for r in &p.reductions {
        for (ty, name) in e.red_state(r) {
            if shared_count(r, &name) {
                writeln!(out, "    {ty} {name} = 0;").unwrap();
                continue;
            }
            writeln!(out, "    {ty} {name}_v[{v}];").unwrap();
            refs.push(format!("{ty}& {name} = {name}_v[j];"));
        }
        if r.kind == ReduceKind::Var {
            let (n, st) = (r.dst, compute_type(k.tmp_dtypes[r.src as usize]));
            let div = if st == "double" { "bz_wdivd" } else { "bz_wdiv" };
            before.push(format!("wn{n} += 1; const {st} wi{n} = {div}(({st})1, ({st})wn{n});"));
            each.push(format!("{{ {st} d = t{s} - wm{n}; wm{n} += d * wi{n}; wq{n} += d * (t{s} - wm{n}); }}", s = r.src));
        } else {
            each.push(e.red_update(r));
        }
    }
    writeln!(out, "    #pragma unroll\n    for (int j = 0; j < {v}; j++) {{").unwrap();
    for r in &p.reductions {
        let lanes: Vec<String> = e.red_state(r).iter().filter(|(_, nm)| !shared_count(r, nm)).map(|(_, nm)| format!("{nm}_v[j] = {nm};")).collect();
        for l in e.red_init(r) {
            writeln!(out, "      {{ {l} {} }}", lanes.join(" ")).unwrap();
        }
    }
    writeln!(out, "    }}").unwrap();
    // A variance's dependent updates want more rows in flight: channels_last bf16 statistics
    // (64×256×56×56) took 47.8 us unrolled 4 times, 36.5 unrolled 16 times (H200, max-autotune's
    // choice); sums kept 4 (52.9 us, 94% of copy bandwidth).
    let has_var = p.reductions.iter().any(|r| r.kind == ReduceKind::Var);
    let unroll = if cfg.unroll > 0 { cfg.unroll } else if has_var { 16 } else { 4 };
    let rows = index(&product(&k.inner));
    let chunked = has_var && p.reductions.iter().all(|r| r.kind != ReduceKind::Var || compute_type(k.tmp_dtypes[r.src as usize]) == "float");
    // Rows past the outer points are read at point 0 (`o`), as the scalar kernel does.
    if chunked {
        emit_welford_chunks(e, k, p, v, unroll, row_step, &rows, Lanes { before, first: refs.clone(), each, ..Lanes::default() }, out)?;
    } else {
        writeln!(out, "    #pragma unroll {unroll}").unwrap();
        writeln!(out, "    for (bz_ix r = cr; r < {rows}; r += {row_step}) {{").unwrap();
        decompose(out, "      ", "r", &k.inner, n_outer);
        let lanes = Lanes { before, first: refs.clone(), each, ..Lanes::default() };
        emit_lanes(e, k, &p.body, last, v, &|_| false, &[], &lanes, "      ", out)?;
        writeln!(out, "    }}").unwrap();
    }
    let mut align = Vec::new();
    add_wide_alignment(&mut align, k, &p.body, last, v, &|_| false);
    for r in &p.reductions {
        let n = r.dst;
        let st = compute_type(k.tmp_dtypes[r.src as usize]);
        let at = e.red_state(r)[0].0;
        let line = match r.kind {
            ReduceKind::Var => {
                let across = if cluster > 1 { format!(" bz_cluster_welford<{cluster}, {xt}, {v}>(wm{n}_v, wq{n}_v, fn_v, cx, cy == 0);") } else { String::new() };
                format!("{{ {st} fn_v[{v}]; for (int j = 0; j < {v}; j++) fn_v[j] = ({st})wn{n}; bz_colv_welford<{xt}, {yt}, {v}>(wm{n}_v, wq{n}_v, fn_v, cx, t);{across} wn{n} = (bz_count_t)fn_v[0]; }}")
            }
            ReduceKind::ArgMax | ReduceKind::ArgMin => unreachable!("column_vector_width excludes arg-reductions"),
            kind => {
                let f = combine_lambda(kind, at, st);
                let across = if cluster > 1 { format!(" bz_cluster_reduce<{cluster}, {xt}, {v}>(a{n}_v, {f}, cx, cy == 0);") } else { String::new() };
                format!("bz_colv_reduce<{xt}, {yt}, {v}>(a{n}_v, {f}, cx, t);{across}")
            }
        };
        writeln!(out, "    {line}").unwrap();
    }
    writeln!(out, "    #pragma unroll\n    for (int j = 0; j < {v}; j++) {{").unwrap();
    writeln!(out, "      const bz_ix i{last} = ov + j;").unwrap();
    for l in &refs {
        writeln!(out, "      {l}").unwrap();
    }
    for r in &p.reductions {
        writeln!(out, "      {}", e.red_final(r)).unwrap();
    }
    let store_guard = if cluster > 1 { "live && cy == 0 && bz_rank == 0" } else { "live && cy == 0" };
    for s in &p.after {
        writeln!(out, "      {}", emit_stmt(e, s, Some(store_guard))?).unwrap();
    }
    writeln!(out, "    }}\n  }}\n}}\n").unwrap();
    // The fallback's grid is this kernel's: the same cluster.
    Ok(Launch { fallback: Some(one_element_fallback(k, gpu, &Config { cluster, ..*cfg }, align)?), ..launch })
}

/// [Note: Welford in chunks] A vector column kernel's f32 variances fold their rows into
/// Welford's state a chunk at a time. The thread's first row starts each lane's mean (a
/// per-element update of a state with no elements), and its last rows, fewer than a chunk,
/// take per-element updates too. Each whole chunk of `unroll` rows between sums
/// its elements' deviations from the mean so far, `s1 = Σ d` and `s2 = Σ d²`, then merges
/// as Chan et al. do: chunk mean `mean + s1 / c`, squared deviations `s2 - s1² / c`. Per
/// element that is a subtraction, an add and a multiply-add, against Welford's four
/// dependent operations and a count's reciprocal per row: channels_last bf16 statistics of
/// 64×256×56×56 spent 33.8 µs in stage 1 where a sum and a sum of squares took 26.4 (H200).
/// The shift keeps the squares small: a deviation is measured from a mean of the same
/// column, so `s2 - s1² / c` cancels no more than a two-pass variance does.
#[allow(clippy::too_many_arguments)]
fn emit_welford_chunks(e: &Emitter, k: &Kernel, p: &braze_sched::loop_ir::Pass, v: i64, unroll: u32, yt: i64, rows: &str, lanes: Lanes, out: &mut String) -> Result<(), CodegenError> {
    let n_outer = k.outer.len();
    let last = (n_outer - 1) as u32;
    let vars: Vec<u32> = p.reductions.iter().filter(|r| r.kind == ReduceKind::Var).map(|r| r.dst).collect();
    // The first row: Welford's per-element update (the count's reciprocal is 1).
    writeln!(out, "    if (cr < {rows}) {{").unwrap();
    writeln!(out, "      const bz_ix r = cr;").unwrap();
    decompose(out, "      ", "r", &k.inner, n_outer);
    emit_lanes(e, k, &p.body, last, v, &|_| false, &[], &lanes, "      ", out)?;
    writeln!(out, "    }}").unwrap();
    // Later rows in whole chunks (no bounds test inside: the loads of a chunk issue together),
    // each variance's lanes summing deviations from the mean so far.
    // The other reductions update per element as before (`lanes.each` has one update per
    // reduction, in the reductions' order).
    let mut first = lanes.first.clone();
    let mut each = Vec::new();
    for (r, l) in p.reductions.iter().zip(&lanes.each) {
        if r.kind == ReduceKind::Var {
            let (n, s) = (r.dst, r.src);
            first.push(format!("float& cs{n} = cs{n}_v[j]; float& cq{n} = cq{n}_v[j];"));
            each.push(format!("{{ const float d = t{s} - wm{n}; cs{n} += d; cq{n} += d * d; }}"));
        } else {
            each.push(l.clone());
        }
    }
    let step = yt * unroll as i64;
    writeln!(out, "    bz_ix r0 = cr + {yt};").unwrap();
    writeln!(out, "    for (; r0 + {} < {rows}; r0 += {step}) {{", step - yt).unwrap();
    for n in &vars {
        writeln!(out, "      float cs{n}_v[{v}] = {{}}, cq{n}_v[{v}] = {{}};").unwrap();
    }
    writeln!(out, "      #pragma unroll\n      for (int u = 0; u < {unroll}; u++) {{").unwrap();
    writeln!(out, "        const bz_ix r = r0 + u * {yt};").unwrap();
    decompose(out, "        ", "r", &k.inner, n_outer);
    let chunk = Lanes { first, each, ..Lanes::default() };
    emit_lanes(e, k, &p.body, last, v, &|_| false, &[], &chunk, "        ", out)?;
    writeln!(out, "      }}").unwrap();
    for n in &vars {
        writeln!(out, "      {{ const bz_count_t nn = wn{n} + {unroll}; const float f = bz_wdiv({unroll}.0f, (float)nn), fw = (float)wn{n} * f;").unwrap();
        writeln!(out, "        #pragma unroll\n        for (int j = 0; j < {v}; j++) {{ const float m = cs{n}_v[j] * (1.0f / {unroll}); wm{n}_v[j] += m * f; wq{n}_v[j] += (cq{n}_v[j] - cs{n}_v[j] * m) + m * m * fw; }}").unwrap();
        writeln!(out, "        wn{n} = nn; }}").unwrap();
    }
    writeln!(out, "    }}").unwrap();
    // The last rows (fewer than a chunk) one at a time.
    writeln!(out, "    for (bz_ix r = r0; r < {rows}; r += {yt}) {{").unwrap();
    decompose(out, "      ", "r", &k.inner, n_outer);
    emit_lanes(e, k, &p.body, last, v, &|_| false, &[], &lanes, "      ", out)?;
    writeln!(out, "    }}").unwrap();
    Ok(())
}

/// [Note: vector rows] A block-per-row reduction reads its row with wide loads (16 bytes
/// per thread and step) when the innermost reduced dim is a multiple of the vector width and
/// every access of the pass walks that dim contiguously or not at all: NCHW BatchNorm
/// statistics, whose rows are 3136-element runs of one channel's images, loaded 2 bytes at a
/// time with a 32-bit division per element ran at a fifth of the H200's copy bandwidth. A
/// variance folds each step's elements into its Welford state at once (`red_vector`).
/// Pointers not aligned for the wide loads run the scalar rows ([Note: lazy scalar
/// fallback]).
fn row_vector_width(k: &Kernel, body: &[Stmt], max_vec: i64) -> i64 {
    let (Some(len), false) = (k.inner.last().and_then(Expr::as_const), k.inner.is_empty()) else { return 1 };
    let last = (k.outer.len() + k.inner.len() - 1) as u32;
    vector_width(k, body, last, len, &tmp_deps(body), &|_| true, max_vec)
}

/// [Note: tiled transposes] A pointwise kernel whose stores walk the last dim but which
/// loads a buffer that walks another dim `a` instead (a 2-d transpose made contiguous, an
/// NCHW activation laid out channels_last, a permute of attention heads) read that buffer one
/// element per 32-byte sector: a bf16 transpose of 16384 x 3136 ran at a tenth of the H200's
/// copy bandwidth (489 us, Inductor 58). Such a kernel runs over tiles of (a, last), a block
/// of 32 x 8 threads per tile: the transposed loads are read with threadIdx.x along `a`
/// (coalesced) into shared memory, then the body runs with threadIdx.x along the last dim
/// (coalesced stores), reading those values from shared memory (rows padded by a word).
/// Each thread moves 4 bytes per access on either side where the sizes and strides allow
/// (two bf16 elements: tiles of 64 x 64, a warp's access a whole 128-byte line; pointers not
/// aligned for them run the one-element version, [Note: lazy scalar fallback]), and takes its
/// rows of the tile unrolled, so 8 to 16 loads are in flight per thread; tile coordinates are
/// 32-bit divisions when the sizes allow. One element per access and 32 x 32 tiles with 64-bit
/// coordinates ran the bf16 transpose and NCHW -> channels_last copy at under half the
/// H200's copy bandwidth (103 and 108 us).
const TILE: i64 = 32;
/// Rows of a tile each thread row takes in turn (a block is 32 x `TILE_ROWS` threads).
const TILE_ROWS: u32 = 8;
/// Bytes a thread moves per access of a tiled kernel (a warp: a 128-byte line).
const TILE_ACCESS_BYTES: i64 = 4;
/// Most shared memory of a tiled kernel's tiles.
const TILE_MAX_SHARED: i64 = 32 << 10;

/// Whether a tiled kernel's smallest tiles (32 x 32, one element per access) for all of its
/// transposed loads fit in shared memory; a kernel whose do not runs untiled (an average pool
/// of 32 x 32 windows over a transposed input reads 1024 such loads).
fn tiles_fit(k: &Kernel, plan: &crate::tiles::TilePlan) -> bool {
    plan.loads.len() as i64 * TILE * (TILE + 1) * tile_word(k, plan) <= TILE_MAX_SHARED
}

/// Bytes of a shared-memory tile's element: the widest type the transposed loads compute in.
fn tile_word(k: &Kernel, plan: &crate::tiles::TilePlan) -> i64 {
    let body = &k.passes[0].body;
    plan.loads.iter().map(|&li| if let Stmt::Load { dst, .. } = &body[li] { k.tmp_dtypes[*dst as usize].size().max(4) as i64 } else { 4 }).max().unwrap_or(4)
}

/// The tiled kernel's body ([Note: tiled transposes]); returns the work to launch a block per
/// item of (the tiles) and the alignment its wide accesses need (empty when it has none).
fn emit_tiled(e: &Emitter, k: &Kernel, plan: &crate::tiles::TilePlan, max_vec: i64, out: &mut String) -> Result<(Expr, Vec<(u32, u64)>), CodegenError> {
    let n = k.outer.len();
    let (a, last) = (plan.a, n - 1);
    let body = &k.passes[0].body;
    let others: Vec<usize> = (0..n).filter(|&d| d != a && d != last).collect();
    let size = |b: u32| k.bufs.iter().find(|r| r.id == b).map_or(4, |r| r.dtype.size()) as i64;
    let tiled_bufs: Vec<u32> = plan.loads.iter().map(|&li| if let Stmt::Load { buf, .. } = &body[li] { *buf } else { unreachable!() }).collect();
    // Elements per access along `a` (loads) and along the last dim (the body).
    let mut ea = tiled_bufs.iter().map(|&b| (TILE_ACCESS_BYTES / size(b)).max(1)).min().unwrap_or(1).min(max_vec);
    let na_const = k.outer[a].as_const();
    let a_ok = plan.loads.iter().all(|&li| {
        let Stmt::Load { index, .. } = &body[li] else { return false };
        index.sub(&Expr::var(a as u32)).all_coefs_divisible(ea)
    });
    if !(a_ok && na_const.is_some_and(|c| c % ea == 0)) {
        ea = 1;
    }
    let tiled_dsts: Vec<u32> = plan.loads.iter().map(|&li| body[li].dst().unwrap()).collect();
    let is_tiled = |s: &Stmt| matches!(s, Stmt::Load { dst, .. } if tiled_dsts.contains(dst));
    let narrowest_store = body.iter().filter_map(|s| if let Stmt::Store { buf, .. } = s { Some(size(*buf)) } else { None }).min().unwrap_or(4);
    let mut eb = match k.outer[last].as_const() {
        Some(len) => vector_width(k, body, last as u32, len, &tmp_deps(body), &|s| !is_tiled(s), (TILE_ACCESS_BYTES / narrowest_store).clamp(1, max_vec)),
        None => 1,
    };
    let (mut ta_len, mut tb_len) = (TILE * ea, TILE * eb);
    if plan.loads.len() as i64 * tb_len * (ta_len + 1) * tile_word(k, plan) > TILE_MAX_SHARED {
        (ea, eb, ta_len, tb_len) = (1, 1, TILE, TILE);
    }
    let tiles_of = |d: usize, t: i64| k.outer[d].add(&Expr::constant(t - 1)).floordiv(&Expr::constant(t));
    let work = others.iter().fold(tiles_of(a, ta_len).mul(&tiles_of(last, tb_len)), |w, &d| w.mul(&k.outer[d]));
    for (t, &li) in plan.loads.iter().enumerate() {
        let Stmt::Load { dst, .. } = &body[li] else { unreachable!() };
        writeln!(out, "  __shared__ {} tile{t}[{tb_len}][{}];", compute_type(k.tmp_dtypes[*dst as usize]), ta_len + 1).unwrap();
    }
    let (na, nb) = (index(&k.outer[a]), index(&k.outer[last]));
    // 32-bit tile coordinates when every size is a constant and the tiles fit.
    let narrow = work.as_const().is_some_and(|w| w < (1 << 31)) && k.outer.iter().all(|d| d.as_const().is_some_and(|c| c < (1 << 31)));
    let (ity, suf) = if narrow { ("unsigned", "u") } else { ("long long", "") };
    writeln!(out, "  const {ity} ta = ({na} + {}) / {ta_len}, tb = ({nb} + {}) / {tb_len};", ta_len - 1, tb_len - 1).unwrap();
    writeln!(out, "  for (bz_ix tile = blockIdx.x; tile < {}; tile += gridDim.x) {{", index(&work)).unwrap();
    writeln!(out, "    {ity} rest = ({ity})tile;").unwrap();
    writeln!(out, "    const bz_ix ob = (bz_ix)(rest % tb) * {tb_len}; rest /= tb;").unwrap();
    writeln!(out, "    const bz_ix oa = (bz_ix)(rest % ta) * {ta_len}; rest /= ta;").unwrap();
    for &d in others.iter().rev() {
        let sz = if narrow { format!("{}{suf}", k.outer[d].as_const().unwrap()) } else { format!("({})", index(&k.outer[d])) };
        writeln!(out, "    const bz_ix i{d} = rest % {sz}; rest /= {sz};").unwrap();
    }
    let mut align: Vec<(u32, u64)> = Vec::new();
    writeln!(out, "    __syncthreads();").unwrap();
    writeln!(out, "    #pragma unroll").unwrap();
    writeln!(out, "    for (int jj = 0; jj < {}; jj++) {{", tb_len / TILE_ROWS as i64).unwrap();
    writeln!(out, "      const int j = threadIdx.y + {TILE_ROWS} * jj;").unwrap();
    writeln!(out, "      const bz_ix i{a} = oa + {ea} * threadIdx.x, i{last} = ob + j;").unwrap();
    writeln!(out, "      if (i{a} < {na} && i{last} < {nb}) {{").unwrap();
    for (t, &li) in plan.loads.iter().enumerate() {
        let Stmt::Load { buf, index: idx, .. } = &body[li] else { unreachable!() };
        let at = format!("b{buf} + ({})", crate::c_emit::index(idx));
        if ea == 1 {
            writeln!(out, "        tile{t}[j][threadIdx.x] = {};", e.from_storage(*buf, &format!("*({at})"))).unwrap();
        } else {
            let bytes = ea * size(*buf);
            add_align(&mut align, *buf, bytes);
            let st = storage_type(k.bufs.iter().find(|b| b.id == *buf).unwrap().dtype);
            writeln!(out, "        {{ __align__(16) {st} w[{ea}]; *({vt}*)w = *(const {vt}*)({at});", vt = vec_type(bytes)).unwrap();
            writeln!(out, "          #pragma unroll\n          for (int l = 0; l < {ea}; l++) tile{t}[j][{ea} * threadIdx.x + l] = {}; }}", e.from_storage(*buf, "w[l]")).unwrap();
        }
    }
    writeln!(out, "      }}\n    }}\n    __syncthreads();").unwrap();
    writeln!(out, "    #pragma unroll").unwrap();
    writeln!(out, "    for (int jj = 0; jj < {}; jj++) {{", ta_len / TILE_ROWS as i64).unwrap();
    writeln!(out, "      const int j = threadIdx.y + {TILE_ROWS} * jj;").unwrap();
    writeln!(out, "      const bz_ix i{a} = oa + j, i{last} = ob + {eb} * threadIdx.x;").unwrap();
    writeln!(out, "      if (i{a} < {na} && i{last} < {nb}) {{").unwrap();
    if eb == 1 {
        for (t, d) in tiled_dsts.iter().enumerate() {
            writeln!(out, "        {} t{d} = tile{t}[threadIdx.x][j];", compute_type(k.tmp_dtypes[*d as usize])).unwrap();
        }
        let rest: Vec<Stmt> = body.iter().filter(|s| !is_tiled(s)).cloned().collect();
        emit_list(e, k, &rest, None, "        ", out, None)?;
    } else {
        for (t, d) in tiled_dsts.iter().enumerate() {
            writeln!(out, "        {} h{d}[{eb}];", compute_type(k.tmp_dtypes[*d as usize])).unwrap();
            writeln!(out, "        #pragma unroll\n        for (int l = 0; l < {eb}; l++) h{d}[l] = tile{t}[{eb} * threadIdx.x + l][j];").unwrap();
        }
        emit_lanes(e, k, body, last as u32, eb, &is_tiled, &tiled_dsts, &Lanes::default(), "        ", out)?;
        add_wide_alignment(&mut align, k, body, last as u32, eb, &is_tiled);
    }
    writeln!(out, "      }}\n    }}\n  }}\n}}\n").unwrap();
    Ok((work, align))
}

/// True when an index reads a kernel temporary (a gathered row): its address is known only
/// inside the lane loop, so no wide access can read it ahead.
pub(crate) fn mentions_tmp(idx: &Expr) -> bool {
    let mut t = Vec::new();
    idx.tmps(&mut t);
    !t.is_empty()
}

/// How an access moves with the last loop variable: 1 (consecutive, vectorizable), 0
/// (the same element for the whole vector) or neither.
fn last_coef(idx: &Expr, last: u32) -> Option<i64> {
    idx.linear_coef(last).filter(|c| *c == 0 || *c == 1)
}

/// [Note: column-invariant hoisting] In a pointwise kernel over a constant last dim (the
/// channels of a channels_last activation, the features of a row), values that depend on
/// the last index alone are the same in every row: a BatchNorm's `1 / sqrt(var + eps)`, its
/// weight and bias. When the grid's thread count is a multiple of the threads that cover one
/// row (`len / v`), each thread keeps its column across its grid-stride steps, so the kernel
/// computes those values once per thread before its loop, into registers (the `h` arrays),
/// and the loop only reads them. The launch rounds its grid up to that multiple
/// (`Launch::grid_multiple`). Without it, ResNet-50's BatchNorm kernels ran IEEE square roots
/// and divisions per element and were bound by them, not by memory. The hoisted loads are read
/// once, so the vector width comes from the buffers the loop walks (16-byte bf16 accesses
/// beside fp32 per-channel parameters).
struct VecPlan {
    /// Elements per thread and step.
    v: i64,
    hoist: Option<Hoist>,
}

struct Hoist {
    /// Temporaries computed before the loop (column-invariant; constants stay in the loop).
    inv: std::collections::HashSet<u32>,
    /// The hoisted values the loop reads, kept per lane in `h` arrays.
    frontier: Vec<u32>,
    /// Threads per row: `len / v`.
    row_threads: i64,
    grid_multiple: u32,
}

/// Most hoisted registers per thread (frontier values times lanes).
const HOIST_MAX_REGS: i64 = 32;
/// Blocks per multiprocessor of a kernel with hoisted values: one wave of 2048 threads.
const HOIST_BLOCKS_PER_SM: u32 = 8;
/// Most blocks a hoisted kernel's grid is rounded up to a multiple of.
const HOIST_MAX_GRID_MULTIPLE: i64 = 16;

/// Elements per thread for the vector path over the loads and stores of `body` that `keep`
/// selects: 16 bytes of the widest such buffer, when the dim of loop variable `last` (`len`
/// long, the innermost one the loop walks) is a multiple of that and each access either
/// walks that dim from a multiple of it (unmasked, or masked by a value the same for the
/// lanes of a step: [Note: lane-uniform masks]) or does not move with it. 1 when there is none.
fn vector_width(k: &Kernel, body: &[Stmt], last: u32, len: i64, deps: &std::collections::HashMap<u32, u64>, keep: &dyn Fn(&Stmt) -> bool, cap: i64) -> i64 {
    let size = |b: u32| k.bufs.iter().find(|r| r.id == b).map_or(4, |r| r.dtype.size()) as i64;
    let widest = body
        .iter()
        .filter(|s| keep(s))
        .filter_map(|s| match s {
            Stmt::Load { buf, .. } | Stmt::Store { buf, .. } => Some(size(*buf)),
            _ => None,
        })
        .max()
        .unwrap_or(4);
    let v = (16 / widest).clamp(1, cap);
    if v == 1 || len % v != 0 {
        return 1;
    }
    let uniform = lane_uniform(body, last, v, deps);
    let mut moves = false;
    for s in body.iter().filter(|s| keep(s)) {
        let (idx, mask) = match s {
            Stmt::Load { index, mask, .. } => (index, *mask),
            Stmt::Store { index, .. } => (index, None),
            _ => continue,
        };
        let steady = mask.is_none_or(|m| uniform.contains(&m));
        match last_coef(idx, last) {
            Some(1) if steady && idx.sub(&Expr::var(last)).all_coefs_divisible(v) && !mentions_tmp(idx) => moves = true,
            Some(0) => {}
            _ => return 1,
        }
    }
    if moves { v } else { 1 }
}

/// [Note: lane-uniform masks] The temporaries of `body` whose value is the same for the `v`
/// lanes of every vector step over loop variable `last` (steps start at multiples of `v`):
/// those that do not depend on `last`; in-bounds masks of an index that walks `last` from a
/// multiple of `v`, between bounds that are multiples of `v` and do not move with it; and
/// values computed from such temporaries alone. A load under such a mask is read wide by lane
/// 0 when the mask holds (`emit_lanes`): the halves of a concatenation along the last dim
/// whose pieces are whole vectors (rotary embeddings' `rotate_half`: `cat(-x[..., 32:],
/// x[..., :32])` of 64-wide heads), a pad by whole vectors. Before, such a mask made the
/// kernel scalar, one 2-byte access per element for bf16.
fn lane_uniform(body: &[Stmt], last: u32, v: i64, deps: &std::collections::HashMap<u32, u64>) -> std::collections::HashSet<u32> {
    let lastbit = 1u64.checked_shl(last).unwrap_or(u64::MAX);
    let still = |e: &Expr| crate::c_emit::expr_deps(e, deps) & lastbit == 0;
    let mut uniform = std::collections::HashSet::new();
    for s in body {
        let Some(t) = s.dst() else { continue };
        let yes = deps.get(&t).is_some_and(|d| d & lastbit == 0)
            || match s {
                Stmt::InRange { index, lo, hi, .. } => {
                    last_coef(index, last) == Some(1)
                        && !mentions_tmp(index)
                        && index.sub(&Expr::var(last)).all_coefs_divisible(v)
                        && [lo, hi].into_iter().all(|b| still(b) && !mentions_tmp(b) && b.all_coefs_divisible(v))
                }
                Stmt::Unary { .. } | Stmt::Binary { .. } | Stmt::Where { .. } | Stmt::Cast { .. } => stmt_reads(s).iter().all(|r| uniform.contains(r)),
                _ => false,
            };
        if yes {
            uniform.insert(t);
        }
    }
    uniform
}

/// The vector path of a pointwise kernel, with its column-invariant values hoisted when that
/// pays and the grid allows it ([Note: column-invariant hoisting]); `None` when there is no
/// vector path.
fn vector_plan(k: &Kernel, block: u32, max_vec: i64) -> Option<VecPlan> {
    let n = k.outer.len();
    if n == 0 {
        return None;
    }
    let last = (n - 1) as u32;
    let len = k.outer[n - 1].as_const()?;
    let body = &k.passes[0].body;
    let deps = tmp_deps(body);
    let lastbit = 1u64.checked_shl(last).unwrap_or(u64::MAX);
    let inv: std::collections::HashSet<u32> = body
        .iter()
        .filter(|s| !matches!(s, Stmt::Const { .. } | Stmt::Store { .. }))
        .filter_map(Stmt::dst)
        .filter(|t| deps.get(t).is_some_and(|d| d & !lastbit == 0))
        .collect();
    if !inv.is_empty() {
        let hoisted = |s: &Stmt| s.dst().is_some_and(|t| inv.contains(&t));
        let mut frontier: Vec<u32> = Vec::new();
        for s in body.iter().filter(|s| !hoisted(s)) {
            for t in stmt_reads(s) {
                if inv.contains(&t) && !frontier.contains(&t) {
                    frontier.push(t);
                }
            }
        }
        // Fewer lanes when the hoisted registers would not fit.
        let mut v = vector_width(k, body, last, len, &deps, &|s| !hoisted(s), max_vec);
        while v > 2 && frontier.len() as i64 * v > HOIST_MAX_REGS {
            v = vector_width(k, body, last, len, &deps, &|s| !hoisted(s), v / 2);
        }
        let block = block as i64;
        let row_threads = len / v.max(1);
        let g = row_threads / gcd(row_threads, block);
        if v > 1 && !frontier.is_empty() && g <= HOIST_MAX_GRID_MULTIPLE && frontier.len() as i64 * v <= HOIST_MAX_REGS {
            return Some(VecPlan { v, hoist: Some(Hoist { inv, frontier, row_threads, grid_multiple: g as u32 }) });
        }
    }
    let v = vector_width(k, body, last, len, &deps, &|_| true, max_vec);
    (v > 1).then_some(VecPlan { v, hoist: None })
}

fn gcd(a: i64, b: i64) -> i64 {
    if b == 0 { a.abs().max(1) } else { gcd(b, a % b) }
}

fn vec_type(bytes: i64) -> &'static str {
    match bytes {
        16 => "uint4",
        8 => "uint2",
        4 => "unsigned int",
        2 => "unsigned short",
        _ => "unsigned char",
    }
}

/// The vector path of a pointwise kernel: each thread takes `v` neighbouring elements of
/// the last dim, reads and writes them with one wide access per buffer, and computes them in
/// an unrolled loop. Returns the alignment each wide buffer needs (the runtime launches the
/// scalar fallback otherwise, [Note: lazy scalar fallback]). A masked
/// wide load (padding, whose mask does not move with the last dim) is read by lane 0 when
/// its mask holds and is zero otherwise. Column-invariant values are computed before the
/// loop when the plan hoists them ([Note: column-invariant hoisting]).
fn emit_vector_path(e: &Emitter, k: &Kernel, plan: &VecPlan, out: &mut String) -> Result<Vec<(u32, u64)>, CodegenError> {
    let v = plan.v;
    let n = k.outer.len();
    let last = (n - 1) as u32;
    let body = &k.passes[0].body;
    let hoisted = |s: &Stmt| plan.hoist.as_ref().is_some_and(|h| s.dst().is_some_and(|t| h.inv.contains(&t)));
    let mut align = Vec::new();
    add_wide_alignment(&mut align, k, body, last, v, &hoisted);
    // Pointers aligned for the wide accesses: the runtime checks (`Launch::misaligned`) and
    // launches the scalar fallback otherwise ([Note: lazy scalar fallback]).
    writeln!(out, "  {{").unwrap();
    let total = index(&product(&k.outer));
    if let Some(h) = &plan.hoist {
        writeln!(out, "  const bz_ix xs = (bz_ix)blockIdx.x * blockDim.x + threadIdx.x;").unwrap();
        writeln!(out, "  // Column-invariant values, once per thread (its column is fixed: the grid is a multiple of {} threads).", h.row_threads).unwrap();
        for t in &h.frontier {
            writeln!(out, "  {} h{t}[{v}];", compute_type(k.tmp_dtypes[*t as usize])).unwrap();
        }
        writeln!(out, "  {{\n    const bz_ix vb = (xs % {}) * {v};", h.row_threads).unwrap();
        writeln!(out, "    #pragma unroll\n    for (int j = 0; j < {v}; j++) {{").unwrap();
        writeln!(out, "      const bz_ix i{last} = vb + j;").unwrap();
        let pre: Vec<Stmt> = body.iter().filter(|s| matches!(s, Stmt::Const { .. }) || hoisted(s)).cloned().collect();
        emit_list(e, k, &pre, None, "      ", out, None)?;
        for t in &h.frontier {
            writeln!(out, "      h{t}[j] = t{t};").unwrap();
        }
        writeln!(out, "    }}\n  }}").unwrap();
        writeln!(out, "  for (bz_ix x = xs; x < ({total}) / {v}; x += (bz_ix)gridDim.x * blockDim.x) {{").unwrap();
    } else {
        writeln!(out, "  for (bz_ix x = (bz_ix)blockIdx.x * blockDim.x + threadIdx.x; x < ({total}) / {v}; x += (bz_ix)gridDim.x * blockDim.x) {{").unwrap();
    }
    decompose(out, "    ", &format!("x * {v}"), &k.outer, 0);
    let frontier: &[u32] = plan.hoist.as_ref().map_or(&[], |h| &h.frontier);
    emit_lanes(e, k, body, last, v, &hoisted, frontier, &Lanes::default(), "    ", out)?;
    writeln!(out, "  }}\n  }}").unwrap();
    Ok(align)
}


/// Whether `s` is a wide access of a vector step over loop variable `last`.
fn is_wide(s: &Stmt, last: u32, hoisted: &dyn Fn(&Stmt) -> bool) -> bool {
    !hoisted(s)
        && match s {
            Stmt::Load { index, .. } | Stmt::Store { index, .. } => last_coef(index, last) == Some(1),
            _ => false,
        }
}

/// Adds (buffer, alignment mask) for an access of `bytes` bytes at once to `align`, once.
fn add_align(align: &mut Vec<(u32, u64)>, buf: u32, bytes: i64) {
    let a = (buf, bytes as u64 - 1);
    if !align.contains(&a) {
        align.push(a);
    }
}

/// Adds to `align` each buffer a vector step of `v` lanes accesses wide, with its alignment.
fn add_wide_alignment(align: &mut Vec<(u32, u64)>, k: &Kernel, body: &[Stmt], last: u32, v: i64, hoisted: &dyn Fn(&Stmt) -> bool) {
    for s in body.iter().filter(|s| is_wide(s, last, hoisted)) {
        let (Stmt::Load { buf, .. } | Stmt::Store { buf, .. }) = s else { continue };
        add_align(align, *buf, v * k.bufs.iter().find(|b| b.id == *buf).unwrap().dtype.size() as i64);
    }
}

/// Per-lane lines a vector step adds around its body (a reduction's accumulators).
#[derive(Default)]
struct Lanes {
    /// Before the lane loop.
    before: Vec<String>,
    /// At the start of each lane.
    first: Vec<String>,
    /// At the end of each lane.
    each: Vec<String>,
    /// After the lane loop.
    after: Vec<String>,
}

/// One vector step over loop variable `last` (already decomposed, at a multiple of `v`):
/// the wide loads into per-lane arrays, the body once per lane (`i{last}` = base + j) with
/// the wide accesses read from and written to those arrays, then the wide stores. Statements
/// `hoisted` selects are not emitted; of them, those in `frontier` are read from their `h`
/// arrays ([Note: column-invariant hoisting]).
#[allow(clippy::too_many_arguments)]
fn emit_lanes(e: &Emitter, k: &Kernel, body: &[Stmt], last: u32, v: i64, hoisted: &dyn Fn(&Stmt) -> bool, frontier: &[u32], extra: &Lanes, pad: &str, out: &mut String) -> Result<(), CodegenError> {
    let wide = |s: &Stmt| is_wide(s, last, hoisted);
    let stype = |buf: u32| storage_type(k.bufs.iter().find(|b| b.id == buf).unwrap().dtype);
    let bytes = |buf: u32| v * k.bufs.iter().find(|b| b.id == buf).unwrap().dtype.size() as i64;
    for s in body.iter().filter(|s| wide(s)) {
        match s {
            Stmt::Load { dst, buf, index: i, mask: None } => {
                writeln!(out, "{pad}__align__(16) {t} w{dst}[{v}]; *({vt}*)w{dst} = *(const {vt}*)(b{buf} + ({}));", crate::c_emit::index(i), t = stype(*buf), vt = vec_type(bytes(*buf))).unwrap();
            }
            Stmt::Load { dst, buf, mask: Some(_), .. } => {
                writeln!(out, "{pad}__align__(16) {t} w{dst}[{v}] = {{}};", t = stype(*buf)).unwrap();
            }
            Stmt::Store { buf, value, .. } => {
                writeln!(out, "{pad}__align__(16) {} s{value}_{buf}[{v}];", stype(*buf)).unwrap();
            }
            _ => {}
        }
    }
    for l in &extra.before {
        writeln!(out, "{pad}{l}").unwrap();
    }
    writeln!(out, "{pad}const bz_ix vb = i{last};").unwrap();
    writeln!(out, "{pad}#pragma unroll\n{pad}for (int j = 0; j < {v}; j++) {{").unwrap();
    writeln!(out, "{pad}  const bz_ix i{last} = vb + j;").unwrap();
    for l in &extra.first {
        writeln!(out, "{pad}  {l}").unwrap();
    }
    let mut lane = Vec::new();
    for s in body {
        match s {
            Stmt::Load { dst, buf, index: i, mask } if wide(s) => {
                let ct = compute_type(k.tmp_dtypes[*dst as usize]);
                let read = format!("{ct} t{dst} = {};", e.from_storage(*buf, &format!("w{dst}[j]")));
                lane.push(match mask {
                    None => read,
                    Some(m) => format!("if (j == 0 && t{m}) *({vt}*)w{dst} = *(const {vt}*)(b{buf} + ({})); {read}", crate::c_emit::index(i), vt = vec_type(bytes(*buf))),
                });
            }
            Stmt::Store { buf, value, .. } if wide(s) => lane.push(format!("s{value}_{buf}[j] = {};", e.to_storage(*buf, *value))),
            _ => match s.dst() {
                Some(t) if hoisted(s) && frontier.contains(&t) => lane.push(format!("{} t{t} = h{t}[j];", compute_type(k.tmp_dtypes[t as usize]))),
                _ => lane.push(String::new()),
            },
        }
    }
    // Ordinary statements keep their spelling (sin/cos pairing included).
    let mut ordinary = String::new();
    let plain: Vec<Stmt> = body.iter().filter(|s| !wide(s) && !hoisted(s)).cloned().collect();
    emit_list(e, k, &plain, None, &format!("{pad}  "), &mut ordinary, None)?;
    let mut ord_lines = ordinary.lines();
    let pairs = sincos_pairs(&plain, k);
    let paired: std::collections::HashSet<u32> = pairs.values().copied().collect();
    for (s, l) in body.iter().zip(&lane) {
        if wide(s) || hoisted(s) {
            if !l.is_empty() {
                writeln!(out, "{pad}  {l}").unwrap();
            }
        } else if !matches!(s, Stmt::Unary { dst, op: braze_ir::UnaryOp::Cos, .. } if paired.contains(dst)) {
            writeln!(out, "{}", ord_lines.next().unwrap_or_default()).unwrap();
        }
    }
    for l in &extra.each {
        writeln!(out, "{pad}  {l}").unwrap();
    }
    writeln!(out, "{pad}}}").unwrap();
    for l in &extra.after {
        writeln!(out, "{pad}{l}").unwrap();
    }
    for s in body.iter().filter(|s| wide(s)) {
        if let Stmt::Store { buf, value, index: i } = s {
            writeln!(out, "{pad}*({vt}*)(b{buf} + ({})) = *(const {vt}*)s{value}_{buf};", crate::c_emit::index(i), vt = vec_type(bytes(*buf))).unwrap();
        }
    }
    Ok(())
}

/// The whole CUDA module of a graph's kernels, as one unit (what the logs show): the prelude
/// and each distinct kernel ([`module_source`]), and the launches of all kernels, each
/// naming its function in that one unit.
pub fn emit_module(kernels: &[Kernel], gpu: Gpu) -> Result<(String, Vec<Launch>), CodegenError> {
    let (distinct, mut launches) = emit_kernels(kernels, gpu)?;
    for l in &mut launches {
        l.unit = 0;
    }
    Ok((module_source(&distinct), launches))
}

/// Distinct kernels as one readable module: the prelude, then each kernel.
pub fn module_source<'a>(distinct: impl IntoIterator<Item = &'a CudaKernel>) -> String {
    let mut s = format!("{}\n", Cuda.prelude());
    for k in distinct {
        s.push_str(&k.text);
    }
    s
}

/// The CUDA prelude every translation unit starts with.
pub fn prelude() -> &'static str {
    Cuda.prelude()
}

/// A distinct kernel of a graph's CUDA module: its function's name, the key it is
/// deduplicated and cached by (its code up to its name and buffer ids, [Note: kernel dedup]),
/// and its text (without the prelude).
#[derive(Clone, Debug)]
pub struct CudaKernel {
    pub name: String,
    pub key: String,
    pub text: String,
}

/// The distinct kernels of a graph, in kernel order, and the launches of all kernels in
/// order. A launch's `name` is its distinct kernel's function and its `unit` the index of
/// that kernel in the distinct list, until the runtime places the kernels in cubins
/// (`braze_runtime::cuda::compile_kernels`, [Note: per-kernel CUDA cache]).
pub fn emit_kernels(kernels: &[Kernel], gpu: Gpu) -> Result<(Vec<CudaKernel>, Vec<Launch>), CodegenError> {
    emit_kernels_with(kernels, gpu, &[])
}

/// [`emit_kernels`] with kernel `i` in configuration `configs[i]` where that is given (the
/// heuristic's otherwise, and for every kernel past the slice's end).
pub fn emit_kernels_with(kernels: &[Kernel], gpu: Gpu, configs: &[Option<Config>]) -> Result<(Vec<CudaKernel>, Vec<Launch>), CodegenError> {
    let mut texts = Vec::with_capacity(kernels.len());
    let mut launches = Vec::with_capacity(kernels.len());
    let mut keys = Vec::with_capacity(kernels.len());
    for (i, k) in kernels.iter().enumerate() {
        let mut text = String::new();
        let cfg = configs.get(i).copied().flatten().unwrap_or_else(|| Config::heuristic(k));
        let launch = emit_kernel_with(k, gpu, &cfg, &mut text)?;
        keys.push(crate::dedup::canonical(&text, &k.name, &launch.bufs));
        texts.push(text);
        launches.push(launch);
    }
    let mut distinct: Vec<CudaKernel> = Vec::new();
    let mut index = vec![0usize; kernels.len()];
    for (i, owner) in crate::dedup::owners(&keys).into_iter().enumerate() {
        if owner == i {
            index[i] = distinct.len();
            distinct.push(CudaKernel { name: kernels[i].name.clone(), key: std::mem::take(&mut keys[i]), text: std::mem::take(&mut texts[i]) });
        }
        launches[i].name = kernels[owner].name.clone();
        launches[i].unit = index[owner];
    }
    Ok((distinct, launches))
}

/// One way to run a kernel that max-autotune times ([Note: kernel configurations]).
#[derive(Clone, Debug)]
pub struct Candidate {
    pub config: Config,
    /// The kernel in this configuration, its function named `<kernel>_c<i>`.
    pub kernel: CudaKernel,
    pub launch: Launch,
}

/// Kernel `k` in each of its [`candidates`] that emits distinct code, the heuristic's first.
pub fn emit_candidates(k: &Kernel, gpu: Gpu) -> Result<Vec<Candidate>, CodegenError> {
    let mut out: Vec<Candidate> = Vec::new();
    let mut named = k.clone();
    for (i, config) in candidates(k).into_iter().enumerate() {
        named.name = format!("{}_c{i}", k.name);
        let mut text = String::new();
        let launch = emit_kernel_with(&named, gpu, &config, &mut text)?;
        let key = crate::dedup::canonical(&text, &named.name, &launch.bufs);
        if out.iter().any(|c| c.kernel.key == key) {
            continue;
        }
        out.push(Candidate { config, kernel: CudaKernel { name: named.name.clone(), key, text }, launch });
    }
    Ok(out)
}

#[cfg(test)]
mod param_order_tests {
    use super::reorder_params;
    use crate::dedup::first_use_order;

    #[test]
    fn parameters_in_first_use_order() {
        let src = "/* k: stores %3 */\nextern \"C\" __global__ void __launch_bounds__(256) k(const float* __restrict__ b0, const float* __restrict__ b1, float* __restrict__ b4, long long s0) {\n  b4[0] = b1[0] + b0[s0];\n}\n";
        let body = &src[src.find(") {\n").unwrap() + 4..];
        let order = first_use_order(body, &[0, 1, 4]);
        assert_eq!(order, vec![4, 1, 0]);
        let out = reorder_params(src, &order);
        assert!(out.contains("k(float* __restrict__ b4, const float* __restrict__ b1, const float* __restrict__ b0, long long s0) {\n"), "{out}");
        assert!(out.ends_with("  b4[0] = b1[0] + b0[s0];\n}\n"));
    }
}
