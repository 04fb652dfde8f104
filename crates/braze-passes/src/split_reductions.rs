//! Split reductions: on a GPU, a reduction with few outer points and very long rows would run
//! on a handful of blocks. When the reduced dims are the trailing dims, have a static size R
//! and R splits into `parts` equal pieces, `reduce(x)` becomes `reduce(reduce(reshape(x,
//! [.., parts, R / parts])))`: the first reduction runs `outer * parts` rows in parallel, the
//! second combines the parts. Applies to sum, prod, amax, amin, any and all (whose partial
//! results combine with the same op); leaves var and arg-reductions alone.

use crate::dce::dce;
use braze_ir::{Expr, Graph, Node, NodeId, Op, ReduceKind};

/// Rows at least this long are split when there are fewer than `min_rows` of them.
pub const MIN_SPLIT_LEN: i64 = 1 << 16;

pub fn split_reductions(g: &Graph, min_rows: i64) -> Graph {
    let mut out = Graph::new(&g.name);
    let mut map: Vec<NodeId> = Vec::with_capacity(g.nodes.len());
    for id in g.ids() {
        let n = g.node(id);
        let inputs: Vec<NodeId> = n.inputs.iter().map(|i| map[i.index()]).collect();
        let new_id = match split(g, id, min_rows).and_then(|plan| emit(&mut out, n, inputs[0], plan).ok()) {
            Some(new_id) => new_id,
            None => out.add_typed(n.op.clone(), inputs, n.ty.clone()),
        };
        map.push(new_id);
    }
    out.outputs = g.outputs.iter().map(|o| map[o.index()]).collect();
    dce(&out)
}

struct Plan {
    kind: ReduceKind,
    keep: Vec<Expr>,
    parts: i64,
    piece: i64,
    keepdim: bool,
    rank: usize,
}

fn split(g: &Graph, id: NodeId, min_rows: i64) -> Option<Plan> {
    let n = g.node(id);
    let Op::Reduce { kind, dims, keepdim, .. } = &n.op else { return None };
    if !matches!(kind, ReduceKind::Sum | ReduceKind::Prod | ReduceKind::Max | ReduceKind::Min | ReduceKind::Any | ReduceKind::All) {
        return None;
    }
    let t = g.ty(n.inputs[0]);
    let r = t.rank();
    let first = r.checked_sub(dims.len())?;
    if !(first..r).all(|d| dims.contains(&d)) {
        return None;
    }
    let len: i64 = t.shape[first..].iter().map(|e| e.as_const()).product::<Option<i64>>()?;
    let rows: Option<i64> = t.shape[..first].iter().map(|e| e.as_const()).product();
    if len < MIN_SPLIT_LEN || rows.is_none_or(|rows| rows >= min_rows) {
        return None;
    }
    // The largest power-of-two part count up to 1024 that divides the row.
    let parts = (1..=10).rev().map(|p| 1i64 << p).find(|p| len % p == 0 && len / p >= 256)?;
    Some(Plan { kind: *kind, keep: t.shape[..first].to_vec(), parts, piece: len / parts, keepdim: *keepdim, rank: r })
}

fn emit(out: &mut Graph, n: &Node, x: NodeId, p: Plan) -> Result<NodeId, braze_ir::Error> {
    let k = p.keep.len();
    let mut shape = p.keep.clone();
    shape.push(Expr::constant(p.parts));
    shape.push(Expr::constant(p.piece));
    let xs = out.add(Op::Reshape(shape), vec![x])?;
    let red = |dims: Vec<usize>| Op::Reduce { kind: p.kind, dims, keepdim: false, correction: 0 };
    let part = out.add(red(vec![k + 1]), vec![xs])?;
    let mut r = out.add(red(vec![k]), vec![part])?;
    if p.keepdim {
        let mut s = p.keep.clone();
        s.extend((k..p.rank).map(|_| Expr::one()));
        r = out.add(Op::Reshape(s), vec![r])?;
    }
    if out.node(r).ty != n.ty {
        return Err(braze_ir::Error::Invalid("split changed the type".into()));
    }
    Ok(r)
}
