//! Views as index maps. `view_index` maps an index of a view's result to an index of its
//! operand; `strided` describes a chain of views over a buffer as sizes/strides/offset
//! when that is possible (so externs and outputs can take a view instead of a copy).

use braze_ir::{contiguous_strides, Expr, Graph, NodeId, Op};

/// A strided window onto a buffer: element `idx` lives at `offset + sum(idx[d]*strides[d])`.
#[derive(Clone, Debug, PartialEq)]
pub struct View {
    pub sizes: Vec<Expr>,
    pub strides: Vec<Expr>,
    pub offset: Expr,
}

/// Groups the dims of a reshape `from -> to` into runs with equal products: each group is
/// (dims of `from`, dims of `to`). Size-1 dims form their own groups. Symbolic sizes group
/// when one side's product divides the other's exactly (`[2*s0, s1] -> [2, s0, s1]`: an
/// LSTM's output split back into batch and rows); a single group when that leaves the
/// grouping undecidable.
pub fn reshape_groups(from: &[Expr], to: &[Expr]) -> Vec<(Vec<usize>, Vec<usize>)> {
    let mut groups = Vec::new();
    let (mut i, mut j) = (0, 0);
    while i < from.len() || j < to.len() {
        if i < from.len() && from[i].is_const(1) {
            groups.push((vec![i], vec![]));
            i += 1;
            continue;
        }
        if j < to.len() && to[j].is_const(1) {
            groups.push((vec![], vec![j]));
            j += 1;
            continue;
        }
        if i >= from.len() || j >= to.len() {
            return vec![((0..from.len()).collect(), (0..to.len()).collect())];
        }
        if from[i] == to[j] {
            groups.push((vec![i], vec![j]));
            i += 1;
            j += 1;
            continue;
        }
        let (mut gi, mut gj) = (vec![i], vec![j]);
        let (mut pi, mut pj) = (from[i].clone(), to[j].clone());
        i += 1;
        j += 1;
        while pi != pj {
            // Constants: grow the smaller product. Symbolic: grow the side whose product
            // divides the other's (sizes under dynamic shapes are at least 2).
            let grow_from = match (pi.as_const(), pj.as_const()) {
                (Some(a), Some(b)) => Some(a < b),
                _ if pj.exact_div(&pi).is_some() => Some(true),
                _ if pi.exact_div(&pj).is_some() => Some(false),
                _ => None,
            };
            match grow_from {
                Some(true) if i < from.len() => {
                    pi = pi.mul(&from[i]);
                    gi.push(i);
                    i += 1;
                }
                Some(false) if j < to.len() => {
                    pj = pj.mul(&to[j]);
                    gj.push(j);
                    j += 1;
                }
                _ => return vec![((0..from.len()).collect(), (0..to.len()).collect())],
            }
        }
        groups.push((gi, gj));
    }
    groups
}

/// The operand index that a view reads for result index `idx`.
pub fn view_index(g: &Graph, view: NodeId, idx: &[Expr]) -> Vec<Expr> {
    let n = g.node(view);
    let src = g.ty(n.inputs[0]);
    match &n.op {
        Op::Permute(p) => {
            let mut out = vec![Expr::zero(); p.len()];
            for (d, &s) in p.iter().enumerate() {
                out[s] = idx[d].clone();
            }
            out
        }
        Op::Expand(shape) => {
            let off = shape.len() - src.rank();
            (0..src.rank())
                .map(|d| if src.shape[d].is_const(1) { Expr::zero() } else { idx[d + off].clone() })
                .collect()
        }
        Op::Reshape(shape) => {
            let mut out = vec![Expr::zero(); src.rank()];
            for (gi, gj) in reshape_groups(&src.shape, shape) {
                let gto: Vec<Expr> = gj.iter().map(|&j| shape[j].clone()).collect();
                let st = contiguous_strides(&gto);
                let lin = gj.iter().zip(&st).fold(Expr::zero(), |a, (&j, s)| a.add(&idx[j].mul(s)));
                let gfrom: Vec<Expr> = gi.iter().map(|&i| src.shape[i].clone()).collect();
                let sf = contiguous_strides(&gfrom);
                for (k, &i) in gi.iter().enumerate() {
                    let mut v = lin.floordiv(&sf[k]);
                    if k > 0 {
                        v = v.rem(&gfrom[k]);
                    }
                    out[i] = if gfrom[k].is_const(1) { Expr::zero() } else { v };
                }
            }
            out
        }
        Op::Slice { dim, start, step, .. } => {
            let mut out = idx.to_vec();
            out[*dim] = start.add(&idx[*dim].mul_c(*step));
            out
        }
        Op::Select { dim, index } => {
            let mut out = idx.to_vec();
            out.insert(*dim, index.clone());
            out
        }
        _ => unreachable!("view_index on a non-view"),
    }
}

