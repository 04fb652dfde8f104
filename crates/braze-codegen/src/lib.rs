//! # braze-codegen: loop IR to source
//!
//! One C emitter (`c_emit.rs`) writes every statement; a [`dialect::Dialect`] supplies what
//! differs by target. `openmp.rs` is the CPU target: C with OpenMP pragmas, compiled by the
//! system C compiler.

// First: its `random_helpers!` and `integer_division_helpers!` macros are used by the
// targets' preludes.
#[macro_use]
pub mod dialect;
pub mod c_emit;
pub mod cuda;
pub mod dedup;
pub mod openmp;
pub mod tiles;

#[derive(Debug, thiserror::Error)]
pub enum CodegenError {
    /// An op/dtype pair the emitter has no spelling for; the graph falls back to eager.
    #[error("codegen unsupported: {0}")]
    Unsupported(String),
}

/// [Note: units] A graph's module is emitted as several translation units (kernels, each unit
/// with the target's prelude), so the compiler (cc or NVRTC) runs on the units in parallel,
/// one thread per core, and each kernel is cached on its own. One unit of every kernel of a
/// BERT-base backward graph (about 300) took NVRTC 16 s on one core of an H100 machine, so
/// splitting bounds the longest compile. At least a minimum per unit keeps the per-unit cost
/// small: `MIN_KERNELS_PER_UNIT` for cc (a process start and the C headers),
/// `MIN_KERNELS_PER_NVRTC_UNIT` for NVRTC, whose per-unit cost is its prelude (20-30 ms,
/// against 35-50 ms a kernel, more for the largest). A 2-layer BERT training graph's 23 CUDA
/// kernels, on one core: units of 8 took 0.98 s in all and 0.45 s for the longest unit, units
/// of 2 1.14 s and 0.21 s. Kernels differ in size (a fused LayerNorm backward's text is many
/// times a bias-add's), so units are balanced by source length, the largest kernels placed
/// first, each into the lightest unit, and the heaviest unit is compiled first: the compile's
/// wall time is then about the largest kernel's or the total over the cores, whichever is
/// more. One core: one unit. `BRAZE_KERNELS_PER_UNIT` fixes the unit size.
pub mod units {
    /// The fewest kernels a C unit gets when the graph is split.
    pub const MIN_KERNELS_PER_UNIT: usize = 8;
    /// The fewest kernels an NVRTC unit gets when the graph is split.
    pub const MIN_KERNELS_PER_NVRTC_UNIT: usize = 1;

    /// How many units `n` kernels make on this machine, at least `min` kernels a unit where
    /// there are that many, at most two units a core.
    pub fn unit_count(n: usize, min: usize) -> usize {
        if let Some(k) = std::env::var("BRAZE_KERNELS_PER_UNIT").ok().and_then(|v| v.parse().ok()).filter(|&k: &usize| k > 0) {
            return n.div_ceil(k).max(1);
        }
        let cores = std::thread::available_parallelism().map(|p| p.get()).unwrap_or(1);
        n.div_ceil(min.max(1)).min(if cores > 1 { 2 * cores } else { 1 }).max(1)
    }

    /// Kernels of source lengths `sizes` split into units (positions into `sizes`, in order
    /// within a unit), heaviest unit first: the largest kernel goes first, each into the unit
    /// lightest so far.
    pub fn balanced(sizes: &[usize], min: usize) -> Vec<Vec<usize>> {
        if sizes.is_empty() {
            return Vec::new();
        }
        let count = unit_count(sizes.len(), min);
        let mut order: Vec<usize> = (0..sizes.len()).collect();
        order.sort_by_key(|&i| (std::cmp::Reverse(sizes[i]), i));
        let mut units: Vec<(usize, Vec<usize>)> = vec![(0, Vec::new()); count];
        for i in order {
            let u = (0..count).min_by_key(|&u| (units[u].0, u)).expect("at least one unit");
            units[u].0 += sizes[i];
            units[u].1.push(i);
        }
        units.retain(|u| !u.1.is_empty());
        units.sort_by_key(|u| std::cmp::Reverse(u.0));
        units
            .into_iter()
            .map(|(_, mut ks)| {
                ks.sort_unstable();
                ks
            })
            .collect()
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn balanced_units_cover_every_kernel_once_heaviest_first() {
            let sizes = [10, 900, 30, 500, 400, 20, 20, 100];
            let units = balanced(&sizes, 1);
            let mut all: Vec<usize> = units.concat();
            all.sort_unstable();
            assert_eq!(all, (0..sizes.len()).collect::<Vec<_>>());
            let weight = |u: &Vec<usize>| u.iter().map(|&i| sizes[i]).sum::<usize>();
            assert!(units.windows(2).all(|w| weight(&w[0]) >= weight(&w[1])));
            // The largest kernel is alone in the heaviest unit wherever there is more than one.
            if units.len() > 1 {
                assert_eq!(units[0], vec![1]);
            }
            assert!(balanced(&[], 1).is_empty());
        }
    }
}
