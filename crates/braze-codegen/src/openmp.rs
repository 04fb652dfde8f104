//! The C + OpenMP dialect: one C file per graph, one function per kernel with the
//! signature `void NAME(void** B, const int64_t* S)` (B: every buffer of the graph by id,
//! S: the size symbols). Outer loops run in parallel, the innermost loop is vectorized
//! (`omp simd`, with a reduction clause for sums and products).

use crate::c_emit::Emitter;
use crate::dialect::{storage_type, Dialect};
use crate::CodegenError;
use braze_ir::{Expr, ReduceKind};
use braze_sched::loop_ir::{Kernel, Stmt};
use std::fmt::Write;

pub struct OpenMp;

const PRELUDE: &str = concat!(
    r#"#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) && defined(__GLIBC__)
/* Vector variants from glibc's libmvec, so `omp simd` loops calling these vectorize. */
#pragma omp declare simd notinbranch
float acosf(float);
#pragma omp declare simd notinbranch
double acos(double);
#pragma omp declare simd notinbranch
float acoshf(float);
#pragma omp declare simd notinbranch
double acosh(double);
#pragma omp declare simd notinbranch
float asinf(float);
#pragma omp declare simd notinbranch
double asin(double);
#pragma omp declare simd notinbranch
float asinhf(float);
#pragma omp declare simd notinbranch
double asinh(double);
#pragma omp declare simd notinbranch
float atanf(float);
#pragma omp declare simd notinbranch
double atan(double);
#pragma omp declare simd notinbranch
float atanhf(float);
#pragma omp declare simd notinbranch
double atanh(double);
#pragma omp declare simd notinbranch
float cosf(float);
#pragma omp declare simd notinbranch
double cos(double);
#pragma omp declare simd notinbranch
float coshf(float);
#pragma omp declare simd notinbranch
double cosh(double);
#pragma omp declare simd notinbranch
float erff(float);
#pragma omp declare simd notinbranch
double erf(double);
#pragma omp declare simd notinbranch
float erfcf(float);
#pragma omp declare simd notinbranch
double erfc(double);
#pragma omp declare simd notinbranch
float expf(float);
#pragma omp declare simd notinbranch
double exp(double);
#pragma omp declare simd notinbranch
float exp2f(float);
#pragma omp declare simd notinbranch
double exp2(double);
#pragma omp declare simd notinbranch
float expm1f(float);
#pragma omp declare simd notinbranch
double expm1(double);
#pragma omp declare simd notinbranch
float logf(float);
#pragma omp declare simd notinbranch
double log(double);
#pragma omp declare simd notinbranch
float log10f(float);
#pragma omp declare simd notinbranch
double log10(double);
#pragma omp declare simd notinbranch
float log1pf(float);
#pragma omp declare simd notinbranch
double log1p(double);
#pragma omp declare simd notinbranch
float log2f(float);
#pragma omp declare simd notinbranch
double log2(double);
#pragma omp declare simd notinbranch
float sinf(float);
#pragma omp declare simd notinbranch
double sin(double);
#pragma omp declare simd notinbranch
float sinhf(float);
#pragma omp declare simd notinbranch
double sinh(double);
#pragma omp declare simd notinbranch
float tanf(float);
#pragma omp declare simd notinbranch
double tan(double);
#pragma omp declare simd notinbranch
float tanhf(float);
#pragma omp declare simd notinbranch
double tanh(double);
#pragma omp declare simd notinbranch
float atan2f(float, float);
#pragma omp declare simd notinbranch
double atan2(double, double);
#pragma omp declare simd notinbranch
float hypotf(float, float);
#pragma omp declare simd notinbranch
double hypot(double, double);
#pragma omp declare simd notinbranch
float powf(float, float);
#pragma omp declare simd notinbranch
double pow(double, double);
#endif
#define bz_isinf(x) isinf(x)
#define bz_min_int64_t INT64_MIN
#define bz_max_int64_t INT64_MAX
#define bz_min_int32_t INT32_MIN
#define bz_max_int32_t INT32_MAX
#define bz_min_int16_t INT16_MIN
#define bz_max_int16_t INT16_MAX
#define bz_min_int8_t INT8_MIN
#define bz_max_int8_t INT8_MAX
#define bz_min_uint8_t 0
#define bz_max_uint8_t 255
// Welford's mean update divides by the count: exactly on the CPU (see the CUDA prelude).
static inline float bz_wdiv(float a, float b) { return a / b; }
static inline double bz_wdivd(double a, double b) { return a / b; }
typedef int64_t bz_count_t;
/* The type index arithmetic is done in: a gathered index enters it widened ([Note: 32-bit indices]). */
typedef int64_t bz_ix;
/* What a steady masked load reads where its mask is off ([Note: steady masked loads]). */
static const unsigned char bz_zeros[65536] __attribute__((aligned(64), unused));
static inline float bz_self(int c, float a, float b) { uint32_t x, y, m = -(uint32_t)(c != 0); memcpy(&x, &a, 4); memcpy(&y, &b, 4); x = (x & m) | (y & ~m); memcpy(&a, &x, 4); return a; }
static inline double bz_f64_from_bits(int64_t x) { double d; memcpy(&d, &x, 8); return d; }
static inline double bz_seld(int c, double a, double b) { uint64_t x, y, m = -(uint64_t)(c != 0); memcpy(&x, &a, 8); memcpy(&y, &b, 8); x = (x & m) | (y & ~m); memcpy(&a, &x, 8); return a; }
static inline int64_t bz_seli(int c, int64_t a, int64_t b) { int64_t m = -(int64_t)(c != 0); return (a & m) | (b & ~m); }
static inline float bz_h2f(uint16_t h) { _Float16 f; memcpy(&f, &h, 2); return (float)f; }
static inline uint16_t bz_f2h(float x) { _Float16 f = (_Float16)x; uint16_t h; memcpy(&h, &f, 2); return h; }
static inline float bz_round_h(float x) { return (float)(_Float16)x; }
static inline float bz_bf2f(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t bz_f2bf(float x) {
  uint32_t u; memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}
static inline float bz_round_bf(float x) { return bz_bf2f(bz_f2bf(x)); }
static inline float bz_rem_float(float a, float b) { float r = fmodf(a, b); if (r != 0 && ((r < 0) != (b < 0))) r += b; return r; }
static inline double bz_rem_double(double a, double b) { double r = fmod(a, b); if (r != 0 && ((r < 0) != (b < 0))) r += b; return r; }
/* Set by a kernel that read an out-of-range index (gather, index_select, embedding); the
   runtime reads and clears it after the kernels and raises, as eager does. A kernel notes
   one in its own `bz_bad`, an OR reduction of its loops ([Note: bounded indices]). */
int braze_oob = 0;
static inline int64_t bz_bounded_at(int64_t i, int64_t n, int* bad) { int ok = (uint64_t)i < (uint64_t)n; *bad |= !ok; return bz_seli(ok, i, 0); }
#define bz_bounded(i, n) bz_bounded_at((i), (n), &bz_bad)
#define BZ_INT static inline
"#,
    integer_division_helpers!(),
    r#"static inline int64_t bz_pow_i64(int64_t a, int64_t b) { int64_t r = 1; if (b < 0) return a == 1 ? 1 : (a == -1 ? ((b & 1) ? -1 : 1) : 0); while (b) { if (b & 1) r *= a; a *= a; b >>= 1; } return r; }
#define BZ_RNG static inline
#define BZ_RNG_PHILOX static inline
#define BZ_RNG_ROUNDS
"#,
    random_helpers!()
);

impl Dialect for OpenMp {
    fn prelude(&self) -> &'static str {
        PRELUDE
    }
    /// Float variances keep their Welford state in double, as ATen's CPU kernels accumulate:
    /// a column's per-element update in f32 over 51 200 rows of bf16 values around 100 (a
    /// spread of 0.05) rounded each mean update away and was 1% off float64.
    fn variance_type(&self, dt: braze_ir::DType) -> &'static str {
        match dt {
            braze_ir::DType::F32 | braze_ir::DType::F16 | braze_ir::DType::BF16 => "double",
            other => crate::dialect::compute_type(other),
        }
    }
}

/// Elements below which a kernel runs on one thread (thread start-up costs more), divided
/// by a reduction's passes over them.
const PARALLEL_MIN: i64 = 32768;

fn product(v: &[Expr]) -> Expr {
    v.iter().fold(Expr::one(), |a, b| a.mul(b))
}

/// Emits one kernel as a C function taking its buffers by position (`B[0]` is the buffer its
/// body names first, and so on: the same code over buffers numbered otherwise, in another
/// graph, is the same function, [Note: kernel dedup]) and the graph's size symbols by id;
/// returns the buffer ids in parameter order.
/// [Note: bounded indices] An index read from memory is checked where it is used
/// (`bz_bounded`): out of range, it reads element 0 and the kernel notes it in `bz_bad`, which
/// every parallel and vector loop of the kernel ORs together (a reduction clause), and the
/// runtime raises after the kernels. A store to the global flag inside the loop was control
/// flow that kept GCC from vectorizing it: bilinear upsampling's gather (4×5×128×128 from
/// 8×8) ran scalar, 1.98 ms against ATen's 0.28.
fn with_bounded_indices(body: &str) -> String {
    let mut out = String::with_capacity(body.len() + 256);
    out.push_str("  int bz_bad = 0;\n");
    for line in body.lines() {
        out.push_str(line);
        let t = line.trim_start();
        if t.starts_with("#pragma omp") && (t.contains(" simd") || t.contains("parallel for")) {
            out.push_str(" reduction(|:bz_bad)");
        }
        out.push('\n');
    }
    out.push_str("  if (bz_bad) __atomic_store_n(&braze_oob, 1, __ATOMIC_RELAXED);\n");
    out
}

pub fn emit_kernel(k: &Kernel, out: &mut String) -> Result<Vec<u32>, CodegenError> {
    // [Note: stored for reload] (braze-sched): the CPU stores a transcendental value for the
    // last pass instead of computing it twice.
    let mut reloaded = k.clone();
    let k = if braze_sched::loop_ir::store_for_reload(&mut reloaded) { &reloaded } else { k };
    let d = OpenMp;
    let e = Emitter { k, d: &d };
    writeln!(out, "/* {}: stores {} */", k.name, k.roots.join(", ")).unwrap();
    writeln!(out, "void {}(void** restrict B, const int64_t* restrict S) {{", k.name).unwrap();
    for s in k.syms() {
        writeln!(out, "  const int64_t s{s} = S[{s}];").unwrap();
    }
    let mut bufs = k.bufs.clone();
    bufs.sort_by_key(|b| b.id);
    let total = product(&k.outer).mul(&product(&k.inner));
    let mut body = String::new();
    // A kernel below the threshold runs on the calling thread with no parallel region at all:
    // `parallel ... if(0)` still enters the OpenMP runtime (a team of one) per call, most of
    // a tiny kernel's time (`x + 1` on 8 elements: 0.80 -> 0.29 us per run). A static size
    // decides at compile time; a symbolic one branches between the two loop nests.
    // Each pass of a reduction walks the elements again: a BatchNorm's statistics and its
    // normalization over 128 x 224 channels_last elements (two passes, 57k element steps) ran
    // on one thread while the other waited (DenseNet-121's training step on the 2-core machine).
    let min = PARALLEL_MIN / k.passes.len().max(1) as i64;
    match total.as_const() {
        Some(n) => emit_loops(k, &e, &mut body, n < min, 1)?,
        None => {
            writeln!(body, "  if ({} >= {min}) {{", crate::c_emit::index(&total)).unwrap();
            emit_loops(k, &e, &mut body, false, 2)?;
            writeln!(body, "  }} else {{").unwrap();
            emit_loops(k, &e, &mut body, true, 2)?;
            writeln!(body, "  }}").unwrap();
        }
    }
    if body.contains("bz_bounded(") {
        body = with_bounded_indices(&body);
    }
    let params = crate::dedup::first_use_order(&body, &bufs.iter().map(|b| b.id).collect::<Vec<_>>());
    for (pos, id) in params.iter().enumerate() {
        let b = bufs.iter().find(|b| b.id == *id).expect("a kernel buffer");
        let c = if b.written { "" } else { "const " };
        writeln!(out, "  {c}{t}* restrict b{id} = ({c}{t}*)B[{pos}];", t = storage_type(b.dtype)).unwrap();
    }
    out.push_str(&body);
    writeln!(out, "}}\n").unwrap();
    Ok(params)
}

