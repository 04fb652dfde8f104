//! Matmul epilogues: work after a matmul that the matrix library does in the same call.
//!
//! - `relu(matmul(a, b[, bias]))` becomes one matmul whose epilogue applies the relu.
//! - `matmul(a, b[, bias]) + r`, with `r` of the result's shape and dtype (a residual
//!   connection), becomes one matmul that adds `r` as cuBLASLt's C operand (beta = 1); also
//!   through a reshape of the matmul's result (`linear` on 3-d input: `view(addmm) + r`),
//!   where `r` is reshaped to the matmul's shape and the sum back.
//!
//! Each only when the matmul (and the reshape) has that op as its one user and is not a graph
//! output, and a residual stored with its own strides has unit stride along rows. Not when
//! the sum is laid out other than row-major (a `layout` user, e.g. eager's strides for
//! `rt.t() + linear(h, w)`): cuBLASLt would write it row-major and a copy would follow, where
//! one pointwise kernel reads both operands and writes the sum in its layout. Every other
//! activation is left to the pointwise kernels that follow the matmul.

use crate::dce::dce;
use braze_ir::{contiguous_strides, BinaryOp, Epilogue, Graph, NodeId, Op, UnaryOp};

/// Whether a node that is stored as it is (an input or extern result, with its own strides)
/// has row-major rows, as cuBLASLt's C operand needs. Other nodes are made so by the
/// scheduler (views it cannot pass are copied).
fn rows_unit_stride(g: &Graph, r: NodeId) -> bool {
    match &g.node(r).op {
        Op::Input { strides, .. } | Op::ExternOut { strides, .. } => {
            let shape = &g.ty(r).shape;
            strides.last().is_none_or(|s| s.is_const(1)) || shape.last().is_some_and(|n| n.is_const(1))
        }
        _ => true,
    }
}

pub fn matmul_epilogue(g: &Graph) -> Graph {
    let users = g.users();
    // `n` feeds only `u` and is not a graph output.
    let only_user = |n: NodeId, u: NodeId| users[n.index()].iter().all(|&x| x == u) && !g.outputs.contains(&n);
    // A plain matmul (no epilogue yet): its tf32 flag.
    let plain = |m: NodeId| match g.node(m).op {
        Op::Matmul { epilogue: Epilogue::None, tf32, residual: false } => Some(tf32),
        _ => None,
    };
    // `n` is stored in a layout other than row-major.
    let permuted_user = |n: NodeId| {
        let rm = contiguous_strides(&g.ty(n).shape);
        users[n.index()].iter().any(|&u| matches!(&g.node(u).op, Op::Layout { strides } if *strides != rm))
    };
    let mapped = |map: &[NodeId], ids: &[NodeId]| ids.iter().map(|i| map[i.index()]).collect::<Vec<_>>();
    let mut out = Graph::like(g);
    let mut map: Vec<NodeId> = Vec::with_capacity(g.nodes.len());
    for id in g.ids() {
        let n = g.node(id);
        let mut new = None;
        match n.op {
            Op::Unary(UnaryOp::Relu) => {
                let m = n.inputs[0];
                if let (Some(tf32), true) = (plain(m), only_user(m, id)) {
                    let op = Op::Matmul { epilogue: Epilogue::Relu, tf32, residual: false };
                    new = out.add(op, mapped(&map, &g.node(m).inputs)).ok();
                }
            }
            Op::Binary(BinaryOp::Add) if !permuted_user(id) => {
                let (x, y) = (n.inputs[0], n.inputs[1]);
                for (p, r) in [(x, y), (y, x)] {
                    // The matmul, directly or under a reshape.
                    let (m, reshaped) = match &g.node(p).op {
                        Op::Reshape(_) if only_user(p, id) => (g.node(p).inputs[0], true),
                        _ => (p, false),
                    };
                    let Some(tf32) = plain(m).filter(|_| only_user(m, if reshaped { p } else { id })) else { continue };
                    if m == r || p == r || g.ty(r) != g.ty(id) || g.ty(p) != g.ty(id) || !rows_unit_stride(g, r) {
                        continue;
                    }
                    let mshape = g.ty(m).shape.clone();
                    let c = if reshaped { out.add(Op::Reshape(mshape), vec![map[r.index()]]).ok() } else { Some(map[r.index()]) };
                    let Some(c) = c else { continue };
                    let mut ins = mapped(&map, &g.node(m).inputs);
                    ins.push(c);
                    let Ok(mm) = out.add(Op::Matmul { epilogue: Epilogue::None, tf32, residual: true }, ins) else { continue };
                    new = if reshaped { out.add(Op::Reshape(g.ty(id).shape.clone()), vec![mm]).ok() } else { Some(mm) };
                    break;
                }
            }
            _ => {}
        }
        let new = match new {
            Some(v) if out.ty(v) == g.ty(id) => v,
            _ => out.add_typed(n.op.clone(), mapped(&map, &n.inputs), n.ty.clone()),
        };
        map.push(new);
    }
    out.outputs_from(g, &map);
    dce(&out)
}
