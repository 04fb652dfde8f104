//! The rewrite driver shared by the passes: walks nodes in order, lets a rule replace each
//! (already remapped) node by an existing node or by a new op, and rebuilds the graph.
//! Unused nodes are dropped at the end (see `dce`).

use braze_ir::{Graph, Node, NodeId, Op};

/// What a rule does with one node.
pub enum Rewrite {
    /// Replace the node by an existing node of the new graph (same type).
    Use(NodeId),
    /// Replace the node by a new op on nodes of the new graph.
    Op(Op, Vec<NodeId>),
}

/// Applies `rule` to every node; returns the rewritten graph (not yet dead-code eliminated).
pub fn rewrite(g: &Graph, mut rule: impl FnMut(&Graph, &Node) -> Option<Rewrite>) -> Graph {
    let mut out = Graph::new(&g.name);
    let mut map: Vec<NodeId> = Vec::with_capacity(g.nodes.len());
    for n in &g.nodes {
        let mut n2 = n.clone();
        n2.inputs = n.inputs.iter().map(|i| map[i.index()]).collect();
        let new_id = match rule(&out, &n2) {
            Some(Rewrite::Use(id)) if out.node(id).ty == n2.ty => id,
            Some(Rewrite::Op(op, ins)) => match out.add(op, ins) {
                Ok(id) if out.node(id).ty == n2.ty => id,
                Ok(id) => {
                    // A rule that changes the type is a bug in the rule; keep the original.
                    out.nodes.truncate(id.index());
                    out.add_typed(n2.op, n2.inputs, n2.ty)
                }
                Err(_) => out.add_typed(n2.op, n2.inputs, n2.ty),
            },
            _ => out.add_typed(n2.op, n2.inputs, n2.ty),
        };
        map.push(new_id);
    }
    out.outputs = g.outputs.iter().map(|o| map[o.index()]).collect();
    out
}