/// Bytes of the zeros a steady masked load reads where its mask is off.
const ZEROS_BYTES: i64 = 1 << 16;

/// [Note: steady masked loads] A masked load in a pointwise kernel reads element 0 where
/// its mask is off (`b[mask * index]`, branch-free). When the mask does not move with the
/// vectorized last dim (a max pool's window tap or a pad, masked per row of channels), that
/// form still scales the last dim's stride by the mask, and GCC emits a gather per vector:
/// ResNet-18's ReLU + max pool (8 x 64 x 112 x 112 f32, channels_last) took 1.52 ms against
/// Inductor's 0.72. Such a load instead picks its row's base pointer once per row, the
/// buffer's or a block of zeros (`bz_zeros`) as long as the row, and walks it at its
/// constant stride: contiguous vector loads. The loads whose destinations this returns
/// qualify: mask steady along the last dim, index linear in it with a constant stride
/// `s >= 0` over a constant extent `n`, `(n - 1) * s` elements within the zeros. Returns
/// those loads' destinations and the statements (by position) computing their masks and
/// bases, which are emitted before the vectorized loop.
fn steady_masked_loads(k: &Kernel, body: &[Stmt]) -> (Vec<u32>, Vec<usize>) {
    let none = (vec![], vec![]);
    let Some(lastd) = k.outer.len().checked_sub(1) else { return none };
    let Some(n) = k.outer[lastd].as_const() else { return none };
    let lastbit = 1u64.checked_shl(lastd as u32).unwrap_or(u64::MAX);
    let deps = crate::c_emit::tmp_deps(body);
    let size = |b: u32| k.bufs.iter().find(|r| r.id == b).map_or(8, |r| r.dtype.size()) as i64;
    let def: std::collections::HashMap<u32, usize> = body.iter().enumerate().filter_map(|(j, s)| s.dst().map(|t| (t, j))).collect();
    let tmps = |e: &Expr| {
        let mut t = Vec::new();
        e.tmps(&mut t);
        t
    };
    // The statements computing `roots` (before the loop: no loads among them), or None.
    let chain = |roots: Vec<u32>| -> Option<Vec<usize>> {
        let mut todo = roots;
        let mut seen = Vec::new();
        while let Some(t) = todo.pop() {
            let &j = def.get(&t)?;
            if seen.contains(&j) {
                continue;
            }
            let s = &body[j];
            match s {
                Stmt::Load { .. } => return None,
                Stmt::Index { index, .. } => todo.extend(tmps(index)),
                Stmt::InRange { index, lo, hi, .. } => todo.extend([index, lo, hi].into_iter().flat_map(&tmps)),
                Stmt::Bounded { a, hi, .. } => todo.extend(std::iter::once(*a).chain(tmps(hi))),
                s => todo.extend(braze_sched::loop_ir::stmt_reads(s)),
            }
            seen.push(j);
        }
        Some(seen)
    };
    let (mut loads, mut hoisted) = (Vec::new(), Vec::new());
    for s in body {
        let Stmt::Load { dst, buf, index, mask: Some(m) } = s else { continue };
        let Some(stride) = index.linear_coef(lastd as u32).filter(|&c| c >= 0) else { continue };
        let base = steady_split(k, index).0;
        let steady = deps.get(m).is_some_and(|d| d & lastbit == 0) && crate::c_emit::expr_deps(&base, &deps) & lastbit == 0;
        let fits = (n - 1).checked_mul(stride).and_then(|e| (e + 1).checked_mul(size(*buf))).is_some_and(|b| b <= ZEROS_BYTES);
        if !(steady && fits) {
            continue;
        }
        if let Some(c) = chain(std::iter::once(*m).chain(tmps(&base)).collect()) {
            loads.push(*dst);
            for j in c {
                if !hoisted.contains(&j) {
                    hoisted.push(j);
                }
            }
        }
    }
    (loads, hoisted)
}

/// A steady masked load's index as (row base, walk along the last dim).
fn steady_split(k: &Kernel, index: &Expr) -> (Expr, Expr) {
    let last = (k.outer.len() - 1) as u32;
    let walk = Expr::var(last).mul_c(index.linear_coef(last).unwrap_or(0));
    (index.sub(&walk), walk)
}

/// One row of a pointwise kernel: its last dim from `lo` to `hi` (C expressions), vectorized,
/// with `body`'s steady masked loads' masks and row pointers computed before it ([Note:
/// steady masked loads]).
#[allow(clippy::too_many_arguments)]
fn emit_row(k: &Kernel, e: &Emitter, out: &mut String, body: &[Stmt], lo: &str, hi: &str, pragma: &str, depth: usize) -> Result<(), CodegenError> {
    let pad = |d: usize| "  ".repeat(d);
    let last = k.outer.len() - 1;
    let (steady, hoisted) = steady_masked_loads(k, body);
    for (j, s) in body.iter().enumerate() {
        if hoisted.contains(&j) {
            writeln!(out, "{}{}", pad(depth), e.stmt(s)?).unwrap();
        }
        if let Stmt::Load { dst, buf, index, mask: Some(m) } = s {
            if steady.contains(dst) {
                let st = storage_type(e.buf_dtype(*buf));
                let base = crate::c_emit::index(&steady_split(k, index).0);
                writeln!(out, "{}const {st}* restrict bz_p{dst} = t{m} ? b{buf} + ({base}) : (const {st}*)bz_zeros;", pad(depth)).unwrap();
            }
        }
    }
    if !pragma.is_empty() {
        writeln!(out, "{}{pragma}", pad(depth)).unwrap();
    }
    writeln!(out, "{}for (int64_t i{last} = {lo}; i{last} < {hi}; i{last}++) {{", pad(depth)).unwrap();
    for (j, s) in body.iter().enumerate() {
        match s {
            _ if hoisted.contains(&j) => {}
            Stmt::Load { dst, buf, index, mask: Some(m) } if steady.contains(dst) => {
                let ct = crate::dialect::compute_type(e.dt(*dst));
                let read = e.from_storage(*buf, &format!("bz_p{dst}[{}]", crate::c_emit::index(&steady_split(k, index).1)));
                writeln!(out, "{}{ct} t{dst} = {};", pad(depth + 1), crate::c_emit::sel(&format!("t{m}"), &read, &format!("({ct})0"), e.dt(*dst))).unwrap();
            }
            _ => writeln!(out, "{}{}", pad(depth + 1), e.stmt(s)?).unwrap(),
        }
    }
    writeln!(out, "{}}}", pad(depth)).unwrap();
    Ok(())
}

/// [Note: interior rows] Masks over the last dim of a pointwise kernel (a max pool's window
/// taps and its padding, `lo <= 2*i + k < hi`; the iota comparisons that pick a window's
/// argmax) are true on most of a row and false only near its ends. In NCHW that dim is W:
/// a masked tap then scales its index by the mask (`b[mask * index]`, branch-free) and GCC
/// gathers every vector. The row is split into its border and its interior, where each such
/// mask holding over at least half the row is known true: those statements become the
/// constant true, the masks left depend on outer dims only, and the interior's taps are
/// steady masked loads walking their row at a constant stride. Masks considered: `InRange`
/// of an index `a*i + r` (a > 0, r constant) within constant bounds, and comparisons of
/// such an iota with an integer constant. Rows are split only where such comparisons are
/// among them (a max pool that also picks its argmax, as training does): there, for
/// ResNet-18's pool (8 x 64 x 112 x 112 f32, NCHW, forward with offsets) 12.8 -> 6.2 ms
/// (eager 6.2); where only the taps' masks fold, the gathers were faster than the
/// interior's stride-2 walks at 16 lanes over 55 outputs (inference pool 2.2 -> 4.1 ms).
/// Returns (interior start, end, interior body), or None when no mask qualifies or the
/// interior is shorter than half the row (or 8). Rows whose masked taps load 16- or 8-bit
/// elements split too, argmax or not: x86 has no gather for them, and GCC loaded each lane
/// alone (a bf16 ResNet-18 stem's BatchNorm, ReLU and pool, 4 x 64 x 32 x 32 NCHW: 4.0 ->
/// 1.1 ms; the whole model under CPU autocast at b4 128² 16.2-16.6 -> 14.5 ms). So do rows
/// that load each buffer under a mask at most once (a pad: f32 8 x 64 x 112 x 112 padded
/// by (1, 1, 2, 0), 3.29 -> 0.83 ms, eager 1.71); a window's taps in f32 keep their gathers
/// (that pool 1.67 ms gathered, 3.79 split).
fn interior_rows(k: &Kernel, body: &[Stmt]) -> Option<(i64, i64, Vec<Stmt>)> {
    use braze_ir::{BinaryOp, Lit};
    let lastd = k.outer.len().checked_sub(1)?;
    if lastd == 0 {
        return None;
    }
    let n = k.outer[lastd].as_const()?;
    let v = lastd as u32;
    let affine = |e: &Expr| -> Option<(i64, i64)> {
        let a = e.linear_coef(v).filter(|&a| a > 0)?;
        Some((a, e.sub(&Expr::var(v).mul_c(a)).as_const()?))
    };
    // Where `lo <= a*i + r < hi` holds within [0, n).
    let interval = |(a, r): (i64, i64), lo: i64, hi: i64| ((lo - r).div_euclid(a) + i64::from((lo - r).rem_euclid(a) != 0)).max(0)..((hi - r - 1).div_euclid(a) + 1).min(n);
    let def: std::collections::HashMap<u32, &Stmt> = body.iter().filter_map(|s| s.dst().map(|t| (t, s))).collect();
    let iota = |t: &u32| match def.get(t) {
        Some(Stmt::Index { index, .. }) => affine(index),
        _ => None,
    };
    let int = |t: &u32| match def.get(t) {
        Some(Stmt::Const { value: Lit::I(c), .. }) => Some(*c),
        _ => None,
    };
    const FAR: i64 = i64::MAX / 4;
    let mut known = Vec::new();
    let mut iota_masks = false;
    for (j, s) in body.iter().enumerate() {
        let range = match s {
            Stmt::InRange { index, lo, hi, .. } => match (affine(index), lo.as_const(), hi.as_const()) {
                (Some(af), Some(lo), Some(hi)) => interval(af, lo, hi),
                _ => continue,
            },
            Stmt::Binary { op, a, b, .. } => {
                let (af, c, op) = match (iota(a), int(b), iota(b), int(a)) {
                    (Some(af), Some(c), _, _) => (af, c, *op),
                    (_, _, Some(af), Some(c)) => (af, c, match op {
                        BinaryOp::Ge => BinaryOp::Le,
                        BinaryOp::Gt => BinaryOp::Lt,
                        BinaryOp::Le => BinaryOp::Ge,
                        BinaryOp::Lt => BinaryOp::Gt,
                        o => *o,
                    }),
                    _ => continue,
                };
                let r = match op {
                    BinaryOp::Ge => interval(af, c, FAR),
                    BinaryOp::Gt => interval(af, c + 1, FAR),
                    BinaryOp::Lt => interval(af, -FAR, c),
                    BinaryOp::Le => interval(af, -FAR, c + 1),
                    _ => continue,
                };
                iota_masks = true;
                r
            }
            _ => continue,
        };
        if range.end - range.start >= (n + 1) / 2 {
            known.push((j, range));
        }
    }
    // Taps of 16- or 8-bit elements (a bf16 max pool) have no gather instruction to fall
    // back on: GCC loads them element by element, and the interior's strided walk wins. A
    // buffer loaded under a mask once (a pad, not a window of taps) splits in any dtype.
    let masked: Vec<u32> = body.iter().filter_map(|s| match s {
        Stmt::Load { buf, mask: Some(_), .. } => Some(*buf),
        _ => None,
    }).collect();
    let narrow_taps = masked.iter().any(|m| k.bufs.iter().any(|b| b.id == *m && b.dtype.size() < 4));
    let window = masked.iter().enumerate().any(|(i, m)| masked[..i].contains(m));
    if !iota_masks && !narrow_taps && (masked.is_empty() || window) {
        return None;
    }
    let lo = known.iter().map(|(_, r)| r.start).max()?;
    let hi = known.iter().map(|(_, r)| r.end).min()?;
    if hi - lo < (n + 1) / 2 || hi - lo < 8 {
        return None;
    }
    let mut inner = body.to_vec();
    for (j, _) in &known {
        if let Some(dst) = body[*j].dst() {
            inner[*j] = Stmt::Const { dst, value: Lit::B(true) };
        }
    }
    Some((lo, hi, inner))
}

