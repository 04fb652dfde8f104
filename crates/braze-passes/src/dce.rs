//! Dead-code elimination: removes every node that no output depends on. Inputs are kept
//! (they are the graph's signature), and so are externs marked `effect` (random ops, asserts,
//! calls returning no tensor): eager runs them whether or not their results are read.

use braze_ir::{Graph, NodeId, Op};

pub fn dce(g: &Graph) -> Graph {
    let mut live = vec![false; g.nodes.len()];
    for o in &g.outputs {
        live[o.index()] = true;
    }
    for id in g.ids().rev() {
        if matches!(g.node(id).op, Op::Input { .. } | Op::Extern { effect: true, .. }) {
            live[id.index()] = true;
        }
        if live[id.index()] {
            for i in &g.node(id).inputs {
                live[i.index()] = true;
            }
        }
    }
    let mut out = Graph::like(g);
    let mut map = vec![NodeId(u32::MAX); g.nodes.len()];
    for id in g.ids().filter(|id| live[id.index()]) {
        let n = g.node(id);
        let ins = n.inputs.iter().map(|i| map[i.index()]).collect();
        map[id.index()] = out.add_typed(n.op.clone(), ins, n.ty.clone());
    }
    out.outputs_from(g, &map);
    out
}
