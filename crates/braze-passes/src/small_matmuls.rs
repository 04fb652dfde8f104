//! [Note: small matmuls] On the GPU a matmul of a few thousand multiply-adds costs its library
//! call, not its arithmetic: cuBLASLt picks split-K kernels for `2×64 @ 64×256` (a sgemm and
//! a `splitKreduce`, 5.7 µs of GPU time where the product needs nanoseconds), and what comes
//! before and after it (a LayerNorm, GELU with a scale) runs as kernels of their own. Twelve
//! tiny LayerNorm + MLP blocks were 63 kernels per call, GPU-bound at 147 µs under whole-graph
//! replay.
//!
//! So a static matmul of at most [`MAX_MACS`] multiply-adds becomes braze's own work: the
//! product of its operands broadcast against each other, summed over K
//! (`sum(a[.., M, 1, K] * bᵀ[.., 1, N, K], -1)`), in f32 for 16-bit operands as the library
//! accumulates, then its bias, residual and activation (`epilogue(a @ b + bias + residual)`,
//! the tanh GELU for `gelu`) and the rounding back. The scheduler fuses it like any
//! reduction: the producers of `a` (a LayerNorm's normalization) inline into the dot
//! products and the pointwise consumers into their epilogue. A GPU-only stage: on the CPU
//! the BLAS call is cheap and the broadcast form was slower (194 against 114 µs for the
//! twelve blocks).

use crate::dce::dce;
use braze_ir::{BinaryOp, DType, Epilogue, Expr, Graph, Lit, NodeId, Op, ReduceKind, UnaryOp};

/// The largest matmul (batch × M × N × K multiply-adds) computed by braze's kernels.
pub const MAX_MACS: i64 = 1 << 18;

pub fn small_matmuls(g: &Graph) -> Graph {
    match crate::rewrite::rebuild(g, as_reduction) {
        Some(out) => dce(&out),
        None => g.clone(),
    }
}