/// [Note: row segments] A concatenation along the last dim of a pointwise kernel (the
/// channels of an Inception block's four branches, channels_last) masks each source with
/// `lo <= i + r < hi` over that dim. Vectorized as one row, every element evaluates every
/// source (a gather under its mask, the source's own BatchNorm and ReLU) and selects one;
/// a max pool of the concatenation does it per tap: GoogLeNet's `inception3a` and `3b` took
/// 16.4 ms on the 2-core build machine against eager's 7.3. The row is cut where such a mask
/// changes; on each piece every such mask is a constant, and the piece keeps only the
/// statements of the sources it does not rule out ([Note: known masks]): a DenseNet-121
/// layer's BatchNorm and ReLU over its block's 25 sources is 25 pieces of one load each.
/// Masks considered: `InRange` of `i + r` (unit stride along the last dim) within constant
/// bounds; applied when one of them holds on at most half the row (pads' masks, true on all
/// but a border, are [Note: interior rows]' business) and the pieces are at most 64. A
/// column kernel (a BatchNorm's statistics over a channels_last concatenation) cuts its
/// columns the same way ([`emit_column`]).
fn row_segments(k: &Kernel, body: &[Stmt]) -> Option<Vec<(i64, i64, Vec<Stmt>)>> {
    let lastd = k.outer.len().checked_sub(1)?;
    let n = k.outer[lastd].as_const()?;
    let pieces = concat_pieces(body.iter(), lastd as u32, n)?;
    Some(pieces.into_iter().map(|(a, b, known)| (a, b, braze_sched::loop_ir::fold_known(body, &known, &k.tmp_dtypes, &Default::default()))).collect())
}

/// The pieces of loop variable `v`'s range `[0, n)` that a concatenation's masks among
/// `stmts` cut it into ([Note: row segments]), each with those masks' values on it: masks
/// `InRange` of `i + r` (unit stride along `v`) within constant bounds. None unless one of
/// them holds on at most half the range and the pieces are at most 64.
fn concat_pieces<'a>(stmts: impl Iterator<Item = &'a Stmt>, v: u32, n: i64) -> Option<Vec<Piece>> {
    const MAX_PIECES: usize = 64;
    let masks: Vec<(u32, i64, i64)> = stmts
        .filter_map(|s| {
            let Stmt::InRange { dst, index, lo, hi } = s else { return None };
            if index.linear_coef(v) != Some(1) {
                return None;
            }
            let r = index.sub(&Expr::var(v)).as_const()?;
            // Where `lo <= i + r < hi` holds within [0, n).
            let (a, b) = ((lo.as_const()? - r).clamp(0, n), (hi.as_const()? - r).clamp(0, n));
            Some((*dst, a, b.max(a)))
        })
        .collect();
    if !masks.iter().any(|&(_, a, b)| b - a <= n / 2) {
        return None;
    }
    let mut cuts: Vec<i64> = masks.iter().flat_map(|&(_, a, b)| [a, b]).chain([0, n]).collect();
    cuts.sort_unstable();
    cuts.dedup();
    if cuts.len() - 1 > MAX_PIECES {
        return None;
    }
    Some(cuts.windows(2).filter(|w| w[0] < w[1]).map(|w| (w[0], w[1], masks.iter().map(|&(dst, a, b)| (dst, a <= w[0] && w[1] <= b)).collect())).collect())
}

/// A piece of a loop variable's range: (start, end, the masks' values on it).
type Piece = (i64, i64, Vec<(u32, bool)>);

/// Pseudo buffer ids of [Note: piece groups]' slots: `b{SLOT_BASE + n}` is a local pointer.
const SLOT_BASE: u32 = 4_000_000_000;

/// [Note: piece groups] The pieces of a concatenation ([Note: row segments]) differ in
/// which source they load and where in the row they are, and often in nothing else: a
/// DenseNet-121 layer's BatchNorm over its block's sources is one 256-channel piece and up
/// to 24 pieces of 32 channels, each a load of its own buffer. Emitted one by one, a
/// training graph's column kernels were 85,000 lines of C and 38 s of GCC (10 s before the
/// pieces). So each piece's kernel is put in a canonical form: its loop variable counts from
/// the piece's start, and each buffer access (buffer, constant term of its index) becomes a
/// slot. Pieces of one form share its code; a slot that differs among them is a pointer
/// (`b{SLOT_BASE + n}`) taken from a table per member, already offset by the access's
/// constant term. Kernels that store a buffer they also load, or index by a temporary (a
/// gather), are left ungrouped.
struct PieceGroup {
    /// (start, end) of each member along the loop variable.
    spans: Vec<(i64, i64)>,
    /// The shared code: the loop variable counts from a member's start.
    kernel: Kernel,
    /// Slots that differ among the members: (pseudo id, written, C pointer per member).
    slots: Vec<(u32, bool, Vec<String>)>,
}

/// `k` with its temporaries numbered in order of definition (the prelude's, then each
/// pass's body, reductions and `after`), so that kernels that differ only in which
/// temporaries they name compare equal.
fn renumber_tmps(k: &Kernel) -> Kernel {
    use std::collections::HashMap;
    let mut map: HashMap<u32, u32> = HashMap::new();
    let mut order: Vec<u32> = Vec::new();
    let mut def = |t: u32, map: &mut HashMap<u32, u32>| {
        if let std::collections::hash_map::Entry::Vacant(v) = map.entry(t) {
            v.insert(order.len() as u32);
            order.push(t);
        }
    };
    let defs = |l: &[Stmt]| l.iter().filter_map(Stmt::dst).collect::<Vec<_>>();
    let defined = defs(&k.prelude).into_iter().chain(k.passes.iter().flat_map(|p| defs(&p.body).into_iter().chain(p.reductions.iter().map(|r| r.dst)).chain(defs(&p.after))));
    for t in defined.collect::<Vec<_>>() {
        def(t, &mut map);
    }
    // Temporaries read but defined nowhere here keep numbers after the defined ones.
    let mut out = k.clone();
    let all_reads: Vec<u32> = k.stmts().flat_map(braze_sched::loop_ir::stmt_reads).chain(k.passes.iter().flat_map(|p| p.reductions.iter().map(|r| r.src))).collect();
    for t in all_reads {
        def(t, &mut map);
    }
    let m = |t: &mut u32| *t = map[t];
    // Index expressions name no temporaries here (`group_pieces` takes no such kernel).
    for s in out.stmts_mut() {
        match s {
            Stmt::Load { dst, mask, .. } => {
                m(dst);
                if let Some(t) = mask {
                    m(t);
                }
            }
            Stmt::Const { dst, .. } | Stmt::Index { dst, .. } | Stmt::InRange { dst, .. } => m(dst),
            Stmt::Random { dst, seed, .. } => {
                m(dst);
                m(seed);
            }
            Stmt::Unary { dst, a, .. } | Stmt::Cast { dst, a } | Stmt::Bounded { dst, a, .. } => {
                m(dst);
                m(a);
            }
            Stmt::Binary { dst, a, b, .. } => {
                m(dst);
                m(a);
                m(b);
            }
            Stmt::Where { dst, c, a, b } => {
                m(dst);
                m(c);
                m(a);
                m(b);
            }
            Stmt::Store { value, .. } => m(value),
        }
    }
    for r in out.passes.iter_mut().flat_map(|p| p.reductions.iter_mut()) {
        m(&mut r.dst);
        m(&mut r.src);
    }
    out.tmp_dtypes = order.iter().map(|&t| k.tmp_dtypes[t as usize]).collect();
    out
}

