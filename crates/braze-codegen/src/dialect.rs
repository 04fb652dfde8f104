//! What differs between C targets. The emitter (`c_emit.rs`) writes statements the same way
//! for every target; a dialect supplies the file prelude, the kernel signature and the loop
//! structure around the statements. Defaults are the plain-C spellings.

use braze_ir::DType;

pub trait Dialect {
    /// Text placed once at the top of a module: includes and helper functions.
    fn prelude(&self) -> &'static str;
    /// The name of the math function `f` (e.g. `sin`) for values of `dt`.
    fn math(&self, f: &str, dt: DType) -> String {
        if dt == DType::F64 {
            f.to_string()
        } else {
            format!("{f}f")
        }
    }
    /// The C type of a variance's Welford state (mean and squared deviations) for values of
    /// `dt`.
    fn variance_type(&self, dt: DType) -> &'static str {
        compute_type(dt)
    }
    /// `restrict` spelling.
    fn restrict(&self) -> &'static str {
        "restrict"
    }
}

/// The C type a value of `dt` is computed in (half types compute in float).
pub fn compute_type(dt: DType) -> &'static str {
    match dt {
        DType::F64 => "double",
        DType::F32 | DType::F16 | DType::BF16 => "float",
        DType::I64 => "int64_t",
        DType::I32 => "int32_t",
        DType::I16 => "int16_t",
        DType::I8 => "int8_t",
        DType::U8 => "uint8_t",
        DType::Bool => "bool",
    }
}

/// The C type a value of `dt` is stored as in memory.
pub fn storage_type(dt: DType) -> &'static str {
    match dt {
        DType::F16 | DType::BF16 => "uint16_t",
        other => compute_type(other),
    }
}

/// Integer floor division and remainder (Python's: the result takes the divisor's sign) in 64
/// and in 32 bits ([Note: 32-bit integer division] in `c_emit.rs`), both preludes' text, as a
/// literal for `concat!`: each prelude defines `BZ_INT` before it. Division by 0 gives 0 (a
/// masked lane's); by -1 a wrapping negation, as eager's, since the type's minimum divided by
/// -1 overflows and x86 traps on it.
macro_rules! integer_division_helpers {
    () => {
        r#"#define BZ_INT_DIVISION(T, U, W) \
BZ_INT T bz_floordiv_##W(T a, T b) { if (b == 0) return 0; if (b == -1) return (T)((U)0 - (U)a); T q = a / b; if ((a % b != 0) && ((a < 0) != (b < 0))) q -= 1; return q; } \
BZ_INT T bz_rem_##W(T a, T b) { if (b == 0 || b == -1) return 0; T r = a % b; if (r != 0 && ((r < 0) != (b < 0))) r += b; return r; }
BZ_INT_DIVISION(int64_t, uint64_t, i64)
BZ_INT_DIVISION(int32_t, uint32_t, i32)
"#
    };
}

/// The random-value helpers ([Note: random values]) both preludes include, as a literal for
/// `concat!`: each prelude defines `BZ_RNG`, `BZ_RNG_PHILOX` and `BZ_RNG_ROUNDS` before it.
macro_rules! random_helpers {
    () => {
        r#"/* [Note: random values] Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as
   1, 2, 3", SC 2011): the counter is (element index, stream, word), the key the seed the
   runtime draws per call from PyTorch's generator. Uniform values sit on the grid of their
   dtype's precision (24 bits for f32, 11 for f16, 8 for bf16, 53 for f64), so that rounding
   to the dtype never reaches 1. */
BZ_RNG_PHILOX uint64_t bz_philox(uint64_t seed, uint64_t idx, uint32_t stream, uint32_t word) {
  uint32_t c0 = (uint32_t)idx, c1 = (uint32_t)(idx >> 32), c2 = stream, c3 = word;
  uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
  BZ_RNG_ROUNDS
  for (int r = 0; r < 10; r++) {
    uint64_t p0 = (uint64_t)0xD2511F53u * c0, p1 = (uint64_t)0xCD9E8D57u * c2;
    uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0, n2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
    c1 = (uint32_t)p1; c3 = (uint32_t)p0; c0 = n0; c2 = n2;
    k0 += 0x9E3779B9u; k1 += 0xBB67AE85u;
  }
  return (uint64_t)c0 | ((uint64_t)c1 << 32);
}
BZ_RNG float bz_uniform_bits(uint64_t seed, uint64_t idx, uint32_t stream, int bits) {
  return (float)((uint32_t)bz_philox(seed, idx, stream, 0) >> (32 - bits)) * (1.0f / (float)(1u << bits));
}
BZ_RNG double bz_uniform_f64(uint64_t seed, uint64_t idx, uint32_t stream) {
  return (double)(bz_philox(seed, idx, stream, 0) >> 11) * (1.0 / 9007199254740992.0);
}
BZ_RNG float bz_normal_f32(uint64_t seed, uint64_t idx, uint32_t stream) {
  uint64_t r = bz_philox(seed, idx, stream, 0);
  float u1 = (float)(((uint32_t)r >> 8) + 1u) * (1.0f / 16777216.0f);
  float u2 = (float)((uint32_t)(r >> 32) >> 8) * (1.0f / 16777216.0f);
  return sqrtf(-2.0f * logf(u1)) * cosf(6.2831853071795864f * u2);
}
BZ_RNG double bz_normal_f64(uint64_t seed, uint64_t idx, uint32_t stream) {
  double u1 = (double)((bz_philox(seed, idx, stream, 0) >> 11) + 1u) * (1.0 / 9007199254740992.0);
  double u2 = (double)(bz_philox(seed, idx, stream, 1) >> 11) * (1.0 / 9007199254740992.0);
  return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}
"#
    };
}