/// Follows views from `n` down to the first non-view node.
pub fn view_base(g: &Graph, mut n: NodeId) -> NodeId {
    while g.node(n).op.is_view() {
        n = g.node(n).inputs[0];
    }
    n
}

/// `n` as a strided view of `view_base(n)`, given the base's strides; `None` when some
/// reshape in the chain cannot be expressed with strides.
pub fn strided(g: &Graph, n: NodeId, base_strides: &[Expr]) -> Option<View> {
    let node = g.node(n);
    if !node.op.is_view() {
        return Some(View { sizes: g.ty(n).shape.clone(), strides: base_strides.to_vec(), offset: Expr::zero() });
    }
    let v = strided(g, node.inputs[0], base_strides)?;
    let out_shape = g.ty(n).shape.clone();
    Some(match &node.op {
        Op::Permute(p) => View { sizes: out_shape, strides: p.iter().map(|&d| v.strides[d].clone()).collect(), offset: v.offset },
        Op::Expand(shape) => {
            let off = shape.len() - v.sizes.len();
            let strides = (0..shape.len())
                .map(|d| if d < off || (v.sizes[d - off].is_const(1) && !shape[d].is_const(1)) { Expr::zero() } else { v.strides[d - off].clone() })
                .collect();
            View { sizes: out_shape, strides, offset: v.offset }
        }
        Op::Slice { dim, start, step, .. } => {
            let mut strides = v.strides.clone();
            let offset = v.offset.add(&start.mul(&strides[*dim]));
            strides[*dim] = strides[*dim].mul_c(*step);
            View { sizes: out_shape, strides, offset }
        }
        Op::Select { dim, index } => {
            let mut strides = v.strides.clone();
            let offset = v.offset.add(&index.mul(&strides[*dim]));
            strides.remove(*dim);
            View { sizes: out_shape, strides, offset }
        }
        Op::Reshape(shape) => {
            let mut strides = vec![Expr::zero(); shape.len()];
            for (gi, gj) in reshape_groups(&v.sizes, shape) {
                // The group's source dims must be contiguous with each other.
                let real: Vec<usize> = gi.iter().copied().filter(|&i| !v.sizes[i].is_const(1)).collect();
                for w in real.windows(2) {
                    if v.strides[w[0]] != v.strides[w[1]].mul(&v.sizes[w[1]]) {
                        return None;
                    }
                }
                let inner = real.last().map(|&i| v.strides[i].clone()).unwrap_or(Expr::one());
                let gto: Vec<Expr> = gj.iter().map(|&j| shape[j].clone()).collect();
                for (k, s) in contiguous_strides(&gto).iter().enumerate() {
                    strides[gj[k]] = s.mul(&inner);
                }
            }
            View { sizes: out_shape, strides, offset: v.offset }
        }
        _ => unreachable!(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn symbolic_reshape_groups_split_by_exact_division() {
        let (s0, s1, s2) = (Expr::sym(0), Expr::sym(1), Expr::sym(2));
        let c = Expr::constant;
        // [2*s0, s1, s2] -> [2, s0, s1, s2]: the first dim splits, the others map one to one.
        let from = [s0.mul_c(2), s1.clone(), s2.clone()];
        let to = [c(2), s0.clone(), s1.clone(), s2.clone()];
        assert_eq!(reshape_groups(&from, &to), vec![(vec![0], vec![0, 1]), (vec![1], vec![2]), (vec![2], vec![3])]);
        // [s0, 2, s1] -> [2*s0, s1] merges; constants still group by size ([6, 4] -> [4, 6]).
        assert_eq!(reshape_groups(&[s0.clone(), c(2), s1.clone()], &[s0.mul_c(2), s1.clone()]), vec![(vec![0, 1], vec![0]), (vec![2], vec![1])]);
        assert_eq!(reshape_groups(&[c(6), c(4)], &[c(4), c(6)]), vec![(vec![0, 1], vec![0, 1])]);
        // s0*s1 -> [s1, s0]: s1 divides s0*s1, so the group takes both `to` dims.
        assert_eq!(reshape_groups(&[s0.mul(&s1)], &[s1.clone(), s0.clone()]), vec![(vec![0], vec![0, 1])]);
        // Undecidable: [s0, s1] -> [s2, s0*s1 / s2] has no exact division: one group.
        assert_eq!(reshape_groups(&[s0.clone(), s1.clone()], &[s2.clone(), s0.clone()]).len(), 1);
    }
}
