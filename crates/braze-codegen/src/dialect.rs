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
