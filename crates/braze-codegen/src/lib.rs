//! # braze-codegen: loop IR to source
//!
//! One C emitter (`c_emit.rs`) writes every statement; a [`dialect::Dialect`] supplies what
//! differs by target. `openmp.rs` is the CPU target: C with OpenMP pragmas, compiled by the
//! system C compiler.

pub mod c_emit;
pub mod cuda;
pub mod dialect;
pub mod openmp;

#[derive(Debug, thiserror::Error)]
pub enum CodegenError {
    /// An op/dtype pair the emitter has no spelling for; the graph falls back to eager.
    #[error("codegen unsupported: {0}")]
    Unsupported(String),
}
