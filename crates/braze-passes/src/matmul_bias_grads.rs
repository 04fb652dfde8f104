//! [Note: bias-gradient epilogues] A linear's backward computes its weight gradient as a
//! matmul of the output gradient `dY` (`[T, N]`) with the input, and its bias gradient as
//! `sum(dY, dim=0)`. cuBLASLt computes such sums over K in the matmul's epilogue
//! (`CUBLASLT_EPILOGUE_BGRADA` / `BGRADB`), as the matmul reads `dY` anyway: the column
//! reduction, a kernel of its own or a part of the kernel producing `dY`, goes away.
//!
//! A 16-bit sum over dim 0 of a 2-d value `G`, of `G`'s dtype (`[1, N]` kept or `[N]`) or
//! summed in f32 and rounded back to it (`sum(G, 0, dtype=float32)`, what CUDA's autograd
//! asks for under autocast), and a plain 2-d matmul (no epilogue, bias or residual, same
//! dtype) reading `G` become one matmul with a bias-gradient epilogue and a `bias_grad` node
//! for the sum:
//!
//! - `matmul(permute(G, [1, 0]), X)` (`nn.Linear`: `dW = dYᵀ X`): `a`'s sums over K,
//!   `bias_grad_a`;
//! - `matmul(X, G)` (GPT-2's Conv1D: `dW = Xᵀ dY`): `b`'s sums over K, `bias_grad_b`.
//!
//! Each matmul takes one sum, each sum one matmul, and only a matmul earlier in the graph
//! than its sum. A GPU-only stage (the CPU's BLAS has no such epilogue), run before
//! `split_reductions` would split the sum and `pad_matmuls` (which leaves these matmuls
//! alone: a padded M or N would pad the sums). Where cuBLASLt offers no algorithm for the
//! epilogue, braze-driver compiles the graph again without this stage.

use crate::dce::dce;
use braze_ir::{DType, Epilogue, Graph, NodeId, Op, ReduceKind, TensorTy};
use std::collections::HashMap;

pub fn matmul_bias_grads(g: &Graph) -> Graph {
    let users = g.users();
    // The node a sum's value ends in -> (matmul, epilogue); matmul -> that node.
    let mut sum_of: HashMap<NodeId, (NodeId, Epilogue)> = HashMap::new();
    let mut taken: HashMap<NodeId, NodeId> = HashMap::new();
    for id in g.ids() {
        let Some((grad, end)) = bias_sum(g, &users, id) else { continue };
        let plain = |m: NodeId| {
            matches!(g.node(m).op, Op::Matmul { epilogue: Epilogue::None, residual: false, .. })
                && g.node(m).inputs.len() == 2
                && g.ty(m).rank() == 2
                && g.ty(m).dtype == g.ty(grad).dtype
                && m.index() < end.index()
                && !taken.contains_key(&m)
        };
        // `matmul(X, G)`: G is b.
        let mut found = users[grad.index()].iter().copied().find(|&m| plain(m) && g.node(m).inputs[1] == grad).map(|m| (m, Epilogue::BiasGradB));
        // `matmul(Gᵀ, X)`: Gᵀ is a.
        if found.is_none() {
            found = users[grad.index()]
                .iter()
                .copied()
                .filter(|&p| matches!(&g.node(p).op, Op::Permute(perm) if perm == &[1, 0]))
                .flat_map(|p| users[p.index()].iter().copied().filter(move |&m| g.node(m).inputs.first() == Some(&p)))
                .find(|&m| plain(m))
                .map(|m| (m, Epilogue::BiasGradA));
        }
        if let Some((m, e)) = found {
            taken.insert(m, end);
            sum_of.insert(end, (m, e));
        }
    }
    if sum_of.is_empty() {
        return g.clone();
    }
    let mut out = Graph::like(g);
    let mut map: Vec<NodeId> = Vec::with_capacity(g.nodes.len());
    // Matmul (old id) -> its bias_grad node in `out`.
    let mut grad_of: HashMap<NodeId, NodeId> = HashMap::new();
    for id in g.ids() {
        let n = g.node(id);
        let ins: Vec<NodeId> = n.inputs.iter().map(|i| map[i.index()]).collect();
        let new = if let (Some(&s), Op::Matmul { tf32, .. }) = (taken.get(&id), &n.op) {
            let (_, epilogue) = sum_of[&s];
            let mm = out.add_typed(Op::Matmul { epilogue, tf32: *tf32, residual: false }, ins, n.ty.clone());
            let t = g.ty(id);
            let len = if epilogue == Epilogue::BiasGradA { t.shape[0].clone() } else { t.shape[1].clone() };
            grad_of.insert(id, out.add_typed(Op::BiasGrad, vec![mm], Some(TensorTy::new(t.dtype, vec![len]))));
            mm
        } else if let Some(&(m, _)) = sum_of.get(&id) {
            let v = grad_of[&m];
            let shape = g.ty(id).shape.clone();
            if shape.len() == 1 { v } else { out.add_typed(Op::Reshape(shape), vec![v], n.ty.clone()) }
        } else {
            out.add_typed(n.op.clone(), ins, n.ty.clone())
        };
        map.push(new);
    }
    out.outputs_from(g, &map);
    dce(&out)
}