/// Matmul `id` as a reduction built in `out` (`map`: old ids to new), or None when it is not
/// small, static and of a plain, relu or gelu epilogue.
fn as_reduction(g: &Graph, out: &mut Graph, map: &[NodeId], id: NodeId) -> Option<NodeId> {
    let n = g.node(id);
    let ins: Vec<NodeId> = n.inputs.iter().map(|i| map[i.index()]).collect();
    let Op::Matmul { epilogue, residual, .. } = n.op else { return None };
    if !matches!(epilogue, Epilogue::None | Epilogue::Relu | Epilogue::Gelu) {
        return None;
    }
    let t = g.ty(id);
    let r = t.rank();
    let sizes: Vec<i64> = t.shape.iter().map(|e| e.as_const()).collect::<Option<_>>()?;
    let k = g.ty(n.inputs[0]).shape[r - 1].as_const()?;
    if sizes.iter().product::<i64>().saturating_mul(k) > MAX_MACS || k == 0 {
        return None;
    }
    let dt = t.dtype;
    let f32 = DType::F32;
    let up = |out: &mut Graph, x: NodeId| if out.ty(x).dtype == f32 { Some(x) } else { out.add(Op::Cast(f32), vec![x]).ok() };
    let scalar = |out: &mut Graph, c: f64| out.add(Op::Scalar { value: Lit::F(c), dtype: f32 }, vec![]).ok();
    let bin = |out: &mut Graph, op: BinaryOp, x: NodeId, y: NodeId| out.add(Op::Binary(op), vec![x, y]).ok();
    // a: [.., M, K] -> [.., M, 1, K]; b: [.., K, N] -> [.., 1, K, N] -> [.., 1, N, K].
    let a = up(out, ins[0])?;
    let mut sa = out.ty(a).shape.clone();
    sa.insert(r - 1, Expr::one());
    let a = out.add(Op::Reshape(sa), vec![a]).ok()?;
    let b = up(out, ins[1])?;
    let mut sb = out.ty(b).shape.clone();
    sb.insert(r - 2, Expr::one());
    let b = out.add(Op::Reshape(sb), vec![b]).ok()?;
    let mut perm: Vec<usize> = (0..=r).collect();
    perm.swap(r - 1, r);
    let b = out.add(Op::Permute(perm), vec![b]).ok()?;
    let prod = bin(out, BinaryOp::Mul, a, b)?;
    let mut v = out.add(Op::Reduce { kind: ReduceKind::Sum, dims: vec![r], keepdim: false, correction: 0 }, vec![prod]).ok()?;
    // Operands after a and b: [bias] [residual].
    let (bias, res) = match (&ins[2..], residual) {
        ([bias, res], true) => (Some(*bias), Some(*res)),
        ([res], true) => (None, Some(*res)),
        ([bias], false) => (Some(*bias), None),
        _ => (None, None),
    };
    if let Some(bias) = bias {
        let bias = up(out, bias)?;
        v = bin(out, BinaryOp::Add, v, bias)?;
    }
    if let Some(res) = res {
        let res = up(out, res)?;
        v = bin(out, BinaryOp::Add, v, res)?;
    }
    match epilogue {
        Epilogue::Relu => v = out.add(Op::Unary(UnaryOp::Relu), vec![v]).ok()?,
        Epilogue::Gelu => {
            // 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), cuBLASLt's GELU.
            let cube = bin(out, BinaryOp::Mul, v, v)?;
            let cube = bin(out, BinaryOp::Mul, cube, v)?;
            let c = scalar(out, 0.044715)?;
            let inner = bin(out, BinaryOp::Mul, cube, c)?;
            let inner = bin(out, BinaryOp::Add, v, inner)?;
            let c = scalar(out, (2.0 / std::f64::consts::PI).sqrt())?;
            let inner = bin(out, BinaryOp::Mul, inner, c)?;
            let th = out.add(Op::Unary(UnaryOp::Tanh), vec![inner]).ok()?;
            let one = scalar(out, 1.0)?;
            let th = bin(out, BinaryOp::Add, th, one)?;
            let half = scalar(out, 0.5)?;
            let hx = bin(out, BinaryOp::Mul, v, half)?;
            v = bin(out, BinaryOp::Mul, hx, th)?;
        }
        _ => {}
    }
    if dt != f32 {
        v = out.add(Op::Cast(dt), vec![v]).ok()?;
    }
    Some(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::count_ops as count;
    use braze_ir::parse::parse_graph as parse;

    #[test]
    fn small_matmuls_become_sums_large_ones_stay() {
        let g = parse(
            "graph g {
              %0 = input index=0 strides=[64, 1] : bf16[2, 64]
              %1 = input index=1 strides=[64, 1] : bf16[256, 64]
              %2 = input index=2 strides=[1] : bf16[256]
              %3 = permute dims=[1, 0] %1 : bf16[64, 256]
              %4 = matmul epilogue=gelu tf32=false %0, %3, %2 : bf16[2, 256]
              %5 = input index=3 strides=[1024, 1] : f32[1024, 1024]
              %6 = matmul epilogue=none tf32=false %5, %5 : f32[1024, 1024]
              return %4, %6
            }",
        )
        .unwrap();
        let out = small_matmuls(&g);
        assert!(braze_ir::verify::verify(&out).is_empty(), "{out}");
        assert_eq!(count(&out, |op| matches!(op, Op::Matmul { .. })), 1, "{out}");
        assert_eq!(count(&out, |op| matches!(op, Op::Reduce { kind: ReduceKind::Sum, .. })), 1, "{out}");
        assert_eq!(count(&out, |op| matches!(op, Op::Unary(UnaryOp::Tanh))), 1, "{out}");
        let ret = out.outputs[0];
        assert_eq!(out.ty(ret).dtype, DType::BF16);
        assert_eq!(out.ty(ret).shape, vec![Expr::constant(2), Expr::constant(256)]);
    }
}
