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
/// units in parallel, one thread per core, and each kernel is cached on its own. One unit of
/// every kernel of a BERT-base backward graph (about 300) took NVRTC 16 s on one core of an
/// H100 machine; compile time per kernel is about constant, so splitting bounds the longest
/// compile. Two units per core balance uneven kernels; at least a minimum per unit keeps the
/// per-unit cost small: `MIN_KERNELS_PER_UNIT` for cc (a process start and the C headers),
/// `MIN_KERNELS_PER_NVRTC_UNIT` for NVRTC, whose per-unit cost is its prelude (20-30 ms,
/// against 35-50 ms a kernel). A 2-layer BERT training graph's 23 CUDA kernels, on one core:
/// units of 8 took 0.98 s in all and 0.45 s for the longest unit, units of 2 1.14 s and
/// 0.21 s, so on a machine of many cores (a GPU host) units of 2 halve the compile's wall time.
/// One core: one unit, as before. `BRAZE_KERNELS_PER_UNIT` fixes the unit size.
pub mod units {
    /// The fewest kernels a C unit gets when the graph is split.
    pub const MIN_KERNELS_PER_UNIT: usize = 8;
    /// The fewest kernels an NVRTC unit gets when the graph is split.
    pub const MIN_KERNELS_PER_NVRTC_UNIT: usize = 2;

    /// Kernels per unit for a graph of `n` kernels on this machine, at least `min` a unit
    /// where there are that many.
    pub fn kernels_per_unit(n: usize, min: usize) -> usize {
        if let Some(k) = std::env::var("BRAZE_KERNELS_PER_UNIT").ok().and_then(|v| v.parse().ok()).filter(|&k: &usize| k > 0) {
            return k;
        }
        let cores = std::thread::available_parallelism().map(|p| p.get()).unwrap_or(1);
        let units = n.div_ceil(min.max(1)).min(if cores > 1 { 2 * cores } else { 1 }).max(1);
        n.div_ceil(units).max(1)
    }
}