/// A bias gradient's sum at `id`: (the 16-bit 2-d value `G` summed over dim 0, the node its
/// 16-bit result ends in). Either a sum of `G`'s dtype (`sum(G, 0)`), or the sum in f32 that
/// CUDA's autograd asks for and its rounding back, `cast(reshape*(sum(cast(G, f32), 0)), G's
/// dtype)` with each link read by the next alone: cuBLASLt's epilogue also sums in f32.
fn bias_sum(g: &Graph, users: &[Vec<NodeId>], id: NodeId) -> Option<(NodeId, NodeId)> {
    let n = g.node(id);
    let Op::Reduce { kind: ReduceKind::Sum, dims, .. } = &n.op else { return None };
    if dims != &[0] || g.ty(n.inputs[0]).rank() != 2 {
        return None;
    }
    let half = |t: DType| matches!(t, DType::BF16 | DType::F16);
    let x = n.inputs[0];
    let (tx, tr) = (g.ty(x).dtype, g.ty(id).dtype);
    if half(tx) && tr == tx {
        return Some((x, id));
    }
    let Op::Cast(DType::F32) = g.node(x).op else { return None };
    let grad = g.node(x).inputs[0];
    let t16 = g.ty(grad).dtype;
    if !half(t16) || tr != DType::F32 {
        return None;
    }
    let mut end = id;
    loop {
        let [next] = users[end.index()][..] else { return None };
        match g.node(next).op {
            Op::Reshape(_) => end = next,
            Op::Cast(t) if t == t16 => return Some((grad, next)),
            _ => return None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::count_ops as count;
    use braze_ir::parse::parse_graph as parse;

    #[test]
    fn linear_and_conv1d_bias_gradients_join_their_weight_gradients() {
        // nn.Linear's dW = dYᵀ X with sum(dY, 0) kept; Conv1D's dW = Xᵀ dY with the sum not kept.
        let g = parse(
            "graph g {
              %0 = input index=0 strides=[64, 1] : bf16[128, 64]
              %1 = input index=1 strides=[32, 1] : bf16[128, 32]
              %2 = permute dims=[1, 0] %0 : bf16[64, 128]
              %3 = matmul epilogue=none tf32=false %2, %1 : bf16[64, 32]
              %4 = sum dims=[0] keepdim=true %0 : bf16[1, 64]
              %5 = permute dims=[1, 0] %1 : bf16[32, 128]
              %6 = matmul epilogue=none tf32=false %5, %0 : bf16[32, 64]
              %7 = sum dims=[0] keepdim=false %0 : bf16[64]
              return %3, %4, %6, %7
            }",
        )
        .unwrap();
        let out = matmul_bias_grads(&g);
        assert!(braze_ir::verify::verify(&out).is_empty(), "{out}");
        assert_eq!(count(&out, |op| matches!(op, Op::Reduce { .. })), 0, "{out}");
        assert_eq!(count(&out, |op| matches!(op, Op::BiasGrad)), 2, "{out}");
        assert_eq!(count(&out, |op| matches!(op, Op::Matmul { epilogue: Epilogue::BiasGradA, .. })), 1, "{out}");
        assert_eq!(count(&out, |op| matches!(op, Op::Matmul { epilogue: Epilogue::BiasGradB, .. })), 1, "{out}");
        // Printed and parsed back the same.
        assert_eq!(parse(&out.to_string()).unwrap().to_string(), out.to_string());
    }

    #[test]
    fn sums_in_f32_rounded_back_join_too() {
        // CUDA autocast's linear backward (torch 2.11): sum(dY, 0, dtype=float32), then the
        // rounding to bf16 after a reshape. A sum in f32 kept in f32 is left alone.
        let g = parse(
            "graph g {
              %0 = input index=0 strides=[64, 1] : bf16[256, 64]
              %1 = input index=1 strides=[32, 1] : bf16[256, 32]
              %2 = permute dims=[1, 0] %0 : bf16[64, 256]
              %3 = matmul epilogue=none tf32=false %2, %1 : bf16[64, 32]
              %4 = cast dtype=f32 %0 : f32[256, 64]
              %5 = sum dims=[0] keepdim=true %4 : f32[1, 64]
              %6 = reshape shape=[64] %5 : f32[64]
              %7 = cast dtype=bf16 %6 : bf16[64]
              %8 = cast dtype=f32 %7 : f32[64]
              %9 = permute dims=[1, 0] %1 : bf16[32, 256]
              %10 = matmul epilogue=none tf32=false %9, %0 : bf16[32, 64]
              %11 = cast dtype=f32 %0 : f32[256, 64]
              %12 = sum dims=[0] keepdim=false %11 : f32[64]
              return %3, %8, %10, %12
            }",
        )
        .unwrap();
        let out = matmul_bias_grads(&g);
        assert!(braze_ir::verify::verify(&out).is_empty(), "{out}");
        assert_eq!(count(&out, |op| matches!(op, Op::BiasGrad)), 1, "{out}");
        assert_eq!(count(&out, |op| matches!(op, Op::Reduce { .. })), 1, "{out}");
        assert_eq!(count(&out, |op| matches!(op, Op::Matmul { epilogue: Epilogue::BiasGradA, .. })), 1, "{out}");
    }

    #[test]
    fn f32_sums_and_sums_before_their_matmul_are_left_alone() {
        let g = parse(
            "graph g {
              %0 = input index=0 strides=[64, 1] : f32[128, 64]
              %1 = input index=1 strides=[32, 1] : f32[128, 32]
              %2 = permute dims=[1, 0] %0 : f32[64, 128]
              %3 = matmul epilogue=none tf32=false %2, %1 : f32[64, 32]
              %4 = sum dims=[0] keepdim=true %0 : f32[1, 64]
              %5 = input index=2 strides=[64, 1] : bf16[128, 64]
              %6 = input index=3 strides=[32, 1] : bf16[128, 32]
              %7 = sum dims=[0] keepdim=true %5 : bf16[1, 64]
              %8 = permute dims=[1, 0] %5 : bf16[64, 128]
              %9 = matmul epilogue=none tf32=false %8, %6 : bf16[64, 32]
              return %3, %4, %7, %9
            }",
        )
        .unwrap();
        let out = matmul_bias_grads(&g);
        assert_eq!(count(&out, |op| matches!(op, Op::Reduce { .. })), 2, "{out}");
        assert_eq!(count(&out, |op| matches!(op, Op::BiasGrad)), 0, "{out}");
    }
}
