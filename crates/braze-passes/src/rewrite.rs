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
    /// Replace the node by the last of several new ops, each on nodes of the new graph or
    /// on earlier ops of the chain.
    Chain(Vec<(Op, Vec<Arg>)>),
}

/// An operand of an op in a [`Rewrite::Chain`].
#[derive(Clone, Copy)]
pub enum Arg {
    Node(NodeId),
    /// The result of the chain's op at this position.
    Step(usize),
}

/// Applies `rule` to every node; returns the rewritten graph (not yet dead-code eliminated).
pub fn rewrite(g: &Graph, mut rule: impl FnMut(&Graph, &Node) -> Option<Rewrite>) -> Graph {
    let mut out = Graph::like(g);
    let mut map: Vec<NodeId> = Vec::with_capacity(g.nodes.len());
    for n in &g.nodes {
        let mut n2 = n.clone();
        n2.inputs = n.inputs.iter().map(|i| map[i.index()]).collect();
        let new_id = match rule(&out, &n2) {
            Some(Rewrite::Use(id)) if out.node(id).ty == n2.ty => id,
            Some(Rewrite::Op(op, ins)) => add_chain(&mut out, vec![(op, ins.into_iter().map(Arg::Node).collect())], n2),
            Some(Rewrite::Chain(ops)) => add_chain(&mut out, ops, n2),
            _ => out.add_typed(n2.op, n2.inputs, n2.ty),
        };
        map.push(new_id);
    }
    out.outputs_from(g, &map);
    out
}

/// Adds a rule's ops; keeps the original node instead when one does not type-check or the
/// last has another type than the node (a rule that changes the type is a bug in the rule).
fn add_chain(out: &mut Graph, ops: Vec<(Op, Vec<Arg>)>, n: Node) -> NodeId {
    let start = out.nodes.len();
    let mut ids: Vec<NodeId> = Vec::with_capacity(ops.len());
    for (op, args) in ops {
        let ins = args.iter().map(|a| match *a {
            Arg::Node(id) => id,
            Arg::Step(k) => ids[k],
        });
        match out.add(op, ins.collect()) {
            Ok(id) => ids.push(id),
            Err(_) => break,
        }
    }
    match ids.last() {
        Some(&id) if ids.len() == out.nodes.len() - start && out.node(id).ty == n.ty => id,
        _ => {
            out.nodes.truncate(start);
            out.add_typed(n.op, n.inputs, n.ty)
        }
    }
}

/// Rebuilds `g` node by node, letting `build` replace a node by nodes it adds to the new graph
/// (given the map from old to new ids so far); a replacement of another type is ignored (the
/// node is copied). `None` when nothing was replaced. Unused nodes are left for `dce`.
pub fn rebuild(g: &Graph, mut build: impl FnMut(&Graph, &mut Graph, &[NodeId], NodeId) -> Option<NodeId>) -> Option<Graph> {
    let mut out = Graph::like(g);
    let mut map: Vec<NodeId> = Vec::with_capacity(g.nodes.len());
    let mut changed = false;
    for id in g.ids() {
        let n = g.node(id);
        let new = match build(g, &mut out, &map, id) {
            Some(v) if out.ty(v) == g.ty(id) => {
                changed = true;
                v
            }
            _ => out.add_typed(n.op.clone(), n.inputs.iter().map(|i| map[i.index()]).collect(), n.ty.clone()),
        };
        map.push(new);
    }
    out.outputs_from(g, &map);
    changed.then_some(out)
}
