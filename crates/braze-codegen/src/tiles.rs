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
    /// The side shorter than `TILE_MIN_DIM`, taken whole by each tile ([Note: short-side
    /// tiles] in cuda.rs), or `None` when both are at least that long.
    pub short: Option<Side>,
}

/// One side of a tile: the transposed loads' dim or the stores' (the last).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    A,
    Last,
}

/// The tiled plan of a pointwise kernel ([Note: tiled transposes]), or `None` when no load
/// walks another dim than the stores do. One side may be a constant dim shorter than
/// `TILE_MIN_DIM` (a 3 x 3 filter's 9 taps laid out channels_last and back) when the other
/// is not.
pub fn tile_plan(k: &Kernel) -> Option<TilePlan> {
    let n = k.outer.len();
    if n < 2 || k.passes.len() != 1 {
        return None;
    }
    let last = (n - 1) as u32;
    let body = &k.passes[0].body;
    let big = |d: &Expr| d.as_const().is_none_or(|c| c >= TILE_MIN_DIM);
    let short = |d: &Expr| d.as_const().is_some_and(|c| (2..TILE_MIN_DIM).contains(&c));
    let last_big = big(&k.outer[n - 1]);
    if !last_big && !short(&k.outer[n - 1]) {
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
        let unit_of = |ok: &dyn Fn(&Expr) -> bool| (0..n - 1).find(|&d| index.linear_coef(d as u32) == Some(1) && ok(&k.outer[d]));
        // A short side needs the other one long.
        let unit = unit_of(&big).or_else(|| if last_big { unit_of(&short) } else { None });
        match (unit, a) {
            (Some(d), None) => {
                a = Some(d);
                loads.push(i);
            }
            (Some(d), Some(x)) if d == x => loads.push(i),
            _ => {}
        }
    }
    let a = a?;
    let short = if !last_big { Some(Side::Last) } else if !big(&k.outer[a]) { Some(Side::A) } else { None };
    Some(TilePlan { a, loads, short })
}
