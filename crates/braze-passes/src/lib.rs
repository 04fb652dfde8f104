//! # braze-passes: graph-to-graph passes
//!
//! Each pass is one file with one `pub fn` taking and returning a [`Graph`]. The pipeline
//! below is the list of stages the compiler runs, by name; each name is also a
//! `BRAZE_LOGS` dump name and a golden-test `// run:` step.

pub mod const_fold;
pub mod cse;
pub mod dce;
pub mod elide_layouts;
pub mod matmul_bias_grads;
pub mod matmul_epilogue;
pub mod one_hot_sums;
pub mod pad_matmuls;
pub mod rewrite;
pub mod simplify;
pub mod small_matmuls;
pub mod split_reductions;

use braze_ir::Graph;

/// A named graph pass.
pub type Pass = fn(&Graph) -> Graph;

/// The passes by name, in the order the default pipeline runs them.
pub const PASSES: &[(&str, Pass)] = &[
    ("const_fold", const_fold::const_fold),
    ("simplify", simplify::simplify),
    ("one_hot_sums", one_hot_sums::one_hot_sums),
    ("cse", cse::cse),
    ("matmul_epilogue", matmul_epilogue::matmul_epilogue),
    ("dce", dce::dce),
];

/// Passes run only for some targets (not in the default pipeline).
pub const TARGET_PASSES: &[(&str, Pass)] = &[
    ("small_matmuls", small_matmuls::small_matmuls),
    ("matmul_bias_grads", matmul_bias_grads::matmul_bias_grads),
    ("split_reductions", |g| split_reductions::split_reductions(g, 64)),
    ("pad_matmuls", pad_matmuls::pad_matmuls),
    ("elide_layouts", elide_layouts::elide_layouts),
];

/// How many nodes of `g` have an op `f` holds for (the passes' unit tests).
#[cfg(test)]
pub(crate) fn count_ops(g: &Graph, f: impl Fn(&braze_ir::Op) -> bool) -> usize {
    g.ids().filter(|&i| f(&g.node(i).op)).count()
}

pub fn pass_by_name(name: &str) -> Option<Pass> {
    PASSES.iter().chain(TARGET_PASSES).find(|(n, _)| *n == name).map(|(_, p)| *p)
}

/// The default pipeline: every pass twice over (a fold can expose a simplification and a
/// simplification a common subexpression), ending with dead-code elimination.
pub fn optimize(g: &Graph) -> Graph {
    let mut g = g.clone();
    for _ in 0..2 {
        for (_, p) in PASSES {
            g = p(&g);
        }
    }
    g
}
