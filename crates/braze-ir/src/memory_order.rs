//! Memory order of a value: the order, outermost first, in which its dims are laid out where
//! it comes from memory. A graph input or extern result has the strides it arrives with; a
//! `layout` node has eager's strides; elementwise ops (unary, cast, binary, where) on an
//! operand of their own shape read it in that operand's order, a concatenation in its
//! operands'.
//!
//! Kernels use it to iterate a reduction in the order its input lies in memory: BatchNorm
//! statistics of a channels_last tensor reduce over N, H, W with C fastest, so the kept C is
//! the innermost dim (a column reduction) and neighbouring threads read neighbouring
//! channels, rather than striding by C through every row.

use crate::graph::{Graph, NodeId};
use crate::op::Op;
use crate::sym::Expr;
use std::collections::HashSet;

/// How many elementwise ops to look through for a stored ancestor.
const MAX_DEPTH: usize = 32;

/// The non-1 dims of `id`'s shape, outermost in memory first; `None` when that order is
/// the logical (row-major) one or cannot be told (symbolic strides, no stored ancestor).
pub fn memory_order(g: &Graph, id: NodeId) -> Option<Vec<usize>> {
    let mut seen = HashSet::new();
    walk(g, id, 0, &mut seen).filter(|o| permuted(o))
}

/// Whether `order` differs from the logical (row-major) order.
fn permuted(order: &[usize]) -> bool {
    order.windows(2).any(|w| w[0] > w[1])
}

/// Each node is looked at once per query (`seen`), so a query costs at most the nodes within
/// `MAX_DEPTH` elementwise ops, not the paths to them.
fn walk(g: &Graph, id: NodeId, depth: usize, seen: &mut HashSet<NodeId>) -> Option<Vec<usize>> {
    if !seen.insert(id) {
        return None;
    }
    let n = g.node(id);
    match &n.op {
        Op::Input { strides, .. } | Op::ExternOut { strides, .. } | Op::Layout { strides } | Op::Conv { strides, .. } => from_strides(&g.ty(id).shape, strides),
        Op::Unary(_) | Op::Cast(_) if depth < MAX_DEPTH => walk(g, n.inputs[0], depth + 1, seen),
        // A slice or pad keeps its operand's dims (a max pool's windows of a channels_last value).
        Op::Slice { .. } | Op::Pad { .. } if depth < MAX_DEPTH => walk(g, n.inputs[0], depth + 1, seen),
        // A matrix product is stored row-major ([Note: permuted views keep their order]).
        Op::Matmul { .. } => Some(non_1_dims(&g.ty(id).shape)),
        // [Note: permuted views keep their order] A permute reads its operand where it lies:
        // output dim `d` is operand dim `perm[d]`, so the operand's order names the output's
        // dims through the inverse permutation. ConvNeXt's MLP runs in NHWC (a matrix product,
        // row-major) and permutes back to NCHW before the layer scale and the residual add;
        // without this, those elementwise kernels walked the NHWC product in NCHW order,
        // striding by the channels on every load and store (1.1 ms for a 38 MB add on the H100).
        // Elementwise ops on a permuted view keep its memory order in eager too.
        Op::Permute(perm) if depth < MAX_DEPTH => {
            let inner = walk(g, n.inputs[0], depth + 1, seen)?;
            inner.iter().map(|&e| perm.iter().position(|&p| p == e)).collect()
        }
        // A reshape of a row-major value is row-major; one that splits one dim into two (a view
        // in any layout): the two take the split dim's place, outer part first.
        Op::Reshape(to) if depth < MAX_DEPTH => {
            let from = &g.ty(n.inputs[0]).shape;
            let inner = walk(g, n.inputs[0], depth + 1, seen)?;
            if !permuted(&inner) {
                return Some(non_1_dims(to));
            }
            let d = split_dim(from, to)?;
            let mut order = Vec::with_capacity(inner.len() + 1);
            for e in inner {
                match e.cmp(&d) {
                    std::cmp::Ordering::Less => order.push(e),
                    std::cmp::Ordering::Equal => order.extend([d, d + 1].into_iter().filter(|&k| !to[k].is_const(1))),
                    std::cmp::Ordering::Greater => order.push(e + 1),
                }
            }
            Some(order)
        }
        // A concatenation lies in its operands' order (they share it but for the cat dim's
        // size): an Inception block's branches, channels_last, concatenated along channels.
        Op::Cat { .. } if depth < MAX_DEPTH => n.inputs.iter().find_map(|&i| walk(g, i, depth + 1, seen).filter(|o| permuted(o))),
        Op::Binary(_) | Op::Where if depth < MAX_DEPTH => {
            let shape = &g.ty(id).shape;
            n.inputs.iter().filter(|&&i| g.ty(i).shape == *shape).find_map(|&i| walk(g, i, depth + 1, seen).filter(|o| permuted(o)))
        }
        _ => None,
    }
}