/// `pieces` (start, end, the kernel folded for the piece) of loop variable `v`'s range in
/// groups that share code ([Note: piece groups]), in order of their first member; None where
/// a kernel stores a buffer it loads.
fn group_pieces(v: u32, pieces: Vec<(i64, i64, Kernel)>) -> Option<Vec<PieceGroup>> {
    // A gathered index (a temporary inside an index expression) keeps its pieces apart.
    if pieces.iter().any(|(_, _, p)| p.index_exprs().iter().any(|e| {
        let mut ts = Vec::new();
        e.tmps(&mut ts);
        !ts.is_empty()
    })) {
        return None;
    }
    // (canonical kernel, members' spans, members' slot keys: (buffer, constant term)).
    type Form = (Kernel, Vec<(i64, i64)>, Vec<Vec<(u32, i64)>>);
    let mut groups: Vec<Form> = Vec::new();
    for (a, b, piece) in pieces {
        let mut c = renumber_tmps(&piece);
        c.map_index_exprs(&|e| e.subst_vars(&|n| if n == v { Expr::var(v).add(&Expr::constant(a)) } else { Expr::var(n) }));
        let mut keys: Vec<(u32, i64)> = Vec::new();
        let (mut loaded, mut stored) = (Vec::new(), Vec::new());
        for s in c.stmts_mut() {
            let (buf, index) = match s {
                Stmt::Load { buf, index, .. } => {
                    loaded.push(*buf);
                    (buf, index)
                }
                Stmt::Store { buf, index, .. } => {
                    stored.push(*buf);
                    (buf, index)
                }
                _ => continue,
            };
            let key = (*buf, index.const_term());
            let n = keys.iter().position(|k| *k == key).unwrap_or_else(|| {
                keys.push(key);
                keys.len() - 1
            });
            *index = index.sub(&Expr::constant(key.1));
            *buf = SLOT_BASE + n as u32;
        }
        if stored.iter().any(|b| loaded.contains(b)) {
            return None;
        }
        c.bufs = keys
            .iter()
            .enumerate()
            .map(|(n, (id, _))| {
                let r = piece.bufs.iter().find(|r| r.id == *id).expect("a kernel buffer");
                braze_sched::loop_ir::BufRef { id: SLOT_BASE + n as u32, dtype: r.dtype, written: stored.contains(id) }
            })
            .collect();
        match groups.iter_mut().find(|g| g.0 == c) {
            Some(g) => {
                g.1.push((a, b));
                g.2.push(keys);
            }
            None => groups.push((c, vec![(a, b)], vec![keys])),
        }
    }
    Some(
        groups
            .into_iter()
            .map(|(mut kernel, spans, members)| {
                // Slots every member fills alike are that buffer at that offset again.
                let n_slots = members[0].len();
                let same: Vec<bool> = (0..n_slots).map(|n| members.iter().all(|m| m[n] == members[0][n])).collect();
                for s in kernel.stmts_mut() {
                    if let Stmt::Load { buf, index, .. } | Stmt::Store { buf, index, .. } = s {
                        let n = (*buf - SLOT_BASE) as usize;
                        if same[n] {
                            let (id, c) = members[0][n];
                            *buf = id;
                            *index = index.add(&Expr::constant(c));
                        }
                    }
                }
                let mut slots = Vec::new();
                for (n, r) in kernel.bufs.iter_mut().enumerate() {
                    if same[n] {
                        r.id = members[0][n].0;
                    } else {
                        slots.push((r.id, r.written, members.iter().map(|m| format!("b{} + ({})", m[n].0, m[n].1)).collect()));
                    }
                }
                let len = spans.iter().map(|(a, b)| b - a).max().unwrap_or(0);
                kernel.outer[v as usize] = Expr::constant(len);
                PieceGroup { spans, kernel, slots }
            })
            .collect(),
    )
}

/// One group of a row's pieces ([Note: piece groups]) at indentation `depth`: its members
/// in turn, each with its slots' pointers.
fn emit_group_rows(g: &PieceGroup, e: &Emitter, out: &mut String, pragma: &str, depth: usize) -> Result<(), CodegenError> {
    let pad = |d: usize| "  ".repeat(d);
    let ge = Emitter { k: &g.kernel, d: e.d };
    let body = &g.kernel.passes[0].body;
    let m = g.spans.len();
    writeln!(out, "{}{{ /* {} */", pad(depth), g.spans.iter().map(|(a, b)| format!("{a}..{b}")).collect::<Vec<_>>().join(", ")).unwrap();
    if m == 1 {
        emit_row(&g.kernel, &ge, out, body, "0", &(g.spans[0].1 - g.spans[0].0).to_string(), pragma, depth + 1)?;
        writeln!(out, "{}}}", pad(depth)).unwrap();
        return Ok(());
    }
    writeln!(out, "{}static const int64_t bz_n[{m}] = {{{}}};", pad(depth + 1), g.spans.iter().map(|(a, b)| (b - a).to_string()).collect::<Vec<_>>().join(", ")).unwrap();
    for (id, written, ptrs) in &g.slots {
        let (c, t) = (if *written { "" } else { "const " }, storage_type(ge.buf_dtype(*id)));
        writeln!(out, "{}{c}{t}* const bz_p{id}[{m}] = {{{}}};", pad(depth + 1), ptrs.join(", ")).unwrap();
    }
    writeln!(out, "{}for (int64_t q = 0; q < {m}; q++) {{", pad(depth + 1)).unwrap();
    for (id, written, _) in &g.slots {
        let (c, t) = (if *written { "" } else { "const " }, storage_type(ge.buf_dtype(*id)));
        writeln!(out, "{}{c}{t}* restrict b{id} = bz_p{id}[q];", pad(depth + 2)).unwrap();
    }
    emit_row(&g.kernel, &ge, out, body, "0", "bz_n[q]", pragma, depth + 2)?;
    writeln!(out, "{}}}", pad(depth + 1)).unwrap();
    writeln!(out, "{}}}", pad(depth)).unwrap();
    Ok(())
}

/// The kernel's loop nest at indentation `depth`: parallel over its outer points, or
/// `serial` on the calling thread (no parallel region).
fn emit_loops(k: &Kernel, e: &Emitter, out: &mut String, serial: bool, depth: usize) -> Result<(), CodegenError> {
    let ix = crate::c_emit::index;
    let n_outer = k.outer.len();
    let parallel = |pragma: String| if serial { None } else { Some(pragma) };
    let reduction_kernel = !k.is_pointwise();
    let mut depth = depth;
    let pad = |d: usize| "  ".repeat(d);
    if !reduction_kernel {
        // Pointwise: parallel over all dims but the last, vectorized over the last.
        let body = &k.passes[0].body;
        if n_outer == 0 {
            for s in body {
                writeln!(out, "{}{}", pad(depth), e.stmt(s)?).unwrap();
            }
            return Ok(());
        }
        if let Some(plan) = crate::tiles::tile_plan(k).filter(|_| k.outer[n_outer - 1].as_const().is_none_or(|c| c > TILE_ROW_MIN)) {
            return emit_tiled_loops(k, e, out, plan.a, serial, depth);
        }
        if let Some(a) = inner_dim(k) {
            return emit_swapped_loops(k, e, out, a, serial, depth);
        }
        for (i, size) in k.outer.iter().enumerate().take(n_outer.saturating_sub(1)) {
            if i == 0 {
                let pragma = if n_outer > 2 { format!("#pragma omp parallel for collapse({}) schedule(static)", n_outer - 1) } else { "#pragma omp parallel for schedule(static)".to_string() };
                if let Some(pragma) = parallel(pragma) {
                    writeln!(out, "{}{pragma}", pad(depth)).unwrap();
                }
            }
            writeln!(out, "{}for (int64_t i{i} = 0; i{i} < {}; i{i}++) {{", pad(depth), ix(size)).unwrap();
            depth += 1;
        }
        // The last dim: one row, or pieces of it, each in a block of its own (its hoisted
        // masks and row pointers): a concatenation's sources ([Note: row segments]) or a
        // row's border and interior ([Note: interior rows]).
        let simd = if wide_load_group(body, (n_outer - 1) as u32) { "" } else { " simd" };
        let row_pragma = if n_outer == 1 && !serial { format!("#pragma omp parallel for{simd} schedule(static)") } else if simd.is_empty() { String::new() } else { "#pragma omp simd".to_string() };
        let n = k.outer.last().map(ix).unwrap_or_default();
        let segments = row_segments(k, body);
        let with_body = |b: Vec<Stmt>| {
            let mut pk = k.clone();
            pk.passes[0].body = b;
            pk
        };
        let groups = segments.clone().and_then(|p| group_pieces((n_outer - 1) as u32, p.into_iter().map(|(a, b, body)| (a, b, with_body(body))).collect()));
        if let Some(groups) = groups {
            for g in &groups {
                emit_group_rows(g, e, out, &row_pragma, depth)?;
            }
            for _ in 1..n_outer {
                depth -= 1;
                writeln!(out, "{}}}", pad(depth)).unwrap();
            }
            return Ok(());
        }
        let pieces = segments.or_else(|| {
            let (lo, hi, inner) = interior_rows(k, body)?;
            let end = k.outer.last().and_then(Expr::as_const)?; // (a split row's length is constant)
            let mut v = Vec::new();
            if lo > 0 {
                v.push((0, lo, body.to_vec()));
            }
            v.push((lo, hi, inner));
            if hi < end {
                v.push((hi, end, body.to_vec()));
            }
            Some(v)
        });
        match pieces {
            Some(pieces) => {
                for (lo, hi, piece) in &pieces {
                    writeln!(out, "{}{{", pad(depth)).unwrap();
                    emit_row(k, e, out, piece, &lo.to_string(), &hi.to_string(), &row_pragma, depth + 1)?;
                    writeln!(out, "{}}}", pad(depth)).unwrap();
                }
            }
            None => emit_row(k, e, out, body, "0", &n, &row_pragma, depth)?,
        }
        for _ in 1..n_outer {
            depth -= 1;
            writeln!(out, "{}}}", pad(depth)).unwrap();
        }
        return Ok(());
    }
    if k.column && n_outer > 0 {
        return emit_column(k, e, out, parallel("#pragma omp parallel for schedule(static)".to_string()));
    }
    // Reduction: parallel over outer points; per point, passes over the inner dims.
    for (i, size) in k.outer.iter().enumerate() {
        if i == 0 {
            let c = if n_outer > 1 { format!(" collapse({n_outer})") } else { String::new() };
            if let Some(pragma) = parallel(format!("#pragma omp parallel for{c} schedule(static)")) {
                writeln!(out, "{}{pragma}", pad(depth)).unwrap();
            }
        }
        writeln!(out, "{}for (int64_t i{i} = 0; i{i} < {}; i{i}++) {{", pad(depth), ix(size)).unwrap();
        depth += 1;
    }
    for s in &k.prelude {
        writeln!(out, "{}{}", pad(depth), e.stmt(s)?).unwrap();
    }
    for p in &k.passes {
        if use_chunks(k, p, e) {
            emit_chunked_welford(k, p, e, out, depth)?;
            continue;
        }
        if use_lanes(k, p, e) {
            emit_lanes_pass(k, p, e, out, depth)?;
            continue;
        }
        for r in &p.reductions {
            for l in e.simd_red_init(r) {
                writeln!(out, "{}{l}", pad(depth)).unwrap();
            }
        }
        let n_inner = k.inner.len();
        for (j, size) in k.inner.iter().enumerate() {
            if j + 1 == n_inner {
                if let Some(clause) = e.simd_clause(&p.reductions) {
                    writeln!(out, "{}#pragma omp simd{clause}", pad(depth)).unwrap();
                }
            }
            let v = n_outer + j;
            writeln!(out, "{}for (int64_t i{v} = 0; i{v} < {}; i{v}++) {{", pad(depth), ix(size)).unwrap();
            depth += 1;
        }
        if n_inner == 0 {
            writeln!(out, "{}{{", pad(depth)).unwrap();
            depth += 1;
        }
        for s in &p.body {
            writeln!(out, "{}{}", pad(depth), e.stmt(s)?).unwrap();
        }
        for r in &p.reductions {
            writeln!(out, "{}{}", pad(depth), e.simd_red_update(r)).unwrap();
        }
        for _ in 0..n_inner.max(1) {
            depth -= 1;
            writeln!(out, "{}}}", pad(depth)).unwrap();
        }
        emit_pass_end(p, out, &pad(depth), |r| e.simd_red_final(r), e)?;
    }
    for _ in 0..n_outer {
        depth -= 1;
        writeln!(out, "{}}}", pad(depth)).unwrap();
    }
    Ok(())
}

/// [Note: wide load groups] Loads of one buffer that move along a loop's variable by the
/// same stride form an interleaved group for GCC's vectorizer, the stride its size; under
/// `omp simd` (vectorize regardless of cost) GCC 12 vectorizes a group of two neighbouring
/// elements 4096 floats apart by loading and permuting the whole group, a function so large
/// that its register allocation took 26 s (an 8 x 8 average pool of an NCHW activation stored
/// channels_last: 64 such loads, 91 s; 0.3 s at a stride of 256, 0.06 s without the pragma,
/// when GCC's cost model declines to vectorize the loop). Such loops get no `omp simd`.
const SIMD_GROUP_STRIDE_MAX: i64 = 256;

