//! Split reductions: on a GPU, a reduction with few kept points and many reduced elements
//! runs on a handful of blocks, each walking a long row. BatchNorm statistics are the
//! common case: over N, H, W of a 64×256×56×56 activation only 256 points are kept (32
//! blocks of a column kernel), each reducing 200 704 elements.
//!
//! The reduction is done in two stages. Stage 1 keeps one more dim, a "part" dim, so that
//! `kept × parts` points reduce in parallel; stage 2 reduces the parts. Parts are as few as
//! give two blocks per wanted block (stage 1 rows stay long). They come from the outermost
//! reduced dim in memory order that has a divisor of at least that many (the batch dim of
//! NCHW and NHWC): its elements are the parts, or it is reshaped into (parts, piece) (a view
//! in any layout; `x.sum()` of a 1-d tensor splits that way). No data moves, and stage 1
//! reads its input in memory order. Stage 1 rows have at least [`MIN_PIECE`] elements.
//!
//! Sum, prod, amax, amin, any and all combine their partial results with the same op.
//! Variance combines per-part population variances `v_p` and means `m_p` of equal-sized
//! parts exactly (the law of total variance): `var = mean(v_p) + mean((m_p - mean(m_p))²)`,
//! times `n / (n - correction)`. Half-precision sums, products and variances run both
//! stages in f32 and round once, as a one-stage kernel does. Arg-reductions are left alone.

use crate::cse::cse;
use crate::dce::dce;
use braze_ir::memory_order::{memory_order, non_1_dims};
use braze_ir::{BinaryOp, DType, Expr, Graph, Lit, Node, NodeId, Op, ReduceKind};

/// Reduced elements per kept point below which a row (kept dims outer) is not split.
pub const MIN_SPLIT_LEN: i64 = 1 << 16;
/// The same for a column reduction (a kept dim innermost in memory), whose blocks each take
/// several kept points.
pub const MIN_SPLIT_LEN_COLUMN: i64 = 1 << 12;
/// Kept points a column kernel's block takes (braze-codegen's `COL_X`; a block reading 16-bit
/// or byte elements takes 2× or 4× as many, [Note: column geometry], and then runs on fewer
/// blocks than planned here, within the margin of two blocks per wanted block). A vector
/// column kernel ([Note: vector columns]) takes 8 threads × 8 bytes of points: 16 of f32, 32
/// of bf16, so channels_last bf16 statistics of 64×256×56×56 split for 264 blocks run on 256
/// (measured at 69% of the H200's copy bandwidth, Inductor's time).
pub const COLUMN_POINTS_PER_BLOCK: i64 = 8;
/// Smallest part count of the fallback split (no dim has enough parts).
pub const MIN_PARTS: i64 = 8;
/// Smallest stage-1 row.
pub const MIN_PIECE: i64 = 64;

/// Splits every reduction that would run on fewer than `min_blocks` blocks.
pub fn split_reductions(g: &Graph, min_blocks: i64) -> Graph {
    let split = |g: &Graph, out: &mut Graph, map: &[NodeId], id: NodeId| {
        let n = g.node(id);
        plan(g, id, min_blocks).and_then(|p| emit(out, n, map[n.inputs[0].index()], &p).ok())
    };
    match crate::rewrite::rebuild(g, split) {
        // A variance and a mean of the same input share their stage 1 input and sums.
        Some(out) => cse(&dce(&out)),
        None => g.clone(),
    }
}

#[derive(Debug, Clone, PartialEq)]
struct Plan {
    kind: ReduceKind,
    /// The reduction's dims, sorted.
    dims: Vec<usize>,
    keepdim: bool,
    correction: i64,
    /// The input's shape.
    shape: Vec<Expr>,
    /// The dim whose elements become parts.
    at: usize,
    /// `Some(p)`: dim `at` is reshaped into (p, size / p); `None`: its elements are the parts.
    reshape: Option<i64>,
    /// Another reduced dim whose elements are parts too (the parts are its elements times
    /// those of `at`): the batch dim when neither it nor any other dim alone gives enough.
    with: Option<usize>,
}

