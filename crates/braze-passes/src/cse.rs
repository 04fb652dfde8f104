//! Common-subexpression elimination: a node equal in op, attributes and operands to an
//! earlier node is replaced by it. Extern calls are never merged (an ATen op may be
//! random, like dropout), and neither are their results.

use crate::rewrite::{rewrite, Rewrite};
use braze_ir::print::op_attrs;
use braze_ir::{Graph, NodeId, Op};
use std::collections::HashMap;

pub fn cse(g: &Graph) -> Graph {
    let mut seen: HashMap<(&'static str, String, Vec<NodeId>), Vec<NodeId>> = HashMap::new();
    rewrite(g, |out, n| {
        if matches!(n.op, Op::Extern { .. } | Op::ExternOut { .. } | Op::Input { .. }) {
            return None;
        }
        let key = (n.op.name(), op_attrs(&n.op), n.inputs.clone());
        let next = NodeId(out.nodes.len() as u32);
        let same = seen.entry(key).or_default();
        if let Some(&hit) = same.iter().find(|&&c| out.node(c).op == n.op) {
            return Some(Rewrite::Use(hit));
        }
        same.push(next);
        None
    })
}