/// Whether two loads of one buffer in `body` move along `var` by the same stride wider than
/// [`SIMD_GROUP_STRIDE_MAX`] ([Note: wide load groups]).
fn wide_load_group(body: &[Stmt], var: u32) -> bool {
    let mut seen = std::collections::HashSet::new();
    body.iter().any(|s| match s {
        Stmt::Load { buf, index, .. } => index.linear_coef(var).is_some_and(|c| c.abs() > SIMD_GROUP_STRIDE_MAX && !seen.insert((*buf, c))),
        _ => false,
    })
}

/// Side of a CPU tile ([Note: tiled transposes] in cuda.rs).
const TILE: i64 = 32;
/// Rows of at most this many elements are not tiled: the lines one row's transposed loads
/// touch (a line per element) fit in L1 and serve the next rows (NCHW laid out channels_last
/// with 64 channels, 32x64x56x56 f32 on two cores: 1.02 ms tiled, 0.61 untiled, in runs where
/// Inductor took 0.49 and 0.45).
const TILE_ROW_MIN: i64 = 256;

/// A pointwise kernel whose loads walk dim `a` where its stores walk the last dim
/// (`tiles::tile_plan`): the two dims are blocked into `TILE` x `TILE` tiles, the tiles spread
/// over the threads with the other dims, so a tile's reads along `a` and its stores along the
/// last dim each touch a few cache lines, read whole while they stay in L1 (a 4096 x 4096 f32
/// transpose made contiguous, row by row, missed a line per element read: 71 ms on two cores,
/// eager 37, Inductor 23).
fn emit_tiled_loops(k: &Kernel, e: &Emitter, out: &mut String, a: usize, serial: bool, depth: usize) -> Result<(), CodegenError> {
    let ix = crate::c_emit::index;
    let n = k.outer.len();
    let last = n - 1;
    let others: Vec<usize> = (0..n).filter(|&d| d != a && d != last).collect();
    let pad = |d: usize| "  ".repeat(d);
    let mut depth = depth;
    if !serial {
        writeln!(out, "{}#pragma omp parallel for collapse({}) schedule(static)", pad(depth), others.len() + 2).unwrap();
    }
    for &d in &others {
        writeln!(out, "{}for (int64_t i{d} = 0; i{d} < {}; i{d}++) {{", pad(depth), ix(&k.outer[d])).unwrap();
        depth += 1;
    }
    let (na, nb) = (ix(&k.outer[a]), ix(&k.outer[last]));
    writeln!(out, "{}for (int64_t ta = 0; ta < {na}; ta += {TILE}) {{", pad(depth)).unwrap();
    writeln!(out, "{}  for (int64_t tb = 0; tb < {nb}; tb += {TILE}) {{", pad(depth)).unwrap();
    writeln!(out, "{}    const int64_t ea = ta + {TILE} < {na} ? ta + {TILE} : {na}, eb = tb + {TILE} < {nb} ? tb + {TILE} : {nb};", pad(depth)).unwrap();
    writeln!(out, "{}    for (int64_t i{a} = ta; i{a} < ea; i{a}++) {{", pad(depth)).unwrap();
    if !wide_load_group(&k.passes[0].body, last as u32) {
        writeln!(out, "{}      #pragma omp simd", pad(depth)).unwrap();
    }
    writeln!(out, "{}      for (int64_t i{last} = tb; i{last} < eb; i{last}++) {{", pad(depth)).unwrap();
    for s in &k.passes[0].body {
        writeln!(out, "{}        {}", pad(depth), e.stmt(s)?).unwrap();
    }
    writeln!(out, "{p}      }}\n{p}    }}\n{p}  }}\n{p}}}", p = pad(depth)).unwrap();
    for _ in &others {
        depth -= 1;
        writeln!(out, "{}}}", pad(depth)).unwrap();
    }
    Ok(())
}

/// [Note: inner dim by stride] A pointwise kernel that reads or writes values of two layouts
/// (a BatchNorm + residual + ReLU between a channels_last convolution and one in eager's
/// layout: the residual and one result channels_last, the convolution's result and the other
/// NCHW) walks one of them with a stride in its inner loop. Rows too short to tile
/// (`TILE_ROW_MIN`) run another dim innermost where that makes the stores' largest stride a
/// quarter or less of what it is along the last dim, or leaves the stores' at most as strided
/// and does so for the loads. Strided stores cost most: over 4×1024×8×8 f32 on two cores, an
/// NCHW -> channels_last copy with the last dim innermost took 0.88 ms (its stores 4 KiB
/// apart, every line in one L1 set), with the channels innermost 0.08; that BatchNorm kernel
/// 1.40 -> 0.29 ms; a kernel with one channels_last load and two NCHW stores was faster as
/// it was (0.24 against 0.31 swapped).
fn inner_dim(k: &Kernel) -> Option<usize> {
    let n = k.outer.len();
    if n < 2 || k.passes.len() != 1 || k.outer[n - 1].as_const().is_none_or(|c| c > TILE_ROW_MIN) {
        return None;
    }
    let last = n - 1;
    let mut loads: Vec<&Expr> = Vec::new();
    let mut stores: Vec<&Expr> = Vec::new();
    for s in &k.passes[0].body {
        match s {
            Stmt::Load { index, mask: None, .. } if !crate::cuda::mentions_tmp(index) => loads.push(index),
            Stmt::Store { index, .. } if !crate::cuda::mentions_tmp(index) => stores.push(index),
            _ => {}
        }
    }
    // The largest stride (elements) along dim `d` of these accesses that move along it but
    // not by one; None where an index is not linear in it.
    let widest = |xs: &[&Expr], d: usize| -> Option<i64> {
        xs.iter().try_fold(0, |m, ix| ix.linear_coef(d as u32).map(|c| if c == 0 || c == 1 { m } else { m.max(c.abs()) }))
    };
    let (store_last, load_last) = (widest(&stores, last)?, widest(&loads, last)?);
    let big = |d: usize| k.outer[d].as_const().is_some_and(|c| c >= crate::tiles::TILE_MIN_DIM);
    (0..last)
        .filter(|&d| big(d) && loads.iter().chain(&stores).any(|ix| ix.linear_coef(d as u32) == Some(1)))
        .filter_map(|d| Some((widest(&stores, d)?, widest(&loads, d)?, d)))
        .filter(|&(s, l, _)| (store_last > 0 && s * 4 <= store_last) || (s <= store_last && load_last > 0 && l * 4 <= load_last))
        .min()
        .map(|(_, _, d)| d)
}

/// A pointwise kernel's loops with dim `a` innermost ([Note: inner dim by stride]): parallel
/// over the other dims, vectorized over `a`.
fn emit_swapped_loops(k: &Kernel, e: &Emitter, out: &mut String, a: usize, serial: bool, depth: usize) -> Result<(), CodegenError> {
    let ix = crate::c_emit::index;
    let others: Vec<usize> = (0..k.outer.len()).filter(|&d| d != a).collect();
    let pad = |d: usize| "  ".repeat(d);
    let mut depth = depth;
    if !serial {
        let collapse = if others.len() > 1 { format!(" collapse({})", others.len()) } else { String::new() };
        writeln!(out, "{}#pragma omp parallel for{collapse} schedule(static)", pad(depth)).unwrap();
    }
    for &d in &others {
        writeln!(out, "{}for (int64_t i{d} = 0; i{d} < {}; i{d}++) {{", pad(depth), ix(&k.outer[d])).unwrap();
        depth += 1;
    }
    if !wide_load_group(&k.passes[0].body, a as u32) {
        writeln!(out, "{}#pragma omp simd", pad(depth)).unwrap();
    }
    writeln!(out, "{}for (int64_t i{a} = 0; i{a} < {}; i{a}++) {{", pad(depth), ix(&k.outer[a])).unwrap();
    for s in &k.passes[0].body {
        writeln!(out, "{}  {}", pad(depth), e.stmt(s)?).unwrap();
    }
    writeln!(out, "{}}}", pad(depth)).unwrap();
    for _ in &others {
        depth -= 1;
        writeln!(out, "{}}}", pad(depth)).unwrap();
    }
    Ok(())
}

/// Elements per chunk of a chunked Welford pass ([Note: chunked Welford]).
const CHUNK: i64 = 256;

/// Whether a reduction pass runs as a chunked Welford pass: its reductions are variances
/// (Welford) and sums, at least one variance, over one reduced dim not known to be short.
fn use_chunks(k: &Kernel, p: &braze_sched::loop_ir::Pass, e: &Emitter) -> bool {
    let Some(last) = k.inner.last() else { return false };
    p.reductions.iter().any(|r| r.kind == ReduceKind::Var)
        && p.reductions.iter().all(|r| (r.kind == ReduceKind::Var && e.dt(r.src).is_float()) || r.kind == ReduceKind::Sum)
        && crate::c_emit::index(last).parse::<i64>().map_or(true, |n| n >= LANES)
}

