//! # braze-codegen: loop IR to source
//!
//! One C emitter (`c_emit.rs`) writes every statement; a [`dialect::Dialect`] supplies what
//! differs by target. `openmp.rs` is the CPU target: C with OpenMP pragmas, compiled by the
//! system C compiler.

pub mod c_emit;
pub mod cuda;
pub mod dedup;
pub mod dialect;
pub mod openmp;

#[derive(Debug, thiserror::Error)]
pub enum CodegenError {
    /// An op/dtype pair the emitter has no spelling for; the graph falls back to eager.
    #[error("codegen unsupported: {0}")]
    Unsupported(String),
}

/// [Note: units] A graph's module is emitted as several translation units (consecutive
/// kernels, each unit with the target's prelude), so the compiler (cc or NVRTC) runs on the
/// units in parallel, one thread per core, and each unit is cached on its own. One unit of
/// every kernel of a BERT-base backward graph (about 300) took NVRTC 16 s on one core of an
/// H100 machine; compile time per kernel is about constant, so splitting bounds the longest
/// compile. Two units per core balance uneven kernels; at least `MIN_KERNELS_PER_UNIT` per
/// unit keeps the per-unit cost (process start, prelude) small. One core: one unit, as
/// before. `BRAZE_KERNELS_PER_UNIT` fixes the unit size.
pub mod units {
    /// The fewest kernels a unit gets when the graph is split.
    pub const MIN_KERNELS_PER_UNIT: usize = 8;

    /// Kernels per unit for a graph of `n` kernels on this machine.
    pub fn kernels_per_unit(n: usize) -> usize {
        if let Some(k) = std::env::var("BRAZE_KERNELS_PER_UNIT").ok().and_then(|v| v.parse().ok()).filter(|&k: &usize| k > 0) {
            return k;
        }
        let cores = std::thread::available_parallelism().map(|p| p.get()).unwrap_or(1);
        let units = n.div_ceil(MIN_KERNELS_PER_UNIT).min(if cores > 1 { 2 * cores } else { 1 }).max(1);
        n.div_ceil(units).max(1)
    }
}
