//! Matmul epilogues: work after a matmul that the matrix library does in the same call.
//!
//! - `relu(matmul(a, b[, bias]))` becomes one matmul whose epilogue applies the relu.
//! - `matmul(a, b[, bias]) + r`, with `r` of the result's shape and dtype (a residual
//!   connection), becomes one matmul that adds `r` as cuBLASLt's C operand (beta = 1).
//!
//! Both only when the matmul's one user is that op and the matmul is not a graph output (and
//! a residual stored with its own strides has unit stride along rows). Every
//! other activation is left to the pointwise kernels that follow the matmul.

use crate::dce::dce;
use braze_ir::{BinaryOp, Epilogue, Graph, Node, NodeId, Op, UnaryOp};

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
    let mut out = g.clone();
    // A plain matmul that only `id` uses.
    let fusable = |m: NodeId, id: NodeId| match g.node(m).op {
        Op::Matmul { epilogue: Epilogue::None, tf32, residual: false } => {
            (users[m.index()].iter().all(|&u| u == id) && !g.outputs.contains(&m)).then_some(tf32)
        }
        _ => None,
    };
    for id in g.ids() {
        match g.node(id).op {
            Op::Unary(UnaryOp::Relu) => {
                let m = g.node(id).inputs[0];
                if let Some(tf32) = fusable(m, id) {
                    let op = Op::Matmul { epilogue: Epilogue::Relu, tf32, residual: false };
                    out.nodes[id.index()] = Node { op, inputs: g.node(m).inputs.clone(), ty: g.node(id).ty.clone() };
                }
            }
            Op::Binary(BinaryOp::Add) => {
                let (x, y) = (g.node(id).inputs[0], g.node(id).inputs[1]);
                for (m, r) in [(x, y), (y, x)] {
                    let Some(tf32) = fusable(m, id) else { continue };
                    if m == r || g.ty(r).shape != g.ty(m).shape || g.ty(r).dtype != g.ty(m).dtype || g.ty(id) != g.ty(m) || !rows_unit_stride(g, r) {
                        continue;
                    }
                    let mut inputs = g.node(m).inputs.clone();
                    inputs.push(r);
                    let op = Op::Matmul { epilogue: Epilogue::None, tf32, residual: true };
                    out.nodes[id.index()] = Node { op, inputs, ty: g.node(id).ty.clone() };
                    break;
                }
            }
            _ => {}
        }
    }
    dce(&out)
}