/// A pass of variances as chunks merged into Welford states.
///
/// [Note: chunked Welford] Per chunk of up to `CHUNK` elements of the row: one vector loop
/// computes the pass's body, keeps each reduced value in a chunk array and sums it (an `omp
/// simd` sum: registers, no division), a second sums the squared deviations from the chunk's
/// mean, and the chunk's (mean, M2, count) is merged into the running state by Chan et al.'s
/// formula, as [Note: lanes] merges its lanes. Over several reduced dims (BatchNorm's
/// statistics of NCHW: N, then H*W) the outer ones loop around the chunks of the innermost
/// (`var(dim=(0, 2))` of 16 x 256 x 1024 f32 on one core: 1.01 ms through the lanes, 0.93
/// chunked). Sums of the same pass accumulate in the first
/// loop (LayerNorm's backward fuses its sums with the forward's recomputed statistics). Welford's per-element update divides by the
/// count, and in the per-lane arrays GCC kept the states in memory: `var(-1)` of 4096 x 1024
/// f32 on one core of the build machine took 1.12 ms (Inductor 0.52).
fn emit_chunked_welford(k: &Kernel, p: &braze_sched::loop_ir::Pass, e: &Emitter, out: &mut String, depth: usize) -> Result<(), CodegenError> {
    let pad = |d: usize| "  ".repeat(d);
    let n_inner = k.inner.len();
    let v = k.outer.len() + n_inner - 1;
    let size = crate::c_emit::index(&k.inner[n_inner - 1]);
    for r in &p.reductions {
        for l in e.red_init(r) {
            writeln!(out, "{}{l}", pad(depth)).unwrap();
        }
    }
    let (vars, plain): (Vec<_>, Vec<_>) = p.reductions.iter().partition(|r| r.kind == ReduceKind::Var);
    // The pass's plain sums add each chunk's sum into a double: a float total over 98 chunks
    // made a BatchNorm mean over 2 x 112 x 112 points 1.6e-6 from float64's (ATen's 5.4e-8),
    // and VOLO's stem gradients 100 times eager's error against float64.
    for r in &plain {
        writeln!(out, "{}double bz_d{} = 0;", pad(depth), r.dst).unwrap();
    }
    let outer_depth = depth;
    let mut depth = depth;
    for (j, n) in k.inner[..n_inner - 1].iter().enumerate() {
        let i = k.outer.len() + j;
        writeln!(out, "{}for (int64_t i{i} = 0; i{i} < {}; i{i}++) {{", pad(depth), crate::c_emit::index(n)).unwrap();
        depth += 1;
    }
    let q = pad(depth + 1);
    writeln!(out, "{}for (int64_t bz_ib = 0; bz_ib < {size}; bz_ib += {CHUNK}) {{", pad(depth)).unwrap();
    writeln!(out, "{q}const int64_t bz_n = ({size}) - bz_ib < {CHUNK} ? ({size}) - bz_ib : {CHUNK};").unwrap();
    let ct = |r: &braze_sched::loop_ir::Reduction| crate::dialect::compute_type(e.dt(r.src));
    // The pass's sums accumulate across chunks as they are; each variance sums its chunk.
    let sums: Vec<String> = vars.iter().map(|r| format!("bz_s{}", r.dst)).chain(plain.iter().map(|r| format!("a{}", r.dst))).collect();
    for r in &vars {
        writeln!(out, "{q}{t} bz_c{n}[{CHUNK}]; {t} bz_s{n} = 0, bz_q{n} = 0;", t = ct(r), n = r.dst).unwrap();
    }
    // Each plain sum's chunk total, under the sum's own name.
    for r in &plain {
        for l in e.red_init(r) {
            writeln!(out, "{q}{l}").unwrap();
        }
    }
    writeln!(out, "{q}#pragma omp simd reduction(+:{})", sums.join(",")).unwrap();
    writeln!(out, "{q}for (int64_t bz_l = 0; bz_l < bz_n; bz_l++) {{").unwrap();
    writeln!(out, "{q}  const int64_t i{v} = bz_ib + bz_l;").unwrap();
    for s in &p.body {
        writeln!(out, "{q}  {}", e.stmt(s)?).unwrap();
    }
    for r in &vars {
        writeln!(out, "{q}  bz_c{n}[bz_l] = t{s}; bz_s{n} += t{s};", n = r.dst, s = r.src).unwrap();
    }
    for r in &plain {
        writeln!(out, "{q}  {}", e.red_update(r)).unwrap();
    }
    writeln!(out, "{q}}}").unwrap();
    for r in &plain {
        writeln!(out, "{q}bz_d{n} += (double)a{n};", n = r.dst).unwrap();
    }
    for r in &vars {
        let (n, t) = (r.dst, ct(r));
        writeln!(out, "{q}const {t} bz_m{n} = bz_s{n} / ({t})bz_n;").unwrap();
        writeln!(out, "{q}#pragma omp simd reduction(+:bz_q{n})").unwrap();
        writeln!(out, "{q}for (int64_t bz_l = 0; bz_l < bz_n; bz_l++) {{ const {t} d = bz_c{n}[bz_l] - bz_m{n}; bz_q{n} += d * d; }}").unwrap();
        // The chunk's state merged as a lane's is (Chan et al.).
        let chunk = |state: &str| match &state[..2] {
            "wm" => format!("bz_m{n}"),
            "wq" => format!("bz_q{n}"),
            _ => "bz_n".to_string(),
        };
        writeln!(out, "{q}{}", e.red_combine(r, &chunk)).unwrap();
    }
    writeln!(out, "{}}}", pad(depth)).unwrap();
    while depth > outer_depth {
        depth -= 1;
        writeln!(out, "{}}}", pad(depth)).unwrap();
    }
    for r in &plain {
        writeln!(out, "{}a{n} = bz_d{n};", pad(depth), n = r.dst).unwrap();
    }
    emit_pass_end(p, out, &pad(depth), |r| e.red_final(r), e)
}

/// A reduction pass's end: each result (`fin`), then the pass's `after` statements.
fn emit_pass_end(
    p: &braze_sched::loop_ir::Pass,
    out: &mut String,
    q: &str,
    fin: impl Fn(&braze_sched::loop_ir::Reduction) -> String,
    e: &Emitter,
) -> Result<(), CodegenError> {
    for r in &p.reductions {
        writeln!(out, "{q}{}", fin(r)).unwrap();
    }
    for s in &p.after {
        writeln!(out, "{q}{}", e.stmt(s)?).unwrap();
    }
    Ok(())
}

/// Lanes of a blocked row reduction: partial states per lane, updated by a vector loop over
/// `LANES` neighbouring elements (several vector registers: independent chains).
const LANES: i64 = 32;

/// Whether a reduction pass runs as a blocked reduction over lanes: when some reduction has
/// no OpenMP reduction clause (argmax, argmin, any, all, variance, max of bools) and the
/// innermost reduced dim is not known to be short. Sums, products, max and min alone keep
/// `omp simd reduction` ([Note: simd max]).
fn use_lanes(k: &Kernel, p: &braze_sched::loop_ir::Pass, e: &Emitter) -> bool {
    let Some(last) = k.inner.last() else { return false };
    if p.reductions.is_empty() || e.simd_clause(&p.reductions).is_some() {
        return false;
    }
    crate::c_emit::index(last).parse::<i64>().map_or(true, |n| n >= LANES)
}

/// A reduction pass as a blocked reduction ([Note: lanes]).
///
/// [Note: lanes] GCC vectorizes a loop-carried max only as an OpenMP/`MAX_EXPR` reduction,
/// which loses NaN (eager's max returns NaN if any element is), and never vectorizes an
/// argmax's conditional pair update or Welford's update. So each reduction keeps `LANES`
/// partial states in arrays; the innermost reduced dim is walked in blocks of `LANES`
/// elements, lane `l` taking element `l` of each block (a loop GCC vectorizes: lanes do not
/// depend on each other), the ragged end goes to the first lanes, and after the loops the
/// lanes are folded into one state in lane order (`Emitter::red_combine`), which keeps NaN
/// propagation, first-index ties and Welford's accuracy (Chan's merge).
fn emit_lanes_pass(k: &Kernel, p: &braze_sched::loop_ir::Pass, e: &Emitter, out: &mut String, depth: usize) -> Result<(), CodegenError> {
    let ix = crate::c_emit::index;
    let pad = |d: usize| "  ".repeat(d);
    let n_outer = k.outer.len();
    let n_inner = k.inner.len();
    let states: Vec<(&str, String)> = p.reductions.iter().flat_map(|r| e.red_state(r)).collect();
    for r in &p.reductions {
        for l in e.red_init(r) {
            writeln!(out, "{}{l}", pad(depth)).unwrap();
        }
    }
    for (t, n) in &states {
        writeln!(out, "{}{t} {n}_v[{LANES}];", pad(depth)).unwrap();
    }
    let init: Vec<String> = states.iter().map(|(_, n)| format!("{n}_v[bz_l] = {n};")).collect();
    writeln!(out, "{}for (int64_t bz_l = 0; bz_l < {LANES}; bz_l++) {{ {} }}", pad(depth), init.join(" ")).unwrap();
    let mut d = depth;
    for (j, size) in k.inner[..n_inner - 1].iter().enumerate() {
        let v = n_outer + j;
        writeln!(out, "{}for (int64_t i{v} = 0; i{v} < {}; i{v}++) {{", pad(d), ix(size)).unwrap();
        d += 1;
    }
    let v = n_outer + n_inner - 1;
    let size = ix(&k.inner[n_inner - 1]);
    writeln!(out, "{}{{", pad(d)).unwrap();
    writeln!(out, "{}const int64_t bz_bn = ({size}) - ({size}) % {LANES};", pad(d + 1)).unwrap();
    // The full blocks, then the ragged end.
    for (lo, count, outer_loop) in [("bz_ib", LANES.to_string(), true), ("bz_bn", format!("({size}) - bz_bn"), false)] {
        let mut dd = d + 1;
        if outer_loop {
            writeln!(out, "{}for (int64_t bz_ib = 0; bz_ib < bz_bn; bz_ib += {LANES}) {{", pad(dd)).unwrap();
            dd += 1;
        }
        writeln!(out, "{}#pragma omp simd", pad(dd)).unwrap();
        writeln!(out, "{}for (int64_t bz_l = 0; bz_l < {count}; bz_l++) {{", pad(dd)).unwrap();
        emit_lane_body(out, &pad(dd + 1), &format!("const int64_t i{v} = {lo} + bz_l;"), "bz_l", "_v", &states, p, e, |r| e.red_update_lane(r))?;
        writeln!(out, "{}}}", pad(dd)).unwrap();
        if outer_loop {
            writeln!(out, "{}}}", pad(dd - 1)).unwrap();
        }
    }
    writeln!(out, "{}}}", pad(d)).unwrap();
    for _ in 0..n_inner - 1 {
        d -= 1;
        writeln!(out, "{}}}", pad(d)).unwrap();
    }
    writeln!(out, "{}for (int64_t bz_l = 0; bz_l < {LANES}; bz_l++) {{", pad(depth)).unwrap();
    for r in &p.reductions {
        writeln!(out, "{}{}", pad(depth + 1), e.red_combine(r, &|n| format!("{n}_v[bz_l]"))).unwrap();
    }
    writeln!(out, "{}}}", pad(depth)).unwrap();
    emit_pass_end(p, out, &pad(depth), |r| e.red_final(r), e)
}

/// The body of a vector loop over `lane` (lanes of a blocked reduction, columns of a column
/// kernel): the loop variable (`var`), each reduction state read from its array slot (arrays
/// `{state}{arr}`), the pass's statements and `update`s, the states written back.
#[allow(clippy::too_many_arguments)]
fn emit_lane_body(
    out: &mut String,
    q: &str,
    var: &str,
    lane: &str,
    arr: &str,
    states: &[(&str, String)],
    p: &braze_sched::loop_ir::Pass,
    e: &Emitter,
    update: impl Fn(&braze_sched::loop_ir::Reduction) -> String,
) -> Result<(), CodegenError> {
    writeln!(out, "{q}{var}").unwrap();
    for (t, n) in states {
        writeln!(out, "{q}{t} {n} = {n}{arr}[{lane}];").unwrap();
    }
    for s in &p.body {
        writeln!(out, "{q}{}", e.stmt(s)?).unwrap();
    }
    for r in &p.reductions {
        writeln!(out, "{q}{}", update(r)).unwrap();
    }
    for (_, n) in states {
        writeln!(out, "{q}{n}{arr}[{lane}] = {n};").unwrap();
    }
    Ok(())
}

/// Columns of a column kernel handled together (the vector loop's length).
const COL_CHUNK: i64 = 64;
/// Chunks a column kernel is cut into at least, where its sizes are known, so that its
/// threads share the work ([`col_width`]).
const MIN_COL_CHUNKS: i64 = 8;

/// Columns per chunk of a column kernel, given its number of chunks at a width (None where
/// sizes are symbolic).
///
/// [Note: column chunk width] A column kernel's threads take whole chunks: a channels_last
/// BatchNorm over 64 channels was one chunk of 64 columns, run by one thread while the others
/// waited, and a concatenation's chunks of 64 and 32 columns split 160 : 96 between two
/// threads (DenseNet-121's training step on the 2-core machine: braze's kernels 3 : 1 between
/// its two threads). The width is halved, down to 16 columns (two AVX2 or one AVX-512 vector),
/// while the kernel would have fewer than `MIN_COL_CHUNKS` chunks. Each column's reduction runs
/// in the same order at any width, so results do not depend on it.
fn col_width(chunks: impl Fn(i64) -> Option<i64>) -> i64 {
    let mut width = COL_CHUNK;
    while width > 16 && chunks(width).is_some_and(|n| n < MIN_COL_CHUNKS) {
        width /= 2;
    }
    width
}