/// The non-1 dims of `shape` in logical (row-major) order: the memory order of a row-major
/// value, and the dims a kernel's domain keeps.
pub fn non_1_dims(shape: &[Expr]) -> Vec<usize> {
    (0..shape.len()).filter(|&d| !shape[d].is_const(1)).collect()
}

/// The dim `d` of `from` that `to` splits into two (`to` is `from` with `from[d]` replaced
/// by `to[d], to[d + 1]`, whose product it is).
fn split_dim(from: &[Expr], to: &[Expr]) -> Option<usize> {
    if to.len() != from.len() + 1 {
        return None;
    }
    let d = (0..from.len()).find(|&d| from[d] != to[d])?.min(from.len() - 1);
    let same = from[..d] == to[..d] && from[d + 1..] == to[d + 2..];
    (same && to[d].mul(&to[d + 1]) == from[d]).then_some(d)
}

/// Dense strides for `shape` laid out in `order` (its non-1 dims, outermost first, as
/// [`memory_order`] gives them). A size-1 dim takes the stride PyTorch gives it in the same
/// layout: it sits just outside the first dim of `order` that follows it logically (the
/// batch dim of a channels_last `[1, C, H, W]` gets `C * H * W`, not 1). Its stride does not
/// move any element, but ATen reads layouts from strides: given batch stride 1, a
/// convolution takes a channels_last `[1, C, H, W]` operand for NCHW, copies it and returns
/// NCHW.
pub fn dense_strides(shape: &[Expr], order: &[usize]) -> Vec<Expr> {
    let mut full: Vec<usize> = Vec::with_capacity(shape.len());
    let ones: Vec<usize> = (0..shape.len()).filter(|&d| !order.contains(&d)).collect();
    let mut next_one = 0;
    for &d in order {
        while next_one < ones.len() && ones[next_one] < d {
            full.push(ones[next_one]);
            next_one += 1;
        }
        full.push(d);
    }
    full.extend_from_slice(&ones[next_one..]);
    let mut strides = vec![Expr::one(); shape.len()];
    let mut acc = Expr::one();
    for &d in full.iter().rev() {
        strides[d] = acc.clone();
        acc = acc.mul(&shape[d]);
    }
    strides
}

/// Where a computed elementwise value (or a concatenation) is stored: in the memory order of
/// the operands it is computed from (a ReLU-backward of channels_last gradients stays
/// channels_last; so do the concatenated branches of an Inception block), so the
/// kernel writing it and the kernels reading it walk memory in order. `None`: row-major.
/// Graph outputs keep eager's strides (the `layout` op), except those of free layout
/// ([`Graph::free_layout_from`]: a forward's saved tensors).
pub fn inherited_order(g: &Graph, id: NodeId) -> Option<Vec<usize>> {
    if g.fixed_layout_output(id) || !matches!(g.node(id).op, Op::Unary(_) | Op::Cast(_) | Op::Binary(_) | Op::Where | Op::Cat { .. }) {
        return None;
    }
    memory_order(g, id)
}

/// Non-1 dims sorted by decreasing stride (ties keep logical order). Symbolic strides have
/// an order when they are dense: the innermost dim's stride is 1 and each next dim's is the
/// previous one's times its size (a channels_last activation under dynamic shapes:
/// `[s1*s2*s3, 1, s1*s3, s1]`); `None` otherwise.
pub fn from_strides(shape: &[Expr], strides: &[Expr]) -> Option<Vec<usize>> {
    if strides.len() != shape.len() {
        return None;
    }
    let dims = non_1_dims(shape);
    if dims.iter().any(|&d| strides[d].as_const().is_none()) {
        return dense_chain(shape, strides, &dims);
    }
    let st: Vec<i64> = dims.iter().map(|&d| strides[d].as_const()).collect::<Option<_>>()?;
    let mut order: Vec<usize> = (0..dims.len()).collect();
    order.sort_by_key(|&k| std::cmp::Reverse(st[k]));
    Some(order.into_iter().map(|k| dims[k]).collect())
}