fn plan(g: &Graph, id: NodeId, min_blocks: i64) -> Option<Plan> {
    let n = g.node(id);
    let Op::Reduce { kind, dims, keepdim, correction } = &n.op else { return None };
    if matches!(kind, ReduceKind::ArgMax | ReduceKind::ArgMin) {
        return None;
    }
    let shape = g.ty(n.inputs[0]).shape.clone();
    let size = |d: usize| shape[d].as_const();
    let reduced: i64 = dims.iter().map(|&d| size(d)).product::<Option<i64>>()?;
    let kept: i64 = (0..shape.len()).filter(|d| !dims.contains(d)).map(size).product::<Option<i64>>()?;
    // Non-1 dims outermost in memory first.
    let order = memory_order(g, n.inputs[0]).unwrap_or_else(|| non_1_dims(&shape));
    let column = order.last().is_some_and(|d| !dims.contains(d));
    let (min_len, per_block) = if column { (MIN_SPLIT_LEN_COLUMN, COLUMN_POINTS_PER_BLOCK) } else { (MIN_SPLIT_LEN, 1) };
    if reduced < min_len || kept >= min_blocks * per_block {
        return None;
    }
    let red_order: Vec<usize> = order.iter().copied().filter(|d| dims.contains(d)).collect();
    let base = Plan { kind: *kind, dims: dims.clone(), keepdim: *keepdim, correction: *correction, shape: shape.clone(), at: 0, reshape: None, with: None };
    // Enough parts for two blocks per wanted block, and no more: stage 1 rows stay long
    // (BatchNorm over 64×1024×14×14 splits the batch into 8 parts of 8 images, not 64 parts
    // of 196 elements, whose combination would cost more than their loads).
    let need = ((2 * min_blocks * per_block + kept - 1) / kept.max(1)).max(2);
    // The outermost reduced dim with a divisor p >= need leaving rows of MIN_PIECE: its
    // elements are the parts (p == its size) or it is reshaped into (p, size / p).
    for &at in &red_order {
        let s = size(at)?;
        if let Some(p) = (need..=s.min(need * 16)).find(|p| s % p == 0 && reduced / p >= MIN_PIECE) {
            return Some(Plan { at, reshape: (p != s).then_some(p), ..base });
        }
    }
    // [Note: split pairs] Otherwise as many parts as the largest reduced dim gives (the
    // outermost of equals), when that is at least half the parts wanted; else the outermost
    // reduced dim's elements times a divisor of the next one's: a 16-channel BatchNorm over
    // 32×112×112 (MobileNet-v3-small's stem, channels_last) wants 264 parts, and gets 32 × 14
    // (rows of 8 × 112) instead of the 112 of one dim. Its stage 1 reads the input with H
    // split in two dims; a pointwise value it reduces is stored by stage 1's kernel ([Note:
    // split dims] in braze-sched).
    let largest = red_order.iter().copied().filter(|&d| size(d).is_some_and(|s| s >= MIN_PARTS && reduced / s >= MIN_PIECE)).min_by_key(|&d| std::cmp::Reverse(size(d)));
    if largest.and_then(size).is_some_and(|s| 2 * s >= need) {
        return Some(Plan { at: largest?, ..base });
    }
    if let [first, next, ..] = red_order[..] {
        let (s0, s1) = (size(first)?, size(next)?);
        let want = (need + s0 - 1) / s0.max(1);
        if s0 > 1 {
            if let Some(p) = (want.max(2)..=s1.min(want * 16)).find(|p| s1 % p == 0 && reduced / (s0 * p) >= MIN_PIECE) {
                return Some(Plan { at: next, reshape: (p != s1).then_some(p), with: Some(first), ..base });
            }
        }
    }
    Some(Plan { at: largest?, ..base })
}