/// Rows a column sum adds into a partial sum of its own ([Note: column sums in blocks]).
const COL_SUM_BLOCK: i64 = 256;

/// A column kernel (the fastest dim is kept, e.g. BatchNorm's statistics and backward in
/// channels_last): per chunk of the last outer dim, each pass walks the reduced dims in order
/// with a vector loop over neighbouring columns, the chunk's accumulators held in arrays.
/// Values of an outer point (the prelude's, the reductions' results, the `after`
/// statements') are per column too: arrays `tN_v`, written in a loop over the chunk after
/// they are computed and read back by later passes. Before, a kernel of several passes
/// walked each column alone with a stride of the row length (BatchNorm backward of a
/// ResNet-50 in channels_last: 10–20 ms per kernel at batch 2 on the 2-core machine).
/// `pragma`: the parallel-for pragma of the column loop (None: the kernel runs serially).
fn emit_column(k: &Kernel, e: &Emitter, out: &mut String, pragma: Option<String>) -> Result<(), CodegenError> {
    let ix = crate::c_emit::index;
    let n_outer = k.outer.len();
    let last = n_outer - 1;
    let c = ix(&k.outer[last]);
    let lead = product(&k.outer[..last]);
    // A concatenation along the columns ([Note: row segments]): chunks that stay within
    // one source, each group of pieces running the kernel folded for it, with its members'
    // pointers ([Note: piece groups]).
    let groups = k.outer[last].as_const().and_then(|n| concat_pieces(k.stmts(), last as u32, n)).and_then(|pieces| {
        group_pieces(last as u32, pieces.into_iter().map(|(a, b, known)| (a, b, braze_sched::loop_ir::fold_known_kernel(k, &known))).collect())
    });
    let width = col_width(|w| {
        let per_lead = match &groups {
            Some(groups) => Some(groups.iter().flat_map(|g| g.spans.iter()).map(|&(a, b)| (b - a + w - 1) / w).sum::<i64>()),
            None => k.outer[last].as_const().map(|c| (c + w - 1) / w),
        };
        Some(per_lead? * lead.as_const()?)
    });
    match &groups {
        Some(groups) => {
            // Chunks: (start within the member, columns, group, member).
            let chunks: Vec<[i64; 4]> = groups
                .iter()
                .enumerate()
                .flat_map(|(gi, g)| g.spans.iter().enumerate().flat_map(move |(q, &(a, b))| (0..b - a).step_by(width as usize).map(move |cb| [cb, (b - a - cb).min(width), gi as i64, q as i64])))
                .collect();
            for (f, name) in ["bz_cb", "bz_cn", "bz_group", "bz_member"].iter().enumerate() {
                writeln!(out, "  static const int32_t {name}[{}] = {{{}}};", chunks.len(), chunks.iter().map(|ch| ch[f].to_string()).collect::<Vec<_>>().join(", ")).unwrap();
            }
            for (gi, g) in groups.iter().enumerate() {
                for (id, written, ptrs) in &g.slots {
                    let (c, t) = (if *written { "" } else { "const " }, storage_type(Emitter { k: &g.kernel, d: e.d }.buf_dtype(*id)));
                    writeln!(out, "  {c}{t}* const bz_g{gi}_p{id}[{}] = {{{}}};", ptrs.len(), ptrs.join(", ")).unwrap();
                }
            }
            writeln!(out, "  const int64_t nch = {};", chunks.len()).unwrap();
        }
        None => writeln!(out, "  const int64_t nch = ({c} + {width} - 1) / {width};").unwrap(),
    }
    if let Some(pragma) = pragma {
        writeln!(out, "  {pragma}").unwrap();
    }
    writeln!(out, "  for (int64_t x = 0; x < {} * nch; x++) {{", ix(&lead)).unwrap();
    if groups.is_some() {
        writeln!(out, "    const int64_t cb = bz_cb[x % nch];").unwrap();
        writeln!(out, "    const int64_t cn = bz_cn[x % nch];").unwrap();
    } else {
        writeln!(out, "    const int64_t cb = (x % nch) * {width};").unwrap();
        writeln!(out, "    const int64_t cn = {c} - cb < {width} ? {c} - cb : {width};").unwrap();
    }
    let mut rest = "(x / nch)".to_string();
    for d in (0..last).rev() {
        let size = ix(&k.outer[d]);
        if d == 0 {
            writeln!(out, "    const int64_t i{d} = {rest};").unwrap();
        } else {
            writeln!(out, "    const int64_t i{d} = {rest} % ({size});").unwrap();
            rest = format!("({rest} / ({size}))");
        }
    }
    match &groups {
        Some(groups) => {
            writeln!(out, "    switch (bz_group[x % nch]) {{").unwrap();
            for (gi, g) in groups.iter().enumerate() {
                let ge = Emitter { k: &g.kernel, d: e.d };
                let mut chunk = String::new();
                for (id, written, _) in &g.slots {
                    let (c, t) = (if *written { "" } else { "const " }, storage_type(ge.buf_dtype(*id)));
                    writeln!(chunk, "    {c}{t}* restrict b{id} = bz_g{gi}_p{id}[bz_member[x % nch]];").unwrap();
                }
                emit_column_chunk(&g.kernel, &ge, &mut chunk)?;
                writeln!(out, "    case {gi}: {{ /* columns {} */", g.spans.iter().map(|(a, b)| format!("{a}..{b}")).collect::<Vec<_>>().join(", ")).unwrap();
                for line in chunk.lines() {
                    writeln!(out, "    {line}").unwrap();
                }
                writeln!(out, "    }} break;").unwrap();
            }
            writeln!(out, "    }}").unwrap();
        }
        None => emit_column_chunk(k, e, out)?,
    }
    writeln!(out, "  }}").unwrap();
    Ok(())
}

/// The body of [`emit_column`]'s loop: one chunk of `cn` columns from `cb` (C variables
/// defined before it, as are the outer dims but the last).
fn emit_column_chunk(k: &Kernel, e: &Emitter, out: &mut String) -> Result<(), CodegenError> {
    let last = k.outer.len() - 1;
    let n_outer = k.outer.len();
    let ix = crate::c_emit::index;
    let defined = |stmts: &[braze_sched::loop_ir::Stmt]| -> Vec<u32> { stmts.iter().filter_map(|s| s.dst()).collect() };
    // What a pass leaves for later passes, per column: its reductions' results and the
    // temporaries of its `after` statements.
    let pass_values = |p: &braze_sched::loop_ir::Pass| -> Vec<u32> { p.reductions.iter().map(|r| r.dst).chain(defined(&p.after)).collect() };
    let ctype = |t: u32| crate::dialect::compute_type(k.tmp_dtypes[t as usize]);
    let col = format!("const int64_t i{last} = cb + j;");
    // Values of the outer point known so far, per column, and how to read them back.
    let mut known: Vec<u32> = Vec::new();
    let read_known = |known: &[u32]| known.iter().map(|&t| format!("{} t{t} = t{t}_v[j]; ", ctype(t))).collect::<String>();
    let keep = |out: &mut String, ts: &[u32]| {
        for &t in ts {
            writeln!(out, "      t{t}_v[j] = t{t};").unwrap();
        }
    };
    // Arrays for the values later passes read: the prelude's and every pass's but the last's.
    let mut point_values: Vec<u32> = defined(&k.prelude);
    for p in &k.passes[..k.passes.len().saturating_sub(1)] {
        point_values.extend(pass_values(p));
    }
    for &t in &point_values {
        writeln!(out, "    {} t{t}_v[{COL_CHUNK}];", ctype(t)).unwrap();
    }
    if !k.prelude.is_empty() {
        writeln!(out, "    for (int64_t j = 0; j < cn; j++) {{").unwrap();
        writeln!(out, "      {col}").unwrap();
        for st in &k.prelude {
            writeln!(out, "      {}", e.stmt(st)?).unwrap();
        }
        let ts = defined(&k.prelude);
        keep(out, &ts);
        known.extend(ts);
        writeln!(out, "    }}").unwrap();
    }
    for (pi, p) in k.passes.iter().enumerate() {
        let states: Vec<(&str, String)> = p.reductions.iter().flat_map(|r| e.red_state(r)).collect();
        for (t, n) in &states {
            writeln!(out, "    {t} {n}_v[{COL_CHUNK}];").unwrap();
        }
        if !states.is_empty() {
            writeln!(out, "    for (int64_t j = 0; j < cn; j++) {{").unwrap();
            for r in &p.reductions {
                for l in e.red_init(r) {
                    writeln!(out, "      {l}").unwrap();
                }
            }
            for (_, n) in &states {
                writeln!(out, "      {n}_v[j] = {n};").unwrap();
            }
            writeln!(out, "    }}").unwrap();
        }
        if column_welford(k, p, e) {
            emit_column_welford(k, p, e, out, &format!("{col} {}", read_known(&known)))?;
        } else {
        // [Note: column sums in blocks] A column's sum over many rows added one row at a time
        // into one accumulator has a rounding error growing with the rows: a sum over the
        // 25 088 rows of a 25 088 x 64 f32 tensor (channels_last BatchNorm sums over 2 x 112 x
        // 112 points per channel) was 6.7e-6 from float64's where ATen's (cascade sums) was
        // 1.6e-7. The innermost reduced loop adds blocks of `COL_SUM_BLOCK` rows into partial
        // sums of their own, each added to the column's sum after its block (4.2e-7).
        let blocked = !states.is_empty()
            && p.reductions.iter().all(|r| r.kind == ReduceKind::Sum)
            && k.inner.last().is_some_and(|n| n.as_const().is_none_or(|n| n > COL_SUM_BLOCK));
        if blocked {
            for (t, n) in &states {
                writeln!(out, "    {t} {n}_p[{COL_CHUNK}];").unwrap();
            }
        }
        let mut depth = 2;
        for (j, size) in k.inner.iter().enumerate() {
            let v = n_outer + j;
            let q = "  ".repeat(depth);
            if blocked && j + 1 == k.inner.len() {
                writeln!(out, "{q}for (int64_t i{v}b = 0; i{v}b < {}; i{v}b += {COL_SUM_BLOCK}) {{", ix(size)).unwrap();
                writeln!(out, "{q}  for (int64_t j = 0; j < cn; j++) {{ {} }}", states.iter().map(|(_, n)| format!("{n}_p[j] = 0;")).collect::<Vec<_>>().join(" ")).unwrap();
                writeln!(out, "{q}  const int64_t i{v}e = i{v}b + {COL_SUM_BLOCK} < {s} ? i{v}b + {COL_SUM_BLOCK} : {s};", s = ix(size)).unwrap();
                writeln!(out, "{q}  for (int64_t i{v} = i{v}b; i{v} < i{v}e; i{v}++) {{").unwrap();
                depth += 2;
            } else {
                writeln!(out, "{q}for (int64_t i{v} = 0; i{v} < {}; i{v}++) {{", ix(size)).unwrap();
                depth += 1;
            }
        }
        let pad = "  ".repeat(depth);
        writeln!(out, "{pad}#pragma omp simd").unwrap();
        writeln!(out, "{pad}for (int64_t j = 0; j < cn; j++) {{").unwrap();
        let arr = if blocked { "_p" } else { "_v" };
        emit_lane_body(out, &format!("{pad}  "), &format!("{col} {}", read_known(&known)), "j", arr, &states, p, e, |r| e.red_update(r))?;
        writeln!(out, "{pad}}}").unwrap();
        for j in (0..k.inner.len()).rev() {
            if blocked && j + 1 == k.inner.len() {
                depth -= 1;
                writeln!(out, "{}}}", "  ".repeat(depth)).unwrap();
                writeln!(out, "{}for (int64_t j = 0; j < cn; j++) {{ {} }}", "  ".repeat(depth), states.iter().map(|(_, n)| format!("{n}_v[j] += {n}_p[j];")).collect::<Vec<_>>().join(" ")).unwrap();
            }
            depth -= 1;
            writeln!(out, "{}}}", "  ".repeat(depth)).unwrap();
        }
        }
        if states.is_empty() && p.after.is_empty() {
            continue;
        }
        writeln!(out, "    for (int64_t j = 0; j < cn; j++) {{").unwrap();
        writeln!(out, "      {col} {}", read_known(&known)).unwrap();
        for (t, n) in &states {
            writeln!(out, "      {t} {n} = {n}_v[j];").unwrap();
        }
        for r in &p.reductions {
            writeln!(out, "      {}", e.red_final(r)).unwrap();
        }
        for st in &p.after {
            writeln!(out, "      {}", e.stmt(st)?).unwrap();
        }
        if pi + 1 < k.passes.len() {
            let ts = pass_values(p);
            keep(out, &ts);
            known.extend(ts);
        }
        writeln!(out, "    }}").unwrap();
    }
    Ok(())
}

