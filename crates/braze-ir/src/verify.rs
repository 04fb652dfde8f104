//! The verifier. A graph is well formed when:
//!
//! 1. every operand is a node defined earlier (the node list is in topological order);
//! 2. every node's operand count matches its op's arity;
//! 3. every node except `Extern` has a tensor type, and that type is what `infer` gives
//!    for its op and operand types (so dtypes and broadcasts are consistent);
//! 4. `Input` indices are 0..n, each once; every `Input` has one stride per dim;
//! 5. an `ExternOut`'s single operand is an `Extern` with more outputs than its index;
//!    only `ExternOut` nodes use an `Extern`;
//! 6. outputs name existing tensor-typed nodes;
//! 7. a `BiasGrad` reads a 2-d matmul with a bias-gradient epilogue and has the type of
//!    the sums it computed (`[M]` or `[N]`).
//!
//! A verifier error after a pass is a braze bug, never a user error.

use crate::graph::{Graph, NodeId};
use crate::infer::infer;
use crate::op::{Epilogue, Op};
use crate::TensorTy;
use std::fmt;

/// One broken invariant, at a node (or at the graph when `at` is None).
#[derive(Debug, Clone)]
pub struct VerifyError {
    pub at: Option<NodeId>,
    pub msg: String,
}

impl fmt::Display for VerifyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.at {
            Some(id) => write!(f, "{id}: {}", self.msg),
            None => write!(f, "graph: {}", self.msg),
        }
    }
}

/// Checks every invariant listed in the module doc; returns all violations.
pub fn verify(g: &Graph) -> Vec<VerifyError> {
    let mut errs = Vec::new();
    let mut e = |at: Option<NodeId>, msg: String| errs.push(VerifyError { at, msg });
    let mut input_idx = Vec::new();
    for id in g.ids() {
        let n = g.node(id);
        if let Some(bad) = n.inputs.iter().find(|i| i.index() >= id.index()) {
            e(Some(id), format!("operand {bad} is not defined before use"));
            continue;
        }
        if let Some(a) = n.op.arity() {
            if a != n.inputs.len() {
                e(Some(id), format!("{} takes {a} operands, has {}", n.op.name(), n.inputs.len()));
                continue;
            }
        }
        for &i in &n.inputs {
            let is_extern = matches!(g.node(i).op, Op::Extern { .. });
            if is_extern != matches!(n.op, Op::ExternOut { .. }) {
                e(Some(id), format!("operand {i}: only extern_out may use an extern, and only an extern"));
            }
        }
        match &n.op {
            Op::Input { index, strides } => {
                input_idx.push(*index);
                match &n.ty {
                    Some(t) if t.rank() == strides.len() => {}
                    _ => e(Some(id), "input needs a type with one stride per dim".into()),
                }
            }
            Op::ExternOut { index, strides } => {
                match g.node(n.inputs[0]).op {
                    Op::Extern { outputs, .. } if *index < outputs => {}
                    _ => e(Some(id), "extern_out index out of range".into()),
                }
                match &n.ty {
                    Some(t) if t.rank() == strides.len() => {}
                    _ => e(Some(id), "extern_out needs a type with one stride per dim".into()),
                }
            }
            Op::BiasGrad => {
                let m = n.inputs[0];
                let want = match (&g.node(m).op, &g.node(m).ty) {
                    (Op::Matmul { epilogue: Epilogue::BiasGradA, .. }, Some(t)) if t.rank() == 2 => Some(TensorTy::new(t.dtype, vec![t.shape[0].clone()])),
                    (Op::Matmul { epilogue: Epilogue::BiasGradB, .. }, Some(t)) if t.rank() == 2 => Some(TensorTy::new(t.dtype, vec![t.shape[1].clone()])),
                    _ => None,
                };
                match want {
                    None => e(Some(id), "bias_grad reads a 2-d matmul with a bias-gradient epilogue".into()),
                    Some(w) if n.ty.as_ref() != Some(&w) => e(Some(id), format!("bias_grad's type must be {w}")),
                    Some(_) => {}
                }
            }
            Op::Extern { .. } => {
                if n.ty.is_some() {
                    e(Some(id), "extern has no type of its own".into());
                }
                if n.inputs.iter().any(|&i| g.node(i).ty.is_none()) {
                    e(Some(id), "extern operands must be tensors".into());
                }
            }
            op => {
                let tys: Vec<_> = n.inputs.iter().filter_map(|&i| g.node(i).ty.as_ref()).collect();
                if tys.len() != n.inputs.len() {
                    continue;
                }
                match crate::infer::with_size_rules(&g.size_rules, || infer(op, &tys)) {
                    Ok(t) if t == n.ty => {}
                    Ok(t) => e(Some(id), format!("type {:?} differs from inferred {:?}", n.ty, t)),
                    Err(err) => e(Some(id), err.to_string()),
                }
            }
        }
    }
    input_idx.sort();
    if input_idx != (0..input_idx.len() as u32).collect::<Vec<_>>() {
        e(None, format!("input indices {input_idx:?} are not 0..n"));
    }
    for o in &g.outputs {
        if o.index() >= g.nodes.len() || g.node(*o).ty.is_none() {
            e(None, format!("output {o} is not a tensor node"));
        }
    }
    errs
}
