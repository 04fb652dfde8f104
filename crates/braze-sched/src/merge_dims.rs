//! Merging the loop dims of a kernel that its indices walk as one.
//!
//! Targets recover each loop variable from a flat index with a division and a modulo per
//! dim, per element; on the GPU that integer arithmetic dominates kernels of several dims.
//! Adjacent dims `k`, `k + 1` (both outer or both inner) are merged when every load and
//! store index, and every reduction's `inner_index`, is affine in their variables with
//! `coef(k) == coef(k + 1) * size(k + 1)` (compared symbolically): then
//! `coef(k)*ik + coef(k+1)*ik1 == coef(k+1)*(ik*size(k+1) + ik1)`, so `ik1` becomes the
//! merged variable over `size(k) * size(k + 1)` points, `ik` becomes 0 and later variables
//! are renumbered down by one. Pairs merge until none does: a contiguous 4-d pointwise kernel
//! becomes 1-d, a channels_last reduction over (h, w) one reduced dim.
//!
//! A pair is kept when an index uses either variable in another way (inside a division or
//! modulo, times a temporary, or with other coefficients: a transposed or broadcast read),
//! or when a statement uses it as a value (iota, the range masks of cat and pad).
//! The merged dim takes the pair's place, so the innermost outer dim stays last (what
//! `column` kernels and the CUDA vector path look at).
//!
//! First, divisions and modulos that the loop ranges decide are folded
//! ([`Expr::fold_divmod_in`]): a view that flattens dims and splits them again (bilinear
//! upsampling's gather from a flattened `[8 * 8]` grid, indexed `(128*i2 + i3) // 128` and
//! `% 128` for output row `i2` and column `i3`) then reads `i2` and `i3`, so what depends on
//! the row alone is loop-invariant in the inner loop, and more pairs merge.

use crate::loop_ir::{Kernel, Stmt};
use braze_ir::Expr;

/// Merges `k`'s mergeable dims.
pub fn merge_dims(k: &mut Kernel) {
    fold_divmods(k);
    loop {
        let n_outer = k.outer.len();
        let n = n_outer + k.inner.len();
        let mut pairs = (0..n.saturating_sub(1)).filter(|&v| v + 1 != n_outer);
        let Some(v) = pairs.find(|&v| mergeable(k, v)) else { return };
        merge(k, v);
    }
}

/// Folds the divisions and modulos of `k`'s indices that its loop ranges decide.
fn fold_divmods(k: &mut Kernel) {
    let sizes = k.const_extents();
    let extent = |v: u32| sizes.get(v as usize).copied().flatten();
    map_indices(k, &|e| e.fold_divmod_in(&extent));
}

/// Replaces every index expression of `k` (loads, stores, index values, bounds, masks'
/// ranges, reductions' inner indices) by `f` of it.
fn map_indices(k: &mut Kernel, f: &dyn Fn(&Expr) -> Expr) {
    let map = |e: &mut Expr| *e = f(e);
    for s in k.stmts_mut() {
        match s {
            Stmt::Load { index, .. } | Stmt::Store { index, .. } | Stmt::Index { index, .. } | Stmt::Random { index, .. } | Stmt::Bounded { hi: index, .. } => map(index),
            Stmt::InRange { index, lo, hi, .. } => {
                map(index);
                map(lo);
                map(hi);
            }
            Stmt::Const { .. } | Stmt::Unary { .. } | Stmt::Binary { .. } | Stmt::Where { .. } | Stmt::Cast { .. } => {}
        }
    }
    for r in k.passes.iter_mut().flat_map(|p| p.reductions.iter_mut()) {
        map(&mut r.inner_index);
    }
}

/// The size of loop variable `v`.
fn size(k: &Kernel, v: usize) -> &Expr {
    k.outer.get(v).unwrap_or_else(|| &k.inner[v - k.outer.len()])
}

/// Whether variables `v` and `v + 1` can be merged (see the module comment).
fn mergeable(k: &Kernel, v: usize) -> bool {
    let (a, b) = (v as u32, v as u32 + 1);
    let next = size(k, v + 1);
    let affine = |e: &Expr| matches!((e.var_coef(a), e.var_coef(b)), (Some(ca), Some(cb)) if ca == cb.mul(next));
    let free = |e: &Expr| !e.uses_var(a) && !e.uses_var(b);
    let mut stmts = k.stmts();
    let stmts_ok = stmts.all(|s| match s {
        Stmt::Load { index, .. } | Stmt::Store { index, .. } | Stmt::Random { index, .. } => affine(index),
        Stmt::Index { index, .. } | Stmt::Bounded { hi: index, .. } => free(index),
        Stmt::InRange { index, lo, hi, .. } => free(index) && free(lo) && free(hi),
        Stmt::Const { .. } | Stmt::Unary { .. } | Stmt::Binary { .. } | Stmt::Where { .. } | Stmt::Cast { .. } => true,
    });
    stmts_ok && k.passes.iter().flat_map(|p| &p.reductions).all(|r| affine(&r.inner_index))
}

/// Merges variables `v` and `v + 1` into one at `v`.
fn merge(k: &mut Kernel, v: usize) {
    let n_outer = k.outer.len();
    let (dims, d) = if v < n_outer { (&mut k.outer, v) } else { (&mut k.inner, v - n_outer) };
    let next = dims.remove(d + 1);
    dims[d] = dims[d].mul(&next);
    let v = v as u32;
    let f = |n: u32| match n.cmp(&v) {
        std::cmp::Ordering::Less => Expr::var(n),
        std::cmp::Ordering::Equal => Expr::zero(),
        std::cmp::Ordering::Greater => Expr::var(n - 1),
    };
    map_indices(k, &|e| e.subst_vars(&f));
}