/// Rows of a column's variance gathered before they are folded into its Welford state
/// ([Note: column Welford in blocks]).
const COL_WELFORD_BLOCK: i64 = 32;

/// Whether a column kernel's pass runs as [`emit_column_welford`]: its reductions are
/// variances of floats and sums, at least one variance.
fn column_welford(k: &Kernel, p: &braze_sched::loop_ir::Pass, e: &Emitter) -> bool {
    !k.inner.is_empty()
        && p.reductions.iter().any(|r| r.kind == ReduceKind::Var)
        && p.reductions.iter().all(|r| (r.kind == ReduceKind::Var && e.dt(r.src).is_float()) || r.kind == ReduceKind::Sum)
}

/// The row loops of a column kernel's pass of variances ([`emit_column_chunk`] declared and
/// initialized the pass's states `{state}_v[j]`; `head` defines the column's index and the
/// values known before the pass).
///
/// [Note: column Welford in blocks] Welford's update divides by the count at every element:
/// in a column kernel (BatchNorm's statistics in channels_last training) that was a double
/// division per element and column, the kernel's bottleneck (DenseNet-121's BatchNorms over
/// its concatenations on the 2-core machine). The innermost reduced dim now runs in blocks of
/// `COL_WELFORD_BLOCK` rows: a vector loop over the chunk's columns computes the pass's body
/// once per row, keeps each variance's value in a block array and sums it (plain sums of the
/// pass add into partial sums, as [Note: column sums in blocks] does); after the block, each
/// column's block mean, its squared deviations from it, and a merge of (mean, M2, count) into
/// the column's Welford state by Chan et al.'s formula, as [Note: chunked Welford] merges a
/// row's chunks: one division per block and column.
fn emit_column_welford(k: &Kernel, p: &braze_sched::loop_ir::Pass, e: &Emitter, out: &mut String, head: &str) -> Result<(), CodegenError> {
    let ix = crate::c_emit::index;
    let pad = |d: usize| "  ".repeat(d);
    let n_outer = k.outer.len();
    let (vars, plain): (Vec<_>, Vec<_>) = p.reductions.iter().partition(|r| r.kind == ReduceKind::Var);
    let ct = |r: &braze_sched::loop_ir::Reduction| crate::dialect::compute_type(e.dt(r.src));
    let block = COL_WELFORD_BLOCK;
    for r in &vars {
        let (t, n) = (ct(r), r.dst);
        writeln!(out, "    {t} bz_c{n}[{block} * {COL_CHUNK}]; {t} bz_s{n}_v[{COL_CHUNK}]; {t} bz_m{n}_v[{COL_CHUNK}]; {t} bz_q{n}_v[{COL_CHUNK}];").unwrap();
    }
    let partial: Vec<(&str, String)> = plain.iter().flat_map(|r| e.red_state(r)).collect();
    for (t, n) in &partial {
        writeln!(out, "    {t} {n}_p[{COL_CHUNK}];").unwrap();
    }
    let last = k.inner.len() - 1;
    let v = n_outer + last;
    let mut depth = 2;
    for (j, size) in k.inner.iter().enumerate() {
        let (q, i) = (pad(depth), n_outer + j);
        if j < last {
            writeln!(out, "{q}for (int64_t i{i} = 0; i{i} < {}; i{i}++) {{", ix(size)).unwrap();
            depth += 1;
            continue;
        }
        let s = ix(size);
        writeln!(out, "{q}for (int64_t i{i}b = 0; i{i}b < {s}; i{i}b += {block}) {{").unwrap();
        writeln!(out, "{q}  const int64_t i{i}e = i{i}b + {block} < {s} ? i{i}b + {block} : {s};").unwrap();
        let zero: Vec<String> = vars
            .iter()
            .flat_map(|r| [format!("bz_s{}_v[j] = 0;", r.dst), format!("bz_q{}_v[j] = 0;", r.dst)])
            .chain(partial.iter().map(|(_, n)| format!("{n}_p[j] = 0;")))
            .collect();
        writeln!(out, "{q}  for (int64_t j = 0; j < cn; j++) {{ {} }}", zero.join(" ")).unwrap();
        writeln!(out, "{q}  for (int64_t i{i} = i{i}b; i{i} < i{i}e; i{i}++) {{").unwrap();
        depth += 2;
    }
    let q = pad(depth);
    writeln!(out, "{q}#pragma omp simd").unwrap();
    writeln!(out, "{q}for (int64_t j = 0; j < cn; j++) {{").unwrap();
    writeln!(out, "{q}  {head}").unwrap();
    for (t, n) in &partial {
        writeln!(out, "{q}  {t} {n} = {n}_p[j];").unwrap();
    }
    for s in &p.body {
        writeln!(out, "{q}  {}", e.stmt(s)?).unwrap();
    }
    for r in &vars {
        writeln!(out, "{q}  bz_c{n}[(i{v} - i{v}b) * {COL_CHUNK} + j] = t{s}; bz_s{n}_v[j] += t{s};", n = r.dst, s = r.src).unwrap();
    }
    for r in &plain {
        writeln!(out, "{q}  {}", e.red_update(r)).unwrap();
    }
    for (_, n) in &partial {
        writeln!(out, "{q}  {n}_p[j] = {n};").unwrap();
    }
    writeln!(out, "{q}}}").unwrap();
    depth -= 1;
    writeln!(out, "{}}}", pad(depth)).unwrap();
    // The block's deviations and its merge into each column's state.
    let q = pad(depth);
    writeln!(out, "{q}const int64_t bz_nb = i{v}e - i{v}b;").unwrap();
    for r in &vars {
        let (t, n) = (ct(r), r.dst);
        writeln!(out, "{q}#pragma omp simd").unwrap();
        writeln!(out, "{q}for (int64_t j = 0; j < cn; j++) bz_m{n}_v[j] = bz_s{n}_v[j] / ({t})bz_nb;").unwrap();
        writeln!(out, "{q}for (int64_t bz_r = 0; bz_r < bz_nb; bz_r++) {{").unwrap();
        writeln!(out, "{q}  #pragma omp simd").unwrap();
        writeln!(out, "{q}  for (int64_t j = 0; j < cn; j++) {{ const {t} d = bz_c{n}[bz_r * {COL_CHUNK} + j] - bz_m{n}_v[j]; bz_q{n}_v[j] += d * d; }}").unwrap();
        writeln!(out, "{q}}}").unwrap();
    }
    writeln!(out, "{q}for (int64_t j = 0; j < cn; j++) {{").unwrap();
    for r in &vars {
        let n = r.dst;
        for (t, s) in e.red_state(r) {
            writeln!(out, "{q}  {t} {s} = {s}_v[j];").unwrap();
        }
        let block_state = |state: &str| match &state[..2] {
            "wm" => format!("bz_m{n}_v[j]"),
            "wq" => format!("bz_q{n}_v[j]"),
            _ => "bz_nb".to_string(),
        };
        writeln!(out, "{q}  {}", e.red_combine(r, &block_state)).unwrap();
        for (_, s) in e.red_state(r) {
            writeln!(out, "{q}  {s}_v[j] = {s};").unwrap();
        }
    }
    for (_, n) in &partial {
        writeln!(out, "{q}  {n}_v[j] += {n}_p[j];").unwrap();
    }
    writeln!(out, "{q}}}").unwrap();
    while depth > 2 {
        depth -= 1;
        writeln!(out, "{}}}", pad(depth)).unwrap();
    }
    Ok(())
}

/// A kernel of a module: the C function it calls (an identical earlier kernel's function,
/// [Note: kernel dedup]), the index of that function among the graph's distinct kernels,
/// and the buffer ids it is handed, in parameter order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    pub name: String,
    pub distinct: usize,
    pub params: Vec<u32>,
}

/// One distinct kernel's C function: its name, its text, and its canonical text (the key
/// that equal kernels share: [Note: kernel dedup]).
#[derive(Clone, Debug)]
pub struct KernelSource {
    pub name: String,
    pub text: String,
    pub key: String,
}

/// The C prelude every translation unit starts with.
pub fn prelude() -> &'static str {
    PRELUDE
}

/// A graph's distinct kernels ([Note: kernel dedup]) and, per kernel in order, the distinct
/// kernel it calls (`Entry::distinct`, its index in the first list) and its buffers.
pub fn emit_kernels(kernels: &[Kernel]) -> Result<(Vec<KernelSource>, Vec<Entry>), CodegenError> {
    let mut texts = Vec::with_capacity(kernels.len());
    let mut params = Vec::with_capacity(kernels.len());
    let mut keys = Vec::with_capacity(kernels.len());
    for k in kernels {
        let mut text = String::new();
        let p = emit_kernel(k, &mut text)?;
        keys.push(crate::dedup::canonical(&text, &k.name, &p));
        texts.push(text);
        params.push(p);
    }
    let mut distinct: Vec<KernelSource> = Vec::new();
    let mut index = vec![0usize; kernels.len()];
    let mut entries = Vec::with_capacity(kernels.len());
    for (i, (owner, p)) in crate::dedup::owners(&keys).into_iter().zip(params).enumerate() {
        if owner == i {
            index[i] = distinct.len();
            distinct.push(KernelSource { name: kernels[i].name.clone(), text: std::mem::take(&mut texts[i]), key: std::mem::take(&mut keys[i]) });
        }
        entries.push(Entry { name: kernels[owner].name.clone(), distinct: index[owner], params: p });
    }
    Ok((distinct, entries))
}

/// The whole C module of a graph's kernels, as one unit: the prelude, then each distinct
/// kernel (what the logs show).
pub fn emit_module(kernels: &[Kernel]) -> Result<String, CodegenError> {
    Ok(module_source(&emit_kernels(kernels)?.0))
}

/// The prelude followed by every kernel of `distinct`.
pub fn module_source<'a>(distinct: impl IntoIterator<Item = &'a KernelSource>) -> String {
    let mut out = format!("{PRELUDE}\n");
    for k in distinct {
        out.push_str(&k.text);
    }
    out
}