fn emit(out: &mut Graph, n: &Node, x: NodeId, p: &Plan) -> Result<NodeId, braze_ir::Error> {
    let dtype = out.ty(x).dtype;
    let widen = matches!(dtype, DType::F16 | DType::BF16) && matches!(p.kind, ReduceKind::Sum | ReduceKind::Prod | ReduceKind::Var);
    let x = if widen { out.add(Op::Cast(DType::F32), vec![x])? } else { x };
    let cdt = if widen { DType::F32 } else { dtype };
    // Stage 1's input, its reduced dims and the part dim's position in it.
    let (x1, red1, part) = match p.reshape {
        Some(parts) => {
            let mut shape = p.shape[..p.at].to_vec();
            shape.push(Expr::constant(parts));
            shape.push(Expr::constant(p.shape[p.at].as_const().expect("static") / parts));
            shape.extend_from_slice(&p.shape[p.at + 1..]);
            let x1 = out.add(Op::Reshape(shape), vec![x])?;
            let red1: Vec<usize> = p.dims.iter().map(|&d| if d < p.at { d } else { d + 1 }).collect();
            (x1, red1, p.at)
        }
        None => (x, p.dims.iter().copied().filter(|&d| d != p.at).collect(), p.at),
    };
    // The second part dim (`with`), at its place in stage 1's input.
    let with = p.with.map(|w| if w > p.at && p.reshape.is_some() { w + 1 } else { w });
    let red1: Vec<usize> = red1.into_iter().filter(|&d| Some(d) != with).collect();
    let rank1 = out.ty(x1).rank();
    // The part dims' positions among stage 1's kept dims.
    let kept_pos = |dim: usize| (0..dim).filter(|d| !red1.contains(d)).count();
    let mut pos: Vec<usize> = std::iter::once(part).chain(with).map(kept_pos).collect();
    pos.sort_unstable();
    debug_assert!(part < rank1);
    let red = |kind: ReduceKind, dims: Vec<usize>, keepdim: bool| Op::Reduce { kind, dims, keepdim, correction: 0 };
    let mut r = if p.kind == ReduceKind::Var {
        let total = p.shape.iter().enumerate().filter(|(d, _)| p.dims.contains(d)).map(|(_, s)| s.as_const().expect("static")).product::<i64>();
        let parts: i64 = std::iter::once(part).chain(with).map(|d| out.ty(x1).shape[d].as_const().expect("static")).product();
        let piece = total / parts;
        let scalar = |out: &mut Graph, v: f64| out.add(Op::Scalar { value: Lit::F(v), dtype: cdt }, vec![]);
        let v1 = out.add(red(ReduceKind::Var, red1.clone(), false), vec![x1])?;
        let s1 = out.add(red(ReduceKind::Sum, red1, false), vec![x1])?;
        let k_piece = scalar(out, piece as f64)?;
        let m1 = out.add(Op::Binary(BinaryOp::Div), vec![s1, k_piece])?;
        let k_parts = scalar(out, parts as f64)?;
        let sm = out.add(red(ReduceKind::Sum, pos.clone(), true), vec![m1])?;
        let m = out.add(Op::Binary(BinaryOp::Div), vec![sm, k_parts])?;
        let dev = out.add(Op::Binary(BinaryOp::Sub), vec![m1, m])?;
        let dev2 = out.add(Op::Binary(BinaryOp::Mul), vec![dev, dev])?;
        let within = out.add(red(ReduceKind::Sum, pos.clone(), false), vec![v1])?;
        let between = out.add(red(ReduceKind::Sum, pos, false), vec![dev2])?;
        let both = out.add(Op::Binary(BinaryOp::Add), vec![within, between])?;
        // (within + between) / parts, then n / (n - correction) for the correction.
        let denom = (total - p.correction).max(0) as f64;
        let factor = if denom > 0.0 { total as f64 / denom / parts as f64 } else { f64::NAN };
        let k = scalar(out, factor)?;
        out.add(Op::Binary(BinaryOp::Mul), vec![both, k])?
    } else {
        let a = out.add(red(p.kind, red1, false), vec![x1])?;
        out.add(red(p.kind, pos, false), vec![a])?
    };
    if p.keepdim {
        let shape: Vec<Expr> = p.shape.iter().enumerate().map(|(d, s)| if p.dims.contains(&d) { Expr::one() } else { s.clone() }).collect();
        r = out.add(Op::Reshape(shape), vec![r])?;
    }
    if cdt != dtype {
        r = out.add(Op::Cast(dtype), vec![r])?;
    }
    if out.node(r).ty != n.ty {
        return Err(braze_ir::Error::Invalid("split changed the type".into()));
    }
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;
    use braze_ir::parse::parse_graph;

    fn plan_of(text: &str, min_blocks: i64) -> Option<Plan> {
        let g = parse_graph(text).unwrap();
        let id = g.ids().find(|&i| matches!(g.node(i).op, Op::Reduce { .. })).unwrap();
        plan(&g, id, min_blocks)
    }

    #[test]
    fn batchnorm_statistics_split_the_batch_or_a_spatial_dim() {
        // channels_last: C innermost, a column reduction over N, H, W. 256 channels want 17
        // parts (2 × 264 blocks × 8 points): the batch of 64 is reshaped into 32 × 2.
        let cl = "graph g {\n  %0 = input index=0 strides=[802816, 1, 14336, 256] : f32[64, 256, 56, 56]\n  %1 = var dims=[0, 2, 3] keepdim=true correction=0 %0 : f32[1, 256, 1, 1]\n  return %1\n}\n";
        let p = plan_of(cl, 264).unwrap();
        assert_eq!((p.at, p.reshape), (0, Some(32)));
        // Enough kept points: no split.
        assert!(plan_of(cl, 16).is_none());
        let g = parse_graph(cl).unwrap();
        let s = split_reductions(&g, 264);
        assert!(braze_ir::verify::verify(&s).is_empty());
        assert_eq!(s.ty(s.outputs[0]), g.ty(g.outputs[0]));
        assert!(s.to_string().contains("var dims=[1, 3, 4] keepdim=false"), "{s}");
        // 64 channels want 66 parts: no divisor of the batch, so H (112) gives them.
        let wide = cl.replace("[802816, 1, 14336, 256] : f32[64, 256, 56, 56]", "[802816, 1, 7168, 64] : f32[64, 64, 112, 112]").replace("f32[1, 256, 1, 1]", "f32[1, 64, 1, 1]");
        let p = plan_of(&wide, 264).unwrap();
        assert_eq!((p.at, p.reshape), (2, None));
    }

    #[test]
    fn few_channels_split_the_batch_and_a_spatial_dim() {
        // MobileNet-v3-small's stem: 16 channels want 264 parts; no dim alone has a divisor
        // that many, so the batch's 32 times H (112) reshaped into 14 × 8.
        let stem = "graph g {\n  %0 = input index=0 strides=[200704, 1, 1792, 16] : f32[32, 16, 112, 112]\n  %1 = var dims=[0, 2, 3] keepdim=true correction=1 %0 : f32[1, 16, 1, 1]\n  %2 = sum dims=[0, 2, 3] keepdim=false %0 : f32[16]\n  return %1, %2\n}\n";
        let p = plan_of(stem, 264).unwrap();
        assert_eq!((p.at, p.reshape, p.with), (2, Some(14), Some(0)));
        let g = parse_graph(stem).unwrap();
        let s = split_reductions(&g, 264);
        assert!(braze_ir::verify::verify(&s).is_empty(), "{s}");
        for (a, b) in s.outputs.iter().zip(&g.outputs) {
            assert_eq!(s.ty(*a), g.ty(*b));
        }
        // Stage 1 keeps the batch, the channels and the 14 parts of H (rows of 8 × 112); stage
        // 2 sums over the batch and the parts.
        let text = s.to_string();
        assert!(text.contains("var dims=[3, 4] keepdim=false"), "{text}");
        assert!(text.contains("sum dims=[0, 2] keepdim=false %3"), "{text}");
    }

    #[test]
    fn long_trailing_row_is_reshaped() {
        let g = "graph g {\n  %0 = input index=0 strides=[1] : bf16[1048576]\n  %1 = sum dims=[0] keepdim=false %0 : bf16[]\n  return %1\n}\n";
        let p = plan_of(g, 264).unwrap();
        assert_eq!((p.at, p.reshape), (0, Some(1024)));
        let s = split_reductions(&parse_graph(g).unwrap(), 264);
        // Both stages in f32, one rounding at the end.
        assert!(s.to_string().contains("cast dtype=f32"), "{s}");
        assert!(s.to_string().contains("cast dtype=bf16"), "{s}");
    }

    #[test]
    fn short_rows_and_arg_reductions_stay() {
        assert!(plan_of("graph g {\n  %0 = input index=0 strides=[512, 1] : f32[8, 512]\n  %1 = sum dims=[1] keepdim=false %0 : f32[8]\n  return %1\n}\n", 264).is_none());
        assert!(plan_of("graph g {\n  %0 = input index=0 strides=[1] : f32[1048576]\n  %1 = argmax dims=[0] keepdim=false %0 : i64[]\n  return %1\n}\n", 264).is_none());
    }
}
