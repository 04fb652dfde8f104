//! Which pointwise kernels run over tiles of two dims ([Note: tiled transposes] in cuda.rs):
//! those that load a buffer along another dim than they store along. The CUDA target stages
//! the transposed loads through shared memory; the CPU target blocks its loops so a tile's
//! cache lines are read whole.

use crate::cuda::mentions_tmp;
use braze_ir::Expr;
use braze_sched::loop_ir::{Kernel, Stmt};

/// Dims shorter than this (3 colour channels) would leave most of a tile idle.
pub const TILE_MIN_DIM: i64 = 16;

pub struct TilePlan {
    /// The dim the transposed loads walk.
    pub a: usize,
    /// Indices (into the body) of the loads read through tiles.
    pub loads: Vec<usize>,
}

/// The tiled plan of a pointwise kernel ([Note: tiled transposes]), or `None` when no load
/// walks another dim than the stores do.
pub fn tile_plan(k: &Kernel) -> Option<TilePlan> {
    let n = k.outer.len();
    if n < 2 || k.passes.len() != 1 {
        return None;
    }
    let last = (n - 1) as u32;
    let body = &k.passes[0].body;
    let big = |d: &Expr| d.as_const().is_none_or(|c| c >= TILE_MIN_DIM);
    if !big(&k.outer[n - 1]) {
        return None;
    }
    let mut stores = 0;
    for s in body {
        if let Stmt::Store { index, .. } = s {
            if index.linear_coef(last) != Some(1) {
                return None;
            }
            stores += 1;
        }
    }
    if stores == 0 {
        return None;
    }
    let mut a = None;
    let mut loads = Vec::new();
    for (i, s) in body.iter().enumerate() {
        let Stmt::Load { index, mask: None, .. } = s else { continue };
        if mentions_tmp(index) {
            continue;
        }
        let moves = index.var_coef(last).is_some_and(|c| !c.is_const(0) && !c.is_const(1));
        if !moves {
            continue;
        }
        let unit = (0..n - 1).find(|&d| index.linear_coef(d as u32) == Some(1) && big(&k.outer[d]));
        match (unit, a) {
            (Some(d), None) => {
                a = Some(d);
                loads.push(i);
            }
            (Some(d), Some(x)) if d == x => loads.push(i),
            _ => {}
        }
    }
    Some(TilePlan { a: a?, loads })
}