/// The order of `dims` (outermost first) when their strides chain densely from 1, compared
/// as canonical expressions; `None` when they do not.
fn dense_chain(shape: &[Expr], strides: &[Expr], dims: &[usize]) -> Option<Vec<usize>> {
    let mut left: Vec<usize> = dims.to_vec();
    let mut inner_first = Vec::with_capacity(dims.len());
    let mut want = Expr::one();
    while !left.is_empty() {
        let k = left.iter().position(|&d| strides[d] == want)?;
        let d = left.remove(k);
        want = want.mul(&shape[d]);
        inner_first.push(d);
    }
    inner_first.reverse();
    Some(inner_first)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parse::parse_graph as parse;

    #[test]
    fn concatenation_keeps_its_operands_order() {
        // Two channels_last branches concatenated along channels (an Inception block's), then
        // a ReLU: both are stored channels_last, and the max over a slice of the cat (a pool's
        // tap) reads it in that order.
        let g = parse(
            "graph g {\n  %0 = input index=0 strides=[1536, 1, 96, 24] : f32[2, 24, 4, 4]\n  %1 = input index=1 strides=[640, 1, 160, 40] : f32[2, 40, 4, 4]\n  %2 = cat dim=1 %0, %1 : f32[2, 64, 4, 4]\n  %3 = relu %2 : f32[2, 64, 4, 4]\n  %4 = slice dim=3 start=0 len=2 step=2 %3 : f32[2, 64, 4, 2]\n  %5 = slice dim=3 start=1 len=2 step=2 %3 : f32[2, 64, 4, 2]\n  %6 = max %4, %5 : f32[2, 64, 4, 2]\n  return %6\n}\n",
        )
        .unwrap();
        let cl = Some(vec![0, 2, 3, 1]);
        assert_eq!(inherited_order(&g, NodeId(2)), cl);
        assert_eq!(inherited_order(&g, NodeId(3)), cl);
        // (%6 is the graph output: stored with eager's strides, but computed in that order.)
        assert_eq!(memory_order(&g, NodeId(6)), cl);
    }

    #[test]
    fn channels_last_input_through_elementwise_ops() {
        let g = parse(
            "graph g {\n  %0 = input index=0 strides=[200704, 1, 3584, 64] : bf16[2, 64, 56, 56]\n  %1 = cast dtype=f32 %0 : f32[2, 64, 56, 56]\n  %2 = input index=1 strides=[64, 1, 1, 1] : f32[1, 64, 1, 1]\n  %3 = mul %1, %2 : f32[2, 64, 56, 56]\n  return %3\n}\n",
        )
        .unwrap();
        assert_eq!(memory_order(&g, NodeId(3)), Some(vec![0, 2, 3, 1]));
        assert_eq!(memory_order(&g, NodeId(2)), None);
    }

    #[test]
    fn free_layout_outputs_keep_their_operands_order() {
        // %3 is returned with eager's (row-major) strides, %4 (a saved tensor) with the order
        // it inherits; the text round-trips.
        let text = "graph g {\n  %0 = input index=0 strides=[200704, 1, 3584, 64] : f32[2, 64, 56, 56]\n  %1 = relu %0 : f32[2, 64, 56, 56]\n  %2 = scalar value=2.0 dtype=f32 : f32[]\n  %3 = mul %1, %2 : f32[2, 64, 56, 56]\n  %4 = add %1, %2 : f32[2, 64, 56, 56]\n  return %3 | free layout %4\n}\n";
        let g = parse(text).unwrap();
        assert_eq!(g.free_layout_from, Some(1));
        assert_eq!(g.to_string(), text);
        assert_eq!(inherited_order(&g, NodeId(3)), None);
        assert_eq!(inherited_order(&g, NodeId(4)), Some(vec![0, 2, 3, 1]));
        assert_eq!(inherited_order(&g, NodeId(1)), Some(vec![0, 2, 3, 1]));
    }

    #[test]
    fn dense_strides_of_an_order() {
        let shape: Vec<Expr> = [2, 64, 1, 56].iter().map(|&v| Expr::constant(v)).collect();
        let st: Vec<Option<i64>> = dense_strides(&shape, &[0, 3, 1]).iter().map(|e| e.as_const()).collect();
        assert_eq!(st, vec![Some(3584), Some(1), Some(3584), Some(64)]);
        // A batch of one channels_last: PyTorch's strides, which ATen reads as channels_last.
        let shape: Vec<Expr> = [1, 64, 16, 16].iter().map(|&v| Expr::constant(v)).collect();
        let st: Vec<Option<i64>> = dense_strides(&shape, &[2, 3, 1]).iter().map(|e| e.as_const()).collect();
        assert_eq!(st, vec![Some(16384), Some(1), Some(1024), Some(64)]);
    }

    #[test]
    fn a_split_batch_dim_keeps_channels_last() {
        let g = parse(
            "graph g {\n  %0 = input index=0 strides=[200704, 1, 14336, 1024] : bf16[64, 1024, 14, 14]\n  %1 = reshape shape=[8, 8, 1024, 14, 14] %0 : bf16[8, 8, 1024, 14, 14]\n  return %1\n}\n",
        )
        .unwrap();
        assert_eq!(memory_order(&g, NodeId(1)), Some(vec![0, 1, 3, 4, 2]));
    }

    #[test]
    fn permuted_row_major_values_keep_their_order() {
        // [Note: permuted views keep their order]: ConvNeXt's MLP output (a matrix product's
        // rows, reshaped to NHWC) permuted back to NCHW and scaled lies channels_last; so does
        // the same permute of a row-major input. A permute of a channels_last value back to
        // NHWC is row-major. A permute of a value of unknown order has none.
        let g = parse(
            "graph g {\n  %0 = input index=0 strides=[96, 1] : bf16[512, 96]\n  %1 = reshape shape=[2, 16, 16, 96] %0 : bf16[2, 16, 16, 96]\n  %2 = permute dims=[0, 3, 1, 2] %1 : bf16[2, 96, 16, 16]\n  %3 = input index=1 strides=[96, 1, 1, 1] : f32[1, 96, 1, 1]\n  %4 = cast dtype=f32 %2 : f32[2, 96, 16, 16]\n  %5 = mul %4, %3 : f32[2, 96, 16, 16]\n  %6 = permute dims=[0, 2, 3, 1] %5 : f32[2, 16, 16, 96]\n  %7 = sum dims=[3] keepdim=true %6 : f32[2, 16, 16, 1]\n  %8 = permute dims=[0, 3, 1, 2] %7 : f32[2, 1, 16, 16]\n  %9 = exp %8 : f32[2, 1, 16, 16]\n  return %6, %9\n}\n",
        )
        .unwrap();
        assert_eq!(memory_order(&g, NodeId(2)), Some(vec![0, 2, 3, 1]));
        assert_eq!(inherited_order(&g, NodeId(5)), Some(vec![0, 2, 3, 1]));
        assert_eq!(memory_order(&g, NodeId(6)), None);
        assert_eq!(memory_order(&g, NodeId(9)), None);
    }

    #[test]
    fn row_major_has_no_order_and_dense_symbolic_strides_have_one() {
        let g = parse(
            "graph g {\n  %0 = input index=0 strides=[12, 4, 1] : f32[2, 3, 4]\n  %1 = input index=1 strides=[1, s0] : f32[s0, 8]\n  %2 = input index=2 strides=[s1*s2*s3, 1, s1*s3, s1] : f32[s0, s1, s2, s3]\n  %3 = input index=3 strides=[1, 2*s0] : f32[s0, 8]\n  return %0, %1, %2, %3\n}\n",
        )
        .unwrap();
        assert_eq!(memory_order(&g, NodeId(0)), None);
        assert_eq!(memory_order(&g, NodeId(1)), Some(vec![1, 0]));
        assert_eq!(memory_order(&g, NodeId(2)), Some(vec![0, 2, 3, 1]));
        // Not dense (a gap between the columns): no order.
        assert_eq!(memory_order(&g, NodeId(3)), None);
    }
}
