//! Algebraic simplification: local identities, each written above its rule. A rule fires
//! only when the replacement has exactly the node's type (so `x * 1` with a broadcasting
//! `1` of higher rank is kept). Does not reassociate or reorder float arithmetic.

use crate::rewrite::{rewrite, Arg, Rewrite};
use braze_ir::{BinaryOp, Graph, Lit, Node, NodeId, Op, UnaryOp};

pub fn simplify(g: &Graph) -> Graph {
    rewrite(g, rule)
}

fn scalar(g: &Graph, id: NodeId) -> Option<f64> {
    match g.node(id).op {
        Op::Scalar { value, .. } => Some(value.as_f64()),
        _ => None,
    }
}

fn rule(g: &Graph, n: &Node) -> Option<Rewrite> {
    use Rewrite::Use;
    let ins = &n.inputs;
    let is = |i: usize, v: f64| scalar(g, ins[i]) == Some(v);
    match &n.op {
        Op::Binary(b) => match b {
            // x + 0 => x ; 0 + x => x
            BinaryOp::Add if is(1, 0.0) => Some(Use(ins[0])),
            BinaryOp::Add if is(0, 0.0) => Some(Use(ins[1])),
            // x - 0 => x
            BinaryOp::Sub if is(1, 0.0) => Some(Use(ins[0])),
            // x * 1 => x ; 1 * x => x
            BinaryOp::Mul if is(1, 1.0) => Some(Use(ins[0])),
            BinaryOp::Mul if is(0, 1.0) => Some(Use(ins[1])),
            // x / 1 => x
            BinaryOp::Div if is(1, 1.0) => Some(Use(ins[0])),
            // x ** 1 => x
            BinaryOp::Pow if is(1, 1.0) => Some(Use(ins[0])),
            // x ** 2 => x * x
            BinaryOp::Pow if is(1, 2.0) => Some(Rewrite::Op(Op::Binary(BinaryOp::Mul), vec![ins[0], ins[0]])),
            // x ** 3 => (x * x) * x (float: `powf` cost a tanh-GELU kernel three times the
            // time of its memory traffic on the H100; the product differs by at most an ulp)
            BinaryOp::Pow if is(1, 3.0) && g.ty(ins[0]).dtype.is_float() => {
                let mul = Op::Binary(BinaryOp::Mul);
                Some(Rewrite::Chain(vec![(mul.clone(), vec![Arg::Node(ins[0]), Arg::Node(ins[0])]), (mul, vec![Arg::Step(0), Arg::Node(ins[0])])]))
            }
            _ => None,
        },
        // neg(neg(x)) => x
        Op::Unary(UnaryOp::Neg) => match &g.node(ins[0]).op {
            Op::Unary(UnaryOp::Neg) => Some(Use(g.node(ins[0]).inputs[0])),
            _ => None,
        },
        // cast(x: d) to d => x
        Op::Cast(d) if g.ty(ins[0]).dtype == *d => Some(Use(ins[0])),
        // where(c, x, x) => x
        Op::Where if ins[1] == ins[2] => Some(Use(ins[1])),
        // where(true, a, b) => a ; where(false, a, b) => b
        Op::Where => match g.node(ins[0]).op {
            Op::Scalar { value: Lit::B(true), .. } => Some(Use(ins[1])),
            Op::Scalar { value: Lit::B(false), .. } => Some(Use(ins[2])),
            _ => None,
        },
        // permute(x, identity) => x
        Op::Permute(p) if p.iter().enumerate().all(|(i, &d)| i == d) => Some(Use(ins[0])),
        // permute(permute(x, p), q) => permute(x, p[q])
        Op::Permute(q) => match &g.node(ins[0]).op {
            Op::Permute(p) => {
                let inner = g.node(ins[0]).inputs[0];
                Some(Rewrite::Op(Op::Permute(q.iter().map(|&d| p[d]).collect()), vec![inner]))
            }
            _ => None,
        },
        // reshape(x) to x's shape => x ; expand(x) to x's shape => x
        Op::Reshape(s) | Op::Expand(s) if &g.ty(ins[0]).shape == s => Some(Use(ins[0])),
        // reshape(reshape(x)) => reshape(x)
        Op::Reshape(s) => match &g.node(ins[0]).op {
            Op::Reshape(_) => Some(Rewrite::Op(Op::Reshape(s.clone()), vec![g.node(ins[0]).inputs[0]])),
            _ => None,
        },
        _ => None,
    }
}
