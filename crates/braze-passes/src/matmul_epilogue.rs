//! Matmul epilogues: `relu(matmul(a, b, bias))` becomes one matmul whose epilogue applies the
//! relu, when the relu is the matmul's only user and the matmul is not a graph output.
//! Leaves every other activation to the pointwise kernels that follow the matmul.

use crate::dce::dce;
use braze_ir::{Epilogue, Graph, Node, Op, UnaryOp};

pub fn matmul_epilogue(g: &Graph) -> Graph {
    let users = g.users();
    let mut out = g.clone();
    for id in g.ids() {
        if !matches!(g.node(id).op, Op::Unary(UnaryOp::Relu)) {
            continue;
        }
        let m = g.node(id).inputs[0];
        if let Op::Matmul { epilogue: Epilogue::None, tf32 } = g.node(m).op {
            if users[m.index()].len() == 1 && !g.outputs.contains(&m) {
                out.nodes[id.index()] = Node { op: Op::Matmul { epilogue: Epilogue::Relu, tf32 }, inputs: g.node(m).inputs.clone(), ty: g.node(id).ty.clone() };
            }
        }
    }
    dce(&out)
}
