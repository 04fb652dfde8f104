//! [Note: bias-gradient epilogues] A linear's backward computes its weight gradient as a
//! matmul of the output gradient `dY` (`[T, N]`) with the input, and its bias gradient as
//! `sum(dY, dim=0)`. cuBLASLt computes such sums over K in the matmul's epilogue
//! (`CUBLASLT_EPILOGUE_BGRADA` / `BGRADB`), as the matmul reads `dY` anyway: the column
//! reduction, a kernel of its own or a part of the kernel producing `dY`, goes away.
//!
//! A 16-bit sum over dim 0 of a 2-d value `G`, of `G`'s dtype (`[1, N]` kept or `[N]`), and a
//! plain 2-d matmul (no epilogue, bias or residual, same dtype) reading `G` become one matmul
//! with a bias-gradient epilogue and a `bias_grad` node for the sum:
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
    // Sum node -> (matmul, epilogue); matmul -> its sum.
    let mut sum_of: HashMap<NodeId, (NodeId, Epilogue)> = HashMap::new();
    let mut taken: HashMap<NodeId, NodeId> = HashMap::new();
    for id in g.ids() {
        let n = g.node(id);
        let Op::Reduce { kind: ReduceKind::Sum, dims, .. } = &n.op else { continue };
        let x = n.inputs[0];
        let (tx, tr) = (g.ty(x), g.ty(id));
        if dims != &[0] || tx.rank() != 2 || tr.dtype != tx.dtype || !matches!(tx.dtype, DType::BF16 | DType::F16) {
            continue;
        }
        let plain = |m: NodeId| {
            matches!(g.node(m).op, Op::Matmul { epilogue: Epilogue::None, residual: false, .. })
                && g.node(m).inputs.len() == 2
                && g.ty(m).rank() == 2
                && m.index() < id.index()
                && !taken.contains_key(&m)
        };
        // `matmul(X, G)`: G is b.
        let mut found = users[x.index()].iter().copied().find(|&m| plain(m) && g.node(m).inputs[1] == x).map(|m| (m, Epilogue::BiasGradB));
        // `matmul(Gᵀ, X)`: Gᵀ is a.
        if found.is_none() {
            found = users[x.index()]
                .iter()
                .copied()
                .filter(|&p| matches!(&g.node(p).op, Op::Permute(perm) if perm == &[1, 0]))
                .flat_map(|p| users[p.index()].iter().copied().filter(move |&m| g.node(m).inputs.first() == Some(&p)))
                .find(|&m| plain(m))
                .map(|m| (m, Epilogue::BiasGradA));
        }
        if let Some((m, e)) = found {
            taken.insert(m, id);
            sum_of.insert(id, (m, e));
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

#[cfg(test)]
mod tests {
    use super::*;
    use braze_ir::parse::parse_graph as parse;

    fn count(g: &Graph, f: impl Fn(&Op) -> bool) -> usize {
        g.ids().filter(|&i| f(&g.node(i).op)).count()
    }

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
